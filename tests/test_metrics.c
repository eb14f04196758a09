/* test_metrics.c — core/metrics.c: recorded numbers come out of the
 * Prometheus exposition exactly, the text obeys the format rules, the vLLM
 * aliases agree with duet's own names, the windowed p99 is right, and
 * concurrent recording loses nothing. */
#include <math.h>
#include <pthread.h>
#include <time.h>

#include "metrics.h"
#include "prom_check.h"
#include "test_util.h"

static double mono_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Renders and parses, failing the test with the checker's reason. */
static void render_parse(duet_metrics *m, prom_doc *d) {
    char *text = duet__metrics_render(m);
    ck_assert_msg(text != NULL, "render returned NULL");
    char err[512] = "";
    bool ok = prom_parse(text, d, err, sizeof err);
    ck_assert_msg(ok, "rendered metrics break the text format: %s\n--- text ---\n%.4000s", err, text);
    free(text);
}

static double value(prom_doc *d, const char *name, const char *filter) {
    double v;
    int n = prom_sum(d, name, filter, &v);
    ck_assert_msg(n > 0, "no sample %s{%s}", name, filter);
    return v;
}

/* The cumulative count of one bucket. */
static double bucket(prom_doc *d, const char *hist, const char *filter, double le) {
    char name[160];
    snprintf(name, sizeof name, "%s_bucket", hist);
    for (int i = 0; i < d->n; i++)
        if (!strcmp(d->s[i].name, name) && d->s[i].has_le && d->s[i].le == le && prom_match(d->s[i].labels, filter))
            return d->s[i].value;
    ck_abort_msg("no bucket %s{%s,le=%g}", name, filter, le);
    return -1;
}

