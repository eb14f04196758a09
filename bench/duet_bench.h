/* duet_bench.h — duet-bench: a load generator that measures where latency
 * and throughput trade off, sweeps load and scheduler knobs, and picks the
 * operating point that meets latency targets.
 *
 * duet_bench.c          command line, the run plan, --all-devices
 * duet_bench_load.c     the workload: prompts, output lengths, priorities,
 *                       arrival times (Poisson / gamma), random numbers
 * duet_bench_http.c     the HTTP client (libcurl multi, SSE parsing, /metrics)
 * duet_bench_inproc.c   the in-process client (duet_engine_* in this process)
 * duet_bench_stats.c    the maths: percentiles, goodput, operating point,
 *                       Prometheus text parsing and histogram diffs
 * duet_bench_sweep.c    one run per sweep point; a server per knob setting
 * duet_bench_report.c   CSV, JSON, markdown, gnuplot plots, progress line
 * duet_bench_timeline.c --rate-profile (load over time) and --timeline (what a
 *                       run did per window: load, latencies, the knobs)
 * duet_bench_sim.c      --simulate: the same runs on a virtual clock (the
 *                       engine's scheduler, a router, a measured step-cost
 *                       model), traces, and the instance-count search
 * duet_bench_util.c     the clock, number lists, names, folders, CPU usage
 *
 * Times are seconds on CLOCK_MONOTONIC unless a name says _ms.
 */
#ifndef DUET_BENCH_H
#define DUET_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "duet.h"

#define DB_MAX_PCT 8    /* --metric-percentiles entries */
#define DB_MAX_SWEEP 32 /* values in one --sweep-* list */
#define DB_MAX_BUCKETS 64

/* ---- small utilities ----------------------------------------------------- */

double db_now(void);
/* Parses "1,2,4,inf" into at most max doubles; false on a bad entry. */
bool db_parse_list(const char *s, double *out, int max, int *n);
/* Formats a rate/knob value: "inf", or the shortest %g form. */
const char *db_fmt_num(char *buf, size_t size, double v);
/* The ISO-8601 UTC time of now ("2024-05-01T12:00:00Z"). */
void db_utc_now(char *buf, size_t size);
/* A string safe as a path component: [A-Za-z0-9._-], others become '-'. */
void db_slug(char *out, size_t size, const char *in);
/* mkdir -p. False with errno set on failure. */
bool db_mkdirs(const char *path);

/* CPU time of the whole machine and of this process (Linux /proc), to tell
 * how much other work ran during a measurement. */
typedef struct db_cpu {
    double busy, total; /* machine: non-idle and all jiffies, every core */
    double self;        /* this process: user + system */
    bool ok;
} db_cpu;
db_cpu db_cpu_sample(void);
/* Share (0..1) of the machine's CPU time between a and b used by other
 * processes; NAN when /proc is unreadable. */
double db_cpu_other_ratio(const db_cpu *a, const db_cpu *b);

/* ---- the maths (duet_bench_stats.c) -------------------------------------- */

/* The p-th percentile (0..100) of n ascending values, defined as numpy's
 * default 'linear' method: h = (n-1)*p/100, the value at floor(h) plus
 * (h - floor(h)) times the step to the next one. NAN when n == 0. */
double db_percentile_sorted(const double *sorted, size_t n, double p);

typedef struct db_summary {
    size_t n;
    double mean, median, std; /* std: population (numpy's default ddof=0) */
    double min, max;
    double pct[DB_MAX_PCT]; /* at db_summarize's `ps` */
} db_summary;

/* Summarises n values (any order; the input is not modified). Every field
 * is NAN when n == 0. False only when out of memory. */
bool db_summarize(const double *vals, size_t n, const double *ps, int n_ps, db_summary *out);

/* One finished (or failed) request, as a client saw it. */
typedef struct db_result {
    bool ok;         /* completed with a 200 / a normal finish */
    char error[160]; /* why not, when !ok */
    duet_priority priority;
    double t_arrival; /* scheduled arrival, relative to the run start */
    double t_sent;    /* when it was sent, relative to the run start */
    double ttft;      /* first token - sent; NAN when no token came */
    double e2el;      /* last byte - sent */
    double *itl;      /* gaps between consecutive token arrivals */
    int n_itl, cap_itl;
    int prompt_tokens, output_tokens;
} db_result;

