/* cmd_serve.c — `duet serve`: an OpenAI-compatible HTTP server over one
 * engine instance, or several (--instance, repeated) behind the router:
 * instances on one backend and device share one loaded model's weights.
 * Options come from a JSON --config file first, then the
 * command line (which wins). SIGTERM or SIGINT stops accepting, lets the
 * requests in flight finish (up to --drain-timeout), then exits 0; a second
 * signal cancels what is left.
 *
 * Start-up, for an orchestrator's probes: load the model (the port is not
 * open yet), warm it (duet_engine_warmup), listen, then report ready: GET
 * /ready answers 200 from then until SIGTERM, when it turns 503 first. */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "server.h"

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: duet serve [-m MODEL] [options]\n"
        "  -m, --model FILE            GGUF model (default: the cached SmolLM2-135M-Instruct)\n"
        "      --host ADDR             address to listen on (default 127.0.0.1; 0.0.0.0 or :: for all)\n"
        "      --port N                port (default 8000; 0 = any free port, printed at start)\n"
        "      --served-model-name S   the model's name in the API (default: the file name less .gguf)\n"
        "      --chat-template T       auto, a family (plain|chatml|llama3|llama2|mistral|zephyr|phi3|gemma) "
        "or\n"
        "                              a Jinja file (default auto: the model's tokenizer.chat_template; "
        "plain\n"
        "                              when it has none)\n"
        "      --backend NAME          auto|cpu|vulkan|opencl (default auto)\n"
        "      --device I              device index within the backend (default: best)\n"
        "  -t, --threads N             cpu threads (default: all cores)\n"
        "  -c, --ctx N                 context length per sequence (default: the model's, at most 4096)\n"
        "      --kv-type T             f32|f16|q8_0 KV cache\n"
        "  scheduler (0 or absent = the engine's default):\n"
        "      --max-batch-seqs N      sequences decoded together (default 16)\n"
        "      --max-batch-tokens N    tokens per step, decodes plus prefill chunks (default 256)\n"
        "      --batch-timeout-ms MS   how long an idle engine waits for more arrivals (default 2)\n"
        "      --prefill-chunk N       prompt tokens per sequence per step (default 128)\n"
        "      --max-waiting N         queued requests beyond which requests get 429 (default 256)\n"
        "      --kv-blocks N           KV cache blocks (default: every slot at full context)\n"
        "      --kv-block-size N       tokens per KV block (default 16)\n"
        "      --no-prefix-cache       do not reuse the cached KV blocks of earlier prompts' shared starts\n"
        "  speculative decoding:\n"
        "      --spec MODE             off (default) or ngram: drafts copied from earlier text in the "
        "prompt\n"
        "                              and output, verified in the step (lossless; helps editing, "
        "summaries,\n"
        "                              code)\n"
        "      --draft FILE            a draft model (same vocabulary) drafting on the same device, with\n"
        "                              its own KV cache; verified in the step like ngram's drafts\n"
        "      --spec-k K              most draft tokens per step and sequence, 1..16 (default 8, adaptive)\n"
        "      --spec-max-batch N      drafts are verified where the measured step costs and acceptance\n"
        "                              predict a gain; N caps a drafting step's decodes (default 0: no\n"
        "                              cap; -1: no cap, every draft verified)\n"
        "  adaptive controller (on when a target is set; retunes batch timeout, batch size, step budget):\n"
        "      --slo-ttft-ms T         p99 time-to-first-token target: MS (interactive requests) or\n"
        "                              interactive=MS,batch=MS\n"
        "      --slo-itl-ms T          p99 inter-token latency target, the same way; steps with decodes of\n"
        "                              the class are sized to a share of it: prompt chunks shrink so the\n"
        "                              step-cost model's predicted step time fits (stall-free steps)\n"
        "      --step-cost FILE        the step-cost model `duet profile` wrote: seeds the model the engine\n"
        "                              fits online (default: learnt from the warm-up and the steps)\n"
        "      --step-budget-share X   the share of a class's ITL target a step with its decodes may take\n"
        "                              (0.25..1, default 0.8; the controller starts here and retunes it)\n"
        "      --step-log FILE         a CSV line for every step the engine completes: start, idle before,\n"
        "                              shape, measured and predicted seconds (one engine only)\n"
        "      --static-knobs          keep the knobs as configured: targets size the steps, the\n"
        "                              controller does not run (to compare it with fixed settings)\n"
        "  instances (repeat --instance for several engines behind one router):\n"
        "      --instance SPEC         one engine: KEY=VALUE,... with keys name (default: its index),\n"
        "                              backend, device, tier (interactive|batch), threads, ctx, "
        "max-batch-seqs,\n"
        "                              max-batch-tokens, batch-timeout-ms, prefill-chunk, max-waiting,\n"
        "                              kv-blocks; keys left out take the options above. Instances on one\n"
        "                              backend and device share the weights. X-Duet-Instance: NAME pins a\n"
        "                              request (GET /v1/models lists them). Example:\n"
        "                              --instance backend=vulkan,device=0,tier=interactive,max-batch-seqs=4\n"
        "                              --instance backend=opencl,tier=batch,max-batch-seqs=32\n"
        "      --spill-over WHICH      when every instance of a tier holds 2 x its max-batch-seqs\n"
        "                              requests, whose requests may use the other tier's instances:\n"
        "                              interactive (default), batch, both or none\n"
        "      --tier-blind            route each request to any instance (least outstanding work)\n"
        "  server:\n"
        "      --config FILE           JSON object with any of these options by name (\"max_batch_seqs\": "
        "32);\n"
        "                              the command line overrides it\n"
        "      --drain-timeout S       on SIGTERM, seconds to let requests in flight finish (default 60)\n"
        "      --max-connections N     open HTTP connections; past it requests get 503 (default 4096)\n"
        "      --idle-timeout S        close a connection idle this many seconds (default 30)\n"
        "      --read-timeout S        a request (headers and body) must arrive within this (default 30)\n"
        "      --request-timeout S     cancel a request still generating after S seconds and answer it with\n"
        "                              408 (default: none; a request's \"timeout\" field may ask for less)\n"
        "  security:\n"
        "      --api-key KEY           require Authorization: Bearer KEY on every endpoint but /health and\n"
        "                              /ready (default: $DUET_API_KEY; none when unset)\n"
        "      --metrics-public        serve /metrics without the API key\n"
        "      --allowed-origins LIST  CORS: web origins allowed to call the API, comma-separated, or '*'\n"
        "                              (default: none; requests from other origins get 403)\n"
        "  -v, --verbose               log one line per request\n"
        "\n"
        "endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,\n"
        "           GET /ready, GET /metrics\n");
}

