/* test_bench_stats.c — duet-bench's maths on fixed data: percentiles (numpy's
 * 'linear' method), summaries, TPOT, goodput, per-run aggregates, the
 * operating-point choice, Prometheus parsing and histogram diffs (also on
 * the engine's own /metrics text), the arrival process and the workload.
 *
 * Expected percentiles were computed with numpy.percentile (default
 * method) on the same data.
 */
#include <math.h>

#include "duet_bench.h"
#include "metrics.h"
#include "test_util.h"

#define EPS 1e-9

static const double data10[10] = {12.5, 3.0, 7.25, 100.0, 1.5, 9.0, 4.75, 33.0, 2.0, 15.5};

START_TEST(percentile_matches_numpy_linear) {
    double s[10];
    memcpy(s, data10, sizeof s);
    for (int i = 1; i < 10; i++)
        for (int j = i; j > 0 && s[j] < s[j - 1]; j--) {
            double t = s[j];
            s[j] = s[j - 1];
            s[j - 1] = t;
        }
    /* numpy.percentile(data10, p) */
    const double p[] = {0, 10, 25, 50, 90, 95, 99, 100};
    const double want[] = {
        1.5, 1.95, 3.4375, 8.125, 39.699999999999974, 69.84999999999994, 93.97000000000001, 100.0};
    for (size_t i = 0; i < sizeof p / sizeof *p; i++) {
        double got = db_percentile_sorted(s, 10, p[i]);
        ck_assert_msg(fabs(got - want[i]) < 1e-9, "p%g: got %.17g, numpy says %.17g", p[i], got, want[i]);
    }
    const double four[] = {1, 2, 3, 4};
    ck_assert_msg(fabs(db_percentile_sorted(four, 4, 50) - 2.5) < EPS, "p50 of 1..4 should be 2.5");
    ck_assert_msg(fabs(db_percentile_sorted(four, 4, 90) - 3.7) < EPS, "p90 of 1..4 should be 3.7");
    ck_assert_msg(fabs(db_percentile_sorted(four, 4, 99) - 3.97) < EPS, "p99 of 1..4 should be 3.97");
    const double one = 42;
    ck_assert_msg(db_percentile_sorted(&one, 1, 99) == 42, "one value: every percentile is that value");
    ck_assert_msg(isnan(db_percentile_sorted(NULL, 0, 50)), "no values: NAN");
}
END_TEST

START_TEST(summary_of_unsorted_values) {
    double ps[] = {50, 90, 99};
    db_summary m;
    double copy[10];
    memcpy(copy, data10, sizeof copy);
    ck_assert(db_summarize(copy, 10, ps, 3, &m));
    ck_assert_msg(memcmp(copy, data10, sizeof copy) == 0, "db_summarize must not reorder its input");
    ck_assert_msg(m.n == 10, "n = %zu", m.n);
    ck_assert_msg(fabs(m.mean - 18.85) < EPS, "mean %g, want 18.85", m.mean);
    ck_assert_msg(fabs(m.std - 28.466910615660424) < 1e-9,
                  "population std %.17g, want numpy's 28.4669106156604", m.std);
    ck_assert_msg(fabs(m.median - 8.125) < EPS, "median %g, want 8.125", m.median);
    ck_assert_msg(m.min == 1.5 && m.max == 100, "min/max %g/%g", m.min, m.max);
    ck_assert_msg(fabs(m.pct[1] - 39.699999999999974) < 1e-9 && fabs(m.pct[2] - 93.97000000000001) < 1e-9,
                  "p90/p99 %.17g/%.17g", m.pct[1], m.pct[2]);
    ck_assert(db_summarize(NULL, 0, ps, 3, &m));
    ck_assert_msg(m.n == 0 && isnan(m.mean) && isnan(m.median) && isnan(m.pct[0]),
                  "empty summary is all NAN");
}
END_TEST

/* A completed request with the given timings (seconds) and gaps. */
static db_result mk(double ttft, double e2el, int out_tokens, const double *itl, int n_itl) {
    db_result r = {.ok = true, .ttft = ttft, .e2el = e2el, .prompt_tokens = 10, .output_tokens = out_tokens};
    for (int i = 0; i < n_itl; i++)
        ck_assert(db_result_add_itl(&r, itl[i]));
    return r;
}