/* Time per output token after the first, vLLM's definition:
 * (e2el - ttft) / (output_tokens - 1); NAN with fewer than two tokens. */
double db_result_tpot(const db_result *r);
/* Appends one inter-token gap (grows the array). False when out of memory. */
bool db_result_add_itl(db_result *r, double gap);
void db_result_free(db_result *r);

/* Service-level objectives in milliseconds; a value <= 0 means "not set". */
typedef struct db_slo {
    double ttft_ms, tpot_ms, itl_ms, e2el_ms;
} db_slo;

/* Parses "ttft:500 itl:50" (space- or comma-separated KEY:MS pairs; keys
 * ttft, tpot, itl, e2el). False with a message in err on a bad entry. */
bool db_slo_parse(const char *s, db_slo *out, char *err, size_t err_size);
bool db_slo_any(const db_slo *s);
/* Whether a completed request meets every set SLO (vLLM's goodput rule,
 * with `itl` meaning: every inter-token gap of the request is within it).
 * A failed request never does. */
bool db_result_meets(const db_result *r, const db_slo *slo);

/* Per-run aggregates (one sweep point). */
typedef struct db_run_stats {
    int n_requests, completed, failed;
    double duration;                  /* first send to last completion */
    int total_input, total_output;    /* tokens of completed requests */
    double request_throughput;        /* completed / duration */
    double output_throughput;         /* output tokens / duration */
    double total_token_throughput;    /* (input + output) / duration */
    double goodput;                   /* SLO-meeting requests / duration; NAN when no SLO */
    int good;                         /* requests meeting the SLOs */
    db_summary ttft, tpot, itl, e2el; /* milliseconds */
    double ps[DB_MAX_PCT];            /* the percentiles in the summaries */
    int n_ps;
} db_run_stats;

/* Computes a run's aggregates; times in the summaries are milliseconds. */
bool db_run_stats_compute(const db_result *res, int n, double duration, const db_slo *goodput_slo,
                          const double *ps, int n_ps, db_run_stats *out);
/* The summary field at percentile p (exact match in ps), or NAN. */
double db_stats_pct(const db_run_stats *s, const db_summary *m, double p);

/* What the operating-point choice needs to know about one sweep point. */
typedef struct db_op_candidate {
    double output_throughput; /* tokens/s */
    double ttft_p99_ms, itl_p99_ms;
    int completed, failed;
} db_op_candidate;

/* The index of the candidate with the highest output-token throughput
 * whose p99 TTFT and p99 ITL are within the targets (a target <= 0 is not
 * set), or -1 when none is. Points with failed requests or no completed
 * request never qualify; a point without ITL samples (one-token outputs)
 * passes the ITL target. Ties go to the lower p99 TTFT, then the earlier
 * point. */
int db_operating_point(const db_op_candidate *c, int n, double slo_ttft_ms, double slo_itl_ms);

/* ---- Prometheus text (duet_bench_stats.c) -------------------------------- */

typedef struct db_prom_sample {
    char *name;   /* metric name, e.g. "duet_batch_size_bucket" */
    char *labels; /* the text between { } without the braces, "" when none */
    double value;
} db_prom_sample;

typedef struct db_prom {
    db_prom_sample *s;
    int n, cap;
} db_prom;

/* Parses the text exposition format (comments skipped). Returns false on
 * a malformed sample line (with its line number in *bad_line). */
bool db_prom_parse(const char *text, db_prom *out, int *bad_line);
void db_prom_free(db_prom *p);
/* The label's value in a label text (`le="0.5",priority="batch"`) into buf;
 * false when absent. */
bool db_prom_label(const char *labels, const char *key, char *buf, size_t size);
/* Sum of the values of every sample named `name` (all label sets), NAN when
 * there is none. */
double db_prom_sum(const db_prom *p, const char *name);

/* A histogram: per-bucket (not cumulative) counts by upper bound. */
typedef struct db_hist {
    int n;                     /* buckets, the last is +Inf */
    double le[DB_MAX_BUCKETS]; /* upper bounds, ascending */
    double count[DB_MAX_BUCKETS];
    double sum, total; /* _sum and _count */
} db_hist;

