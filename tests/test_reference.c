/* test_reference.c — stories260K against llama2.c's run.c (an independent
 * implementation): prompt ids exactly, greedy ids exactly up to the first
 * near-tie (top-1/top-2 gap below 1e-3), and the first logits within 1e-3.
 * Runs on every backend named in DUET_TEST_BACKENDS (default: cpu). */
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

int main(void) {
    Suite *s = suite_create("reference");
    TCase *tc = tcase_create("stories260K");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, greedy_matches_run_c);
    tcase_add_test(tc, first_logits_match_run_c);
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
