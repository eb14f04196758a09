/* cmd_eval.c — `duet eval`: how closely a model follows a reference model
 * (KL divergence, top-1 agreement, perplexity) over the same tokens. */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: duet eval -m MODEL --ref REF_MODEL [--text FILE | --generate N] [options]\n"
            "Runs both models over the same tokens (teacher forcing) and reports the mean KL divergence\n"
            "KL(ref || model) of the next-token distributions, how often their top-1 tokens agree, and\n"
            "the perplexity of each on the actual next tokens.\n"
            "  -m, --model FILE        the model to judge (e.g. a q8_0 quantisation)\n"
            "      --ref FILE          the reference (e.g. the f32 original); both need the same vocabulary\n"
            "      --text FILE         score this text, tokenized by the reference's tokenizer (BOS first)\n"
            "      --generate N        score N tokens the reference samples itself: BOS, then temperature 1\n"
            "                          over the full distribution with --seed, a fresh BOS at EOS or when a\n"
            "                          window is full (the default, with N = 2048)\n"
            "      --backend NAME      the model's backend: auto|cpu|vulkan|opencl (default auto)\n"
            "      --device I          the model's device within its backend (default: best)\n"
            "      --ref-backend NAME  the reference's backend (default cpu, the oracle)\n"
            "      --ref-device I      the reference's device (default: best)\n"
            "  -t, --threads N         cpu threads (default: all cores)\n"
            "  -c, --ctx N             window length: the text is split into windows of at most N tokens,\n"
            "                          each run from position 0 (default: the models' context)\n"
            "      --seed S            seed of --generate (default 1)\n"
            "      --json              print one JSON object\n");
}