START_TEST(empty_render_has_every_family) {
    duet_metrics *m = duet__metrics_new("tiny \"model\"\\x\ny");
    ck_assert_ptr_nonnull(m);
    prom_doc d;
    render_parse(m, &d);
    static const struct {
        const char *name, *type;
    } want[] = {
        {"duet_requests_total", "counter"},
        {"duet_preemptions_total", "counter"},
        {"duet_request_latency_seconds", "histogram"},
        {"duet_time_to_first_token_seconds", "histogram"},
        {"duet_queue_time_seconds", "histogram"},
        {"duet_inter_token_latency_seconds", "histogram"},
        {"duet_batch_size", "histogram"},
        {"duet_batch_tokens", "histogram"},
        {"duet_requests_waiting", "gauge"},
        {"duet_requests_running", "gauge"},
        {"duet_kv_cache_usage_ratio", "gauge"},
        {"duet_max_batch_seqs", "gauge"},
        {"duet_max_batch_tokens", "gauge"},
        {"duet_prefill_chunk", "gauge"},
        {"duet_batch_timeout_seconds", "gauge"},
        {"duet_prompt_tokens_total", "counter"},
        {"duet_generation_tokens_total", "counter"},
        {"duet_device_busy_seconds_total", "counter"},
        {"duet_device_busy_ratio", "gauge"},
        {"duet_engine_healthy", "gauge"},
        {"vllm:num_requests_running", "gauge"},
        {"vllm:num_requests_waiting", "gauge"},
        {"vllm:kv_cache_usage_perc", "gauge"},
        {"vllm:gpu_cache_usage_perc", "gauge"},
        {"vllm:prompt_tokens_total", "counter"},
        {"vllm:generation_tokens_total", "counter"},
        {"vllm:request_success_total", "counter"},
        {"vllm:num_preemptions_total", "counter"},
        {"vllm:time_to_first_token_seconds", "histogram"},
        {"vllm:inter_token_latency_seconds", "histogram"},
        {"vllm:time_per_output_token_seconds", "histogram"},
        {"vllm:e2e_request_latency_seconds", "histogram"},
        {"vllm:request_queue_time_seconds", "histogram"},
        {"vllm:iteration_tokens_total", "histogram"},
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        ck_assert_msg(!strcmp(prom_type(&d, want[i].name), want[i].type), "family %s: type '%s', want %s",
                      want[i].name, prom_type(&d, want[i].name), want[i].type);
    /* Every series carries the model name, escaped and read back intact. */
    for (int i = 0; i < d.n; i++)
        ck_assert_msg(prom_match(d.s[i].labels, "model_name=\"tiny \"model\"\\x\ny\""),
                      "%s{%s} lacks the model_name label", d.s[i].name, d.s[i].labels);
    ck_assert_msg(value(&d, "duet_requests_total", "") == 0, "fresh counters must be 0");
    ck_assert_msg(value(&d, "vllm:e2e_request_latency_seconds_count", "") == 0, "fresh histogram count");
    ck_assert_msg(value(&d, "duet_engine_healthy", "") == 1, "a fresh engine is healthy");
    prom_free(&d);
    duet__metrics_free(m);
}
END_TEST

START_TEST(recorded_requests_come_out_exactly) {
    duet_metrics *m = duet__metrics_new("m");
    /* interactive: stop, length, cancelled before its first token; batch: error */
    duet__metrics_request_done(m, DUET_PRIORITY_INTERACTIVE, DUET_FINISH_STOP, 2.0, 0.1, 0.01, 10, 20);
    duet__metrics_request_done(m, DUET_PRIORITY_INTERACTIVE, DUET_FINISH_LENGTH, 3.0, 0.5, 0.25, 30, 40);
    duet__metrics_request_done(m, DUET_PRIORITY_INTERACTIVE, DUET_FINISH_CANCELLED, 0.3, 0, 0.3, 5, 0);
    duet__metrics_request_done(m, DUET_PRIORITY_BATCH, DUET_FINISH_ERROR, 1.0, 0.2, 0.05, 7, 3);
    duet__metrics_request_refused(m, DUET_PRIORITY_BATCH, "rejected");
    duet__metrics_request_refused(m, DUET_PRIORITY_BATCH, "rejected");
    duet__metrics_request_refused(m, DUET_PRIORITY_INTERACTIVE, "invalid");
    duet__metrics_preempted(m, DUET_PRIORITY_BATCH);
    prom_doc d;
    render_parse(m, &d);

    static const struct {
        const char *filter;
        double want;
    } req[] = {
        {"priority=\"interactive\",status=\"stop\"", 1},   {"priority=\"interactive\",status=\"length\"", 1},
        {"priority=\"interactive\",status=\"cancelled\"", 1}, {"priority=\"interactive\",status=\"error\"", 0},
        {"priority=\"batch\",status=\"error\"", 1},        {"priority=\"batch\",status=\"rejected\"", 2},
        {"priority=\"interactive\",status=\"invalid\"", 1}, {"priority=\"batch\",status=\"stop\"", 0},
    };
    for (size_t i = 0; i < sizeof req / sizeof *req; i++)
        ck_assert_msg(value(&d, "duet_requests_total", req[i].filter) == req[i].want,
                      "duet_requests_total{%s} = %g, want %g", req[i].filter,
                      value(&d, "duet_requests_total", req[i].filter), req[i].want);
    ck_assert_msg(value(&d, "vllm:request_success_total", "finished_reason=\"stop\"") == 1, "vllm stop count");
    ck_assert_msg(value(&d, "vllm:request_success_total", "finished_reason=\"abort\"") == 1, "vllm abort count");
    ck_assert_msg(value(&d, "vllm:request_success_total", "finished_reason=\"error\"") == 1, "vllm error count");
    ck_assert_msg(value(&d, "duet_prompt_tokens_total", "") == 52, "prompt tokens 10+30+5+7");
    ck_assert_msg(value(&d, "vllm:prompt_tokens_total", "") == 52, "vllm prompt tokens");
    ck_assert_msg(value(&d, "vllm:generation_tokens_total", "") == 63, "generated 20+40+0+3");
    ck_assert_msg(value(&d, "duet_preemptions_total", "priority=\"batch\"") == 1, "batch preemption");
    ck_assert_msg(value(&d, "vllm:num_preemptions_total", "") == 1, "vllm preemptions");

    /* End-to-end: every finished request, split by priority in duet's name
     * and summed in vLLM's. */
    ck_assert_msg(value(&d, "duet_request_latency_seconds_count", "priority=\"interactive\"") == 3, "e2e count");
    ck_assert_msg(value(&d, "duet_request_latency_seconds_count", "priority=\"batch\"") == 1, "e2e batch count");
    ck_assert_msg(fabs(value(&d, "vllm:e2e_request_latency_seconds_sum", "") - 6.3) < 1e-12, "e2e sum");
    ck_assert_msg(value(&d, "vllm:e2e_request_latency_seconds_count", "") == 4, "vllm e2e count");
    /* A value on a bound lands in that bucket (le is inclusive). */
    ck_assert_msg(bucket(&d, "vllm:e2e_request_latency_seconds", "", 1.0) == 2, "le=1 holds 0.3 and 1.0");
    ck_assert_msg(bucket(&d, "vllm:e2e_request_latency_seconds", "", 0.8) == 1, "le=0.8 holds 0.3");
    ck_assert_msg(bucket(&d, "vllm:e2e_request_latency_seconds", "", 2.0) == 3, "le=2 holds 2.0");
    /* TTFT only for requests that produced a token: the cancelled one has none. */
    ck_assert_msg(value(&d, "vllm:time_to_first_token_seconds_count", "") == 3, "ttft count");
    ck_assert_msg(bucket(&d, "vllm:time_to_first_token_seconds", "", 0.1) == 1, "ttft le=0.1");
    ck_assert_msg(bucket(&d, "duet_time_to_first_token_seconds", "priority=\"batch\"", 0.2) == 1, "batch ttft");
    ck_assert_msg(value(&d, "vllm:request_queue_time_seconds_count", "") == 4, "queue count");
    ck_assert_msg(fabs(value(&d, "duet_queue_time_seconds_sum", "priority=\"interactive\"") - 0.56) < 1e-12,
                  "interactive queue sum");
    /* Per-request mean time per output token: (2-0.1)/19 and (3-0.5)/39 and (1-0.2)/2. */
    ck_assert_msg(value(&d, "vllm:request_time_per_output_token_seconds_count", "") == 3, "tpot count");
    prom_free(&d);
    duet__metrics_free(m);
}
END_TEST

START_TEST(steps_gauges_and_aliases) {
    duet_metrics *m = duet__metrics_new("m");
    duet__metrics_step(m, 1, 128, 0.01);
    duet__metrics_step(m, 16, 16, 0.02);
    duet__metrics_step(m, 17, 300, 0.03);
    for (int i = 1; i <= 4; i++) duet__metrics_inter_token(m, 0.004 * i);
    duet__metrics_inter_token(m, NAN); /* ignored: would poison the sum */
    duet_metrics_gauges g = {.waiting = {3, 5},
                             .running = {2, 7},
                             .kv_usage = 0.375,
                             .max_batch_seqs = 16,
                             .max_batch_tokens = 256,
                             .prefill_chunk = 128,
                             .batch_timeout_s = 0.002,
                             .kv_block_size = 16,
                             .kv_blocks = 640};
    duet__metrics_set_gauges(m, &g);
    prom_doc d;
    render_parse(m, &d);
    /* The KV pool's geometry as vLLM's info gauge, which gateways read. */
    ck_assert_msg(!strcmp(prom_type(&d, "vllm:cache_config_info"), "gauge"), "cache_config_info type");
    ck_assert_msg(value(&d, "vllm:cache_config_info",
                        "block_size=\"16\",enable_prefix_caching=\"False\","
                        "num_gpu_blocks=\"640\"") == 1,
                  "vllm:cache_config_info labels");
    ck_assert_msg(value(&d, "duet_batch_size_count", "") == 3, "three steps");
    ck_assert_msg(value(&d, "duet_batch_size_sum", "") == 34, "sequences 1+16+17");
    ck_assert_msg(bucket(&d, "duet_batch_size", "", 16) == 2, "le=16 holds 1 and 16");
    ck_assert_msg(bucket(&d, "duet_batch_size", "", 1) == 1, "le=1 holds 1");
    ck_assert_msg(value(&d, "duet_batch_tokens_sum", "") == 444, "tokens 128+16+300");
    ck_assert_msg(bucket(&d, "vllm:iteration_tokens_total", "", 256) == 2, "iteration tokens le=256");
    ck_assert_msg(fabs(value(&d, "duet_device_busy_seconds_total", "") - 0.06) < 1e-12, "busy seconds");
    ck_assert_msg(value(&d, "duet_inter_token_latency_seconds_count", "") == 4, "NaN gap must be dropped");
    ck_assert_msg(fabs(value(&d, "vllm:inter_token_latency_seconds_sum", "") - 0.04) < 1e-12, "itl sum");
    ck_assert_msg(value(&d, "vllm:time_per_output_token_seconds_count", "") == 4, "tpot alias count");
    ck_assert_msg(bucket(&d, "vllm:inter_token_latency_seconds", "", 0.01) == 2, "itl le=0.01 holds 4ms, 8ms");
    ck_assert_msg(value(&d, "duet_requests_waiting", "priority=\"batch\"") == 5, "waiting batch");
    ck_assert_msg(value(&d, "duet_requests_running", "priority=\"interactive\"") == 2, "running interactive");
    ck_assert_msg(value(&d, "vllm:num_requests_waiting", "") == 8, "vllm waiting is the sum");
    ck_assert_msg(value(&d, "vllm:num_requests_running", "") == 9, "vllm running is the sum");
    ck_assert_msg(value(&d, "vllm:kv_cache_usage_perc", "") == 0.375, "kv usage alias");
    ck_assert_msg(value(&d, "duet_kv_cache_usage_ratio", "") == 0.375, "kv usage");
    ck_assert_msg(value(&d, "duet_max_batch_seqs", "") == 16, "knob max_batch_seqs");
    ck_assert_msg(value(&d, "duet_max_batch_tokens", "") == 256, "knob max_batch_tokens");
    ck_assert_msg(value(&d, "duet_prefill_chunk", "") == 128, "knob prefill_chunk");
    ck_assert_msg(value(&d, "duet_batch_timeout_seconds", "") == 0.002, "knob batch_timeout");
    prom_free(&d);
    /* Health is its own setting: new gauges leave it alone. */
    duet__metrics_set_healthy(m, false);
    duet__metrics_set_gauges(m, &g);
    render_parse(m, &d);
    ck_assert_msg(value(&d, "duet_engine_healthy", "") == 0, "unhealthy after the device was lost");
    prom_free(&d);
    duet__metrics_free(m);
}
END_TEST

/* Speculative decoding's counters come out under vLLM's names, per draft
 * position too, and only when speculation is on. */
START_TEST(speculative_counters) {
    duet_metrics *m = duet__metrics_new("spec");
    ck_assert_ptr_nonnull(m);
    prom_doc d;
    render_parse(m, &d);
    ck_assert_msg(prom_sum(&d, "vllm:spec_decode_num_drafts_total", "", &(double){0}) == 0,
                  "no spec metrics while speculation is off");
    prom_free(&d);
    duet_metrics_gauges g = {.spec_k = 4, .spec_max_batch = 3, .spec_throttled_tokens = 17};
    duet__metrics_set_gauges(m, &g);
    duet__metrics_spec(m, 4, 2); /* kept positions 0 and 1 */
    duet__metrics_spec(m, 3, 3);
    duet__metrics_spec(m, 2, 0);
    duet__metrics_spec(m, 0, 0); /* no drafts: not a draft */
    render_parse(m, &d);
    ck_assert(value(&d, "vllm:spec_decode_num_drafts_total", "") == 3);
    ck_assert(value(&d, "vllm:spec_decode_num_draft_tokens_total", "") == 9);
    ck_assert(value(&d, "vllm:spec_decode_num_accepted_tokens_total", "") == 5);
    ck_assert(value(&d, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position=\"0\"") == 2);
    ck_assert(value(&d, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position=\"1\"") == 2);
    ck_assert(value(&d, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position=\"2\"") == 1);
    ck_assert(value(&d, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position=\"3\"") == 0);
    ck_assert(value(&d, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "") == 5);
    ck_assert(value(&d, "duet_spec_decode_max_batch", "") == 3);
    ck_assert(value(&d, "duet_spec_decode_throttled_tokens_total", "") == 17);
    prom_free(&d);
    duet__metrics_free(m);
}
END_TEST

START_TEST(window_p99_rate_and_busy_ratio) {
    duet_metrics *m = duet__metrics_new("m");
    struct timespec pause = {0, 200 * 1000 * 1000};
    nanosleep(&pause, NULL);
    /* 100 gaps of 1..100 ms in shuffled order: nearest-rank p99 is 99 ms. */
    for (int i = 0; i < 100; i++) duet__metrics_inter_token(m, ((i * 37) % 100 + 1) * 1e-3);
    for (int i = 0; i < 10; i++)
        duet__metrics_request_done(m, DUET_PRIORITY_INTERACTIVE, DUET_FINISH_STOP, 1.0 + i, 0.1 * (i + 1), 0, 4, 4);
    duet__metrics_request_refused(m, DUET_PRIORITY_BATCH, "rejected");
    duet__metrics_step(m, 4, 4, 0.05);
    duet__metrics_step(m, 4, 4, 0.05);
    double now = mono_now();
    duet_metrics_window w;
    duet__metrics_window(m, now, 60, &w);
    ck_assert_msg(fabs(w.itl_p99_s - 0.099) < 1e-12, "itl p99 %g, want 0.099", w.itl_p99_s);
    /* p99 of 10 samples is the largest. */
    ck_assert_msg(fabs(w.ttft_p99_s - 1.0) < 1e-12, "ttft p99 %g, want 1.0", w.ttft_p99_s);
    ck_assert_msg(fabs(w.e2e_p99_s - 10.0) < 1e-12, "e2e p99 %g, want 10", w.e2e_p99_s);
    ck_assert_msg(w.n_requests == 10, "n_requests %d, want 10", w.n_requests);
    /* Arrival times are finish time less latency (up to 10 s ago) plus the
     * refusal: all 11 inside a 60 s window. */
    ck_assert_msg(fabs(w.arrival_rate - 11.0 / 60) < 1e-9, "arrival rate %g, want %g", w.arrival_rate, 11.0 / 60);
    /* 0.1 s busy over the ~0.2 s the metrics have existed (the window is
     * longer than that). */
    ck_assert_msg(w.busy_ratio > 0.3 && w.busy_ratio < 0.51, "busy ratio %g, want ~0.5 (0.1 s of ~0.2 s)",
                  w.busy_ratio);
    /* A 5 s window holds the arrivals of the requests that took 1..4 s and the refusal. */
    duet__metrics_window(m, now, 5, &w);
    ck_assert_msg(fabs(w.arrival_rate - 5.0 / 5) < 1e-9, "5 s arrival rate %g, want 1.0", w.arrival_rate);
    /* A window that ends long after every sample sees none of them. */
    duet__metrics_window(m, now + 1000, 60, &w);
    ck_assert_msg(w.n_requests == 0 && w.itl_p99_s == 0 && w.ttft_p99_s == 0 && w.busy_ratio == 0,
                  "stale samples leaked into a later window: n=%d itl=%g ttft=%g busy=%g", w.n_requests,
                  w.itl_p99_s, w.ttft_p99_s, w.busy_ratio);
    duet__metrics_free(m);
}
END_TEST

START_TEST(window_ring_keeps_the_newest) {
    duet_metrics *m = duet__metrics_new("m");
    /* Far more gaps than the ring holds: old large ones must be forgotten. */
    for (int i = 0; i < 40000; i++) duet__metrics_inter_token(m, 5.0);
    for (int i = 0; i < 40000; i++) duet__metrics_inter_token(m, 0.001);
    duet_metrics_window w;
    duet__metrics_window(m, mono_now(), 3600, &w);
    ck_assert_msg(w.itl_p99_s == 0.001, "itl p99 %g: the ring kept samples older than its capacity", w.itl_p99_s);
    duet__metrics_free(m);
}
END_TEST

typedef struct hammer_arg {
    duet_metrics *m;
    int iters;
} hammer_arg;

static void *hammer(void *p) {
    hammer_arg *a = p;
    for (int i = 0; i < a->iters; i++) {
        duet__metrics_request_done(a->m, i & 1 ? DUET_PRIORITY_BATCH : DUET_PRIORITY_INTERACTIVE, DUET_FINISH_STOP,
                                   0.5, 0.01, 0.001, 3, 2);
        duet__metrics_inter_token(a->m, 0.002);
        duet__metrics_step(a->m, 2, 2, 1e-6);
    }
    return NULL;
}

static void *scraper(void *p) {
    hammer_arg *a = p;
    for (int i = 0; i < a->iters; i++) {
        char *t = duet__metrics_render(a->m);
        prom_doc d;
        char err[256];
        bool ok = t && prom_parse(t, &d, err, sizeof err);
        prom_free(&d);
        free(t);
        if (!ok) return (void *)1;
        duet_metrics_window w;
        duet__metrics_window(a->m, mono_now(), 10, &w);
    }
    return NULL;
}

START_TEST(concurrent_recording_loses_nothing) {
    duet_metrics *m = duet__metrics_new("m");
    enum { THREADS = 4, ITERS = 20000 };
    pthread_t th[THREADS], sc;
    hammer_arg a = {m, ITERS}, s = {m, 50};
    for (int i = 0; i < THREADS; i++) pthread_create(&th[i], NULL, hammer, &a);
    pthread_create(&sc, NULL, scraper, &s);
    for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
    void *scrape_fail;
    pthread_join(sc, &scrape_fail);
    ck_assert_msg(scrape_fail == NULL, "a render during recording did not parse");
    prom_doc d;
    render_parse(m, &d);
    double total = THREADS * (double)ITERS;
    ck_assert_msg(value(&d, "duet_requests_total", "status=\"stop\"") == total, "requests %g, want %g",
                  value(&d, "duet_requests_total", "status=\"stop\""), total);
    ck_assert_msg(value(&d, "vllm:generation_tokens_total", "") == 2 * total, "generated tokens");
    ck_assert_msg(value(&d, "duet_inter_token_latency_seconds_count", "") == total, "gaps");
    ck_assert_msg(value(&d, "duet_batch_size_count", "") == total, "steps");
    prom_free(&d);
    duet__metrics_free(m);
}
END_TEST

/* The checker itself must reject broken text, or the tests above prove nothing. */
START_TEST(checker_rejects_broken_text) {
    static const char *const bad[] = {
        "a 1",                                                       /* no final newline */
        "# TYPE a counter\na_total 1\n# TYPE a counter\n",           /* second TYPE */
        "a 1\n# TYPE a gauge\n",                                     /* TYPE after samples */
        "a{x=\"1\"} 1\nb 2\na{x=\"2\"} 3\n",                         /* not contiguous */
        "a{x=1} 1\n",                                                /* unquoted label */
        "a{x=\"\\q\"} 1\n",                                          /* bad escape */
        "a 1x\n",                                                    /* bad value */
        "1a 1\n",                                                    /* bad name */
        "a 1\na 2\n",                                                /* duplicate series */
        "# TYPE c counter\nc -1\n",                                  /* negative counter */
        "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
        "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",            /* no +Inf */
        "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 1\n",        /* count mismatch */
        "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n",                 /* no sum */
        "# TYPE h histogram\nh_bucket{le=\"2\"} 1\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        prom_doc d;
        char err[256];
        bool ok = prom_parse(bad[i], &d, err, sizeof err);
        prom_free(&d);
        ck_assert_msg(!ok, "the checker accepted broken text #%zu:\n%s", i, bad[i]);
    }
    prom_doc d;
    char err[256];
    const char *good = "# HELP h x\n# TYPE h histogram\nh_bucket{a=\"1\",le=\"1\"} 1\nh_bucket{a=\"1\",le=\"+Inf\"} "
                       "2\nh_sum{a=\"1\"} 3\nh_count{a=\"1\"} 2\n# TYPE g gauge\ng NaN\ng{b=\"\\\"\"} -Inf\n";
    ck_assert_msg(prom_parse(good, &d, err, sizeof err), "the checker rejected valid text: %s", err);
    prom_free(&d);
}
END_TEST

int main(void) {
    Suite *s = suite_create("metrics");
    TCase *tc = tcase_create("metrics");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, checker_rejects_broken_text);
    tcase_add_test(tc, empty_render_has_every_family);
    tcase_add_test(tc, recorded_requests_come_out_exactly);
    tcase_add_test(tc, steps_gauges_and_aliases);
    tcase_add_test(tc, speculative_counters);
    tcase_add_test(tc, window_p99_rate_and_busy_ratio);
    tcase_add_test(tc, window_ring_keeps_the_newest);
    tcase_add_test(tc, concurrent_recording_loses_nothing);
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