enum {
    O_HOST = 256,
    O_PORT,
    O_NAME,
    O_TEMPLATE,
    O_BACKEND,
    O_DEVICE,
    O_KV,
    O_MAX_SEQS,
    O_MAX_TOKENS,
    O_TIMEOUT,
    O_CHUNK,
    O_MAX_WAITING,
    O_KV_BLOCKS,
    O_KV_BLOCK_SIZE,
    O_CONFIG,
    O_DRAIN,
    O_MAX_CONN,
    O_IDLE,
    O_READ_TIMEOUT,
    O_REQUEST_TIMEOUT,
    O_API_KEY,
    O_METRICS_PUBLIC,
    O_ORIGINS,
    O_NO_PREFIX_CACHE,
    O_SPEC,
    O_SPEC_K,
    O_SPEC_MAX_BATCH,
    O_DRAFT,
    O_SLO_TTFT,
    O_SLO_ITL,
    O_INSTANCE,
    O_SPILL,
    O_TIER_BLIND,
    O_STEP_COST,
    O_STEP_LOG,
    O_STATIC_KNOBS,
    O_BUDGET_SHARE
};

static const struct option opts[] = {
    {"model", required_argument, 0, 'm'},
    {"host", required_argument, 0, O_HOST},
    {"port", required_argument, 0, O_PORT},
    {"served-model-name", required_argument, 0, O_NAME},
    {"chat-template", required_argument, 0, O_TEMPLATE},
    {"backend", required_argument, 0, O_BACKEND},
    {"device", required_argument, 0, O_DEVICE},
    {"threads", required_argument, 0, 't'},
    {"ctx", required_argument, 0, 'c'},
    {"kv-type", required_argument, 0, O_KV},
    {"max-batch-seqs", required_argument, 0, O_MAX_SEQS},
    {"max-batch-tokens", required_argument, 0, O_MAX_TOKENS},
    {"batch-timeout-ms", required_argument, 0, O_TIMEOUT},
    {"prefill-chunk", required_argument, 0, O_CHUNK},
    {"max-waiting", required_argument, 0, O_MAX_WAITING},
    {"kv-blocks", required_argument, 0, O_KV_BLOCKS},
    {"kv-block-size", required_argument, 0, O_KV_BLOCK_SIZE},
    {"no-prefix-cache", no_argument, 0, O_NO_PREFIX_CACHE},
    {"spec", required_argument, 0, O_SPEC},
    {"spec-k", required_argument, 0, O_SPEC_K},
    {"spec-max-batch", required_argument, 0, O_SPEC_MAX_BATCH},
    {"draft", required_argument, 0, O_DRAFT},
    {"slo-ttft-ms", required_argument, 0, O_SLO_TTFT},
    {"slo-itl-ms", required_argument, 0, O_SLO_ITL},
    {"step-cost", required_argument, 0, O_STEP_COST},
    {"step-log", required_argument, 0, O_STEP_LOG},
    {"static-knobs", no_argument, 0, O_STATIC_KNOBS},
    {"step-budget-share", required_argument, 0, O_BUDGET_SHARE},
    {"config", required_argument, 0, O_CONFIG},
    {"drain-timeout", required_argument, 0, O_DRAIN},
    {"max-connections", required_argument, 0, O_MAX_CONN},
    {"idle-timeout", required_argument, 0, O_IDLE},
    {"read-timeout", required_argument, 0, O_READ_TIMEOUT},
    {"request-timeout", required_argument, 0, O_REQUEST_TIMEOUT},
    {"api-key", required_argument, 0, O_API_KEY},
    {"metrics-public", no_argument, 0, O_METRICS_PUBLIC},
    {"allowed-origins", required_argument, 0, O_ORIGINS},
    {"instance", required_argument, 0, O_INSTANCE},
    {"spill-over", required_argument, 0, O_SPILL},
    {"tier-blind", no_argument, 0, O_TIER_BLIND},
    {"verbose", no_argument, 0, 'v'},
    {"help", no_argument, 0, 'h'},
    {0, 0, 0, 0},
};