/* Reads a whole file; NULL (with a message) on failure. */
static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (size_t got; buf && (got = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += got;
        if (n == cap) {
            char *b = realloc(buf, cap *= 2);
            if (!b) free(buf);
            buf = b;
        }
    }
    bool err = ferror(f);
    fclose(f);
    if (!buf || err) {
        fprintf(stderr, "duet: %s: %s\n", path, buf ? "read error" : "out of memory");
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

int cmd_eval(int argc, char **argv) {
    enum { O_REF = 256, O_TEXT, O_GEN, O_BACKEND, O_DEVICE, O_REF_BACKEND, O_REF_DEVICE, O_SEED, O_JSON };
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},         {"ref", required_argument, 0, O_REF},
        {"text", required_argument, 0, O_TEXT},       {"generate", required_argument, 0, O_GEN},
        {"backend", required_argument, 0, O_BACKEND}, {"device", required_argument, 0, O_DEVICE},
        {"ref-backend", required_argument, 0, O_REF_BACKEND}, {"ref-device", required_argument, 0, O_REF_DEVICE},
        {"threads", required_argument, 0, 't'},       {"ctx", required_argument, 0, 'c'},
        {"seed", required_argument, 0, O_SEED},       {"json", no_argument, 0, O_JSON},
        {"help", no_argument, 0, 'h'},                {0, 0, 0, 0}};
    const char *model = NULL, *ref = NULL, *text = NULL;
    int generate = 0, window = 0;
    bool json = false;
    unsigned long long seed = 1;
    duet_open_params mp = duet_open_params_default(), rp = duet_open_params_default();
    rp.backend = "cpu";
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "m:t:c:h", opts, NULL)) != -1) {
        bool ok = true;
        switch (c) {
        case 'm': model = optarg; break;
        case O_REF: ref = optarg; break;
        case O_TEXT: text = optarg; break;
        case O_GEN: ok = cli_int("--generate", optarg, 2, 1 << 24, &generate); break;
        case O_BACKEND: mp.backend = optarg; break;
        case O_DEVICE: ok = cli_int("--device", optarg, 0, 1024, &mp.device); break;
        case O_REF_BACKEND: rp.backend = optarg; break;
        case O_REF_DEVICE: ok = cli_int("--ref-device", optarg, 0, 1024, &rp.device); break;
        case 't': ok = cli_int("--threads", optarg, 0, 1024, &mp.n_threads); rp.n_threads = mp.n_threads; break;
        case 'c': ok = cli_int("--ctx", optarg, 2, 1 << 20, &window); break;
        case O_SEED: ok = cli_u64("--seed", optarg, &seed); break;
        case O_JSON: json = true; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
        if (!ok) return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "duet: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }
    if (!model || !ref) {
        fprintf(stderr, "duet: eval needs both -m MODEL and --ref REF_MODEL\n");
        usage(stderr);
        return 2;
    }
    if (text && generate) {
        fprintf(stderr, "duet: give either --text or --generate, not both\n");
        return 2;
    }
    if (!text && !generate) generate = 2048;
    /* The window is also each model's context, so KV memory matches it. */
    mp.n_ctx = rp.n_ctx = window;

    duet_model *m = NULL, *r = NULL;
    int32_t *ids = NULL;
    int rc = 1, n = 0;
    duet_status st;
    if ((st = duet_model_open(ref, &rp, &r))) {
        rc = cli_fail(ref, st);
        goto done;
    }
    if ((st = duet_model_open(model, &mp, &m))) {
        rc = cli_fail(model, st);
        goto done;
    }
    if (text) {
        size_t len;
        char *buf = read_file(text, &len);
        if (!buf) goto done;
        n = duet_tokenize(r, buf, len, true, false, NULL, 0);
        if (n >= 0 && (ids = malloc(sizeof *ids * (size_t)(n > 0 ? n : 1))))
            n = duet_tokenize(r, buf, len, true, false, ids, n);
        free(buf);
        if (n < 0) {
            rc = cli_fail("tokenize", (duet_status)n);
            goto done;
        }
        if (!ids) {
            fprintf(stderr, "duet: out of memory for %d tokens\n", n);
            goto done;
        }
        if (n < 2) {
            fprintf(stderr, "duet: %s gives %d token%s; eval needs at least 2\n", text, n, n == 1 ? "" : "s");
            goto done;
        }
    } else {
        n = generate;
        if (!(ids = malloc(sizeof *ids * (size_t)n))) {
            fprintf(stderr, "duet: out of memory for %d tokens\n", n);
            goto done;
        }
        if ((st = duet_quality_generate(r, n, window, seed, ids))) {
            fprintf(stderr, "duet: %s\n", duet_last_error()); /* the message names its step */
            goto done;
        }
    }

    duet_quality q;
    if ((st = duet_quality_eval(m, r, ids, n, window, &q))) {
        fprintf(stderr, "duet: %s\n", duet_last_error());
        goto done;
    }
    duet_model_desc md, rd;
    duet_model_describe(m, &md);
    duet_model_describe(r, &rd);
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "model", model);
        cJSON_AddStringToObject(o, "ref", ref);
        cJSON_AddStringToObject(o, "backend", md.backend);
        cJSON_AddStringToObject(o, "device", md.device);
        cJSON_AddStringToObject(o, "ref_backend", rd.backend);
        cJSON_AddStringToObject(o, "ref_device", rd.device);
        cJSON_AddStringToObject(o, "source", text ? "text" : "generate");
        if (!text) cJSON_AddNumberToObject(o, "seed", (double)seed);
        cJSON_AddNumberToObject(o, "tokens", n);
        cJSON_AddNumberToObject(o, "window", window ? window : (md.n_ctx < rd.n_ctx ? md.n_ctx : rd.n_ctx));
        cJSON_AddNumberToObject(o, "windows", q.windows);
        cJSON_AddNumberToObject(o, "positions", q.positions);
        cJSON_AddNumberToObject(o, "kl_mean", q.kl_mean);
        cJSON_AddNumberToObject(o, "kl_p99", q.kl_p99);
        cJSON_AddNumberToObject(o, "kl_max", q.kl_max);
        cJSON_AddNumberToObject(o, "top1_agreement", q.top1_agreement);
        cJSON_AddNumberToObject(o, "ppl", q.ppl);
        cJSON_AddNumberToObject(o, "ppl_ref", q.ppl_ref);
        cJSON_AddNumberToObject(o, "seconds", q.seconds);
        char *s = cJSON_PrintUnformatted(o);
        puts(s);
        cJSON_free(s);
        cJSON_Delete(o);
    } else {
        printf("model      %s (%s on %s)\n", model, md.backend, md.device);
        printf("reference  %s (%s on %s)\n", ref, rd.backend, rd.device);
        if (text) printf("text       %s: %d tokens in %d window%s\n", text, n, q.windows, q.windows == 1 ? "" : "s");
        else printf("text       %d tokens sampled from the reference (seed %llu) in %d window%s\n", n, seed,
                    q.windows, q.windows == 1 ? "" : "s");
        printf("positions  %d\n", q.positions);
        printf("KL         mean %.6g  p99 %.6g  max %.6g (nats, KL(ref || model))\n", q.kl_mean, q.kl_p99,
               q.kl_max);
        printf("top-1      %.4f agreement\n", q.top1_agreement);
        printf("perplexity %.4f model, %.4f reference\n", q.ppl, q.ppl_ref);
        printf("time       %.2f s\n", q.seconds);
    }
    rc = 0;
done:
    free(ids);
    duet_model_close(m);
    duet_model_close(r);
    return rc;
}