START_TEST(tpot_follows_vllm) {
    const double gaps[] = {0.01, 0.03};
    db_result r = mk(0.1, 0.5, 5, gaps, 2);
    ck_assert_msg(fabs(db_result_tpot(&r) - 0.1) < EPS, "tpot = (0.5-0.1)/(5-1) = 0.1, got %g",
                  db_result_tpot(&r));
    r.output_tokens = 1;
    ck_assert_msg(isnan(db_result_tpot(&r)), "one token has no TPOT");
    r.output_tokens = 5;
    r.ok = false;
    ck_assert_msg(isnan(db_result_tpot(&r)), "a failed request has no TPOT");
    db_result_free(&r);
}
END_TEST

START_TEST(slo_parsing) {
    db_slo s;
    char err[200];
    ck_assert_msg(db_slo_parse("ttft:500 itl:50,e2el:2000 tpot:20", &s, err, sizeof err), "valid list: %s",
                  err);
    ck_assert_msg(s.ttft_ms == 500 && s.itl_ms == 50 && s.e2el_ms == 2000 && s.tpot_ms == 20,
                  "values read back");
    ck_assert_msg(!db_slo_parse("ttft:-1", &s, err, sizeof err), "negative SLO refused");
    ck_assert_msg(!db_slo_parse("latency:5", &s, err, sizeof err) && strstr(err, "latency"),
                  "unknown key named: %s", err);
    ck_assert_msg(!db_slo_parse("ttft", &s, err, sizeof err), "missing value refused");
    ck_assert_msg(!db_slo_parse("ttft:5x", &s, err, sizeof err), "trailing junk refused");
    ck_assert_msg(db_slo_parse("", &s, err, sizeof err) && !db_slo_any(&s), "empty: no SLO set");
}
END_TEST

START_TEST(goodput_counts_requests_meeting_every_slo) {
    const double fast[] = {0.010, 0.012, 0.011}, spiky[] = {0.010, 0.090, 0.010};
    db_result r[5];
    r[0] = mk(0.100, 0.140, 4, fast, 3);  /* meets all */
    r[1] = mk(0.300, 0.340, 4, fast, 3);  /* TTFT too slow */
    r[2] = mk(0.100, 0.220, 4, spiky, 3); /* one gap of 90 ms > 50 ms */
    r[3] = mk(0.050, 0.080, 4, fast, 3);  /* meets all */
    r[4] = mk(0.050, 0.080, 4, fast, 3);
    r[4].ok = false; /* failed: never good */
    db_slo slo = {.ttft_ms = 200, .itl_ms = 50};
    ck_assert_msg(db_result_meets(&r[0], &slo) && !db_result_meets(&r[1], &slo) &&
                      !db_result_meets(&r[2], &slo) && db_result_meets(&r[3], &slo) &&
                      !db_result_meets(&r[4], &slo),
                  "per-request SLO verdicts");
    double ps[] = {50, 99};
    db_run_stats st;
    ck_assert(db_run_stats_compute(r, 5, 2.0, &slo, ps, 2, &st));
    ck_assert_msg(st.good == 2, "2 requests meet every SLO, got %d", st.good);
    ck_assert_msg(fabs(st.goodput - 1.0) < EPS, "goodput = 2 good / 2 s = 1 req/s, got %g", st.goodput);
    /* e2el and tpot SLOs too. */
    db_slo e = {.e2el_ms = 150};
    ck_assert(db_run_stats_compute(r, 5, 2.0, &e, ps, 2, &st));
    ck_assert_msg(st.good == 2, "2 complete within 150 ms, got %d", st.good);
    db_slo t = {.tpot_ms = 15}; /* tpot: 13.3, 13.3, 40, 10 ms */
    ck_assert(db_run_stats_compute(r, 5, 2.0, &t, ps, 2, &st));
    ck_assert_msg(st.good == 3, "3 have TPOT <= 15 ms, got %d", st.good);
    db_slo none = {0};
    ck_assert(db_run_stats_compute(r, 5, 2.0, &none, ps, 2, &st));
    ck_assert_msg(isnan(st.goodput), "no SLO: goodput is not defined (NAN), got %g", st.goodput);
    for (int i = 0; i < 5; i++)
        db_result_free(&r[i]);
}
END_TEST