#define MAX_INSTANCES 16

typedef struct serve_opts {
    const char *model, *config;
    srv_config srv;
    duet_engine_params ep;
    double drain_timeout_s;
    const char *instances[MAX_INSTANCES]; /* --instance specs */
    int n_instances;
    duet_fleet_params fleet;
    const char *step_cost; /* --step-cost FILE */
} serve_opts;

/* A latency target per priority class: "MS" (interactive) or
 * "interactive=MS,batch=MS" (either may be left out; ':' works for '='). */
static bool parse_slo(const char *flag, const char *v, double out[2]) {
    char buf[128];
    snprintf(buf, sizeof buf, "%s", v);
    char *save = NULL;
    bool any = false;
    for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        int cls = 0;
        char *num = item, *eq = strpbrk(item, "=:");
        if (eq) {
            *eq = 0;
            num = eq + 1;
            if (!strcmp(item, "interactive"))
                cls = 0;
            else if (!strcmp(item, "batch"))
                cls = 1;
            else
                return fprintf(stderr, "duet: %s: unknown class '%s' (interactive or batch)\n", flag, item),
                       false;
        }
        char *end;
        double x = strtod(num, &end);
        if (!*num || *end || !(x > 0 && x <= 3.6e6))
            return fprintf(stderr, "duet: %s wants milliseconds in (0, 3600000], got '%s'\n", flag, num),
                   false;
        out[cls] = x;
        any = true;
    }
    if (!any) return fprintf(stderr, "duet: %s: no target given\n", flag), false;
    return true;
}

