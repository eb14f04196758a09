/* test_grammar.c — core/grammar.c (GBNF parsing, the recognizer, the
 * vocabulary mask against a brute-force check) and core/json_schema.c
 * (schemas to grammars that accept what the schema accepts). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "json_schema.h"

static duet_grammar *parse_ok(const char *src) {
    duet_grammar *g = NULL;
    duet_status st = duet_grammar_parse(src, &g);
    ck_assert_msg(st == DUET_OK, "grammar refused: %s\n%s", duet_last_error(), src);
    return g;
}

/* Whether the whole text is a sentence of g. */
static bool accepts(const duet_grammar *g, const char *text) {
    duet_grammar_state *s;
    ck_assert_int_eq(duet_grammar_state_new(g, &s), DUET_OK);
    bool ok = duet_grammar_accept(s, text, strlen(text)) && duet_grammar_complete(s);
    duet_grammar_state_free(s);
    return ok;
}

START_TEST(gbnf_basics) {
    duet_grammar *g = parse_ok("root ::= \"a\" b* | [x-z]+ \"!\"?  # comment\n"
                               "b ::= (\"b\" | \"c\"){1,2} \".\"\n");
    const char *yes[] = {"a", "ab.", "abb.c.", "x", "xyz!", "zz"};
    const char *no[] = {"", "b", "abbb.", "ab", "x!!", "a."};
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++)
        ck_assert_msg(accepts(g, yes[i]), "refused '%s'", yes[i]);
    for (size_t i = 0; i < sizeof no / sizeof *no; i++)
        ck_assert_msg(!accepts(g, no[i]), "accepted '%s'", no[i]);
    duet_grammar_free(g);
    /* Multi-line rules, a leading '|', classes with escapes, any character, UTF-8. */
    g = parse_ok("root ::= (\n  \"[\" item\n  (\",\" item)*\n  \"]\"\n)\n"
                 "item ::= [^\\]\\x2c]\n  | \"é\" . \n");
    ck_assert(accepts(g, "[a,b,c]"));
    ck_assert(accepts(g, "[é€,x]"));
    ck_assert(!accepts(g, "[,]"));
    ck_assert(!accepts(g, "[é"));
    duet_grammar_free(g);
    /* Refusals, each with a message. */
    const char *bad[] = {"",
                         "root ::= foo",
                         "root ::= root \"a\" | \"b\"",
                         "x ::= \"a\"",
                         "root ::= \"a",
                         "root ::= [a",
                         "root ::= \"a\" )",
                         "root ::= \"a\"\nroot ::= \"b\"",
                         "root ::= \"a\"{3,1}"};
    /* Too deep or too many rules: refused, not a stack overflow. */
    static char deep[64 * 1024];
    strcpy(deep, "root ::= ");
    for (int i = 0; i < 20000; i++) strcat(deep + 9 + i, "(");
    duet_grammar *d = NULL;
    ck_assert_int_eq(duet_grammar_parse(deep, &d), DUET_BAD_REQUEST);
    char *chain = malloc(10000 * 32);
    size_t at = (size_t)sprintf(chain, "root ::= r0\n");
    for (int i = 0; i < 9000; i++) at += (size_t)sprintf(chain + at, "r%d ::= r%d \"x\"\n", i, i + 1);
    sprintf(chain + at, "r9000 ::= \"y\"\n");
    ck_assert_int_eq(duet_grammar_parse(chain, &d), DUET_BAD_REQUEST);
    free(chain);
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        duet_grammar *b = NULL;
        ck_assert_msg(duet_grammar_parse(bad[i], &b) == DUET_BAD_REQUEST, "accepted bad grammar '%s'",
                      bad[i]);
        ck_assert(duet_last_error()[0]);
        ck_assert(!b);
    }
}
END_TEST

