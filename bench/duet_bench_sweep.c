/* duet_bench_sweep.c — one sweep on one target: for every knob setting an
 * engine (in process) or a server (--serve-cmd), then every load point
 * against it; the stats of each point and the operating point.
 *
 * The workload (prompts, lengths, priorities) and the arrival times are the
 * same for every point and every device: only the load and knobs change.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "duet_bench.h"

/* ---- where the numbers come from ----------------------------------------- */

static void run_cmd_line(const char *cmd, char *buf, size_t size) {
    buf[0] = 0;
    FILE *f = popen(cmd, "r");
    if (!f) return;
    if (fgets(buf, (int)size, f)) buf[strcspn(buf, "\r\n")] = 0;
    if (pclose(f) != 0) buf[0] = 0;
}

/* The duet commit: git at run time, in the source tree this binary was
 * built from (then the working directory); "unknown" outside a checkout. */
static void find_commit(char *buf, size_t size) {
    const char *dirs[] = {
#ifdef DUET_SOURCE_DIR
        DUET_SOURCE_DIR,
#endif
        "."};
    for (size_t i = 0; i < sizeof dirs / sizeof *dirs; i++) {
        char cmd[1200], rev[64];
        snprintf(cmd, sizeof cmd, "git -C '%s' rev-parse HEAD 2>/dev/null", dirs[i]);
        run_cmd_line(cmd, rev, sizeof rev);
        if (strlen(rev) < 40) continue;
        snprintf(cmd, sizeof cmd,
                 "git -C '%s' status --porcelain --untracked-files=no 2>/dev/null | head -c1", dirs[i]);
        char dirty[8];
        run_cmd_line(cmd, dirty, sizeof dirty);
        snprintf(buf, size, "%.40s%s", rev, dirty[0] ? "-dirty" : "");
        return;
    }
    snprintf(buf, size, "unknown");
}

/* Device name and driver of backend/device from duet_devices_describe:
 * by index, else by name, else the backend's only device (a server left
 * to choose its best device has just one choice then). */
static void describe_device(const char *backend, int device, const char *name_hint, db_meta *m) {
    size_t need = duet_devices_describe(NULL, 0, true);
    char *buf = malloc(need + 1);
    if (!buf) return;
    duet_devices_describe(buf, need + 1, true);
    cJSON *arr = cJSON_Parse(buf);
    free(buf);
    const cJSON *b;
    cJSON_ArrayForEach(b, arr) {
        const cJSON *bn = cJSON_GetObjectItemCaseSensitive(b, "backend");
        if (!cJSON_IsString(bn) || strcmp(bn->valuestring, backend) != 0) continue;
        const cJSON *devs = cJSON_GetObjectItemCaseSensitive(b, "devices"), *d;
        bool only = device < 0 && !name_hint && cJSON_GetArraySize(devs) == 1;
        cJSON_ArrayForEach(d, devs) {
            const cJSON *idx = cJSON_GetObjectItemCaseSensitive(d, "index");
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(d, "name");
            const cJSON *drv = cJSON_GetObjectItemCaseSensitive(d, "driver");
            bool match =
                only ||
                (device >= 0 ? (cJSON_IsNumber(idx) && idx->valueint == device)
                             : (name_hint && cJSON_IsString(name) && !strcmp(name->valuestring, name_hint)));
            if (!match) continue;
            if (cJSON_IsString(name)) snprintf(m->device, sizeof m->device, "%s", name->valuestring);
            if (cJSON_IsString(drv)) snprintf(m->driver, sizeof m->driver, "%s", drv->valuestring);
            if (cJSON_IsNumber(idx)) m->device_index = idx->valueint;
        }
    }
    cJSON_Delete(arr);
}

/* ---- a server per knob setting (--serve-cmd) --------------------------------- */

typedef struct served {
    pid_t pid;
    char base_url[128];
} served;