START_TEST(run_aggregates) {
    const double g1[] = {0.010, 0.020}, g2[] = {0.030};
    db_result r[3];
    r[0] = mk(0.100, 0.130, 3, g1, 2);
    r[1] = mk(0.200, 0.230, 2, g2, 1);
    r[2] = mk(NAN, 0.001, 0, NULL, 0);
    r[2].ok = false;
    double ps[] = {50, 99};
    db_run_stats st;
    ck_assert(db_run_stats_compute(r, 3, 4.0, NULL, ps, 2, &st));
    ck_assert_msg(st.completed == 2 && st.failed == 1 && st.n_requests == 3, "counts %d/%d/%d", st.completed,
                  st.failed, st.n_requests);
    ck_assert_msg(st.total_output == 5 && st.total_input == 20, "tokens out %d in %d", st.total_output,
                  st.total_input);
    ck_assert_msg(fabs(st.request_throughput - 0.5) < EPS, "2 completed / 4 s, got %g",
                  st.request_throughput);
    ck_assert_msg(fabs(st.output_throughput - 1.25) < EPS, "5 tokens / 4 s, got %g", st.output_throughput);
    ck_assert_msg(fabs(st.total_token_throughput - 6.25) < EPS, "25 tokens / 4 s, got %g",
                  st.total_token_throughput);
    /* ITL is flattened over requests: {10, 20, 30} ms. */
    ck_assert_msg(st.itl.n == 3 && fabs(st.itl.median - 20) < 1e-6, "ITL flattened: n %zu median %g",
                  st.itl.n, st.itl.median);
    ck_assert_msg(fabs(db_stats_pct(&st, &st.itl, 99) - 29.8) < 1e-6, "ITL p99 of {10,20,30} = 29.8, got %g",
                  db_stats_pct(&st, &st.itl, 99));
    ck_assert_msg(fabs(st.ttft.mean - 150) < 1e-6, "TTFT in ms over completed requests, got %g",
                  st.ttft.mean);
    ck_assert_msg(isnan(db_stats_pct(&st, &st.itl, 90)), "a percentile not asked for is NAN");
    for (int i = 0; i < 3; i++)
        db_result_free(&r[i]);
}
END_TEST

START_TEST(operating_point_selection) {
    db_op_candidate c[] = {
        {.output_throughput = 100, .ttft_p99_ms = 50, .itl_p99_ms = 10, .completed = 10},  /* 0 meets */
        {.output_throughput = 300, .ttft_p99_ms = 150, .itl_p99_ms = 20, .completed = 10}, /* 1 meets, best */
        {.output_throughput = 500,
         .ttft_p99_ms = 900,
         .itl_p99_ms = 20,
         .completed = 10}, /* 2 TTFT too high */
        {.output_throughput = 400,
         .ttft_p99_ms = 100,
         .itl_p99_ms = 60,
         .completed = 10}, /* 3 ITL too high */
        {.output_throughput = 450,
         .ttft_p99_ms = 100,
         .itl_p99_ms = 20,
         .completed = 9,
         .failed = 1}, /* 4 failures */
    };
    ck_assert_msg(db_operating_point(c, 5, 200, 50) == 1,
                  "highest throughput within both targets is point 1, got %d",
                  db_operating_point(c, 5, 200, 50));
    ck_assert_msg(db_operating_point(c, 5, 10, 50) == -1, "nothing has p99 TTFT <= 10 ms");
    ck_assert_msg(db_operating_point(c, 5, 200, 0) == 3, "without an ITL target point 3 qualifies, got %d",
                  db_operating_point(c, 5, 200, 0));
    ck_assert_msg(db_operating_point(c, 5, 0, 0) == 2,
                  "no targets: the highest throughput without failures, got %d",
                  db_operating_point(c, 5, 0, 0));
    /* A tie in throughput goes to the lower p99 TTFT. */
    db_op_candidate t[] = {{.output_throughput = 200, .ttft_p99_ms = 80, .itl_p99_ms = 5, .completed = 4},
                           {.output_throughput = 200, .ttft_p99_ms = 40, .itl_p99_ms = 5, .completed = 4}};
    ck_assert_msg(db_operating_point(t, 2, 100, 10) == 1, "tie broken by lower TTFT");
    /* One-token outputs: no ITL samples pass the ITL target; no completed requests never qualify. */
    db_op_candidate u[] = {{.output_throughput = 50, .ttft_p99_ms = 10, .itl_p99_ms = NAN, .completed = 3},
                           {.output_throughput = NAN, .ttft_p99_ms = NAN, .itl_p99_ms = NAN, .completed = 0}};
    ck_assert_msg(db_operating_point(u, 2, 100, 10) == 0,
                  "a point without ITL samples passes the ITL target");
    ck_assert_msg(db_operating_point(u + 1, 1, 100, 10) == -1,
                  "a point with no completed request never qualifies");
    ck_assert_msg(db_operating_point(c, 0, 100, 10) == -1, "no points: -1");
}
END_TEST