/* Reads histogram `name` (its _bucket/_sum/_count series, summed over all
 * label sets other than le). False when it is absent. */
bool db_prom_hist(const db_prom *p, const char *name, db_hist *out);
/* after - before, bucket by bucket (same bounds required; false if not). */
bool db_hist_diff(const db_hist *after, const db_hist *before, db_hist *out);

/* Engine-side figures of one run, from two /metrics snapshots. */
typedef struct db_server_stats {
    bool have_batch;   /* the batch-size histogram was found */
    db_hist batch;     /* sequences per step, during the run */
    double mean_batch; /* sum / count of the diff; NAN when no step */
    double busy_ratio; /* device busy seconds / wall seconds; NAN when unknown */
    double preemptions;
    /* The engine's knob gauges at the end of the run (NAN when absent):
     * what "default" meant, or what the adaptive controller chose. */
    double max_batch_seqs, batch_timeout_ms, max_batch_tokens, prefill_chunk;
} db_server_stats;

/* Diffs two scrapes taken `wall_s` apart. Either text may be NULL. */
void db_server_stats_from(const char *before, const char *after, double wall_s, db_server_stats *out);

/* ---- the workload (duet_bench_load.c) ------------------------------------ */

typedef struct db_rng {
    uint64_t s[4];
} db_rng;

void db_rng_seed(db_rng *r, uint64_t seed);
uint64_t db_rng_next(db_rng *r);
double db_rng_uniform(db_rng *r); /* [0, 1) */
/* Gamma(shape, scale) by Marsaglia and Tsang (shape < 1 boosted). */
double db_rng_gamma(db_rng *r, double shape, double scale);

/* Arrival gaps of vLLM's model: gamma with shape = burstiness and mean
 * 1/rate (burstiness 1 = Poisson process). rate = INFINITY: all at 0. */
double db_next_gap(db_rng *r, double rate, double burstiness);

typedef struct db_prompt {
    char *text;   /* a text prompt, or NULL */
    int32_t *ids; /* token ids (when known) */
    int n_ids;
    int output_len;
    duet_priority priority;
    bool priority_set; /* false: send none (the server's default) */
    double arrival;    /* from a trace (--trace): seconds after the first; else 0 */
} db_prompt;

typedef struct db_workload_cfg {
    const char *dataset_path; /* JSONL {"prompt": ..., "output_len": ...} or NULL */
    int input_len, output_len;
    int prefix_len;           /* random prompts: a prefix of this many tokens (words), the same for every
                                 prompt of the workload, before each one's input_len (0 = none) */
    double range_ratio;       /* uniform in [len*(1-r), len*(1+r)] */
    double interactive_share; /* fraction of interactive requests; <0 = leave priority unset */
    uint64_t seed;
    int n; /* requests to make */
} db_workload_cfg;

/* How to turn text into tokens and what ids random prompts may use. A
 * NULL model makes text prompts of input_len words instead of ids. */
typedef struct db_vocab {
    const duet_model *model;
    int n_vocab, bos, eos;
} db_vocab;

/* Builds n prompts. False with a message in err on a bad dataset. */
bool db_workload_make(const db_workload_cfg *cfg, const db_vocab *vocab, db_prompt **out, char *err,
                      size_t esize);
void db_workload_free(db_prompt *p, int n);
/* The workload seed of load point i of a sweep (point 0: seed itself). */
static inline uint64_t db_point_seed(uint64_t seed, int i) {
    return seed + (uint64_t)i * UINT64_C(0x9E3779B97F4A7C15);
}

/* ---- load over time (duet_bench_load.c) and the timeline (duet_bench_timeline.c) */

#define DB_MAX_KNOTS 64

/* --rate-profile: the offered rate, piecewise linear between knots (a ramp,
 * a plateau, a step where two knots share a time). */
typedef struct db_profile {
    int n; /* knots; 0 = no profile (a constant rate) */
    double t[DB_MAX_KNOTS], rate[DB_MAX_KNOTS];
} db_profile;

/* Parses "0:1,300:6,600:1" (seconds:requests/s; times from 0, not
 * decreasing; rates >= 0, not all 0). False with a message in err. */
