/* cmd_files.c — `duet mkmodel` and `duet quantize`: write model files. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

#define MKMODEL_USAGE                                                                                        \
    "usage: duet mkmodel --shape tiny|small|125m|1b|7b --type f32|f16|q8_0 [--seed S] [--ctx N] [-o FILE]\n" \
    "  without -o the model goes into duet's cache (once per parameter set) and its path is printed\n"

int cmd_mkmodel(int argc, char **argv) {
    static const struct option opts[] = {{"shape", required_argument, 0, 's'}, {"type", required_argument, 0, 'T'},
                                         {"seed", required_argument, 0, 'S'},  {"ctx", required_argument, 0, 'c'},
                                         {"help", no_argument, 0, 'h'},        {0, 0, 0, 0}};
    duet_mkmodel_params p = {.shape = "tiny", .type = "f32", .seed = 0};
    const char *out = NULL;
    unsigned long long seed = 0;
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "o:h", opts, NULL)) != -1) {
        switch (c) {
        case 's': p.shape = optarg; break;
        case 'T': p.type = optarg; break;
        case 'S':
            if (!cli_u64("--seed", optarg, &seed)) return 2;
            p.seed = seed;
            break;
        case 'c':
            if (!cli_int("--ctx", optarg, 1, 1 << 20, &p.n_ctx)) return 2;
            break;
        case 'o': out = optarg; break;
        case 'h':
            printf(MKMODEL_USAGE);
            return 0;
        default: return 2;
        }
    }
    if (!out) {
        /* Into duet's cache, once per parameter set (safe to race). */
        static char path[4096];
        duet_status st = duet_mkmodel_cached(&p, path, sizeof path, NULL);
        if (st) return cli_fail("mkmodel", st);
        printf("%s\n", path);
        return 0;
    }
    duet_status st = duet_mkmodel(&p, out);
    if (st) return cli_fail("mkmodel", st);
    fprintf(stderr, "duet: wrote %s (shape %s, %s, seed %llu)\n", out, p.shape, p.type, (unsigned long long)p.seed);
    return 0;
}

#define QUANTIZE_USAGE                                                                                       \
    "usage: duet quantize IN.gguf OUT.gguf --type T [--allow-requantize] [--pure]\n"                         \
    "  T: f16 q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k_s q3_k_m q3_k_l q4_k_s q4_k_m q5_k_s q5_k_m q6_k iq4_nl "   \
    "iq4_xs\n"                                                                                               \
    "     (q3_k, q4_k, q5_k: the _m mixes, as in llama-quantize)\n"                                          \
    "  --allow-requantize  accept matrices that are already quantized (costs quality)\n"                     \
    "  --pure              every matrix in T: no per-tensor mix, no q6_k output matrix\n"

int cmd_quantize(int argc, char **argv) {
    const char *in = NULL, *out = NULL;
    duet_quantize_params p = {.type = "q8_0"};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--type")) {
            if (++i == argc) {
                fprintf(stderr, "duet: --type needs a type\n" QUANTIZE_USAGE);
                return 2;
            }
            p.type = argv[i];
        } else if (!strcmp(argv[i], "--allow-requantize")) {
            p.allow_requantize = true;
        } else if (!strcmp(argv[i], "--pure")) {
            p.pure = true;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf(QUANTIZE_USAGE);
            return 0;
        } else if (!in)
            in = argv[i];
        else if (!out) out = argv[i];
        else {
            fprintf(stderr, "duet: unexpected argument '%s'\n", argv[i]);
            return 2;
        }
    }
    if (!in || !out) {
        fprintf(stderr, QUANTIZE_USAGE);
        return 2;
    }
    char *report = NULL;
    duet_status st = duet_quantize_model(in, out, &p, &report);
    if (report) fputs(report, stderr);
    free(report);
    if (st) return cli_fail("quantize", st);
    fprintf(stderr, "duet: wrote %s (%s%s)\n", out, p.type, p.pure ? ", pure" : "");
    return 0;
}