START_TEST(utf8_split_across_tokens) {
    duet_grammar *g = parse_ok("root ::= \"<\" [^>]* \">\"\n");
    duet_grammar_state *s;
    ck_assert_int_eq(duet_grammar_state_new(g, &s), DUET_OK);
    ck_assert(duet_grammar_accept(s, "<\xe2", 2)); /* the first byte of € */
    ck_assert(!duet_grammar_complete(s));
    ck_assert(!duet_grammar_accept(s, "x", 1)); /* not a continuation byte */
    ck_assert(duet_grammar_accept(s, "\x82\xac>", 3));
    ck_assert(duet_grammar_complete(s));
    ck_assert(!duet_grammar_can_continue(s));
    duet_grammar_state_free(s);
    duet_grammar_free(g);
}
END_TEST

/* A small vocabulary: the mask equals accepting each token alone. */
START_TEST(mask_matches_brute_force) {
    static const char *const pieces[] = {"{",    "}",   "\"", "\"a",  "a\"", ":",    " ",    "\n", "{\"",
                                         "1",    "12",  "-",  "true", "tr",  "ue",   "null", ",",  "\xc3",
                                         "\xa9", "é\"", "[",  "]",    "",    "x\"}", "\"}",  "e",  "0."};
    enum { N = sizeof pieces / sizeof *pieces };
    int len[N + 1];
    bool eog[N + 1];
    const char *bytes[N + 1];
    for (int i = 0; i < N; i++)
        bytes[i] = pieces[i], len[i] = (int)strlen(pieces[i]), eog[i] = false;
    bytes[N] = "", len[N] = 0, eog[N] = true; /* an end-of-generation token */
    duet_vocab *v;
    ck_assert_int_eq(duet_vocab_new(N + 1, bytes, len, eog, &v), DUET_OK);
    char *gbnf;
    ck_assert_int_eq(duet_json_schema_to_gbnf(NULL, &gbnf), DUET_OK);
    duet_grammar *g = parse_ok(gbnf);
    free(gbnf);
    duet_grammar_state *s;
    ck_assert_int_eq(duet_grammar_state_new(g, &s), DUET_OK);
    /* Walk a text token by token, checking the mask at every step. */
    const int path[] = {8, 4, 5, 6, 12, 16, 6, 2, 17, 18, 2, 5, 20, 10, 16, 9, 21, 1};
    for (size_t k = 0; k <= sizeof path / sizeof *path; k++) {
        uint32_t mask[2] = {0, 0}, again[2] = {0, 0};
        int n = duet_grammar_mask(s, v, mask);
        int count = 0;
        for (int t = 0; t <= N; t++) {
            bool want = duet_grammar_allows(s, v, t);
            ck_assert_msg(((mask[t >> 5] >> (t & 31)) & 1) == want,
                          "step %zu token %d '%s': mask %d, alone %d", k, t, t < N ? pieces[t] : "<eos>",
                          (int)((mask[t >> 5] >> (t & 31)) & 1), want);
            count += want;
        }
        ck_assert_int_eq(n, count);
        ck_assert_int_eq(duet_grammar_mask(s, v, again), n); /* from the cache */
        ck_assert(!memcmp(mask, again, sizeof mask));
        if (k == sizeof path / sizeof *path) {
            ck_assert(duet_grammar_complete(s)); /* {"a": true, "é": [12, 1]} */
            ck_assert((mask[N >> 5] >> (N & 31)) & 1);
            break;
        }
        ck_assert_msg(duet_grammar_accept_token(s, v, path[k]), "step %zu: '%s' refused", k, pieces[path[k]]);
    }
    duet_grammar_state_free(s);
    duet_grammar_free(g);
    duet_vocab_free(v);
}
END_TEST

static duet_grammar *schema_grammar(const char *schema) {
    char *gbnf = NULL;
    duet_status st = duet_json_schema_to_gbnf(schema, &gbnf);
    ck_assert_msg(st == DUET_OK, "schema refused: %s", duet_last_error());
    duet_grammar *g = parse_ok(gbnf);
    free(gbnf);
    return g;
}

