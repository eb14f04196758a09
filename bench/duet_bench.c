/* duet_bench.c — duet-bench's command line: parse the flags (named as in
 * `vllm bench serve` where the meaning is the same), run the sweep on one
 * target or on every backend and device, write the reports, print the
 * operating point.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "duet_bench.h"

static const char usage[] =
    "usage: duet-bench (--base-url URL | --in-process -m MODEL | --serve-cmd CMD | --simulate PROFILE) "
    "[options]\n"
    "\n"
    "Target (one of):\n"
    "  --base-url URL             an OpenAI-compatible server (streams POST /v1/completions)\n"
    "                             (with $DUET_API_KEY set, sent as Authorization: Bearer)\n"
    "  --host H --port P          the same as --base-url http://H:P\n"
    "  --in-process               run a duet engine in this process (needs -m)\n"
    "  --serve-cmd CMD            start a server per knob setting: CMD plus --host, --port and the knob "
    "flags\n"
    "                             (e.g. \"./duet serve -m model.gguf\"); needed for HTTP knob sweeps\n"
    "  -m, --model PATH           the GGUF model (in-process: the model; HTTP: its tokenizer, for token-id "
    "prompts)\n"
    "  --backend B --device N     in-process or --serve-cmd: backend (auto|cpu|vulkan|opencl) and device\n"
    "  --threads N --ctx N        in-process: cpu threads (0 = all) and context length\n"
    "  --all-devices              the same sweep on every backend x device found; writes comparison.md/.png\n"
    "  --peer LABEL=URL           also run every load point against this OpenAI-compatible server (repeat\n"
    "                             for more), alternating point by point with the target; writes\n"
    "                             comparison.md/.png (the target is named by --label, default duet)\n"
    "  --per-instance             --base-url of a duet server with several instances (--instance):\n"
    "                             every load point against each instance in turn (pinned with the\n"
    "                             X-Duet-Instance header), alternating point by point; writes\n"
    "                             comparison.md/.csv/.png, the instances labelled backend/device/tier\n"
    "  --endpoint PATH            default /v1/completions\n"
    "  --served-model-name NAME   the \"model\" field (default: the first id of GET /v1/models)\n"
    "  --simulate PROFILE         no server: the engine's scheduler on a virtual clock, steps costed by the\n"
    "                             step-cost model `duet profile` wrote; the same workload, arrivals and "
    "report\n"
    "  --instances N              --simulate: N (1..64) identical instances behind the router\n"
    "  --find-instances MAX       --simulate: fleets of 1..MAX instances until every load meets\n"
    "                             --slo-ttft-ms/--slo-itl-ms; writes instances.csv, needed.csv, "
    "instances.png\n"
    "  --sim-ctx N                --simulate: context per sequence (default: the profile's)\n"
    "  --sim-latency-ms X         --simulate: added to every token's time (the client-server path)\n"
    "  --sim-step-noise on|off    --simulate: each step's cost times a draw from the profile's measured\n"
    "                             dispersion (seeded by --seed; default on when the profile has one)\n"
    "  --sim-noise-seed N         --simulate: other draws of the dispersion, the same workload (default 0)\n"
    "  --sim-step-scale F         --simulate: every step costs F times the profile's prediction: a server's\n"
    "                             duet_step_cost_served_seconds_total over ..._profiled_seconds_total\n"
    "                             (duet serve --step-cost PROFILE) when serving runs slower than profiled;\n"
    "                             prompt=F,decode=G: steps with a prompt chunk F times, decode-only steps\n"
    "                             G times (a --step-log's seconds over profile_s by kind; the simulated\n"
    "                             schedulers keep the profile)\n"
    "  --sim-slo-ttft-ms T --sim-slo-itl-ms T   --simulate: the simulated servers' latency targets, as\n"
    "                             duet serve --slo-ttft-ms/--slo-itl-ms take them (MS, or\n"
    "                             interactive=MS,batch=MS): the adaptive controller and the stall-free step\n"
    "                             budget then run as in such a server (default: none, as duet serve's)\n"
    "  --sim-static-knobs         --simulate: the simulated servers keep their knobs (duet serve\n"
    "                             --static-knobs: targets size the steps, no controller)\n"
    "  --sim-step-log             --simulate: sim_steps.csv, a line per simulated step: the point and\n"
    "                             instance, then duet serve --step-log's columns (its learnt and draft\n"
    "                             columns left out; predicted_s without the dispersion's draw)\n"
    "  --trace FILE               --simulate: arrivals and lengths from a file, one request a line:\n"
    "                             arrival_s,prompt_tokens,output_tokens[,interactive|batch] or JSONL with "
    "those\n"
    "                             keys (arrival, prompt_tokens, output_tokens, priority); with "
    "--request-rate\n"
    "                             or --sweep-rate the times are rescaled to that mean rate\n"
    "\n"
    "Workload:\n"
    "  --num-prompts N            requests per point (default 100)\n"
    "  --duration S               stop sending after S seconds (then --num-prompts defaults to unbounded)\n"
    "  --random-input-len N       prompt tokens (default 64)\n"
    "  --random-prefix-len N      a random prefix of N tokens shared by every prompt, before its\n"
    "                             --random-input-len own tokens (a system prompt; default 0)\n"
    "  --random-output-len N      output tokens (default 32)\n"
    "  --random-range-ratio R     lengths uniform in [len*(1-R), len*(1+R)] (default 0: fixed)\n"
    "  --dataset-path FILE        JSONL lines {\"prompt\": \"...\", \"output_len\": N}\n"
    "  --priority-mix X           share of interactive requests, as 0.3 or 3:7 (interactive:batch)\n"
    "  --temperature T            default 0 (greedy)\n"
    "  --ignore-eos / --no-ignore-eos   generate exactly the output length (default on)\n"
    "  --seed N                   workload and arrival seed (default 0); each load point draws its own\n"
    "                             random prompts from it (a server's prefix cache gains nothing from\n"
    "                             earlier points), the same for every target and knob setting\n"
    "  --warmup N                 unmeasured requests, sent at once, before each knob setting (default:\n"
    "                             max_batch_seqs, so every batch size runs once before measuring)\n"
    "\n"
    "Load and sweeps:\n"
    "  --request-rate R           requests/s, Poisson arrivals (default inf: all at once)\n"
    "  --rate-profile P           the offered rate over time, piecewise linear: SECONDS:RATE,... from 0\n"
    "                             (e.g. 0:1,300:6,600:1, a ramp up and down); the run ends with it, and\n"
    "                             --timeline defaults to 30\n"
    "  --burstiness B             gamma shape of the gaps (1 = Poisson; <1 burstier)\n"
    "  --max-concurrency N        at most N requests in flight (closed loop with rate inf)\n"
    "  --sweep-rate L             e.g. 1,2,4,inf\n"
    "  --sweep-concurrency L      e.g. 1,2,4,8\n"
    "  --sweep-batch-timeout-ms L e.g. 0,2,10 (in-process or --serve-cmd)\n"
    "  --sweep-max-batch-seqs L   e.g. 1,4,16 (in-process or --serve-cmd)\n"
    "  --batch-timeout-ms X --max-batch-seqs N --max-batch-tokens N --prefill-chunk N --max-waiting N\n"
    "                             engine knobs when not swept (default: the engine's)\n"
    "\n"
    "Statistics:\n"
    "  --percentile-metrics L     printed metrics, of ttft,tpot,itl,e2el (default all)\n"
    "  --metric-percentiles L     default 50,90,99 (p50 and p99 are always computed)\n"
    "  --goodput KEY:MS ...       SLOs for goodput, keys ttft tpot itl e2el (itl: every gap of a request)\n"
    "  --slo-ttft-ms X --slo-itl-ms Y   targets for the operating point (p99 TTFT and p99 ITL)\n"
    "\n"
    "Output:\n"
    "  --output-dir DIR           default bench/results/<timestamp>-<device>\n"
    "  --label NAME               names the device in reports (HTTP mode)\n"
    "  --save-detailed            also write requests.csv (every request's timings)\n"
    "  --timeline S               also write timeline.csv/.png: per S-second window the offered and\n"
    "                             served load, p99 TTFT and ITL per class, and the server's knobs\n"
    "                             (sampled from /metrics every min(2, S/2) s)\n"
    "  --no-plots                 skip gnuplot\n"
    "  --disable-tqdm, --no-progress   no progress line\n";

/* "X" (out[0], when bare_ok) or "key0=X,key1=Y" (either part may be left
 * out), every X in [lo, hi]; x_name names X in the message. A latency
 * target as duet serve takes it: MS (interactive requests) or
 * interactive=MS,batch=MS. */
