/* cmd_run.c — `duet run`: tokenize a prompt, generate, stream the text. */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: duet run [-m MODEL] -p PROMPT [options]\n"
            "  -m, --model FILE        GGUF model (default: the cached SmolLM2-135M-Instruct)\n"
            "  -p, --prompt TEXT       prompt text\n"
            "  -n, --n-predict N       tokens to generate (default 128)\n"
            "      --backend NAME      auto|cpu|vulkan|opencl (default auto)\n"
            "      --device I          device index within the backend (default: best)\n"
            "  -t, --threads N         cpu threads (default: all cores)\n"
            "  -c, --ctx N             context length (default: the model's, at most 4096)\n"
            "      --kv-type T         f32|f16|q8_0 KV cache (default: f32 for f32 models, else f16)\n"
            "      --temp T            temperature; 0 = greedy (default 0.8)\n"
            "      --top-k K           (default 40; 0 = off)\n"
            "      --top-p P           (default 0.95; 1 = off)\n"
            "      --min-p P           (default 0.05; 0 = off)\n"
            "      --repeat-penalty R  (default 1 = off)\n"
            "      --presence-penalty P, --frequency-penalty F   (default 0)\n"
            "      --seed S            sampling seed (default: from the clock)\n"
            "      --ignore-eos        keep generating past end-of-sequence\n"
            "      --spec MODE         speculative decoding: off (default) or ngram (drafts copied from\n"
            "                          earlier text: helps when the output repeats the prompt)\n"
            "      --spec-k K          most draft tokens per step, 1..16 (default 8, adapted as it goes)\n"
            "      --draft FILE        speculative decoding with a draft model (same vocabulary, same backend)\n"
            "      --json              print one JSON object instead of streaming text\n");
}

typedef struct run_ctx {
    bool json;
    cJSON *tokens;
    char *text;
    size_t len, cap;
} run_ctx;

static bool on_token(int32_t id, const char *text, size_t len, void *user) {
    run_ctx *r = user;
    if (id >= 0 && r->tokens) cJSON_AddItemToArray(r->tokens, cJSON_CreateNumber(id));
    if (r->json) {
        if (r->len + len + 1 > r->cap) {
            size_t cap = (r->cap + len + 1) * 2;
            char *t = realloc(r->text, cap);
            if (!t) return false;
            r->text = t;
            r->cap = cap;
        }
        memcpy(r->text + r->len, text, len);
        r->len += len;
        r->text[r->len] = 0;
    } else {
        fwrite(text, 1, len, stdout);
        fflush(stdout);
    }
    return true;
}