START_TEST(json_schema_subset) {
    duet_grammar *g =
        schema_grammar("{\"type\":\"object\",\"properties\":{"
                       "\"name\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":8},"
                       "\"age\":{\"type\":\"integer\"},"
                       "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\",3,null]},\"minItems\":"
                       "1,\"maxItems\":2},"
                       "\"pet\":{\"anyOf\":[{\"type\":\"null\"},{\"$ref\":\"#/$defs/pet\"}]},"
                       "\"ok\":{\"type\":[\"boolean\",\"number\"]}},"
                       "\"required\":[\"name\",\"tags\"],"
                       "\"$defs\":{\"pet\":{\"type\":\"object\",\"properties\":{\"kind\":{\"const\":\"cat\"},"
                       "\"friend\":{\"$ref\":\"#/$defs/pet\"}}}}}");
    const char *yes[] = {
        "{\"name\":\"Al\",\"tags\":[\"a\"]}",
        "{\"name\": \"Al\", \"tags\": [3, null], \"age\": -12}",
        "{\n  \"name\": \"x\",\n  \"tags\": [\"b\"],\n  \"pet\": {\"kind\": \"cat\", \"friend\": {}},\n  "
        "\"ok\": 1.5e3\n}",
        "{\"name\":\"Al\",\"tags\":[\"a\"],\"age\":1,\"pet\":null,\"ok\":false}",
        "{\"name\":\"\\u00e9\\n\",\"tags\":[\"a\"]}",
    };
    const char *no[] = {
        "{\"tags\":[\"a\"]}",                             /* name required */
        "{\"name\":\"\",\"tags\":[\"a\"]}",               /* minLength */
        "{\"name\":\"123456789\",\"tags\":[\"a\"]}",      /* maxLength */
        "{\"name\":\"Al\",\"tags\":[]}",                  /* minItems */
        "{\"name\":\"Al\",\"tags\":[\"a\",\"b\",3]}",     /* maxItems */
        "{\"name\":\"Al\",\"tags\":[\"c\"]}",             /* enum */
        "{\"name\":\"Al\",\"tags\":[\"a\"],\"age\":1.5}", /* integer */
        "{\"name\":\"Al\",\"tags\":[\"a\"],\"pet\":{\"kind\":\"dog\"}}",
        "{\"name\":\"Al\",\"tags\":[\"a\"]} ", /* nothing after the value */
        "{\"name\":\"Al\",\"tags\":[\"a\"],\"age\":01}",
    };
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++)
        ck_assert_msg(accepts(g, yes[i]), "refused %s", yes[i]);
    for (size_t i = 0; i < sizeof no / sizeof *no; i++)
        ck_assert_msg(!accepts(g, no[i]), "accepted %s", no[i]);
    duet_grammar_free(g);
    /* No required property: any subset, in order. */
    g = schema_grammar("{\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"boolean\"}}}");
    const char *sub[] = {"{}", "{\"a\":1}", "{\"b\":true}", "{\"a\":1,\"b\":false}"};
    for (size_t i = 0; i < 4; i++)
        ck_assert_msg(accepts(g, sub[i]), "refused %s", sub[i]);
    ck_assert(!accepts(g, "{,\"b\":true}"));
    ck_assert(!accepts(g, "{\"b\":true,\"a\":1}"));
    duet_grammar_free(g);
    /* json_object: any object. */
    g = schema_grammar(NULL);
    ck_assert(accepts(g, "{\"x\": [1, {\"y\": null}, \"z\"], \"w\": -0.5}"));
    ck_assert(!accepts(g, "[1]"));
    duet_grammar_free(g);
    char *gbnf;
    ck_assert_int_eq(duet_json_schema_to_gbnf("{\"type\":\"tuple\"}", &gbnf), DUET_BAD_REQUEST);
    ck_assert_int_eq(duet_json_schema_to_gbnf("{\"$ref\":\"#/nowhere\"}", &gbnf), DUET_BAD_REQUEST);
    ck_assert_int_eq(duet_json_schema_to_gbnf("not json", &gbnf), DUET_BAD_REQUEST);
}
END_TEST