static bool parse_keyed(const char *flag, const char *v, const char *x_name, const char *key0,
                        const char *key1, bool bare_ok, double lo, double hi, double out[2]) {
    char buf[128];
    snprintf(buf, sizeof buf, "%s", v);
    bool ok = *v != 0;
    for (char *save, *tok = strtok_r(buf, ",", &save); ok && tok; tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        int c = 0;
        if (eq) {
            *eq = 0;
            c = !strcmp(tok, key0) ? 0 : !strcmp(tok, key1) ? 1 : -1;
            tok = eq + 1;
        } else if (tok != buf || !bare_ok) {
            c = -1; /* a bare number only alone */
        }
        char *end;
        double x = c >= 0 ? strtod(tok, &end) : NAN;
        ok = c >= 0 && *tok && !*end && x >= lo && x <= hi;
        if (ok) out[c] = x;
    }
    if (!ok)
        fprintf(stderr, "duet-bench: %s wants %s%s%s=%s,%s=%s (each in [%g, %g]), got '%s'\n", flag,
                bare_ok ? x_name : "", bare_ok ? " or " : "", key0, x_name, key1, x_name, lo, hi, v);
    return ok;
}

static bool parse_int(const char *flag, const char *v, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (!*v || *end || errno || x < lo || x > hi) {
        fprintf(stderr, "duet-bench: %s wants an integer in [%ld, %ld], got '%s'\n", flag, lo, hi, v);
        return false;
    }
    *out = (int)x;
    return true;
}

static bool parse_double(const char *flag, const char *v, double lo, double hi, bool inf_ok, double *out) {
    if (inf_ok && (!strcmp(v, "inf") || !strcmp(v, "infinity"))) {
        *out = INFINITY;
        return true;
    }
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (!*v || *end || errno || !(x >= lo && x <= hi)) {
        fprintf(stderr, "duet-bench: %s wants a number in [%g, %g]%s, got '%s'\n", flag, lo, hi,
                inf_ok ? " or inf" : "", v);
        return false;
    }
    *out = x;
    return true;
}

static bool parse_sweep(const char *flag, const char *v, double *out, int *n, bool integer, bool inf_ok) {
    if (!db_parse_list(v, out, DB_MAX_SWEEP, n)) {
        fprintf(stderr,
                "duet-bench: %s wants a comma-separated list of up to %d non-negative numbers, got '%s'\n",
                flag, DB_MAX_SWEEP, v);
        return false;
    }
    for (int i = 0; i < *n; i++)
        if ((!inf_ok && isinf(out[i])) || (integer && (out[i] != floor(out[i]) || out[i] < 1))) {
            fprintf(stderr, "duet-bench: %s: '%s' is not a valid entry\n", flag, v);
            return false;
        }
    return true;
}