static const char prom_text[] =
    "# HELP duet_batch_size Sequences in one engine step.\n"
    "# TYPE duet_batch_size histogram\n"
    "duet_batch_size_bucket{model_name=\"m\",le=\"1\"} 5\n"
    "duet_batch_size_bucket{model_name=\"m\",le=\"2\"} 7\n"
    "duet_batch_size_bucket{model_name=\"m\",le=\"4\"} 10\n"
    "duet_batch_size_bucket{model_name=\"m\",le=\"+Inf\"} 10\n"
    "duet_batch_size_sum{model_name=\"m\"} 21\n"
    "duet_batch_size_count{model_name=\"m\"} 10\n"
    "duet_device_busy_seconds_total{model_name=\"m\"} 1.5\n"
    "duet_preemptions_total{model_name=\"m\",priority=\"interactive\"} 0\n"
    "duet_preemptions_total{model_name=\"m\",priority=\"batch\"} 2\n"
    "vllm:num_requests_waiting{model_name=\"a \\\"quoted\\\" } name\"} 3 1700000000000\n";

static const char prom_text2[] = "duet_batch_size_bucket{model_name=\"m\",le=\"1\"} 6\n"
                                 "duet_batch_size_bucket{model_name=\"m\",le=\"2\"} 8\n"
                                 "duet_batch_size_bucket{model_name=\"m\",le=\"4\"} 20\n"
                                 "duet_batch_size_bucket{model_name=\"m\",le=\"+Inf\"} 21\n"
                                 "duet_batch_size_sum{model_name=\"m\"} 73\n"
                                 "duet_batch_size_count{model_name=\"m\"} 21\n"
                                 "duet_device_busy_seconds_total{model_name=\"m\"} 3.5\n"
                                 "duet_preemptions_total{model_name=\"m\",priority=\"batch\"} 5\n";