/* Applies one option (from argv or the config file); false after printing why. */
static bool set_opt(serve_opts *o, int key, const char *v) {
    duet_engine_params *ep = &o->ep;
    float f;
    int i;
    switch (key) {
    case 'm':
        o->model = v;
        return true;
    case O_HOST:
        o->srv.host = v;
        return true;
    case O_PORT:
        return cli_int("--port", v, 0, 65535, &o->srv.port);
    case O_NAME:
        o->srv.model_name = v;
        return true;
    case O_TEMPLATE:
        o->srv.chat_template = v;
        return true;
    case O_BACKEND:
        ep->open.backend = v;
        return true;
    case O_DEVICE:
        return cli_int("--device", v, 0, 1024, &ep->open.device);
    case 't':
        return cli_int("--threads", v, 0, 1024, &ep->open.n_threads);
    case 'c':
        return cli_int("--ctx", v, 1, 1 << 20, &ep->open.n_ctx);
    case O_KV:
        ep->open.kv_type = v;
        return true;
    case O_MAX_SEQS:
        return cli_int("--max-batch-seqs", v, 1, 4096, &ep->max_batch_seqs);
    case O_MAX_TOKENS:
        return cli_int("--max-batch-tokens", v, 1, 1 << 20, &ep->max_batch_tokens);
    case O_TIMEOUT:
        if (!cli_float("--batch-timeout-ms", v, 0, 60000, &f)) return false;
        ep->batch_timeout_ms = f;
        return true;
    case O_CHUNK:
        return cli_int("--prefill-chunk", v, 1, 1 << 20, &ep->prefill_chunk);
    case O_MAX_WAITING:
        return cli_int("--max-waiting", v, 1, 1 << 20, &ep->max_waiting);
    case O_KV_BLOCKS:
        return cli_int("--kv-blocks", v, 1, 1 << 24, &ep->kv_blocks);
    case O_KV_BLOCK_SIZE:
        return cli_int("--kv-block-size", v, 1, 4096, &ep->kv_block_size);
    case O_NO_PREFIX_CACHE:
        ep->no_prefix_cache = true;
        return true;
    case O_SPEC:
        ep->open.spec = v;
        return true;
    case O_SPEC_K:
        return cli_int("--spec-k", v, 1, 16, &ep->open.spec_k);
    case O_SPEC_MAX_BATCH:
        return cli_int("--spec-max-batch", v, -1, 4096, &ep->spec_max_batch);
    case O_DRAFT:
        ep->open.draft = v;
        return true;
    case O_SLO_TTFT:
        return parse_slo("--slo-ttft-ms", v, ep->slo_ttft_ms);
    case O_SLO_ITL:
        return parse_slo("--slo-itl-ms", v, ep->slo_itl_ms);
    case O_STEP_COST:
        o->step_cost = v;
        return true;
    case O_STEP_LOG:
        ep->step_log = v;
        return true;
    case O_STATIC_KNOBS:
        ep->static_knobs = true;
        return true;
    case O_BUDGET_SHARE:
        if (!cli_float("--step-budget-share", v, 0.25f, 1, &f)) return false;
        ep->step_budget_share = f;
        return true;
    case O_CONFIG:
        o->config = v;
        return true;
    case O_DRAIN:
        if (!cli_float("--drain-timeout", v, 0, 86400, &f)) return false;
        o->drain_timeout_s = f;
        return true;
    case O_MAX_CONN:
        if (!cli_int("--max-connections", v, 1, 65536, &i)) return false;
        o->srv.max_connections = i;
        return true;
    case O_IDLE:
        return cli_int("--idle-timeout", v, 1, 86400, &o->srv.idle_timeout_s);
    case O_READ_TIMEOUT:
        return cli_int("--read-timeout", v, 1, 86400, &o->srv.read_timeout_s);
    case O_REQUEST_TIMEOUT:
        if (!cli_float("--request-timeout", v, 0, 86400 * 7, &f)) return false;
        o->srv.request_timeout_s = f;
        return true;
    case O_API_KEY:
        if (!*v) return fprintf(stderr, "duet: --api-key must not be empty\n"), false;
        o->srv.api_key = v;
        return true;
    case O_METRICS_PUBLIC:
        o->srv.metrics_public = true;
        return true;
    case O_ORIGINS:
        o->srv.allowed_origins = v;
        return true;
    case O_INSTANCE:
        if (o->n_instances == MAX_INSTANCES)
            return fprintf(stderr, "duet: at most %d --instance options\n", MAX_INSTANCES), false;
        o->instances[o->n_instances++] = v;
        return true;
    case O_SPILL:
        if (strcmp(v, "interactive") && strcmp(v, "batch") && strcmp(v, "both") && strcmp(v, "none"))
            return fprintf(stderr, "duet: --spill-over must be interactive, batch, both or none (not '%s')\n",
                           v),
                   false;
        o->fleet.spill_interactive = !strcmp(v, "interactive") || !strcmp(v, "both");
        o->fleet.spill_batch = !strcmp(v, "batch") || !strcmp(v, "both");
        return true;
    case O_TIER_BLIND:
        o->fleet.tier_blind = true;
        return true;
    case 'v':
        o->srv.verbose = true;
        return true;
    default:
        return false;
    }
}