bool db_profile_parse(const char *s, db_profile *out, char *err, size_t esize);
double db_profile_rate(const db_profile *p, double t);
/* Expected arrivals in [0, t]: the integral of the rate. */
double db_profile_cumulative(const db_profile *p, double t);
/* The time at which the expected arrivals reach u; INFINITY past the end. */
double db_profile_invert(const db_profile *p, double u);
double db_profile_end(const db_profile *p);

/* /metrics samples taken during a run (--timeline): the engine's knobs and
 * queue, NAN where the server does not export them. */
typedef struct db_scrape {
    double t; /* seconds after the run's start */
    double max_batch_seqs, batch_timeout_ms, max_batch_tokens, budget_share, waiting, running;
} db_scrape;

typedef struct db_scrapes {
    db_scrape *s;
    int n, cap;
    double every_s;
} db_scrapes;

/* Appends the sample of one /metrics text (NULL: every value NAN). */
bool db_scrapes_add(db_scrapes *sc, double t, const char *metrics_text);
void db_scrapes_free(db_scrapes *sc);

/* ---- one run: the load, the client -------------------------------------- */

/* The load of one sweep point. */
typedef struct db_load {
    double rate; /* requests/s; INFINITY = all at once */
    double burstiness;
    int max_concurrency; /* 0 = unlimited */
    double duration_s;   /* stop sending after this long; 0 = no bound */
    uint64_t seed;
    const db_profile *profile; /* a rate over time instead of `rate` (NULL: constant) */
    db_scrapes *scrapes;       /* output: /metrics sampled every scrapes->every_s (NULL: none) */
} db_load;

/* The arrival times of a load, in order: at a constant rate gaps of
 * db_next_gap with the first request at 0; under a profile the same
 * unit-mean gaps in operational time (expected arrivals) mapped back
 * through the profile, a non-homogeneous Poisson (or gamma) process. */
typedef struct db_arrivals {
    const db_load *load;
    db_rng rng;
    double t, u;
    bool started;
} db_arrivals;
void db_arrivals_init(db_arrivals *a, const db_load *load);
/* The next arrival (seconds from the start); INFINITY when the profile has
 * ended. */
double db_arrivals_next(db_arrivals *a);

/* The engine knobs of one sweep point (<0 / 0 = the engine's default). */
typedef struct db_knobs {
    double batch_timeout_ms; /* <0: default */
    int max_batch_seqs;      /* 0: default */
    int max_batch_tokens;
    int prefill_chunk;
} db_knobs;

typedef struct db_progress {
    const char *label; /* "[3/12 rate=4]" */
    bool enabled, tty;
    double t_last;
} db_progress;

/* Redraws the progress line (at most ~4 times a second; forced when
 * force). */
void db_progress_update(db_progress *p, int done, int total, int in_flight, double elapsed, bool force);
void db_progress_end(db_progress *p);

/* Common settings of a request sent by either client. */
typedef struct db_req_opts {
    double temperature;
    bool ignore_eos;
} db_req_opts;

/* The HTTP target. */
typedef struct db_http {
    char base_url[512];
    char endpoint[128];   /* "/v1/completions" */
    char model_name[256]; /* sent as "model"; "" = omit */
    char instance[64];    /* sent as the X-Duet-Instance header (pins the request there); "" = none */
} db_http;

/* Runs one point against an HTTP server: results[i] for prompts[i].
 * metrics_before/after get /metrics (malloc'd, may stay NULL). Returns
 * false when the run could not start (message in err). */
bool db_http_run(const db_http *h, const db_prompt *prompts, int n, const db_load *load,
                 const db_req_opts *ro, db_progress *prog, db_result *results, int *n_sent, double *duration,
                 char **metrics_before, char **metrics_after, char *err, size_t esize);
/* GET base_url+path into a malloc'd string; NULL on failure or non-200. */
char *db_http_get(const char *base_url, const char *path, double timeout_s, long *status);
/* The first model id of GET /v1/models into buf; false when unknown. */
bool db_http_model_id(const char *base_url, char *buf, size_t size);

