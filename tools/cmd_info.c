/* cmd_info.c — `duet info` and `duet devices`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

int cmd_info(int argc, char **argv) {
    bool json = false;
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) json = true;
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: duet info [--json] MODEL.gguf\n");
            return 0;
        } else if (!path) path = argv[i];
        else {
            fprintf(stderr, "duet: info takes one file, got also '%s'\n", argv[i]);
            return 2;
        }
    }
    if (!path) {
        fprintf(stderr, "usage: duet info [--json] MODEL.gguf\n");
        return 2;
    }
    char *text;
    duet_status st = duet_file_info(path, json, &text);
    if (st) return cli_fail(path, st);
    fputs(text, stdout);
    if (json) putchar('\n');
    free(text);
    return 0;
}

int cmd_devices(int argc, char **argv) {
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) json = true;
        else {
            /* Help goes to stdout; a usage error to stderr. */
            bool help = !strcmp(argv[i], "-h") || !strcmp(argv[i], "--help");
            if (!help) fprintf(stderr, "duet: devices: unknown argument '%s'\n", argv[i]);
            fprintf(help ? stdout : stderr, "usage: duet devices [--json]\n");
            return help ? 0 : 2;
        }
    }
    size_t need = duet_devices_describe(NULL, 0, json);
    char *buf = malloc(need + 1);
    if (!buf) return 1;
    duet_devices_describe(buf, need + 1, json);
    fputs(buf, stdout);
    if (json) putchar('\n');
    free(buf);
    return 0;
}