/* Reads the --config JSON object: each key is an option's long name, with
 * '_' or '-'. Values: strings, numbers, or true for flags. The parsed
 * document stays alive (in *doc) because options point into it. */
static bool load_config(serve_opts *o, const char *path, cJSON **doc) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "duet: --config %s: cannot open\n", path);
        return false;
    }
    char *text = NULL;
    size_t len = 0, cap = 0, n;
    char buf[4096];
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
        if (len + n + 1 > cap) {
            cap = (len + n + 1) * 2;
            char *t = realloc(text, cap);
            if (!t) break;
            text = t;
        }
        memcpy(text + len, buf, n);
        len += n;
    }
    fclose(f);
    *doc = text ? cJSON_ParseWithLength(text, len) : NULL;
    free(text);
    if (!cJSON_IsObject(*doc)) {
        fprintf(stderr, "duet: --config %s: not a JSON object\n", path);
        return false;
    }
    for (cJSON *it = (*doc)->child; it; it = it->next) {
        char name[64];
        snprintf(name, sizeof name, "%s", it->string);
        for (char *p = name; *p; p++)
            if (*p == '_') *p = '-';
        const struct option *op = NULL;
        for (const struct option *q = opts; q->name; q++)
            if (!strcmp(q->name, name) && strcmp(name, "config") && strcmp(name, "help")) op = q;
        if (!op) {
            fprintf(stderr, "duet: --config %s: unknown option \"%s\"\n", path, it->string);
            return false;
        }
        if (cJSON_IsArray(it)) { /* a repeatable option: "instance": ["backend=cpu", ...] */
            for (cJSON *el = it->child; el; el = el->next)
                if (!cJSON_IsString(el) || !set_opt(o, op->val, el->valuestring)) {
                    fprintf(stderr, "duet: --config %s: \"%s\" must hold valid strings\n", path, it->string);
                    return false;
                }
            continue;
        }
        char num[64];
        const char *v = NULL;
        if (op->has_arg == no_argument) {
            if (!cJSON_IsBool(it)) {
                fprintf(stderr, "duet: --config %s: \"%s\" must be true or false\n", path, it->string);
                return false;
            }
            if (!cJSON_IsTrue(it)) continue;
        } else if (cJSON_IsString(it)) {
            v = it->valuestring;
        } else if (cJSON_IsNumber(it)) {
            snprintf(num, sizeof num, "%.17g", it->valuedouble);
            v = num;
        } else {
            fprintf(stderr, "duet: --config %s: \"%s\" must be a string or a number\n", path, it->string);
            return false;
        }
        if (!set_opt(o, op->val, v)) {
            fprintf(stderr, "duet: (in --config %s)\n", path);
            return false;
        }
    }
    return true;
}

/* "models/foo-q8_0.gguf" -> "foo-q8_0" (malloc'd). */
static char *default_name(const char *path) {
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    size_t n = strlen(base);
    if (n > 5 && !strcmp(base + n - 5, ".gguf")) n -= 5;
    char *s = malloc(n + 1);
    if (s) memcpy(s, base, n), s[n] = 0;
    return s;
}

/* One --instance: its engine's params (the global ones, overridden by the
 * spec's keys) and tier. The backend name lives in `backend`. */
typedef struct instance_spec {
    duet_engine_params ep;
    duet_priority tier;
    char backend[32];
    char name[64]; /* "" = its index */
} instance_spec;

