/* duet.c — the command-line entry point: dispatches to a subcommand. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} commands[] = {
    {"run", cmd_run, "generate text from a prompt"},
    {"chat", cmd_chat, "chat with a model in the terminal, through its chat template"},
    {"serve", cmd_serve, "serve the OpenAI-compatible HTTP API"},
    {"info", cmd_info, "describe a GGUF model file"},
    {"devices", cmd_devices, "list backends and devices with their features"},
    {"tokenize", cmd_tokenize, "print the token ids of a text"},
    {"mkmodel", cmd_mkmodel, "write a synthetic Llama-shaped model"},
    {"quantize", cmd_quantize, "convert a model's weights to q8_0 or f16"},
    {"eval", cmd_eval, "compare a model with a reference: KL divergence, top-1 agreement, perplexity"},
    {"profile", cmd_profile, "measure step costs on a device and fit the model duet-bench --simulate uses"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: duet COMMAND [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof *commands; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
    fprintf(f, "\n`duet COMMAND --help` describes a command's options; `duet --version` prints the\n"
               "version and the backends built in.\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) {
        const char *backends;
        const char *version = duet_version(&backends);
        printf("duet %s\nbackends: %s\n", version, backends);
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof *commands; i++)
        if (!strcmp(argv[1], commands[i].name)) return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "duet: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