/* Integer bounds: every integer near and between the bounds is accepted
 * exactly when it lies within them (against the arithmetic). */
START_TEST(json_schema_numeric_bounds) {
    static const struct {
        const char *bounds;
        long long lo, hi;
    } cases[] = {
        {"\"minimum\": 5, \"maximum\": 123", 5, 123},
        {"\"minimum\": 0, \"maximum\": 100", 0, 100},
        {"\"minimum\": -37, \"maximum\": 12", -37, 12},
        {"\"minimum\": -1000, \"maximum\": -990", -1000, -990},
        {"\"exclusiveMinimum\": 9, \"exclusiveMaximum\": 1001", 10, 1000},
        {"\"minimum\": 1.5, \"maximum\": 19.5", 2, 19},
        {"\"minimum\": 7, \"maximum\": 7", 7, 7},
        {"\"minimum\": 1995", 1995, 9999999999999999LL},
        {"\"maximum\": 3", -9999999999999999LL, 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char schema[160], *gbnf;
        snprintf(schema, sizeof schema, "{\"type\": \"integer\", %s}", cases[i].bounds);
        ck_assert_int_eq(duet_json_schema_to_gbnf(schema, &gbnf), DUET_OK);
        duet_grammar *g = parse_ok(gbnf);
        long long lo = cases[i].lo, hi = cases[i].hi;
        long long probes[] = {lo, hi, 0, -1, 1, 9, 10, 99, 100, 101, 999, 1000, 1001, 10000, -9, -10, -100};
        for (long long x = lo - 30; x <= lo + 30; x++)
            if (x > -9999999999999999LL) {
                char t[32];
                snprintf(t, sizeof t, "%lld", x);
                ck_assert_msg(accepts(g, t) == (x >= lo && x <= hi), "%s: %s", schema, t);
            }
        for (long long x = hi - 30; x <= hi + 30; x++)
            if (x < 9999999999999999LL) {
                char t[32];
                snprintf(t, sizeof t, "%lld", x);
                ck_assert_msg(accepts(g, t) == (x >= lo && x <= hi), "%s: %s", schema, t);
            }
        for (size_t k = 0; k < sizeof probes / sizeof *probes; k++) {
            char t[32];
            snprintf(t, sizeof t, "%lld", probes[k]);
            ck_assert_msg(accepts(g, t) == (probes[k] >= lo && probes[k] <= hi), "%s: %s", schema, t);
        }
        ck_assert_msg(!accepts(g, "007") && !accepts(g, "-0") && !accepts(g, "1.0"), "%s", schema);
        duet_grammar_free(g);
        free(gbnf);
    }
    /* A number between non-negative integers: fractions below the maximum. */
    char *gbnf;
    ck_assert_int_eq(
        duet_json_schema_to_gbnf("{\"type\": \"number\", \"minimum\": 0, \"maximum\": 10}", &gbnf), DUET_OK);
    duet_grammar *g = parse_ok(gbnf);
    const char *yes[] = {"0", "0.5", "9.99", "10", "10.0", "3"};
    const char *no[] = {"-1", "10.5", "11", "-0.5", "1e3", "100"};
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++)
        ck_assert_msg(accepts(g, yes[i]), "refused %s", yes[i]);
    for (size_t i = 0; i < sizeof no / sizeof *no; i++)
        ck_assert_msg(!accepts(g, no[i]), "accepted %s", no[i]);
    duet_grammar_free(g);
    free(gbnf);
    ck_assert_int_eq(
        duet_json_schema_to_gbnf("{\"type\": \"integer\", \"minimum\": 5, \"maximum\": 4}", &gbnf),
        DUET_BAD_REQUEST);
}
END_TEST

int main(void) {
    Suite *s = suite_create("grammar");
    TCase *tc = tcase_create("grammar");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, gbnf_basics);
    tcase_add_test(tc, utf8_split_across_tokens);
    tcase_add_test(tc, mask_matches_brute_force);
    tcase_add_test(tc, json_schema_subset);
    tcase_add_test(tc, json_schema_numeric_bounds);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