static bool parse_priority_mix(const char *v, double *share) {
    const char *colon = strchr(v, ':');
    char *end;
    if (colon) {
        double a = strtod(v, &end);
        if (end != colon) return false;
        double b = strtod(colon + 1, &end);
        if (*end || !(a >= 0 && b >= 0 && a + b > 0)) return false;
        *share = a / (a + b);
        return true;
    }
    double x = strtod(v, &end);
    if (!*v || *end || !(x >= 0 && x <= 1)) return false;
    *share = x;
    return true;
}

static bool parse_metric_list(const char *v, db_config *c) {
    c->pm_ttft = c->pm_tpot = c->pm_itl = c->pm_e2el = false;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", v);
    for (char *save, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (!strcmp(t, "ttft"))
            c->pm_ttft = true;
        else if (!strcmp(t, "tpot"))
            c->pm_tpot = true;
        else if (!strcmp(t, "itl"))
            c->pm_itl = true;
        else if (!strcmp(t, "e2el"))
            c->pm_e2el = true;
        else
            return false;
    }
    return true;
}

/* Adds p to the percentile list unless present. */
static void ensure_pct(db_config *c, double p) {
    for (int i = 0; i < c->n_ps; i++)
        if (c->ps[i] == p) return;
    if (c->n_ps < DB_MAX_PCT) c->ps[c->n_ps++] = p;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void default_dir(const char *what, char *out, size_t size) {
    char ts[32], slug[200];
    time_t t = time(NULL);
    struct tm tm;
    localtime_r(&t, &tm);
    strftime(ts, sizeof ts, "%Y%m%d-%H%M%S", &tm);
    db_slug(slug, sizeof slug, what);
    snprintf(out, size, "bench/results/%s-%s", ts, slug[0] ? slug : "unknown");
}

static void print_table(const db_sweep *s) {
    printf("\n%-3s %-22s %-34s %9s %10s %10s %10s %10s %10s\n", "#", "load", "knobs", "req/s", "tok/s",
           "TTFTp50", "TTFTp99", "ITLp50", "ITLp99");
    for (int p = 0; p < s->n_points; p++) {
        const db_point *pt = &s->points[p];
        char ld[64], kn[96], r[32], bt[32], mbs[32];
        db_fmt_num(r, sizeof r, pt->load.rate);
        if (pt->load.max_concurrency > 0)
            snprintf(ld, sizeof ld, "rate %s conc %d", r, pt->load.max_concurrency);
        else
            snprintf(ld, sizeof ld, "rate %s", r);
        db_fmt_num(bt, sizeof bt, pt->knobs.batch_timeout_ms < 0 ? NAN : pt->knobs.batch_timeout_ms);
        db_fmt_num(mbs, sizeof mbs, pt->knobs.max_batch_seqs <= 0 ? NAN : pt->knobs.max_batch_seqs);
        snprintf(kn, sizeof kn, "timeout %s ms, seqs %s", bt, mbs);
        printf("%-3d %-22s %-34s %9.2f %10.1f %10.1f %10.1f %10.2f %10.2f%s\n", p, ld, kn,
               pt->stats.request_throughput, pt->stats.output_throughput, pt->ttft_p50_ms, pt->ttft_p99_ms,
               pt->itl_p50_ms, pt->itl_p99_ms, p == s->op ? "  <- operating point" : "");
    }
}

/* Runs one target and writes its report. */
static bool run_one(db_config *cfg, const char *backend, int device, const char *dir_hint, db_sweep *s,
                    const char *command) {
    snprintf(s->dir, sizeof s->dir, "%s", dir_hint ? dir_hint : "");
    /* A server started by us logs next to the results: the folder must exist. */
    if (cfg->serve_cmd && s->dir[0]) db_mkdirs(s->dir);
    bool ok = db_sweep_run(cfg, backend, device, s);
    snprintf(s->meta.command, sizeof s->meta.command, "%s", command);
    if (!s->dir[0]) default_dir(s->meta.device, s->dir, sizeof s->dir);
    if (!ok) fprintf(stderr, "duet-bench: %s%s%s\n", backend ? backend : "", backend ? ": " : "", s->why);
    if (s->n_points > 0) {
        print_table(s);
        db_report_write(cfg, s, s->dir);
        printf("results: %s\n", s->dir);
    }
    db_report_print_op(cfg, s);
    return ok;
}

/* Moves src's points to the end of dst's (src keeps its meta, loses its
 * points). */
static bool append_points(db_sweep *dst, db_sweep *src) {
    db_point *p = realloc(dst->points, (size_t)(dst->n_points + src->n_points) * sizeof *p);
    if (!p) return false;
    memcpy(p + dst->n_points, src->points, (size_t)src->n_points * sizeof *p);
    dst->points = p;
    dst->n_points += src->n_points;
    free(src->points);
    src->points = NULL;
    src->n_points = 0;
    return true;
}

/* One server of a side-by-side comparison (--peer, --per-instance). */
typedef struct db_target {
    char label[128];
    char url[512];    /* "" = the configured target itself (--base-url or --serve-cmd) */
    db_instance inst; /* --per-instance: the instance pinned (inst.name "" = none) */
} db_target;
#define DB_MAX_TARGETS 16

/* --peer and --per-instance: every load point against each target in turn,
 * then the next point: drift on a shared machine (other work, thermal
 * state) then hits every target alike. Each (point, target) pair is one
 * sweep of one point, with its own warm-up. */
static int run_compare(db_config *c, const db_target *tg, int n_t, const char *command) {
    char top[1024];
    if (c->output_dir)
        snprintf(top, sizeof top, "%s", c->output_dir);
    else
        default_dir("compare", top, sizeof top);
    int n_load = c->n_sweep_rate ? c->n_sweep_rate : c->n_sweep_conc ? c->n_sweep_conc : 1;
    db_sweep sw[DB_MAX_TARGETS];
    memset(sw, 0, sizeof sw);
    bool all_ok = true;
    for (int il = 0; il < n_load; il++)
        for (int t = 0; t < n_t; t++) {
            db_config cc = *c;
            /* Point il's own prompts, the same for every target. */
            cc.workload.seed = db_point_seed(c->workload.seed, il);
            if (c->n_sweep_rate) cc.sweep_rate[0] = c->sweep_rate[il], cc.n_sweep_rate = 1;
            if (c->n_sweep_conc) cc.sweep_conc[0] = c->sweep_conc[il], cc.n_sweep_conc = 1;
            const char *label = tg[t].label;
            cc.label = label;
            if (tg[t].url[0]) {
                cc.serve_cmd = NULL;
                snprintf(cc.http.base_url, sizeof cc.http.base_url, "%s", tg[t].url);
                cc.http.model_name[0] = 0; /* each server names its own model */
            }
            snprintf(cc.http.instance, sizeof cc.http.instance, "%s", tg[t].inst.name);
            char slug[200];
            db_slug(slug, sizeof slug, label);
            db_sweep one = {0};
            snprintf(one.dir, sizeof one.dir, "%.800s/%.200s", top, slug);
            db_mkdirs(one.dir);
            printf("\n=== load point %d/%d: %s ===\n", il + 1, n_load, label);
            fflush(stdout);
            bool ok = db_sweep_run(&cc, c->backend, c->device, &one);
            if (tg[t].inst.name[0]) { /* the instance, as the server describes it */
                db_meta *m = &one.meta;
                snprintf(m->backend, sizeof m->backend, "%s", tg[t].inst.backend);
                snprintf(m->device, sizeof m->device, "%s", tg[t].inst.device);
                snprintf(m->instance, sizeof m->instance, "%s", tg[t].inst.name);
                snprintf(m->tier, sizeof m->tier, "%s", tg[t].inst.tier);
                /* The server's knob gauges sum its instances: this one's own. */
                for (int p = 0; p < one.n_points && tg[t].inst.max_batch_seqs > 0; p++)
                    one.points[p].knobs.max_batch_seqs = one.points[p].server.max_batch_seqs =
                        tg[t].inst.max_batch_seqs;
            }
            if (!ok) {
                fprintf(stderr, "duet-bench: %s: %s\n", label, one.why);
                all_ok = false;
            }
            if (il == 0 || !sw[t].meta.started[0]) {
                sw[t].meta = one.meta;
                if (!strcmp(sw[t].meta.device, "unknown"))
                    snprintf(sw[t].meta.device, sizeof sw[t].meta.device, "%s", label);
                snprintf(sw[t].dir, sizeof sw[t].dir, "%s", one.dir);
            }
            if (!ok) {
                sw[t].failed = true;
                snprintf(sw[t].why, sizeof sw[t].why, "%s", one.why);
            }
            if (!append_points(&sw[t], &one)) {
                db_sweep_free(&one);
                all_ok = false;
            }
        }
    for (int t = 0; t < n_t; t++) {
        snprintf(sw[t].meta.command, sizeof sw[t].meta.command, "%s", command);
        db_sweep_pick_op(c, &sw[t]);
        printf("\n%s:", tg[t].label);
        print_table(&sw[t]);
        if (sw[t].n_points) db_report_write(c, &sw[t], sw[t].dir);
        db_report_print_op(c, &sw[t]);
    }
    db_report_compare(c, sw, n_t, top);
    printf("\ncomparison: %s/comparison.md\n", top);
    for (int t = 0; t < n_t; t++)
        db_sweep_free(&sw[t]);
    return all_ok ? 0 : 1;
}

/* --per-instance: the targets are the server's instances. */
static int per_instance_targets(const db_config *c, db_target *tg) {
    db_instance inst[DB_MAX_TARGETS];
    char err[512];
    int n = db_http_instances(c->http.base_url, inst, DB_MAX_TARGETS, err, sizeof err);
    if (n < 0) {
        fprintf(stderr, "duet-bench: --per-instance: %s\n", err);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        memset(&tg[i], 0, sizeof tg[i]);
        tg[i].inst = inst[i];
        snprintf(tg[i].label, sizeof tg[i].label, "%.60s-%.40s-%.15s", inst[i].name, inst[i].backend,
                 inst[i].tier);
        printf("instance %s: %s on %s, tier %s, max_batch_seqs %d%s\n", inst[i].name, inst[i].backend,
               inst[i].device, inst[i].tier, inst[i].max_batch_seqs, inst[i].healthy ? "" : " (unhealthy)");
    }
    return n;
}

int main(int argc, char **argv) {
    db_config c = {0};
    c.device = -1;
    c.workload = (db_workload_cfg){.input_len = 64, .output_len = 32, .interactive_share = -1};
    c.req = (db_req_opts){.temperature = 0, .ignore_eos = true};
    c.num_prompts = 0; /* 0 = not given */
    c.warmup = -1;     /* auto */
    c.load = (db_load){.rate = INFINITY, .burstiness = 1};
    c.knobs = (db_knobs){.batch_timeout_ms = -1};
    c.pm_ttft = c.pm_tpot = c.pm_itl = c.pm_e2el = true;
    c.ps[0] = 50, c.ps[1] = 90, c.ps[2] = 99, c.n_ps = 3;
    c.plots = c.progress = true;
    snprintf(c.http.endpoint, sizeof c.http.endpoint, "/v1/completions");
    const char *host = NULL;
    int port = 0;
    bool goodput_given = false;
    db_target peers[1 + DB_MAX_PEERS];
    int n_peers = 0;
    bool per_instance = false;

#define NEED_ARG()                                                                                           \
    do {                                                                                                     \
        if (i + 1 >= argc) {                                                                                 \
            fprintf(stderr, "duet-bench: %s needs a value\n%s", a, usage);                                   \
            return 2;                                                                                        \
        }                                                                                                    \
        v = argv[++i];                                                                                       \
    } while (0)

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        bool ok = true;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(usage, stdout);
            return 0;
        } else if (!strcmp(a, "--base-url")) {
            NEED_ARG();
            snprintf(c.http.base_url, sizeof c.http.base_url, "%s", v);
            size_t n = strlen(c.http.base_url);
            while (n > 0 && c.http.base_url[n - 1] == '/')
                c.http.base_url[--n] = 0;
        } else if (!strcmp(a, "--host")) {
            NEED_ARG();
            host = v;
        } else if (!strcmp(a, "--port")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 65535, &port);
        } else if (!strcmp(a, "--endpoint")) {
            NEED_ARG();
            snprintf(c.http.endpoint, sizeof c.http.endpoint, "%s", v);
        } else if (!strcmp(a, "--served-model-name")) {
            NEED_ARG();
            snprintf(c.http.model_name, sizeof c.http.model_name, "%s", v);
        } else if (!strcmp(a, "--in-process")) {
            c.in_process = true;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            NEED_ARG();
            c.model_path = v;
        } else if (!strcmp(a, "--backend")) {
            NEED_ARG();
            c.backend = !strcmp(v, "auto") ? NULL : v;
        } else if (!strcmp(a, "--device")) {
            NEED_ARG();
            ok = parse_int(a, v, 0, 1024, &c.device);
        } else if (!strcmp(a, "--threads")) {
            NEED_ARG();
            ok = parse_int(a, v, 0, 1024, &c.n_threads);
        } else if (!strcmp(a, "--ctx")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 1 << 20, &c.n_ctx);
        } else if (!strcmp(a, "--peer")) {
            NEED_ARG();
            const char *eq = strchr(v, '=');
            if (n_peers == DB_MAX_PEERS || !eq || eq == v || strncmp(eq + 1, "http", 4)) {
                fprintf(stderr, "duet-bench: --peer wants LABEL=http://HOST:PORT (at most %d), got '%s'\n",
                        DB_MAX_PEERS, v);
                ok = false;
            } else {
                db_target *p = &peers[1 + n_peers++];
                memset(p, 0, sizeof *p);
                snprintf(p->label, sizeof p->label, "%.*s", (int)(eq - v), v);
                snprintf(p->url, sizeof p->url, "%s", eq + 1);
            }
        } else if (!strcmp(a, "--per-instance")) {
            per_instance = true;
        } else if (!strcmp(a, "--all-devices")) {
            c.all_devices = true;
        } else if (!strcmp(a, "--serve-cmd")) {
            NEED_ARG();
            c.serve_cmd = v;
        } else if (!strcmp(a, "--serve-port")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 65535, &c.serve_port);
        } else if (!strcmp(a, "--num-prompts")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 1000000, &c.num_prompts);
        } else if (!strcmp(a, "--duration")) {
            NEED_ARG();
            ok = parse_double(a, v, 0.001, 1e7, false, &c.load.duration_s);
        } else if (!strcmp(a, "--random-input-len")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 1 << 20, &c.workload.input_len);
        } else if (!strcmp(a, "--random-prefix-len")) {
            NEED_ARG();
            ok = parse_int(a, v, 0, 1 << 20, &c.workload.prefix_len);
        } else if (!strcmp(a, "--random-output-len")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 1 << 20, &c.workload.output_len);
        } else if (!strcmp(a, "--random-range-ratio")) {
            NEED_ARG();
            ok = parse_double(a, v, 0, 0.999, false, &c.workload.range_ratio);
        } else if (!strcmp(a, "--dataset-path")) {
            NEED_ARG();
            c.workload.dataset_path = v;
        } else if (!strcmp(a, "--priority-mix")) {
            NEED_ARG();
            if (!parse_priority_mix(v, &c.workload.interactive_share)) {
                fprintf(
                    stderr,
                    "duet-bench: --priority-mix wants a share in [0, 1] (0.3) or a ratio (3:7), got '%s'\n",
                    v);
                ok = false;
            }
        } else if (!strcmp(a, "--temperature")) {
            NEED_ARG();
            ok = parse_double(a, v, 0, 100, false, &c.req.temperature);
        } else if (!strcmp(a, "--ignore-eos")) {
            c.req.ignore_eos = true;
        } else if (!strcmp(a, "--no-ignore-eos")) {
            c.req.ignore_eos = false;
        } else if (!strcmp(a, "--seed")) {
            NEED_ARG();
            int s;
            ok = parse_int(a, v, 0, 2147483647L, &s);
            c.workload.seed = c.load.seed = (uint64_t)s;
        } else if (!strcmp(a, "--warmup")) {
            NEED_ARG();
            ok = parse_int(a, v, 0, 1000, &c.warmup);
        } else if (!strcmp(a, "--request-rate")) {
            NEED_ARG();
            ok = parse_double(a, v, 1e-6, 1e9, true, &c.load.rate);
        } else if (!strcmp(a, "--rate-profile")) {
            NEED_ARG();
            char perr[200];
            if (!(ok = db_profile_parse(v, &c.profile, perr, sizeof perr)))
                fprintf(stderr, "duet-bench: %s\n", perr);
        } else if (!strcmp(a, "--timeline")) {
            NEED_ARG();
            ok = parse_double(a, v, 0.1, 86400, false, &c.timeline_s);
        } else if (!strcmp(a, "--burstiness")) {
            NEED_ARG();
            ok = parse_double(a, v, 1e-3, 1e3, false, &c.load.burstiness);
        } else if (!strcmp(a, "--max-concurrency")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 1000000, &c.load.max_concurrency);
        } else if (!strcmp(a, "--sweep-rate")) {
            NEED_ARG();
            ok = parse_sweep(a, v, c.sweep_rate, &c.n_sweep_rate, false, true);
            for (int k = 0; ok && k < c.n_sweep_rate; k++)
                if (c.sweep_rate[k] <= 0) {
                    fprintf(stderr, "duet-bench: --sweep-rate entries must be > 0\n");
                    ok = false;
                }
        } else if (!strcmp(a, "--sweep-concurrency")) {
            NEED_ARG();
            ok = parse_sweep(a, v, c.sweep_conc, &c.n_sweep_conc, true, false);
        } else if (!strcmp(a, "--sweep-batch-timeout-ms")) {
            NEED_ARG();
            ok = parse_sweep(a, v, c.sweep_bt, &c.n_sweep_bt, false, false);
        } else if (!strcmp(a, "--sweep-max-batch-seqs")) {
            NEED_ARG();
            ok = parse_sweep(a, v, c.sweep_mbs, &c.n_sweep_mbs, true, false);
        } else if (!strcmp(a, "--batch-timeout-ms")) {
            NEED_ARG();
            ok = parse_double(a, v, 0, 60000, false, &c.knobs.batch_timeout_ms);
        } else if (!strcmp(a, "--max-batch-seqs")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 1024, &c.knobs.max_batch_seqs);
        } else if (!strcmp(a, "--max-batch-tokens")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 65536, &c.knobs.max_batch_tokens);
        } else if (!strcmp(a, "--prefill-chunk")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 65536, &c.knobs.prefill_chunk);
        } else if (!strcmp(a, "--max-waiting")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 100000, &c.max_waiting);
        } else if (!strcmp(a, "--goodput")) {
            /* vLLM takes the SLOs as separate words: --goodput ttft:500 tpot:50 */
            char buf[512] = "";
            while (i + 1 < argc && argv[i + 1][0] != '-' && strchr(argv[i + 1], ':')) {
                size_t n = strlen(buf);
                snprintf(buf + n, sizeof buf - n, "%s%s", n ? " " : "", argv[++i]);
            }
            char err[200];
            if (!buf[0]) {
                fprintf(stderr, "duet-bench: --goodput needs KEY:MS values (e.g. ttft:500 itl:50)\n");
                ok = false;
            } else if (!db_slo_parse(buf, &c.goodput, err, sizeof err)) {
                fprintf(stderr, "duet-bench: %s\n", err);
                ok = false;
            }
            goodput_given = true;
        } else if (!strcmp(a, "--percentile-metrics")) {
            NEED_ARG();
            if (!parse_metric_list(v, &c)) {
                fprintf(stderr, "duet-bench: --percentile-metrics takes ttft,tpot,itl,e2el; got '%s'\n", v);
                ok = false;
            }
        } else if (!strcmp(a, "--metric-percentiles")) {
            NEED_ARG();
            double ps[DB_MAX_PCT];
            int n;
            ok = db_parse_list(v, ps, DB_MAX_PCT - 2, &n);
            for (int k = 0; ok && k < n; k++)
                ok = ps[k] > 0 && ps[k] < 100;
            if (!ok)
                fprintf(stderr,
                        "duet-bench: --metric-percentiles wants up to %d values in (0, 100), got '%s'\n",
                        DB_MAX_PCT - 2, v);
            else
                memcpy(c.ps, ps, sizeof ps), c.n_ps = n;
        } else if (!strcmp(a, "--slo-ttft-ms")) {
            NEED_ARG();
            ok = parse_double(a, v, 1e-6, 1e9, false, &c.slo_ttft_ms);
        } else if (!strcmp(a, "--slo-itl-ms")) {
            NEED_ARG();
            ok = parse_double(a, v, 1e-6, 1e9, false, &c.slo_itl_ms);
        } else if (!strcmp(a, "--simulate")) {
            NEED_ARG();
            c.simulate = v;
        } else if (!strcmp(a, "--instances")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 64, &c.sim_instances);
        } else if (!strcmp(a, "--find-instances")) {
            NEED_ARG();
            ok = parse_int(a, v, 1, 64, &c.find_instances);
        } else if (!strcmp(a, "--sim-ctx")) {
            NEED_ARG();
            ok = parse_int(a, v, 2, 1 << 20, &c.sim_n_ctx);
        } else if (!strcmp(a, "--sim-latency-ms")) {
            NEED_ARG();
            ok = parse_double(a, v, 0, 1e6, false, &c.sim_latency_ms);
        } else if (!strcmp(a, "--sim-step-noise")) {
            NEED_ARG();
            ok = !strcmp(v, "on") || !strcmp(v, "off");
            if (!ok) fprintf(stderr, "duet-bench: --sim-step-noise takes on or off, not '%s'\n", v);
            c.sim_no_step_noise = !strcmp(v, "off");
        } else if (!strcmp(a, "--sim-step-scale")) {
            NEED_ARG();
            ok = strchr(v, '=')
                     ? parse_keyed(a, v, "F", "prompt", "decode", false, 0.01, 100, c.sim_kind_scale)
                     : parse_double(a, v, 0.01, 100, false, &c.sim_step_scale);
        } else if (!strcmp(a, "--sim-noise-seed")) {
            NEED_ARG();
            int ns;
            ok = parse_int(a, v, 0, 2147483647L, &ns);
            c.sim_noise_seed = (uint64_t)ns;
        } else if (!strcmp(a, "--sim-slo-ttft-ms") || !strcmp(a, "--sim-slo-itl-ms")) {
            NEED_ARG();
            ok = parse_keyed(a, v, "MS", "interactive", "batch", true, 0, 3.6e6,
                             a[10] == 't' ? c.sim_slo_ttft_ms : c.sim_slo_itl_ms);
        } else if (!strcmp(a, "--sim-static-knobs")) {
            c.sim_static_knobs = true;
        } else if (!strcmp(a, "--sim-step-log")) {
            c.sim_step_log = true;
        } else if (!strcmp(a, "--trace")) {
            NEED_ARG();
            c.trace_path = v;
        } else if (!strcmp(a, "--output-dir")) {
            NEED_ARG();
            c.output_dir = v;
        } else if (!strcmp(a, "--label")) {
            NEED_ARG();
            c.label = v;
        } else if (!strcmp(a, "--save-detailed")) {
            c.save_requests = true;
        } else if (!strcmp(a, "--no-plots")) {
            c.plots = false;
        } else if (!strcmp(a, "--disable-tqdm") || !strcmp(a, "--no-progress")) {
            c.progress = false;
        } else {
            fprintf(stderr, "duet-bench: unknown argument '%s'\n%s", a, usage);
            return 2;
        }
        if (!ok) return 2;
    }