START_TEST(prometheus_parse_and_diff) {
    db_prom a, b;
    int bad = -1;
    ck_assert_msg(db_prom_parse(prom_text, &a, &bad), "valid text parses (bad line %d)", bad);
    ck_assert_msg(a.n == 10, "10 samples (comments skipped), got %d", a.n);
    ck_assert_msg(db_prom_sum(&a, "vllm:num_requests_waiting") == 3,
                  "a quoted '}' in a label and a timestamp");
    char v[64];
    ck_assert_msg(db_prom_label(a.s[9].labels, "model_name", v, sizeof v) &&
                      !strcmp(v, "a \"quoted\" } name"),
                  "escaped label value read back: '%s'", v);
    ck_assert_msg(db_prom_sum(&a, "duet_preemptions_total") == 2, "a counter summed over label sets");
    ck_assert_msg(isnan(db_prom_sum(&a, "nope")), "absent metric: NAN");
    db_hist h;
    ck_assert(db_prom_hist(&a, "duet_batch_size", &h));
    ck_assert_msg(h.n == 4 && h.le[0] == 1 && h.le[2] == 4 && isinf(h.le[3]), "bounds 1,2,4,+Inf sorted");
    ck_assert_msg(h.count[0] == 5 && h.count[1] == 2 && h.count[2] == 3 && h.count[3] == 0,
                  "cumulative buckets become per-bucket counts: %g %g %g %g", h.count[0], h.count[1],
                  h.count[2], h.count[3]);
    ck_assert_msg(h.sum == 21 && h.total == 10, "sum and count");
    ck_assert(db_prom_parse(prom_text2, &b, &bad));
    db_hist h2, d;
    ck_assert(db_prom_hist(&b, "duet_batch_size", &h2));
    ck_assert_msg(db_hist_diff(&h2, &h, &d), "same bounds diff");
    ck_assert_msg(d.count[0] == 1 && d.count[1] == 0 && d.count[2] == 9 && d.count[3] == 1 && d.total == 11 &&
                      d.sum == 52,
                  "diff per bucket: %g %g %g %g (total %g, sum %g)", d.count[0], d.count[1], d.count[2],
                  d.count[3], d.total, d.sum);
    db_server_stats ss;
    db_server_stats_from(prom_text, prom_text2, 4.0, &ss);
    ck_assert_msg(ss.have_batch && fabs(ss.mean_batch - 52.0 / 11) < EPS, "mean batch during the run %g",
                  ss.mean_batch);
    ck_assert_msg(fabs(ss.busy_ratio - 0.5) < EPS, "busy 2 s of 4 s = 0.5, got %g", ss.busy_ratio);
    ck_assert_msg(ss.preemptions == 3, "3 preemptions during the run, got %g", ss.preemptions);
    db_server_stats_from(NULL, prom_text2, 4.0, &ss);
    ck_assert_msg(!ss.have_batch && isnan(ss.busy_ratio), "a missing scrape gives no engine stats");
    db_prom_free(&a);
    db_prom_free(&b);
    db_prom bad_p;
    ck_assert_msg(!db_prom_parse("ok 1\nbroken{le=\"1\" 2\n", &bad_p, &bad) && bad == 2,
                  "unclosed brace on line 2");
    ck_assert_msg(!db_prom_parse("name_without_value\n", &bad_p, &bad) && bad == 1, "a sample needs a value");
    ck_assert_msg(!db_prom_parse("x 1 junk\n", &bad_p, &bad), "junk after the value");
}
END_TEST

/* The parser against the engine's own exposition (core/metrics.c). */
START_TEST(prometheus_reads_duet_metrics) {
    duet_metrics *m = duet__metrics_new("bench-test");
    ck_assert(m);
    duet_metrics_gauges g = {
        .max_batch_seqs = 8, .max_batch_tokens = 128, .prefill_chunk = 64, .batch_timeout_s = 0.002};
    duet__metrics_set_gauges(m, &g);
    char *before = duet__metrics_render(m);
    duet__metrics_step(m, 1, 40, 0.010);
    duet__metrics_step(m, 3, 3, 0.002);
    duet__metrics_step(m, 3, 3, 0.002);
    duet__metrics_step(m, 16, 16, 0.006);
    char *after = duet__metrics_render(m);
    ck_assert(before && after);
    db_prom p;
    int bad = 0;
    ck_assert_msg(db_prom_parse(after, &p, &bad), "duet's /metrics parses (bad line %d)", bad);
    db_prom_free(&p);
    db_server_stats ss;
    db_server_stats_from(before, after, 0.1, &ss);
    ck_assert_msg(ss.have_batch, "duet_batch_size found in duet's exposition");
    ck_assert_msg(ss.batch.total == 4 && fabs(ss.mean_batch - 23.0 / 4) < 1e-9,
                  "4 steps, mean 5.75 seqs; got %g, %g", ss.batch.total, ss.mean_batch);
    double in_3 = 0, in_16 = 0;
    for (int k = 0; k < ss.batch.n; k++) {
        if (ss.batch.le[k] == 3) in_3 = ss.batch.count[k];
        if (ss.batch.le[k] == 16) in_16 = ss.batch.count[k];
    }
    ck_assert_msg(in_3 == 2 && in_16 == 1, "two steps of 3 sequences, one of 16: %g, %g", in_3, in_16);
    ck_assert_msg(fabs(ss.busy_ratio - 0.2) < 1e-6, "20 ms busy over 100 ms = 0.2, got %g", ss.busy_ratio);
    ck_assert_msg(ss.max_batch_seqs == 8 && fabs(ss.batch_timeout_ms - 2) < 1e-9 &&
                      ss.max_batch_tokens == 128 && ss.prefill_chunk == 64,
                  "knob gauges read back: %g %g %g %g", ss.max_batch_seqs, ss.batch_timeout_ms,
                  ss.max_batch_tokens, ss.prefill_chunk);
    free(before);
    free(after);
    duet__metrics_free(m);
}
END_TEST