int cmd_run(int argc, char **argv) {
    enum { O_BACKEND = 256, O_DEVICE, O_KV, O_TEMP, O_TOPK, O_TOPP, O_MINP, O_REP, O_PRES, O_FREQ, O_SEED,
           O_IGNORE_EOS, O_JSON, O_SPEC, O_SPEC_K, O_DRAFT };
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},     {"prompt", required_argument, 0, 'p'},
        {"n-predict", required_argument, 0, 'n'}, {"threads", required_argument, 0, 't'},
        {"ctx", required_argument, 0, 'c'},       {"backend", required_argument, 0, O_BACKEND},
        {"device", required_argument, 0, O_DEVICE}, {"kv-type", required_argument, 0, O_KV},
        {"temp", required_argument, 0, O_TEMP},   {"top-k", required_argument, 0, O_TOPK},
        {"top-p", required_argument, 0, O_TOPP},  {"min-p", required_argument, 0, O_MINP},
        {"repeat-penalty", required_argument, 0, O_REP}, {"presence-penalty", required_argument, 0, O_PRES},
        {"frequency-penalty", required_argument, 0, O_FREQ}, {"seed", required_argument, 0, O_SEED},
        {"ignore-eos", no_argument, 0, O_IGNORE_EOS}, {"json", no_argument, 0, O_JSON},
        {"spec", required_argument, 0, O_SPEC},   {"spec-k", required_argument, 0, O_SPEC_K},
        {"draft", required_argument, 0, O_DRAFT},
        {"help", no_argument, 0, 'h'},            {0, 0, 0, 0}};
    const char *model = NULL, *prompt = NULL;
    int n_predict = 128;
    bool json = false, ignore_eos = false, seed_set = false;
    duet_open_params op = duet_open_params_default();
    duet_sampling smp = duet_sampling_default();
    unsigned long long seed = 0;
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "m:p:n:t:c:h", opts, NULL)) != -1) {
        bool ok = true;
        switch (c) {
        case 'm': model = optarg; break;
        case 'p': prompt = optarg; break;
        case 'n': ok = cli_int("-n", optarg, 0, 1 << 20, &n_predict); break;
        case 't': ok = cli_int("--threads", optarg, 0, 1024, &op.n_threads); break;
        case 'c': ok = cli_int("--ctx", optarg, 1, 1 << 20, &op.n_ctx); break;
        case O_BACKEND: op.backend = optarg; break;
        case O_DEVICE: ok = cli_int("--device", optarg, 0, 1024, &op.device); break;
        case O_KV: op.kv_type = optarg; break;
        case O_TEMP: ok = cli_float("--temp", optarg, 0, 100, &smp.temperature); break;
        case O_TOPK: ok = cli_int("--top-k", optarg, 0, 1 << 24, &smp.top_k); break;
        case O_TOPP: ok = cli_float("--top-p", optarg, 1e-6, 1, &smp.top_p); break;
        case O_MINP: ok = cli_float("--min-p", optarg, 0, 1, &smp.min_p); break;
        case O_REP: ok = cli_float("--repeat-penalty", optarg, 1e-3, 100, &smp.repetition_penalty); break;
        case O_PRES: ok = cli_float("--presence-penalty", optarg, -100, 100, &smp.presence_penalty); break;
        case O_FREQ: ok = cli_float("--frequency-penalty", optarg, -100, 100, &smp.frequency_penalty); break;
        case O_SEED: ok = cli_u64("--seed", optarg, &seed), seed_set = true; break;
        case O_IGNORE_EOS: ignore_eos = true; break;
        case O_JSON: json = true; break;
        case O_SPEC: op.spec = optarg; break;
        case O_SPEC_K: ok = cli_int("--spec-k", optarg, 1, 16, &op.spec_k); break;
        case O_DRAFT: op.draft = optarg; break;
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
    if (!prompt) prompt = "";
    if (!model && !(model = cli_default_model())) return 1;
    smp.seed = seed_set ? seed : (unsigned long long)time(NULL);

    duet_model *m;
    duet_status st = duet_model_open(model, &op, &m);
    if (st) return cli_fail(model, st);
    duet_model_desc d;
    duet_model_describe(m, &d);

    int32_t *ids;
    int n = cli_tokenize(m, prompt, true, true, &ids);
    if (n <= 0) {
        if (n == 0) fprintf(stderr, "duet: the prompt is empty and the model adds no BOS token: give a prompt with -p\n");
        free(ids);
        duet_model_close(m);
        return n < 0 ? 1 : 2;
    }

    run_ctx r = {.json = json, .tokens = json ? cJSON_CreateArray() : NULL};
    if (!json) {
        fputs(prompt, stdout);
        fflush(stdout);
    }
    duet_generate_stats gs;
    st = duet_generate(m, ids, n, n_predict, &smp, ignore_eos, on_token, &r, &gs);
    int rc = 0;
    double prefill_tps = gs.prefill_seconds > 0 ? gs.prompt_tokens / gs.prefill_seconds : 0;
    double decode_tps = gs.generated_tokens > 1 && gs.decode_seconds > 0
                            ? (gs.generated_tokens - 1) / gs.decode_seconds : 0;
    if (st) {
        rc = cli_fail("generate", st);
    } else if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "model", model);
        cJSON_AddStringToObject(o, "backend", d.backend);
        cJSON_AddStringToObject(o, "device", d.device);
        cJSON *pt = cJSON_AddArrayToObject(o, "prompt_tokens");
        for (int i = 0; i < n; i++) cJSON_AddItemToArray(pt, cJSON_CreateNumber(ids[i]));
        cJSON_AddItemToObject(o, "tokens", r.tokens);
        r.tokens = NULL;
        cJSON_AddStringToObject(o, "text", r.text ? r.text : "");
        cJSON_AddNumberToObject(o, "prefill_tokens_per_s", prefill_tps);
        cJSON_AddNumberToObject(o, "decode_tokens_per_s", decode_tps);
        cJSON_AddNumberToObject(o, "prefill_seconds", gs.prefill_seconds);
        cJSON_AddNumberToObject(o, "decode_seconds", gs.decode_seconds);
        cJSON_AddNumberToObject(o, "decode_cpu_seconds", gs.decode_cpu_seconds);
        cJSON_AddBoolToObject(o, "stopped_by_eos", gs.stopped_by_eos);
        cJSON_AddNumberToObject(o, "seed", (double)smp.seed);
        if ((op.spec && strcmp(op.spec, "off") != 0) || op.draft) {
            cJSON *sp = cJSON_AddObjectToObject(o, "speculative");
            cJSON_AddStringToObject(sp, "mode", op.draft ? "draft" : op.spec);
            cJSON_AddNumberToObject(sp, "drafts", gs.spec_drafts);
            cJSON_AddNumberToObject(sp, "draft_tokens", gs.spec_draft_tokens);
            cJSON_AddNumberToObject(sp, "accepted_tokens", gs.spec_accepted_tokens);
            cJSON_AddNumberToObject(sp, "acceptance_rate",
                                    gs.spec_draft_tokens ? (double)gs.spec_accepted_tokens / gs.spec_draft_tokens : 0);
        }
        char *s = cJSON_PrintUnformatted(o);
        puts(s);
        cJSON_free(s);
        cJSON_Delete(o);
    } else {
        printf("\n");
        fflush(stdout);
        fprintf(stderr, "duet: model %s\nduet: %s on %s (%s): %d prompt tokens at %.1f tokens/s, %d generated at %.1f tokens/s\n",
                model, d.arch, d.backend, d.device, gs.prompt_tokens, prefill_tps, gs.generated_tokens, decode_tps);
        if (gs.spec_draft_tokens)
            fprintf(stderr, "duet: speculative: %d of %d draft tokens accepted (%.0f%%) in %d drafts\n",
                    gs.spec_accepted_tokens, gs.spec_draft_tokens,
                    100.0 * gs.spec_accepted_tokens / gs.spec_draft_tokens, gs.spec_drafts);
    }
    cJSON_Delete(r.tokens);
    free(r.text);
    free(ids);
    duet_model_close(m);
    return rc;
}