/* One instance of a duet server, as GET /v1/models lists it. */
typedef struct db_instance {
    char name[64], backend[64], device[256], tier[16];
    int max_batch_seqs;
    bool healthy;
} db_instance;
/* The instances of the server's first model (duet's "instances" field of
 * GET /v1/models) into out[max]; their count, or -1 with a message in err
 * when the server does not list any (not duet, or too old). */
int db_http_instances(const char *base_url, db_instance *out, int max, char *err, size_t esize);

/* Runs one point against an engine in this process. */
bool db_inproc_run(duet_engine *e, const db_prompt *prompts, int n, const db_load *load,
                   const db_req_opts *ro, db_progress *prog, db_result *results, int *n_sent,
                   double *duration, char **metrics_before, char **metrics_after, char *err, size_t esize);

/* ---- sweeps and reports --------------------------------------------------- */

/* One sweep point's settings and outcome. */
typedef struct db_point {
    db_load load;
    db_knobs knobs;
    db_run_stats stats;
    db_server_stats server;
    db_result *results; /* [n_sent] */
    int n_sent;
    db_scrapes scrapes;                                      /* with --timeline */
    double ttft_p50_ms, ttft_p99_ms, itl_p50_ms, itl_p99_ms; /* for the plots and the choice */
    /* By priority class (duet_priority index): completed requests, p99
     * TTFT and p99 ITL in ms (NAN without requests of that class). */
    int n_prio[2];
    double ttft_p99_prio_ms[2], itl_p99_prio_ms[2];
    /* Share of the machine's CPU other processes used during the point
     * (in HTTP mode that includes the server): high means noisy numbers. */
    double other_cpu;
} db_point;

/* What every result file records about where the numbers come from. */
typedef struct db_meta {
    char device[256], driver[256], backend[64], model[512], mode[32];
    char commit[64], started[32], host[128];
    char instance[64], tier[16]; /* --per-instance: the server's instance and its tier ("" otherwise) */
    char command[2048];
    int device_index;
} db_meta;

/* Everything duet-bench was asked to do. */
typedef struct db_config {
    /* target */
    bool in_process;
    const char *model_path;
    const char *backend;
    int device, n_threads, n_ctx;
    db_http http;
    const char *serve_cmd; /* start a server per knob setting (HTTP knob sweeps) */
    int serve_port;
    bool all_devices;
    /* workload */
    db_workload_cfg workload;
    db_req_opts req;
    int num_prompts; /* -1 = unbounded (with duration) */
    int warmup;      /* warm-up requests per knob setting; -1 = auto */
    /* load and sweeps */
    db_load load;
    double sweep_rate[DB_MAX_SWEEP];
    int n_sweep_rate;
    double sweep_conc[DB_MAX_SWEEP];
    int n_sweep_conc;
    double sweep_bt[DB_MAX_SWEEP];
    int n_sweep_bt;
    double sweep_mbs[DB_MAX_SWEEP];
    int n_sweep_mbs;
    db_knobs knobs;
    int max_waiting;
    db_profile profile; /* --rate-profile (n = 0: none) */
    double timeline_s;  /* --timeline: window length (0: no timeline) */
    /* stats */
    db_slo goodput;
    double ps[DB_MAX_PCT];
    int n_ps;
    bool pm_ttft, pm_tpot, pm_itl, pm_e2el; /* --percentile-metrics */
    double slo_ttft_ms, slo_itl_ms;
    /* output */
    const char *output_dir;
    const char *label;
    bool plots, progress, save_requests;
    /* --simulate: a virtual clock instead of real runs */
    const char *simulate;     /* the step-cost file (duet profile); NULL = real runs */
    duet_step_cost sim_cost;  /* read from it */
    int sim_instances;        /* instances behind the router (default 1) */
    int sim_n_ctx;            /* context per sequence; 0 = the profile's */
    double sim_latency_ms;    /* added to every token's time: the client-server path */
    bool sim_no_step_noise;   /* steps cost the model's prediction, not a draw from its dispersion */
    double sim_step_scale;    /* every step's cost times this (0 = 1: the profile's) */
    double sim_kind_scale[2]; /* prompt-chunk and decode-only steps' cost times these (0 = 1) */
    uint64_t
        sim_noise_seed; /* mixed into each point's dispersion draws (default 0: the point's seed alone) */
    /* The simulated servers' latency targets per duet_priority (ms, 0 =
     * none), as duet serve --slo-ttft-ms / --slo-itl-ms take them: with one
     * set, the adaptive controller and the stall-free step budget run in
     * the simulation as they would in those servers. */
    double sim_slo_ttft_ms[2], sim_slo_itl_ms[2];
    bool sim_static_knobs;  /* the simulated servers keep their knobs (no controller) */
    bool sim_step_log;      /* writes sim_steps.csv: every simulated step */
    const char *trace_path; /* arrivals and lengths from a file */
    int find_instances;     /* > 0: search 1..find_instances for the fewest meeting the targets */
} db_config;