START_TEST(arrival_gaps) {
    db_rng r;
    db_rng_seed(&r, 1);
    ck_assert_msg(db_next_gap(&r, INFINITY, 1) == 0, "rate inf: everything at once");
    /* Poisson at 4/s: mean gap 0.25 s, variance 1/16. Gamma shape 0.25:
     * same mean, squared coefficient of variation 1/shape = 4. */
    const int n = 200000;
    const double shapes[] = {1.0, 0.25, 4.0};
    for (int s = 0; s < 3; s++) {
        double sum = 0, sq = 0;
        for (int i = 0; i < n; i++) {
            double g = db_next_gap(&r, 4.0, shapes[s]);
            ck_assert_msg(g >= 0, "gaps are never negative");
            sum += g;
            sq += g * g;
        }
        double mean = sum / n, var = sq / n - mean * mean, cv2 = var / (mean * mean);
        ck_assert_msg(fabs(mean - 0.25) < 0.25 * 0.02, "burstiness %g: mean gap %g, want 0.25 +- 2%%",
                      shapes[s], mean);
        ck_assert_msg(fabs(cv2 - 1.0 / shapes[s]) < 0.05 / shapes[s] + 0.02,
                      "burstiness %g: CV^2 %g, want %g (gamma shape)", shapes[s], cv2, 1.0 / shapes[s]);
    }
    db_rng a, b;
    db_rng_seed(&a, 99);
    db_rng_seed(&b, 99);
    for (int i = 0; i < 100; i++)
        ck_assert_msg(db_rng_next(&a) == db_rng_next(&b), "same seed, same stream");
}
END_TEST

