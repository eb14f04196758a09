/* test_eval.c — duet_quality_eval and duet_quality_generate on the CPU:
 * the teacher-forced scores (all rows of a prefill chunk) against the same
 * scores built from duet_eval one token at a time, the window rule, a model
 * against itself, vocabulary mismatches and argument errors. The quality
 * thresholds on every backend are in test_eval.py. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "duet.h"
#include "test_util.h"

static char dir[64];
static char q8_path[128], tiny_path[128];
static const char *stories;

static void files_setup(void) {
    snprintf(dir, sizeof dir, "/tmp/duet-eval-test-XXXXXX");
    ck_assert_msg(mkdtemp(dir) != NULL, "mkdtemp: %s", strerror(errno));
    stories = test_shared_path("models/stories260K.gguf");
    snprintf(q8_path, sizeof q8_path, "%s/stories-q8_0.gguf", dir);
    snprintf(tiny_path, sizeof tiny_path, "%s/tiny.gguf", dir);
    ck_assert_msg(duet_quantize_file(stories, q8_path, "q8_0", NULL) == DUET_OK, "quantize: %s", duet_last_error());
    duet_mkmodel_params mp = {.shape = "tiny", .type = "f32", .seed = 3};
    ck_assert_msg(duet_mkmodel(&mp, tiny_path) == DUET_OK, "mkmodel: %s", duet_last_error());
}

static void files_teardown(void) {
    unlink(q8_path);
    unlink(tiny_path);
    rmdir(dir);
}

static duet_model *open_cpu(const char *path, int n_ctx) {
    duet_open_params p = duet_open_params_default();
    p.backend = "cpu";
    p.n_threads = 2;
    p.n_ctx = n_ctx;
    duet_model *m = NULL;
    ck_assert_msg(duet_model_open(path, &p, &m) == DUET_OK, "open %s: %s", path, duet_last_error());
    return m;
}

/* The oracle: one duet_eval call per token, windows built from the rule in
 * duet.h, softmax and KL in long double. */
typedef struct oracle {
    int positions, windows, agree;
    double kl_sum, kl_max, nll, nll_ref;
} oracle;

static int argmax(const float *x, int n) {
    int a = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[a]) a = i;
    return a;
}

static void log_softmax(const float *x, long double *out, int n) {
    long double mx = x[0], s = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > mx) mx = x[i];
    for (int i = 0; i < n; i++) s += expl(x[i] - mx);
    for (int i = 0; i < n; i++) out[i] = x[i] - mx - logl(s);
}

static oracle oracle_scores(duet_model *m, duet_model *r, const int32_t *t, int n, int W) {
    duet_model_desc d;
    duet_model_describe(r, &d);
    const int V = d.n_vocab;
    float *lm = malloc(sizeof(float) * V), *lr = malloc(sizeof(float) * V);
    long double *pm = malloc(sizeof(long double) * V), *pr = malloc(sizeof(long double) * V);
    int32_t *feed = malloc(sizeof(int32_t) * W);
    oracle o = {0};
    for (int s = 0; s < n;) {
        int len = 0;
        if (s > 0 && t[s] != d.bos) feed[len++] = d.bos >= 0 ? d.bos : t[s - 1];
        int e = s + (W - len) < n ? s + (W - len) : n;
        for (int i = s; i < e; i++) feed[len++] = t[i];
        for (int i = 0; i + 1 < len; i++) {
            ck_assert_msg(duet_eval(m, &feed[i], 1, i, lm) == DUET_OK, "eval: %s", duet_last_error());
            ck_assert_msg(duet_eval(r, &feed[i], 1, i, lr) == DUET_OK, "eval: %s", duet_last_error());
            log_softmax(lm, pm, V);
            log_softmax(lr, pr, V);
            long double kl = 0;
            for (int j = 0; j < V; j++) kl += expl(pr[j]) * (pr[j] - pm[j]);
            o.kl_sum += (double)kl;
            if (kl > o.kl_max) o.kl_max = (double)kl;
            o.nll -= (double)pm[feed[i + 1]];
            o.nll_ref -= (double)pr[feed[i + 1]];
            o.agree += argmax(lm, V) == argmax(lr, V);
            o.positions++;
        }
        o.windows++;
        s = e;
    }
    free(lm), free(lr), free(pm), free(pr), free(feed);
    return o;
}

static int32_t *story_tokens(duet_model *r, int *n) {
    static const char text[] =
        "Once upon a time, there was a little girl named Lily. She loved to play in the park with her red "
        "ball. One day, she saw a big dog near the swings. The dog was sad because he was lost. Lily said, "
        "\"Do not be sad, dog. I will help you find your home.\" The dog wagged his tail and licked her hand. "
        "They walked and walked until they saw a small house with a blue door.";
    int32_t *ids = malloc(sizeof(int32_t) * 1024);
    *n = duet_tokenize(r, text, strlen(text), true, false, ids, 1024);
    ck_assert_msg(*n > 101 && *n <= 1024, "tokenize gave %d tokens; the window tests need more than 101", *n);
    return ids;
}