static bool parse_instance(const char *spec, const duet_engine_params *base, instance_spec *out) {
    memset(out, 0, sizeof *out);
    out->ep = *base;
    out->tier = DUET_PRIORITY_INTERACTIVE;
    snprintf(out->backend, sizeof out->backend, "%s", base->open.backend ? base->open.backend : "auto");
    char buf[512];
    if (snprintf(buf, sizeof buf, "%s", spec) >= (int)sizeof buf)
        return fprintf(stderr, "duet: --instance '%s' is too long\n", spec), false;
    duet_engine_params *ep = &out->ep;
    char *save = NULL;
    for (char *kv = strtok_r(buf, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
        char *v = strchr(kv, '=');
        if (!v || v == kv || !v[1])
            return fprintf(stderr, "duet: --instance '%s': '%s' is not KEY=VALUE\n", spec, kv), false;
        *v++ = 0;
        float f;
        bool ok = true;
        if (!strcmp(kv, "backend")) {
            if (strcmp(v, "auto") && strcmp(v, "cpu") && strcmp(v, "vulkan") && strcmp(v, "opencl"))
                return fprintf(stderr, "duet: --instance '%s': backend must be auto, cpu, vulkan or opencl\n",
                               spec),
                       false;
            snprintf(out->backend, sizeof out->backend, "%s", v);
        } else if (!strcmp(kv, "tier")) {
            if (!strcmp(v, "interactive"))
                out->tier = DUET_PRIORITY_INTERACTIVE;
            else if (!strcmp(v, "batch"))
                out->tier = DUET_PRIORITY_BATCH;
            else
                return fprintf(stderr, "duet: --instance '%s': tier must be interactive or batch\n", spec),
                       false;
        } else if (!strcmp(kv, "name")) {
            size_t n = strlen(v);
            if (n >= sizeof out->name ||
                strspn(v, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") != n)
                return fprintf(
                           stderr,
                           "duet: --instance '%s': name must be 1 to %zu letters, digits, '.', '_' or '-'\n",
                           spec, sizeof out->name - 1),
                       false;
            snprintf(out->name, sizeof out->name, "%s", v);
        } else if (!strcmp(kv, "device"))
            ok = cli_int("device", v, 0, 1024, &ep->open.device);
        else if (!strcmp(kv, "threads"))
            ok = cli_int("threads", v, 0, 1024, &ep->open.n_threads);
        else if (!strcmp(kv, "ctx"))
            ok = cli_int("ctx", v, 1, 1 << 20, &ep->open.n_ctx);
        else if (!strcmp(kv, "max-batch-seqs"))
            ok = cli_int("max-batch-seqs", v, 1, 4096, &ep->max_batch_seqs);
        else if (!strcmp(kv, "max-batch-tokens"))
            ok = cli_int("max-batch-tokens", v, 1, 1 << 20, &ep->max_batch_tokens);
        else if (!strcmp(kv, "prefill-chunk"))
            ok = cli_int("prefill-chunk", v, 1, 1 << 20, &ep->prefill_chunk);
        else if (!strcmp(kv, "max-waiting"))
            ok = cli_int("max-waiting", v, 1, 1 << 20, &ep->max_waiting);
        else if (!strcmp(kv, "kv-blocks"))
            ok = cli_int("kv-blocks", v, 1, 1 << 24, &ep->kv_blocks);
        else if (!strcmp(kv, "batch-timeout-ms")) {
            ok = cli_float("batch-timeout-ms", v, 0, 60000, &f);
            ep->batch_timeout_ms = f;
        } else {
            return fprintf(stderr, "duet: --instance '%s': unknown key '%s'\n", spec, kv), false;
        }
        if (!ok) return fprintf(stderr, "duet: (in --instance '%s')\n", spec), false;
    }
    ep->open.backend = out->backend;
    return true;
}

/* Starts the engines of the --instance specs: one model load per backend,
 * device and thread count, shared by the instances there. On failure stops
 * what started and returns false after printing why. */
static bool start_instances(const serve_opts *o, instance_spec *spec, int n, duet_engine **engines) {
    duet_model *models[MAX_INSTANCES] = {0};
    bool ok = true;
    for (int i = 0; i < n && ok; i++) {
        int same = -1;
        for (int k = 0; k < i && same < 0; k++)
            if (!strcmp(spec[k].backend, spec[i].backend) &&
                spec[k].ep.open.device == spec[i].ep.open.device &&
                spec[k].ep.open.n_threads == spec[i].ep.open.n_threads)
                same = k;
        duet_status st = DUET_OK;
        if (same >= 0) {
            models[i] = models[same];
        } else {
            duet_open_params op = spec[i].ep.open;
            op.weights_only = true; /* each engine makes its own KV pool */
            fprintf(stderr, "duet: instance %d: loading %s on %s\n", i, o->model, spec[i].backend);
            st = duet_model_open(o->model, &op, &models[i]);
        }
        if (!st) st = duet_engine_start_model(models[i], &spec[i].ep, &engines[i]);
        if (st) {
            fprintf(stderr, "duet: instance %d (%s): %s: %s\n", i, o->instances[i], duet_status_str(st),
                    duet_last_error());
            ok = false;
        }
    }
    /* The engines hold their references: ours go. */
    for (int i = 0; i < n; i++) {
        bool first = true;
        for (int k = 0; k < i; k++)
            if (models[k] == models[i]) first = false;
        if (first) duet_model_close(models[i]);
    }
    for (int i = 0; !ok && i < n; i++)
        if (engines[i]) duet_engine_stop(engines[i], false), engines[i] = NULL;
    return ok;
}

static double mono_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int cmd_serve(int argc, char **argv) {
    serve_opts o = {.srv = {.host = "127.0.0.1", .port = 8000},
                    .ep = duet_engine_params_default(),
                    .drain_timeout_s = 60,
                    .fleet = duet_fleet_params_default()};
    /* Pass 1 finds --config, so the command line can override it in pass 2. */
    int c;
    opterr = 0;
    optind = 0;
    while ((c = getopt_long(argc, argv, "m:t:c:vh", opts, NULL)) != -1) {
        if (c == 'h') {
            usage(stdout);
            return 0;
        }
        if (c == O_CONFIG) o.config = optarg;
    }
    cJSON *config_doc = NULL;
    int rc = 2;
    char *name = NULL;
    if (o.config && !load_config(&o, o.config, &config_doc)) goto out;
    opterr = 1;
    optind = 0;
    while ((c = getopt_long(argc, argv, "m:t:c:vh", opts, NULL)) != -1) {
        if (c == '?' || c == ':' || !set_opt(&o, c, optarg)) {
            usage(stderr);
            goto out;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "duet: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        goto out;
    }
    if (!o.srv.api_key && getenv("DUET_API_KEY") && *getenv("DUET_API_KEY"))
        o.srv.api_key = getenv("DUET_API_KEY");
    duet_step_cost step_cost;
    if (o.step_cost) {
        if (duet_step_cost_load(o.step_cost, &step_cost)) {
            fprintf(stderr, "duet: --step-cost %s: %s\n", o.step_cost, duet_last_error());
            goto out;
        }
        o.ep.step_cost = &step_cost;
    }
    rc = 1;
    if (!o.model && !(o.model = cli_default_model())) goto out;
    if (!o.srv.model_name) {
        if (!(name = default_name(o.model))) goto out;
        o.srv.model_name = name;
    }
    o.srv.model_path = o.model;

    /* Signals go to this thread only: block them before any thread starts
     * (threads inherit the mask), then wait for them with sigwait. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN); /* a vanished client must not kill the server */

    duet_engine *engines[MAX_INSTANCES] = {0};
    duet_fleet_instance fi[MAX_INSTANCES];
    instance_spec spec[MAX_INSTANCES];
    int n_inst = o.n_instances ? o.n_instances : 1;
    duet_fleet *fleet = NULL;
    o.ep.served_name = o.srv.model_name; /* the metrics name the model as the API does */
    if (o.ep.step_log && o.n_instances > 1) {
        fprintf(stderr, "duet: --step-log logs one engine; %d --instance options were given\n",
                o.n_instances);
        rc = 2;
        goto out;
    }
    for (int i = 0; i < o.n_instances; i++)
        if (!parse_instance(o.instances[i], &o.ep, &spec[i])) {
            rc = 2;
            goto out;
        }
    for (int i = 0; i < o.n_instances; i++)
        for (int k = 0; k < i; k++) {
            char a[16], b[16]; /* an unnamed instance is named by its index */
            snprintf(a, sizeof a, "%d", i), snprintf(b, sizeof b, "%d", k);
            if (!strcmp(spec[i].name[0] ? spec[i].name : a, spec[k].name[0] ? spec[k].name : b)) {
                fprintf(stderr, "duet: --instance %d and %d have the same name '%s'\n", k, i,
                        spec[i].name[0] ? spec[i].name : a);
                rc = 2;
                goto out;
            }
        }
    const double t_start = mono_seconds();
    fprintf(stderr, "duet: loading %s\n", o.model);
    fflush(stderr);
    duet_status st = DUET_OK;
    if (!o.n_instances) {
        if ((st = duet_engine_start(o.model, &o.ep, &engines[0]))) {
            rc = cli_fail(o.model, st);
            goto out;
        }
        spec[0] = (instance_spec){.ep = o.ep, .tier = DUET_PRIORITY_INTERACTIVE};
    } else if (!start_instances(&o, spec, n_inst, engines)) {
        goto out;
    }
    char names[MAX_INSTANCES][64];
    for (int i = 0; i < n_inst; i++) {
        snprintf(names[i], sizeof names[i], "%s", spec[i].name);
        if (!names[i][0]) snprintf(names[i], sizeof names[i], "%d", i);
        int seqs = spec[i].ep.max_batch_seqs ? spec[i].ep.max_batch_seqs : 16;
        fi[i] = (duet_fleet_instance){.engine = engines[i],
                                      .tier = spec[i].tier,
                                      .max_outstanding = o.n_instances > 1 ? 2 * seqs : 0,
                                      .name = names[i]};
    }
    if ((st = duet_fleet_new(fi, n_inst, &o.fleet, &fleet))) {
        fprintf(stderr, "duet: %s\n", duet_last_error());
        goto stop_engines;
    }
    const double t_loaded = mono_seconds();
    fprintf(stderr, "duet: loaded in %.2f s; warming up (a first forward pass)\n", t_loaded - t_start);
    fflush(stderr);
    if ((st = duet_fleet_warmup(fleet))) {
        fprintf(stderr, "duet: warm-up failed: %s: %s\n", duet_status_str(st), duet_last_error());
        goto stop_engines;
    }
    const double t_warm = mono_seconds();
    srv *s;
    if (srv_start(fleet, &o.srv, &s)) goto stop_engines;
    srv_set_ready(s);
    for (int i = 0; i < n_inst; i++) {
        duet_model_desc d;
        duet_model_describe(duet_engine_model(engines[i]), &d);
        if (n_inst > 1)
            fprintf(stderr, "duet: instance %s: %s on %s, tier %s, context %d\n", names[i], d.backend,
                    d.device, spec[i].tier == DUET_PRIORITY_BATCH ? "batch" : "interactive",
                    duet_engine_max_sequence_tokens(engines[i]));
        else
            fprintf(stderr, "duet: serving %s (%s, %s on %s, context %d, chat template %s) on http://%s:%d\n",
                    o.srv.model_name, d.arch, d.backend, d.device, d.n_ctx, srv_chat_template_in_use(s),
                    o.srv.host, srv_port(s));
    }
    if (n_inst > 1)
        fprintf(stderr, "duet: serving %s (%d instances, chat template %s) on http://%s:%d\n",
                o.srv.model_name, n_inst, srv_chat_template_in_use(s), o.srv.host, srv_port(s));
    fprintf(stderr, "duet: ready in %.2f s (load %.2f s, warm-up %.2f s)\n", mono_seconds() - t_start,
            t_loaded - t_start, t_warm - t_loaded);
    fflush(stderr);

    int sig = 0;
    sigwait(&sigs, &sig);
    fprintf(stderr, "duet: %s: no new requests; draining the ones in flight (up to %.0f s)\n",
            sig == SIGTERM ? "SIGTERM" : "SIGINT", o.drain_timeout_s);
    srv_drain(s); /* /ready turns 503 and the port closes */
    /* Drain until idle, the timeout, or a second signal (then cancel). */
    double deadline = mono_seconds() + o.drain_timeout_s;
    bool cancelled = false;
    while (!srv_wait_idle(s, 0.1)) {
        struct timespec zero = {0, 0};
        bool again = sigtimedwait(&sigs, NULL, &zero) > 0;
        if (!cancelled && (again || mono_seconds() > deadline)) {
            fprintf(stderr, "duet: %s; cancelling the requests in flight\n",
                    again ? "second signal" : "drain timeout");
            srv_cancel_all(s);
            cancelled = true;
            deadline = mono_seconds() + 10;
        } else if (cancelled && mono_seconds() > deadline) {
            break; /* srv_stop closes whatever is left */
        }
    }
    srv_stop(s);
    rc = 0;
stop_engines:
    /* Engines first: their last events go through the fleet. */
    for (int i = 0; i < n_inst; i++)
        duet_engine_stop(engines[i], rc == 0);
    duet_fleet_free(fleet);
    if (rc == 0) fprintf(stderr, "duet: stopped\n");
out:
    free(name);
    cJSON_Delete(config_doc);
    return rc;
}