/* A whole sweep on one target, with its points and chosen operating point. */
typedef struct db_sweep {
    db_meta meta;
    db_point *points;
    int n_points;
    int op;         /* index of the operating point, -1 = none meets the targets */
    bool failed;    /* the target could not be used at all */
    char why[512];  /* why, when failed */
    char dir[1024]; /* where its files went */
} db_sweep;

/* --peer LABEL=URL: another OpenAI-compatible server run side by side. */
#define DB_MAX_PEERS 7

/* Runs every sweep point on one target (backend/device or URL). */
bool db_sweep_run(const db_config *cfg, const char *backend, int device, db_sweep *out);
void db_sweep_free(db_sweep *s);
/* Sets s->op from its points and the config's p99 targets. */
void db_sweep_pick_op(const db_config *cfg, db_sweep *s);

/* Writes points.csv, requests.csv (with --save-detailed), batch_hist.csv, results.json,
 * summary.md and (with gnuplot) the plots under dir. */
bool db_report_write(const db_config *cfg, const db_sweep *s, const char *dir);
/* The side-by-side report of --all-devices under dir. */
bool db_report_compare(const db_config *cfg, const db_sweep *sweeps, int n, const char *dir);
/* Prints the operating point (or "none meets the targets") to stdout. */
void db_report_print_op(const db_config *cfg, const db_sweep *s);
/* The terminal, size and output lines every plot script starts with. */
void db_gp_header(FILE *f, const char *out_png, int w, int h);
/* Runs gnuplot on a script file; false (and a message once) when it is
 * missing or fails. */
bool db_gnuplot(const char *script_path, char *err, size_t esize);
const char *db_gnuplot_terminal(void); /* "pngcairo", "png", or NULL */

/* Writes timeline.csv (or timeline-P.csv for point P of several) and its
 * plot under dir: per window of cfg->timeline_s seconds, the offered and
 * served load, p99 TTFT and ITL per class, and the knobs scraped. */
bool db_timeline_write(const db_config *cfg, const db_sweep *s, const char *dir);

/* ---- --simulate (duet_bench_sim.c) ------------------------------------------ */

/* Runs one point on the virtual clock: the same prompts and arrival times
 * as a real run of this load (or the trace's), on cfg->sim_instances
 * instances with knobs kn. Same contract as db_http_run, and the
 * engine-side figures a server's /metrics would give: steps by sequences
 * in them (one bucket per size), device busy ratio, preemptions. With
 * `steps` open, a line per step (point `point`; sim_steps.csv's columns). */
bool db_sim_run(const db_config *cfg, const db_knobs *kn, const db_prompt *prompts, int n,
                const db_load *load, db_result *results, int *n_sent, double *duration,
                db_server_stats *server, FILE *steps, int point, char *err, size_t esize);
/* Requests a simulated point needs for cfg's duration and fastest rate. */
int db_sim_requests_needed(const db_config *cfg);
/* Reads a trace: one request a line, "arrival_s,prompt_tokens,output_tokens[,interactive|batch]"
 * (CSV; a header line and # comments are skipped) or JSONL objects with
 * arrival, prompt_tokens, output_tokens[, priority]. Arrivals must not
 * decrease. False with a message naming the line. */
bool db_trace_load(const char *path, db_prompt **out, int *n, char *err, size_t esize);
/* --find-instances: a sweep per instance count until every load meets the
 * p99 targets; writes instances.csv and instances.png under the output
 * folder and prints the answer. Returns the exit status. */
int db_sim_find_instances(db_config *cfg, const char *command);

#endif /* DUET_BENCH_H */