#undef NEED_ARG
    (void)goodput_given;

    /* Consistency of the target. */
    if (host || port) {
        snprintf(c.http.base_url, sizeof c.http.base_url, "http://%s:%d", host ? host : "127.0.0.1",
                 port ? port : 8000);
    }
    int targets = (c.http.base_url[0] != 0) + c.in_process + (c.serve_cmd != NULL) + (c.simulate != NULL);
    if (targets != 1) {
        fprintf(stderr,
                "duet-bench: choose one target: --base-url URL, --in-process -m MODEL, --serve-cmd CMD, or "
                "--simulate PROFILE\n%s",
                usage);
        return 2;
    }
    bool sim_slo =
        c.sim_slo_ttft_ms[0] + c.sim_slo_ttft_ms[1] + c.sim_slo_itl_ms[0] + c.sim_slo_itl_ms[1] > 0;
    if (!c.simulate &&
        (c.sim_instances || c.find_instances || c.sim_n_ctx || c.sim_latency_ms || c.sim_no_step_noise ||
         c.sim_noise_seed || c.sim_step_scale || c.sim_kind_scale[0] || c.sim_kind_scale[1] || c.trace_path ||
         sim_slo || c.sim_static_knobs || c.sim_step_log)) {
        fprintf(stderr, "duet-bench: --instances, --find-instances, --sim-ctx, --sim-latency-ms, "
                        "--sim-step-noise, --sim-noise-seed, --sim-step-scale, --sim-slo-*-ms, "
                        "--sim-static-knobs, --sim-step-log and --trace belong to --simulate\n");
        return 2;
    }
    if (c.sim_step_log && !c.output_dir && !c.find_instances) {
        fprintf(stderr, "duet-bench: --sim-step-log writes into --output-dir DIR: name one\n");
        return 2;
    }
    if (c.simulate) {
        if (c.all_devices || c.load.max_concurrency > 0 || c.n_sweep_conc) {
            fprintf(stderr, "duet-bench: --simulate runs one device's profile with open-loop arrivals (no "
                            "--all-devices, --max-concurrency or --sweep-concurrency)\n");
            return 2;
        }
        duet_status st = duet_step_cost_load(c.simulate, &c.sim_cost);
        if (st) {
            fprintf(stderr, "duet-bench: --simulate: %s\n", duet_last_error());
            return 2;
        }
        if (c.sim_step_scale) duet_step_cost_scale(&c.sim_cost, c.sim_step_scale);
        if (n_peers) {
            fprintf(stderr,
                    "duet-bench: --peer compares real servers; it does not combine with --simulate\n");
            return 2;
        }
        if (c.find_instances && c.sim_instances) {
            fprintf(stderr,
                    "duet-bench: --find-instances chooses the instance count itself (no --instances)\n");
            return 2;
        }
        if (!c.sim_instances) c.sim_instances = 1;
    }
    if (c.in_process && !c.model_path) {
        fprintf(stderr, "duet-bench: --in-process needs -m MODEL\n");
        return 2;
    }
    if (c.http.base_url[0] && (c.n_sweep_bt || c.n_sweep_mbs || c.all_devices)) {
        fprintf(stderr, "duet-bench: knob sweeps and --all-devices need a server duet-bench starts itself "
                        "(--serve-cmd) or --in-process; a running server's knobs cannot be changed\n");
        return 2;
    }
    if (c.n_sweep_rate && c.n_sweep_conc) {
        fprintf(stderr,
                "duet-bench: --sweep-rate and --sweep-concurrency are exclusive (sweep one load axis)\n");
        return 2;
    }
    if (c.all_devices && (c.backend || c.device >= 0)) {
        fprintf(stderr, "duet-bench: --all-devices chooses the backend and device itself\n");
        return 2;
    }
    if (n_peers && (c.in_process || c.n_sweep_bt || c.n_sweep_mbs || c.all_devices)) {
        fprintf(stderr, "duet-bench: --peer compares HTTP servers under the same load: the target must be "
                        "--base-url or --serve-cmd, without knob sweeps or --all-devices\n");
        return 2;
    }
    if (per_instance && (!c.http.base_url[0] || n_peers || c.all_devices)) {
        fprintf(stderr, "duet-bench: --per-instance compares the instances of one running duet server: it "
                        "needs --base-url, without --peer or --all-devices\n");
        return 2;
    }
    if (c.profile.n) {
        if (!isinf(c.load.rate) || c.n_sweep_rate || c.load.max_concurrency > 0 || c.n_sweep_conc ||
            c.trace_path) {
            fprintf(stderr, "duet-bench: --rate-profile is the load itself: no --request-rate, --sweep-rate, "
                            "--max-concurrency, --sweep-concurrency or --trace with it\n");
            return 2;
        }
        /* The profile's mean rate names the point in tables and plots. */
        double end = db_profile_end(&c.profile);
        c.load.rate = db_profile_cumulative(&c.profile, end) / end;
        c.load.profile = &c.profile;
        if (c.load.duration_s <= 0 || c.load.duration_s > end) c.load.duration_s = end;
        if (c.timeline_s <= 0) c.timeline_s = 30;
    }
    if (c.num_prompts == 0) c.num_prompts = c.load.duration_s > 0 ? -1 : 100;
    /* p50 and p99 feed the plots and the operating point. */
    ensure_pct(&c, 50);
    ensure_pct(&c, 99);
    qsort(c.ps, (size_t)c.n_ps, sizeof *c.ps, cmp_double);

    char command[2048] = "";
    for (int i = 0; i < argc; i++) {
        size_t n = strlen(command);
        bool quote = strpbrk(argv[i], " \t\"'") != NULL;
        snprintf(command + n, sizeof command - n, "%s%s%s%s", i ? " " : "", quote ? "'" : "", argv[i],
                 quote ? "'" : "");
    }
    if (c.plots && !db_gnuplot_terminal())
        fprintf(
            stderr,
            "duet-bench: gnuplot not found (or it lacks the png terminals): CSV and JSON only, no plots\n");

    if (c.find_instances) return db_sim_find_instances(&c, command);
    if (n_peers) {
        memset(&peers[0], 0, sizeof peers[0]); /* the target itself first */
        snprintf(peers[0].label, sizeof peers[0].label, "%s", c.label ? c.label : "duet");
        return run_compare(&c, peers, 1 + n_peers, command);
    }
    if (per_instance) {
        db_target tg[DB_MAX_TARGETS];
        int n = per_instance_targets(&c, tg);
        return n < 0 ? 2 : run_compare(&c, tg, n, command);
    }
    if (!c.all_devices) {
        db_sweep s = {0};
        bool ok = run_one(&c, c.backend, c.device, c.output_dir, &s, command);
        db_sweep_free(&s);
        return ok ? 0 : 1;
    }

    /* --all-devices: every available backend and device, one after the other. */
    size_t need = duet_devices_describe(NULL, 0, true);
    char *buf = malloc(need + 1);
    if (!buf) return 1;
    duet_devices_describe(buf, need + 1, true);
    cJSON *arr = cJSON_Parse(buf);
    free(buf);
    char top[1024];
    if (c.output_dir)
        snprintf(top, sizeof top, "%s", c.output_dir);
    else
        default_dir("all-devices", top, sizeof top);
    db_sweep sweeps[64];
    int n = 0;
    int n_ok = 0;
    const cJSON *b;
    cJSON_ArrayForEach(b, arr) {
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(b, "backend");
        if (!cJSON_IsString(name) || n == 64) continue;
        if (!cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(b, "available"))) {
            const cJSON *why = cJSON_GetObjectItemCaseSensitive(b, "reason");
            db_sweep *s = &sweeps[n++];
            memset(s, 0, sizeof *s);
            s->failed = true;
            s->op = -1;
            snprintf(s->meta.backend, sizeof s->meta.backend, "%s", name->valuestring);
            snprintf(s->meta.device, sizeof s->meta.device, "–");
            snprintf(s->meta.driver, sizeof s->meta.driver, "–");
            snprintf(s->why, sizeof s->why, "unavailable: %s",
                     cJSON_IsString(why) ? why->valuestring : "(no reason)");
            printf("%s: %s\n", name->valuestring, s->why);
            continue;
        }
        const cJSON *d;
        cJSON_ArrayForEach(d, cJSON_GetObjectItemCaseSensitive(b, "devices")) {
            if (n == 64) break;
            const cJSON *idx = cJSON_GetObjectItemCaseSensitive(d, "index");
            const cJSON *dn = cJSON_GetObjectItemCaseSensitive(d, "name");
            int di = cJSON_IsNumber(idx) ? idx->valueint : 0;
            char sub[1280], slug[200], what[400];
            snprintf(what, sizeof what, "%s-%d-%s", name->valuestring, di,
                     cJSON_IsString(dn) ? dn->valuestring : "");
            db_slug(slug, sizeof slug, what);
            snprintf(sub, sizeof sub, "%s/%s", top, slug);
            printf("\n=== %s device %d: %s ===\n", name->valuestring, di,
                   cJSON_IsString(dn) ? dn->valuestring : "?");
            fflush(stdout);
            db_sweep *s = &sweeps[n++];
            memset(s, 0, sizeof *s);
            if (run_one(&c, name->valuestring, di, sub, s, command)) n_ok++;
            if (s->n_points == 0) {
                snprintf(s->meta.backend, sizeof s->meta.backend, "%s", name->valuestring);
                if (cJSON_IsString(dn))
                    snprintf(s->meta.device, sizeof s->meta.device, "%s", dn->valuestring);
            }
        }
    }
    cJSON_Delete(arr);
    db_report_compare(&c, sweeps, n, top);
    printf("\ncomparison: %s/comparison.md\n", top);
    for (int i = 0; i < n; i++)
        db_sweep_free(&sweeps[i]);
    /* A backend or device that fails is reported, not fatal: the tool
     * fails only when no device could be measured. */
    return n_ok > 0 ? 0 : 1;
}