START_TEST(test_teacher_forcing_matches_token_by_token) {
    /* Window 100 with 64 rows per step: windows of two chunks, a second
     * window that starts mid-text (so with a BOS lead) and a short tail. */
    duet_model *m = open_cpu(q8_path, 128), *r = open_cpu(stories, 128);
    int n;
    int32_t *t = story_tokens(r, &n);
    const int W = 100;
    duet_quality q;
    ck_assert_msg(duet_quality_eval(m, r, t, n, W, &q) == DUET_OK, "quality: %s", duet_last_error());
    oracle o = oracle_scores(m, r, t, n, W);
    ck_assert_msg(q.positions == o.positions && q.positions == n - 1, "positions %d, oracle %d, tokens %d",
                  q.positions, o.positions, n);
    ck_assert_msg(q.windows == o.windows && q.windows == (n - 1 + W - 2) / (W - 1), "windows %d, oracle %d",
                  q.windows, o.windows);
    /* Chunked and single-token steps may round differently; far below the
     * q8_0-vs-f32 differences being measured (KL ~1e-3). */
    double kl = o.kl_sum / o.positions;
    ck_assert_msg(fabs(q.kl_mean - kl) < 1e-6 + 1e-3 * kl, "kl_mean %.9g, oracle %.9g", q.kl_mean, kl);
    ck_assert_msg(fabs(q.kl_max - o.kl_max) < 1e-5 + 1e-3 * o.kl_max, "kl_max %.9g, oracle %.9g", q.kl_max,
                  o.kl_max);
    ck_assert_msg(q.kl_p99 <= q.kl_max && q.kl_p99 >= 0, "kl_p99 %g outside [0, max %g]", q.kl_p99,
                  q.kl_max);
    double ppl = exp(o.nll / o.positions), ppl_ref = exp(o.nll_ref / o.positions);
    ck_assert_msg(fabs(q.ppl / ppl - 1) < 1e-4, "ppl %.8g, oracle %.8g", q.ppl, ppl);
    ck_assert_msg(fabs(q.ppl_ref / ppl_ref - 1) < 1e-4, "ppl_ref %.8g, oracle %.8g", q.ppl_ref, ppl_ref);
    double agree = (double)o.agree / o.positions;
    ck_assert_msg(fabs(q.top1_agreement - agree) <= 1.5 / o.positions, "top1 %.6f, oracle %.6f",
                  q.top1_agreement, agree);
    ck_assert_msg(q.kl_mean > 0, "a q8_0 model should differ from its f32 original (kl_mean %g)", q.kl_mean);
    free(t);
    duet_model_close(m);
    duet_model_close(r);
}
END_TEST

START_TEST(test_model_against_itself) {
    /* Two handles of one file on one backend compute the same logits. */
    duet_model *m = open_cpu(stories, 0), *r = open_cpu(stories, 0);
    int n;
    int32_t *t = story_tokens(r, &n);
    duet_quality q;
    ck_assert_msg(duet_quality_eval(m, r, t, n, 0, &q) == DUET_OK, "quality: %s", duet_last_error());
    ck_assert_msg(q.kl_mean == 0 && q.kl_max == 0, "kl_mean %g kl_max %g, expected 0", q.kl_mean, q.kl_max);
    ck_assert_msg(q.top1_agreement == 1.0, "top1 %g", q.top1_agreement);
    ck_assert_msg(q.ppl == q.ppl_ref, "ppl %.17g vs ppl_ref %.17g", q.ppl, q.ppl_ref);
    ck_assert_msg(q.ppl > 1 && q.ppl < 100, "stories260K on a story: ppl %g", q.ppl);
    ck_assert_msg(q.windows == 1 && q.positions == n - 1, "windows %d positions %d", q.windows, q.positions);
    free(t);
    duet_model_close(m);
    duet_model_close(r);
}
END_TEST