static int free_port(void) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = -1;
    if (bind(s, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(s, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(s);
    return port;
}

/* The server running now, for the signal handler: an interrupted
 * duet-bench takes its server down with it (the server has its own process
 * group, so the terminal's Ctrl-C does not reach it). */
static volatile pid_t served_pid;

static void on_fatal_signal(int sig) {
    pid_t pid = served_pid;
    if (pid > 0) kill(-pid, SIGTERM);
    signal(sig, SIG_DFL);
    raise(sig);
}

static void serve_stop(served *s) {
    served_pid = 0;
    if (s->pid <= 0) return;
    /* SIGTERM drains; the server has nothing in flight by now. */
    kill(-s->pid, SIGTERM);
    for (int i = 0; i < 300; i++) {
        if (waitpid(s->pid, NULL, WNOHANG) == s->pid) {
            s->pid = 0;
            return;
        }
        usleep(100000);
    }
    kill(-s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
    s->pid = 0;
}

static bool serve_start(const db_config *cfg, const char *backend, int device, const db_knobs *k,
                        const char *log, served *s, char *err, size_t esize) {
    memset(s, 0, sizeof *s);
    int port = cfg->serve_port > 0 ? cfg->serve_port : free_port();
    if (port <= 0) {
        snprintf(err, esize, "no free port for the server");
        return false;
    }
    char cmd[4096];
    int n = snprintf(cmd, sizeof cmd, "exec %s --host 127.0.0.1 --port %d", cfg->serve_cmd, port);
    if (k->max_batch_seqs > 0)
        n += snprintf(cmd + n, sizeof cmd - (size_t)n, " --max-batch-seqs %d", k->max_batch_seqs);
    if (k->batch_timeout_ms >= 0)
        n += snprintf(cmd + n, sizeof cmd - (size_t)n, " --batch-timeout-ms %g", k->batch_timeout_ms);
    if (k->max_batch_tokens > 0)
        n += snprintf(cmd + n, sizeof cmd - (size_t)n, " --max-batch-tokens %d", k->max_batch_tokens);
    if (k->prefill_chunk > 0)
        n += snprintf(cmd + n, sizeof cmd - (size_t)n, " --prefill-chunk %d", k->prefill_chunk);
    if (cfg->max_waiting > 0)
        n += snprintf(cmd + n, sizeof cmd - (size_t)n, " --max-waiting %d", cfg->max_waiting);
    if (backend) n += snprintf(cmd + n, sizeof cmd - (size_t)n, " --backend %s", backend);
    if (device >= 0) n += snprintf(cmd + n, sizeof cmd - (size_t)n, " --device %d", device);
    if (n >= (int)sizeof cmd) {
        snprintf(err, esize, "--serve-cmd is too long");
        return false;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(err, esize, "fork: %s", strerror(errno));
        return false;
    }
    if (pid == 0) {
        /* Own process group, so stopping it reaches the shell's child too. */
        setpgid(0, 0);
        FILE *f = log ? freopen(log, "a", stdout) : NULL;
        if (f) dup2(fileno(stdout), 2);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    setpgid(pid, pid);
    s->pid = pid;
    served_pid = pid;
    signal(SIGINT, on_fatal_signal);
    signal(SIGTERM, on_fatal_signal);
    signal(SIGHUP, on_fatal_signal);
    snprintf(s->base_url, sizeof s->base_url, "http://127.0.0.1:%d", port);
    for (int i = 0; i < 1200; i++) { /* up to 120 s: loading a model, compiling kernels */
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            s->pid = 0;
            served_pid = 0;
            snprintf(err, esize, "the server exited (status %d) before it was ready; see %.400s", status,
                     log ? log : "its output");
            return false;
        }
        long code = 0;
        char *body = db_http_get(s->base_url, "/health", 1, &code);
        free(body);
        if (code == 200) return true;
        usleep(100000);
    }
    serve_stop(s);
    snprintf(err, esize, "the server did not answer /health within 120 s");
    return false;
}

/* ---- one sweep ------------------------------------------------------------- */

static void point_fill(const db_config *cfg, db_point *pt, const char *mb, const char *ma) {
    db_run_stats_compute(pt->results, pt->n_sent, pt->stats.duration, &cfg->goodput, cfg->ps, cfg->n_ps,
                         &pt->stats);
    if (!cfg->simulate) db_server_stats_from(mb, ma, pt->stats.duration, &pt->server); /* else db_sim_run's */
    /* A knob left at its default is recorded as the value the engine used. */
    if (pt->knobs.max_batch_seqs <= 0 && pt->server.max_batch_seqs >= 1)
        pt->knobs.max_batch_seqs = (int)pt->server.max_batch_seqs;
    if (pt->knobs.batch_timeout_ms < 0 && pt->server.batch_timeout_ms >= 0)
        pt->knobs.batch_timeout_ms = pt->server.batch_timeout_ms;
    /* Per priority class: does interactive work get ahead of batch work? */
    for (int c = 0; c < 2; c++) {
        db_result *sub = calloc((size_t)pt->n_sent + 1, sizeof *sub);
        int n = 0;
        for (int i = 0; sub && i < pt->n_sent; i++)
            if ((int)pt->results[i].priority == c) sub[n++] = pt->results[i]; /* shallow: read-only */
        db_run_stats st;
        const double p99 = 99;
        bool ok = sub && db_run_stats_compute(sub, n, pt->stats.duration, NULL, &p99, 1, &st);
        pt->n_prio[c] = ok ? st.completed : 0;
        pt->ttft_p99_prio_ms[c] = ok ? st.ttft.pct[0] : NAN;
        pt->itl_p99_prio_ms[c] = ok ? st.itl.pct[0] : NAN;
        free(sub);
    }
    pt->ttft_p50_ms = db_stats_pct(&pt->stats, &pt->stats.ttft, 50);
    pt->ttft_p99_ms = db_stats_pct(&pt->stats, &pt->stats.ttft, 99);
    pt->itl_p50_ms = db_stats_pct(&pt->stats, &pt->stats.itl, 50);
    pt->itl_p99_ms = db_stats_pct(&pt->stats, &pt->stats.itl, 99);
}

static void print_point(const db_config *cfg, int k, int total, const db_point *pt) {
    char r[32], c[32], bt[32], mbs[32];
    db_fmt_num(r, sizeof r, pt->load.rate);
    snprintf(c, sizeof c, "%d", pt->load.max_concurrency);
    db_fmt_num(bt, sizeof bt, pt->knobs.batch_timeout_ms < 0 ? NAN : pt->knobs.batch_timeout_ms);
    db_fmt_num(mbs, sizeof mbs, pt->knobs.max_batch_seqs <= 0 ? NAN : pt->knobs.max_batch_seqs);
    const db_run_stats *s = &pt->stats;
    printf("point %d/%d: rate %s, max concurrency %s, batch_timeout_ms %s, max_batch_seqs %s\n", k, total, r,
           pt->load.max_concurrency > 0 ? c : "none", bt, mbs);
    printf("  %d ok, %d failed in %.2f s: %.2f req/s, %.1f output tok/s, %.1f total tok/s", s->completed,
           s->failed, s->duration, s->request_throughput, s->output_throughput, s->total_token_throughput);
    if (!isnan(s->goodput)) printf(", goodput %.2f req/s", s->goodput);
    printf("\n");
    const struct {
        bool on;
        const char *name;
        const db_summary *m;
    } rows[] = {{cfg->pm_ttft, "TTFT", &s->ttft},
                {cfg->pm_tpot, "TPOT", &s->tpot},
                {cfg->pm_itl, "ITL", &s->itl},
                {cfg->pm_e2el, "E2EL", &s->e2el}};
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
        if (!rows[i].on) continue;
        printf("  %-4s ms: mean %8.2f", rows[i].name, rows[i].m->mean);
        for (int j = 0; j < s->n_ps; j++)
            printf("  p%g %8.2f", s->ps[j], rows[i].m->pct[j]);
        printf("\n");
    }
    if (cfg->workload.interactive_share >= 0)
        printf("  by priority: interactive %d ok, p99 TTFT %.2f ms, p99 ITL %.2f ms; batch %d ok, p99 TTFT "
               "%.2f ms, "
               "p99 ITL %.2f ms\n",
               pt->n_prio[0], pt->ttft_p99_prio_ms[0], pt->itl_p99_prio_ms[0], pt->n_prio[1],
               pt->ttft_p99_prio_ms[1], pt->itl_p99_prio_ms[1]);
    if (pt->other_cpu > 0.2)
        printf("  note: other processes used %.0f%% of the machine's CPU during this point%s\n",
               pt->other_cpu * 100,
               cfg->in_process ? "; the numbers are noisy" : " (this includes the server)");
    if (pt->server.have_batch || !isnan(pt->server.busy_ratio))
        printf("  engine: mean batch %.2f seqs over %.0f steps, device busy %.0f%%, preemptions %.0f\n",
               pt->server.mean_batch, pt->server.batch.total, pt->server.busy_ratio * 100,
               pt->server.preemptions);
    for (int i = 0; i < pt->n_sent; i++)
        if (!pt->results[i].ok) {
            printf("  first failure: %s\n", pt->results[i].error);
            break;
        }
    fflush(stdout);
}

void db_sweep_free(db_sweep *s) {
    for (int i = 0; i < s->n_points; i++) {
        for (int j = 0; j < s->points[i].n_sent; j++)
            db_result_free(&s->points[i].results[j]);
        free(s->points[i].results);
        db_scrapes_free(&s->points[i].scrapes);
    }
    free(s->points);
    s->points = NULL;
    s->n_points = 0;
}

void db_sweep_pick_op(const db_config *cfg, db_sweep *s) {
    db_op_candidate *cand = calloc((size_t)(s->n_points + 1), sizeof *cand);
    for (int i = 0; cand && i < s->n_points; i++) {
        const db_point *pt = &s->points[i];
        cand[i] = (db_op_candidate){.output_throughput = pt->stats.output_throughput,
                                    .ttft_p99_ms = pt->ttft_p99_ms,
                                    .itl_p99_ms = pt->itl_p99_ms,
                                    .completed = pt->stats.completed,
                                    .failed = pt->stats.failed};
    }
    s->op = cand ? db_operating_point(cand, s->n_points, cfg->slo_ttft_ms, cfg->slo_itl_ms) : -1;
    free(cand);
}

bool db_sweep_run(const db_config *cfg, const char *backend, int device, db_sweep *out) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", out->dir);
    memset(out, 0, sizeof *out);
    snprintf(out->dir, sizeof out->dir, "%s", dir);
    out->op = -1;
    db_meta *m = &out->meta;
    m->device_index = device;
    find_commit(m->commit, sizeof m->commit);
    db_utc_now(m->started, sizeof m->started);
    gethostname(m->host, sizeof m->host);
    snprintf(m->mode, sizeof m->mode, "%s",
             cfg->simulate     ? "simulated"
             : cfg->in_process ? "in-process"
             : cfg->serve_cmd  ? "http (--serve-cmd)"
                               : "http");
    snprintf(m->model, sizeof m->model, "%s", cfg->model_path ? cfg->model_path : "");
    snprintf(m->backend, sizeof m->backend, "%s", backend ? backend : "auto");
    snprintf(m->device, sizeof m->device, "unknown");
    snprintf(m->driver, sizeof m->driver, "unknown");
    if (cfg->simulate) {
        /* The device the step costs were measured on, times the fleet size. */
        const duet_step_cost *c = &cfg->sim_cost;
        snprintf(m->mode, sizeof m->mode, "simulated x%d", cfg->sim_instances > 0 ? cfg->sim_instances : 1);
        snprintf(m->backend, sizeof m->backend, "%s", c->backend[0] ? c->backend : "?");
        snprintf(m->device, sizeof m->device, "%s", c->device[0] ? c->device : "?");
        snprintf(m->driver, sizeof m->driver, "step costs: %.200s", cfg->simulate);
        if (!cfg->model_path) snprintf(m->model, sizeof m->model, "%s", c->model);
    } else if (!cfg->in_process && !cfg->serve_cmd) {
        snprintf(m->backend, sizeof m->backend, "%s", "remote");
        snprintf(m->device, sizeof m->device, "%.255s", cfg->label ? cfg->label : cfg->http.base_url);
    }

    /* Knob and load grids. */
    double bts[DB_MAX_SWEEP], mbss[DB_MAX_SWEEP];
    int n_bt = cfg->n_sweep_bt, n_mbs = cfg->n_sweep_mbs;
    if (n_bt)
        memcpy(bts, cfg->sweep_bt, sizeof bts);
    else
        bts[0] = cfg->knobs.batch_timeout_ms, n_bt = 1;
    if (n_mbs)
        memcpy(mbss, cfg->sweep_mbs, sizeof mbss);
    else
        mbss[0] = cfg->knobs.max_batch_seqs, n_mbs = 1;
    db_load loads[DB_MAX_SWEEP];
    int n_load = 0;
    if (cfg->n_sweep_rate) {
        for (int i = 0; i < cfg->n_sweep_rate; i++)
            loads[n_load] = cfg->load, loads[n_load++].rate = cfg->sweep_rate[i];
    } else if (cfg->n_sweep_conc) {
        for (int i = 0; i < cfg->n_sweep_conc; i++)
            loads[n_load] = cfg->load, loads[n_load++].max_concurrency = (int)cfg->sweep_conc[i];
    } else {
        loads[n_load++] = cfg->load;
    }
    int total = n_bt * n_mbs * n_load;
    if (!(out->points = calloc((size_t)total, sizeof *out->points))) {
        snprintf(out->why, sizeof out->why, "out of memory");
        out->failed = true;
        return false;
    }

    /* The workload, tokenized with the model's own vocabulary when known. */
    duet_model *vocab_model = NULL;
    db_vocab vocab = {0};
    if (cfg->model_path) {
        duet_open_params op = duet_open_params_default();
        op.vocab_only = true;
        if (duet_model_open(cfg->model_path, &op, &vocab_model) != DUET_OK) {
            snprintf(out->why, sizeof out->why, "cannot read %s: %s", cfg->model_path, duet_last_error());
            out->failed = true;
            return false;
        }
        duet_model_desc d;
        duet_model_describe(vocab_model, &d);
        vocab = (db_vocab){
            .model = vocab_model, .n_vocab = d.n_vocab, .bos = d.add_bos ? d.bos : -1, .eos = d.eos};
    }
    db_workload_cfg wc = cfg->workload;
    wc.n = cfg->num_prompts > 0 ? cfg->num_prompts : cfg->simulate ? db_sim_requests_needed(cfg) : 20000;
    /* Each load point draws its own random prompts (db_point_seed): the
     * same prompts at every point would hit a server's prefix cache from
     * the second point on and skip their prefill. A trace is the same
     * requests at every point (its times rescaled). Knob settings at the
     * same load point get the same prompts. */
    db_prompt *lp[DB_MAX_SWEEP] = {0};
    char err[512] = "";
    bool ok = true;
    int n_req = wc.n;
    for (int il = 0; ok && il < n_load; il++) {
        if (cfg->trace_path) {
            ok = db_trace_load(cfg->trace_path, &lp[il], &wc.n, err, sizeof err);
        } else {
            db_workload_cfg pw = wc;
            pw.seed = db_point_seed(wc.seed, il);
            ok = db_workload_make(&pw, &vocab, &lp[il], err, sizeof err);
        }
        n_req = wc.n;
    }
    if (!ok) {
        for (int il = 0; il < n_load; il++)
            db_workload_free(lp[il], n_req);
        snprintf(out->why, sizeof out->why, "workload: %s", err);
        out->failed = true;
        duet_model_close(vocab_model);
        return false;
    }
    /* Warm-up requests (auto: as many as the largest batch), sent at once
     * with output lengths 2, 3, 4, ...: the decode batch then shrinks
     * through every size, so each batch shape's first-use cost (a kernel
     * JIT-compiled per shape, a pipeline created) is paid before measuring. */
    int n_warm = cfg->simulate ? 0 : cfg->warmup;
    if (n_warm < 0) {
        n_warm = 4;
        for (int i = 0; i < n_mbs; i++)
            if ((int)mbss[i] > n_warm) n_warm = (int)mbss[i];
        if (n_mbs == 1 && mbss[0] <= 0) n_warm = duet_engine_params_default().max_batch_seqs;
    }
    db_prompt *warm = NULL;
    if (n_warm > 0) {
        db_workload_cfg ww = wc;
        ww.n = n_warm;
        ww.seed = wc.seed + 7919;
        ww.dataset_path = NULL;
        if (!db_workload_make(&ww, &vocab, &warm, err, sizeof err)) warm = NULL;
        for (int i = 0; warm && i < n_warm; i++)
            warm[i].output_len = 2 + i;
    }

    char log[1200];
    snprintf(log, sizeof log, "%s/server.log", out->dir);
    FILE *steps = NULL; /* --sim-step-log: every point's simulated steps */
    if (ok && cfg->simulate && cfg->sim_step_log) {
        char path[1200];
        snprintf(path, sizeof path, "%s/sim_steps.csv", out->dir);
        if (!db_mkdirs(out->dir) || !(steps = fopen(path, "w"))) {
            snprintf(out->why, sizeof out->why, "%.300s: %s", path, strerror(errno));
            ok = false;
        } else {
            fprintf(steps, "point,instance,start_s,idle_s,seqs,decode_tokens,prefill_tokens,decode_ctx,"
                           "prefill_ctx,seconds,predicted_s\n");
        }
    }
    int k = 0;
    for (int ib = 0; ok && ib < n_bt; ib++)
        for (int im = 0; ok && im < n_mbs; im++) {
            db_knobs kn = cfg->knobs;
            kn.batch_timeout_ms = bts[ib];
            kn.max_batch_seqs = (int)mbss[im];
            duet_engine *eng = NULL;
            served srv = {0};
            db_http http = cfg->http;
            if (cfg->simulate) {
                /* Nothing to start: the fleet lives in db_sim_run. */
            } else if (cfg->in_process) {
                duet_engine_params ep = duet_engine_params_default();
                ep.open.backend = backend;
                ep.open.device = device;
                ep.open.n_threads = cfg->n_threads;
                ep.open.n_ctx = cfg->n_ctx;
                if (kn.max_batch_seqs > 0) ep.max_batch_seqs = kn.max_batch_seqs;
                if (kn.batch_timeout_ms >= 0) ep.batch_timeout_ms = kn.batch_timeout_ms;
                if (kn.max_batch_tokens > 0) ep.max_batch_tokens = kn.max_batch_tokens;
                if (kn.prefill_chunk > 0) ep.prefill_chunk = kn.prefill_chunk;
                if (ep.max_batch_tokens < ep.max_batch_seqs) ep.max_batch_tokens = ep.max_batch_seqs;
                if (ep.prefill_chunk > ep.max_batch_tokens) ep.prefill_chunk = ep.max_batch_tokens;
                ep.max_waiting = cfg->max_waiting > 0 ? cfg->max_waiting
                                                      : (n_req < 256      ? 256
                                                         : n_req > 100000 ? 100000
                                                                          : n_req);
                if (duet_engine_start(cfg->model_path, &ep, &eng) != DUET_OK) {
                    snprintf(out->why, sizeof out->why, "%s", duet_last_error());
                    ok = false;
                    break;
                }
                duet_model_desc d;
                duet_model_describe(duet_engine_model(eng), &d);
                snprintf(m->backend, sizeof m->backend, "%s", d.backend ? d.backend : "?");
                snprintf(m->device, sizeof m->device, "%s", d.device ? d.device : "?");
                describe_device(m->backend, device, d.device, m);
            } else if (cfg->serve_cmd) {
                if (!serve_start(cfg, backend, device, &kn, log, &srv, out->why, sizeof out->why)) {
                    ok = false;
                    break;
                }
                snprintf(http.base_url, sizeof http.base_url, "%s", srv.base_url);
                if (backend) describe_device(backend, device, NULL, m);
            }
            if (!cfg->in_process && !cfg->simulate && !http.model_name[0])
                db_http_model_id(http.base_url, http.model_name, sizeof http.model_name);
            /* A remote target's model is the id it serves. */
            if (!m->model[0] && http.model_name[0])
                snprintf(m->model, sizeof m->model, "%s", http.model_name);

            /* Warm-up: not measured; it also proves the target works. */
            if (warm) {
                /* This setting's batch limit bounds the batch sizes to warm. */
                int nw = kn.max_batch_seqs > 0 && kn.max_batch_seqs < n_warm && cfg->warmup < 0
                             ? kn.max_batch_seqs
                             : n_warm;
                if (nw < 4 && n_warm >= 4) nw = 4;
                db_result *wr = calloc((size_t)nw, sizeof *wr);
                int ns = 0;
                double dur;
                /* All at once, so batched shapes (kernel variants, JIT
                 * compiles) are warm too, not only single sequences. */
                db_load wl = {.rate = INFINITY, .burstiness = 1, .seed = cfg->load.seed};
                bool wok = wr && (cfg->in_process ? db_inproc_run(eng, warm, nw, &wl, &cfg->req, NULL, wr,
                                                                  &ns, &dur, NULL, NULL, err, sizeof err)
                                                  : db_http_run(&http, warm, nw, &wl, &cfg->req, NULL, wr,
                                                                &ns, &dur, NULL, NULL, err, sizeof err));
                for (int i = 0; wok && i < ns; i++)
                    if (!wr[i].ok) {
                        snprintf(err, sizeof err, "%s", wr[i].error);
                        wok = false;
                    }
                for (int i = 0; wr && i < ns; i++)
                    db_result_free(&wr[i]);
                free(wr);
                if (!wok) {
                    snprintf(out->why, sizeof out->why, "warm-up request failed: %s", err);
                    ok = false;
                }
            }
            for (int il = 0; ok && il < n_load; il++) {
                db_prompt *prompts = lp[il];
                db_point *pt = &out->points[k];
                pt->load = loads[il];
                if (cfg->timeline_s > 0 && !cfg->simulate) {
                    pt->scrapes.every_s = fmin(2, cfg->timeline_s / 2);
                    pt->load.scrapes = &pt->scrapes;
                }
                pt->knobs = kn;
                if (!(pt->results = calloc((size_t)n_req, sizeof *pt->results))) {
                    snprintf(out->why, sizeof out->why, "out of memory");
                    ok = false;
                    break;
                }
                char label[200], rs[32], cs[32], bs[32], ms[32];
                snprintf(cs, sizeof cs, " conc %d", pt->load.max_concurrency);
                snprintf(label, sizeof label,
                         "%s%s[%d/%d] rate %s%s, timeout %s ms, seqs %s:", backend ? backend : "",
                         backend ? " " : "", k + 1, total, db_fmt_num(rs, sizeof rs, pt->load.rate),
                         pt->load.max_concurrency > 0 ? cs : "",
                         db_fmt_num(bs, sizeof bs, kn.batch_timeout_ms < 0 ? NAN : kn.batch_timeout_ms),
                         db_fmt_num(ms, sizeof ms, kn.max_batch_seqs <= 0 ? NAN : kn.max_batch_seqs));
                db_progress prog = {.label = label, .enabled = cfg->progress, .tty = isatty(2)};
                char *mb = NULL, *ma = NULL;
                double dur = 0;
                db_cpu cpu0 = db_cpu_sample();
                bool rok = cfg->simulate
                               ? db_sim_run(cfg, &kn, prompts, n_req, &pt->load, pt->results, &pt->n_sent,
                                            &dur, &pt->server, steps, k, err, sizeof err)
                           : cfg->in_process
                               ? db_inproc_run(eng, prompts, n_req, &pt->load, &cfg->req, &prog, pt->results,
                                               &pt->n_sent, &dur, &mb, &ma, err, sizeof err)
                               : db_http_run(&http, prompts, n_req, &pt->load, &cfg->req, &prog, pt->results,
                                             &pt->n_sent, &dur, &mb, &ma, err, sizeof err);
                db_progress_end(&prog);
                db_cpu cpu1 = db_cpu_sample();
                pt->other_cpu = cfg->simulate ? 0 : db_cpu_other_ratio(&cpu0, &cpu1);
                pt->stats.duration = dur;
                point_fill(cfg, pt, mb, ma);
                free(mb), free(ma);
                k++;
                out->n_points = k;
                if (!rok) {
                    snprintf(out->why, sizeof out->why, "%s", err);
                    ok = false;
                    break;
                }
                print_point(cfg, k, total, pt);
            }
            if (eng) duet_engine_stop(eng, false);
            serve_stop(&srv);
        }
    if (steps && fclose(steps) != 0 && ok) {
        snprintf(out->why, sizeof out->why, "sim_steps.csv: %s", strerror(errno));
        ok = false;
    }
    for (int il = 0; il < n_load; il++)
        db_workload_free(lp[il], n_req);
    db_workload_free(warm, n_warm);
    duet_model_close(vocab_model);

    db_sweep_pick_op(cfg, out);
    if (!ok) out->failed = true;
    return ok;
}