START_TEST(rate_profile) {
    db_profile p;
    char err[200];
    /* A ramp 1 -> 5 over 10 s, a plateau to 20 s, a step down to 0 at 20 s. */
    ck_assert(db_profile_parse("0:1,10:5,20:5,20:0", &p, err, sizeof err));
    ck_assert_int_eq(p.n, 4);
    ck_assert(fabs(db_profile_rate(&p, 5) - 3) < EPS);
    ck_assert(fabs(db_profile_rate(&p, 15) - 5) < EPS);
    ck_assert(fabs(db_profile_end(&p) - 20) < EPS);
    /* The integral: 30 arrivals expected over the ramp, 50 on the plateau. */
    ck_assert_msg(fabs(db_profile_cumulative(&p, 10) - 30) < EPS, "ramp: %g", db_profile_cumulative(&p, 10));
    ck_assert(fabs(db_profile_cumulative(&p, 20) - 80) < EPS);
    ck_assert(fabs(db_profile_cumulative(&p, 99) - 80) < EPS);
    for (double t = 0; t <= 20; t += 0.37)
        ck_assert_msg(fabs(db_profile_invert(&p, db_profile_cumulative(&p, t)) - t) < 1e-9,
                      "invert(cumulative(%g)) = %g", t, db_profile_invert(&p, db_profile_cumulative(&p, t)));
    ck_assert_msg(isinf(db_profile_invert(&p, 80.5)), "past the end: no more arrivals");
    /* A falling ramp inverts too (the negative slope's root). */
    ck_assert(db_profile_parse("0:6,100:0.5", &p, err, sizeof err));
    for (double t = 0; t <= 100; t += 3.1)
        ck_assert(fabs(db_profile_invert(&p, db_profile_cumulative(&p, t)) - t) < 1e-9);
    const char *bad[] = {"", "1:2,3:4", "0:1", "0:1,5", "0:1,5:2,4:1", "0:-1,5:2", "0:0,5:0", "0:1;5:2", "x"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        ck_assert_msg(!db_profile_parse(bad[i], &p, err, sizeof err) && err[0], "'%s' refused", bad[i]);

    /* Arrivals under a profile follow it: counts per window near the
     * integral (Poisson: within 5 standard deviations), none past the end;
     * and a constant rate keeps its old draws (first request at 0). */
    ck_assert(db_profile_parse("0:20,100:200,200:20", &p, err, sizeof err));
    db_load l = {.rate = INFINITY, .burstiness = 1, .seed = 7, .profile = &p};
    db_arrivals a;
    db_arrivals_init(&a, &l);
    int count[20] = {0}, total = 0;
    double prev = 0, t;
    while (!isinf(t = db_arrivals_next(&a))) {
        ck_assert_msg(t >= prev && t <= 200, "arrivals in order, inside the profile: %g after %g", t, prev);
        count[(int)fmin(t / 10, 19)]++, total++, prev = t;
    }
    for (int k = 0; k < 20; k++) {
        double want = db_profile_cumulative(&p, 10 * (k + 1)) - db_profile_cumulative(&p, 10 * k);
        ck_assert_msg(fabs((double)count[k] - want) < 5 * sqrt(want), "window %d: %d arrivals, want about %g",
                      k, count[k], want);
    }
    ck_assert_msg(fabs((double)total - 22000) < 5 * sqrt(22000), "%d in all", total);
    db_load c = {.rate = 4, .burstiness = 1, .seed = 7};
    db_rng r;
    db_rng_seed(&r, 7);
    db_arrivals_init(&a, &c);
    ck_assert(db_arrivals_next(&a) == 0);
    double want = 0;
    for (int i = 0; i < 100; i++) {
        want += db_next_gap(&r, 4, 1);
        ck_assert(db_arrivals_next(&a) == want);
    }
}
END_TEST

START_TEST(other_cpu_share) {
    db_cpu a = {.busy = 100, .total = 400, .self = 50, .ok = true},
           b = {.busy = 300, .total = 800, .self = 150, .ok = true};
    ck_assert_msg(fabs(db_cpu_other_ratio(&a, &b) - 0.25) < EPS, "(200 busy - 100 ours) / 400 = 0.25, got %g",
                  db_cpu_other_ratio(&a, &b));
    db_cpu c = b;
    c.self = 400; /* more than the machine's busy time: clamp at 0 */
    ck_assert_msg(db_cpu_other_ratio(&a, &c) == 0, "clamped at 0");
    c.ok = false;
    ck_assert_msg(isnan(db_cpu_other_ratio(&a, &c)), "an unreadable sample gives NAN");
    ck_assert_msg(isnan(db_cpu_other_ratio(&b, &a)), "no time passed: NAN");
    db_cpu now = db_cpu_sample();
    ck_assert_msg(now.ok && now.total > 0 && now.busy <= now.total, "/proc/stat read on Linux");
}
END_TEST

START_TEST(lists_and_names) {
    double v[8];
    int n;
    ck_assert_msg(db_parse_list("1,2.5,inf", v, 8, &n) && n == 3 && v[1] == 2.5 && isinf(v[2]), "1,2.5,inf");
    ck_assert_msg(!db_parse_list("1,,2", v, 8, &n), "empty entry refused");
    ck_assert_msg(!db_parse_list("1,x", v, 8, &n), "non-number refused");
    ck_assert_msg(!db_parse_list("-1", v, 8, &n), "negative refused");
    ck_assert_msg(!db_parse_list("1,2,3", v, 2, &n), "too many refused");
    char s[64];
    db_slug(s, sizeof s, "llvmpipe (LLVM 15.0.7, 256 bits)");
    ck_assert_msg(!strcmp(s, "llvmpipe-LLVM-15.0.7-256-bits"), "slug '%s'", s);
}
END_TEST

START_TEST(workload_lengths_priorities_dataset) {
    db_workload_cfg c = {
        .input_len = 20, .output_len = 10, .range_ratio = 0.5, .interactive_share = 0.3, .seed = 5, .n = 10};
    db_prompt *p, *q;
    char err[256];
    ck_assert_msg(db_workload_make(&c, NULL, &p, err, sizeof err), "random workload: %s", err);
    ck_assert_msg(db_workload_make(&c, NULL, &q, err, sizeof err), "again");
    int inter = 0;
    for (int i = 0; i < 10; i++) {
        ck_assert_msg(p[i].text && !p[i].ids, "no tokenizer: a text prompt");
        ck_assert_msg(p[i].output_len >= 5 && p[i].output_len <= 15, "output len %d in [5, 15]",
                      p[i].output_len);
        int words = 1;
        for (const char *t = p[i].text; *t; t++)
            words += *t == ' ';
        ck_assert_msg(words >= 10 && words <= 30, "prompt of %d words in [10, 30]", words);
        ck_assert_msg(!strcmp(p[i].text, q[i].text) && p[i].output_len == q[i].output_len,
                      "same seed, same workload");
        ck_assert_msg(p[i].priority_set, "a mix sets every priority");
        inter += p[i].priority == DUET_PRIORITY_INTERACTIVE;
    }
    ck_assert_msg(inter == 3, "share 0.3 of 10 requests: exactly 3 interactive, got %d", inter);
    db_workload_free(p, 10);
    db_workload_free(q, 10);

    char path[] = "/tmp/duet-bench-ds-XXXXXX";
    int fd = mkstemp(path);
    ck_assert(fd >= 0);
    const char *ds = "{\"prompt\": \"hello there\", \"output_len\": 7}\n\n{\"prompt\": \"second\"}\n";
    ck_assert(write(fd, ds, strlen(ds)) == (ssize_t)strlen(ds));
    close(fd);
    db_workload_cfg d = {.dataset_path = path, .output_len = 12, .interactive_share = -1, .n = 5};
    ck_assert_msg(db_workload_make(&d, NULL, &p, err, sizeof err), "dataset: %s", err);
    ck_assert_msg(!strcmp(p[0].text, "hello there") && p[0].output_len == 7, "line 1 as written");
    ck_assert_msg(!strcmp(p[1].text, "second") && p[1].output_len == 12,
                  "no output_len: --random-output-len");
    ck_assert_msg(!strcmp(p[2].text, "hello there") && !strcmp(p[3].text, "second"),
                  "the dataset repeats in order");
    ck_assert_msg(!p[0].priority_set, "no mix: no priority sent");
    db_workload_free(p, 5);
    FILE *f = fopen(path, "w");
    fputs("{\"prompt\": 3}\n", f);
    fclose(f);
    ck_assert_msg(!db_workload_make(&d, NULL, &p, err, sizeof err) && strstr(err, ":1:"),
                  "a bad line is reported with its number: %s", err);
    unlink(path);
}
END_TEST

int main(void) {
    Suite *s = suite_create("bench_stats");
    TCase *tc = tcase_create("maths");
    tcase_add_test(tc, percentile_matches_numpy_linear);
    tcase_add_test(tc, summary_of_unsorted_values);
    tcase_add_test(tc, tpot_follows_vllm);
    tcase_add_test(tc, slo_parsing);
    tcase_add_test(tc, goodput_counts_requests_meeting_every_slo);
    tcase_add_test(tc, run_aggregates);
    tcase_add_test(tc, operating_point_selection);
    tcase_add_test(tc, prometheus_parse_and_diff);
    tcase_add_test(tc, prometheus_reads_duet_metrics);
    tcase_add_test(tc, arrival_gaps);
    tcase_add_test(tc, rate_profile);
    tcase_add_test(tc, other_cpu_share);
    tcase_add_test(tc, lists_and_names);
    tcase_add_test(tc, workload_lengths_priorities_dataset);
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