START_TEST(test_generate_segments_and_windows) {
    duet_model *r = open_cpu(stories, 64), *m = open_cpu(q8_path, 64);
    duet_model_desc d;
    duet_model_describe(r, &d);
    enum { N = 300, W = 64 };
    int32_t a[N], b[N], c[N];
    ck_assert_msg(duet_quality_generate(r, N, W, 5, a) == DUET_OK, "generate: %s", duet_last_error());
    ck_assert_msg(duet_quality_generate(r, N, W, 5, b) == DUET_OK, "generate: %s", duet_last_error());
    ck_assert_msg(duet_quality_generate(r, N, W, 6, c) == DUET_OK, "generate: %s", duet_last_error());
    ck_assert_msg(!memcmp(a, b, sizeof a), "the same seed gave different tokens");
    ck_assert_msg(memcmp(a, c, sizeof a), "seeds 5 and 6 gave the same %d tokens", N);
    /* Segments: BOS, then up to W - 1 sampled tokens, ending early only at EOS. */
    int since_bos = -1, distinct = 0;
    bool seen[512] = {0};
    for (int i = 0; i < N; i++) {
        ck_assert_msg(a[i] >= 0 && a[i] < d.n_vocab, "token %d = %d", i, a[i]);
        if (!seen[a[i]]) seen[a[i]] = true, distinct++;
        bool seg_start = i == 0 || since_bos == W - 1 || a[i - 1] == d.eos;
        if (seg_start) {
            ck_assert_msg(a[i] == d.bos, "token %d = %d should start a segment with BOS", i, a[i]);
            since_bos = 0;
        } else {
            since_bos++;
        }
    }
    /* Temperature 1 over the whole vocabulary is not a greedy loop. */
    ck_assert_msg(distinct > 60, "only %d distinct tokens in %d sampled ones", distinct, N);
    /* Windows of W over segments of W: a window that starts at the text's
     * BOS needs no lead, and that BOS is not predicted. */
    duet_quality q;
    ck_assert_msg(duet_quality_eval(m, r, a, N, W, &q) == DUET_OK, "quality: %s", duet_last_error());
    oracle o = oracle_scores(m, r, a, N, W);
    ck_assert_msg(q.positions == o.positions && q.windows == o.windows, "positions %d/%d windows %d/%d",
                  q.positions, o.positions, q.windows, o.windows);
    int bos_windows = 0;
    for (int s = W; s < N; s += W) bos_windows += a[s] == d.bos;
    if (bos_windows == q.windows - 1) /* no EOS moved the segments */
        ck_assert_msg(q.positions == N - q.windows, "positions %d with %d windows", q.positions, q.windows);
    duet_model_close(r);
    duet_model_close(m);
}
END_TEST

START_TEST(test_mismatched_vocabularies) {
    /* The synthetic tiny model has 512 tokens too, but other pieces. */
    duet_model *m = open_cpu(tiny_path, 0), *r = open_cpu(stories, 0);
    int32_t t[4] = {1, 20, 30, 40};
    duet_quality q;
    duet_status st = duet_quality_eval(m, r, t, 4, 0, &q);
    ck_assert_msg(st == DUET_INVALID_ARGUMENT, "got %s", duet_status_name(st));
    ck_assert_msg(strstr(duet_last_error(), "vocabularies differ") && strstr(duet_last_error(), "token"),
                  "message: %s", duet_last_error());
    duet_model_close(m);
    duet_model_close(r);
}
END_TEST

START_TEST(test_argument_errors) {
    duet_model *m = open_cpu(stories, 32), *r = open_cpu(stories, 64);
    int32_t t[4] = {1, 20, 30, 40};
    duet_quality q;
    ck_assert_int_eq(duet_quality_eval(m, r, t, 1, 0, &q), DUET_INVALID_ARGUMENT);
    ck_assert_int_eq(duet_quality_eval(m, r, t, 4, 1, &q), DUET_INVALID_ARGUMENT);
    /* The window may not exceed the smaller context. */
    ck_assert_int_eq(duet_quality_eval(m, r, t, 4, 33, &q), DUET_INVALID_ARGUMENT);
    ck_assert_msg(strstr(duet_last_error(), "32"), "message: %s", duet_last_error());
    ck_assert_int_eq(duet_quality_eval(m, r, t, 4, 32, &q), DUET_OK);
    int32_t bad[3] = {1, 512, 3};
    ck_assert_int_eq(duet_quality_eval(m, r, bad, 3, 0, &q), DUET_INVALID_ARGUMENT);
    ck_assert_msg(strstr(duet_last_error(), "512"), "message: %s", duet_last_error());
    ck_assert_int_eq(duet_quality_eval(NULL, r, t, 4, 0, &q), DUET_INVALID_ARGUMENT);
    ck_assert_int_eq(duet_quality_generate(r, 0, 0, 1, t), DUET_INVALID_ARGUMENT);
    ck_assert_int_eq(duet_quality_generate(r, 4, 65, 1, t), DUET_INVALID_ARGUMENT);
    duet_open_params vp = duet_open_params_default();
    vp.vocab_only = true;
    duet_model *v;
    ck_assert_msg(duet_model_open(stories, &vp, &v) == DUET_OK, "open: %s", duet_last_error());
    ck_assert_int_eq(duet_quality_eval(v, r, t, 4, 0, &q), DUET_INVALID_ARGUMENT);
    ck_assert_int_eq(duet_quality_generate(v, 4, 0, 1, t), DUET_INVALID_ARGUMENT);
    duet_model_close(v);
    duet_model_close(m);
    duet_model_close(r);
}
END_TEST

int main(void) {
    Suite *s = suite_create("eval");
    TCase *tc = tcase_create("quality");
    tcase_add_unchecked_fixture(tc, files_setup, files_teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_teacher_forcing_matches_token_by_token);
    tcase_add_test(tc, test_model_against_itself);
    tcase_add_test(tc, test_generate_segments_and_windows);
    tcase_add_test(tc, test_mismatched_vocabularies);
    tcase_add_test(tc, test_argument_errors);
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
