/* test_tool_calls.c — core/tool_calls.c: the syntax each shared chat
 * template writes, parsing replies into calls (whole, and as every prefix
 * of a stream, which must only ever grow toward the whole answer), and the
 * grammar of a required call. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "duet.h"
#include "grammar.h"

typedef struct want_call {
    const char *name, *arguments;
} want_call;

/* Parses text whole and checks content and calls; then parses every prefix
 * as a stream would and checks that nothing it shows is ever taken back. */
static void check_reply(duet_tool_syntax syn, const char *text, const char *content, int n,
                        const want_call *want) {
    size_t len = strlen(text);
    duet_tool_calls fin;
    ck_assert_int_eq(duet_tool_calls_parse(syn, text, len, true, &fin), DUET_OK);
    ck_assert_msg(fin.content_len == strlen(content) && !memcmp(text, content, fin.content_len),
                  "%s: content '%.*s', want '%s'", text, (int)fin.content_len, text, content);
    ck_assert_msg(fin.n == n, "%s: %d calls, want %d", text, fin.n, n);
    for (int k = 0; k < n; k++) {
        ck_assert_msg(fin.call[k].name && !strcmp(fin.call[k].name, want[k].name), "%s: call %d name %s",
                      text, k, fin.call[k].name ? fin.call[k].name : "(null)");
        ck_assert_msg(!strcmp(fin.call[k].arguments, want[k].arguments),
                      "%s: call %d arguments '%s', want '%s'", text, k, fin.call[k].arguments,
                      want[k].arguments);
        ck_assert_uint_eq(fin.call[k].arguments_len, strlen(want[k].arguments));
        ck_assert(fin.call[k].complete);
    }
    size_t last_content = 0;
    for (size_t cut = 0; cut <= len; cut++) {
        duet_tool_calls p;
        ck_assert_int_eq(duet_tool_calls_parse(syn, text, cut, false, &p), DUET_OK);
        ck_assert_msg(p.content_len >= last_content && p.content_len <= fin.content_len,
                      "%s: prefix %zu shows content %zu (before %zu, whole %zu)", text, cut, p.content_len,
                      last_content, fin.content_len);
        last_content = p.content_len;
        ck_assert_msg(p.n <= fin.n, "%s: prefix %zu has %d calls", text, cut, p.n);
        for (int k = 0; k < p.n; k++) {
            if (p.call[k].name) ck_assert_str_eq(p.call[k].name, fin.call[k].name);
            ck_assert_msg(p.call[k].arguments_len <= fin.call[k].arguments_len &&
                              !memcmp(p.call[k].arguments, fin.call[k].arguments, p.call[k].arguments_len),
                          "%s: prefix %zu: arguments '%s' do not lead to '%s'", text, cut,
                          p.call[k].arguments, fin.call[k].arguments);
        }
        duet_tool_calls_free(&p);
    }
    duet_tool_calls_free(&fin);
}

START_TEST(hermes) {
    const duet_tool_syntax H = DUET_TOOL_SYNTAX_HERMES;
    want_call w1[] = {{"get_weather", "{\"city\": \"Paris\", \"days\": [1, 2]}"}};
    check_reply(H,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, "
                "2]}}\n</tool_call>",
                "", 1, w1);
    /* Text first, two calls, the name after the arguments, escapes. */
    want_call w2[] = {{"a", "{\"s\": \"}{\\\"\"}"}, {"b\"q", "{}"}};
    check_reply(H,
                "Let me look.\n<tool_call>{\"name\": \"a\", \"arguments\": {\"s\": \"}{\\\"\"}}</tool_call>\n"
                "<tool_call>\n{\"arguments\": {}, \"name\": \"b\\\"q\"}\n</tool_call>",
                "Let me look.\n", 2, w2);
    /* Arguments as a JSON string are decoded; a call without arguments has {}. */
    want_call w3[] = {{"f", "{\"x\":1}"}};
    check_reply(H, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\":1}\"}</tool_call>", "", 1, w3);
    want_call w4[] = {{"g", "{}"}};
    check_reply(H, "<tool_call>{\"name\": \"g\"}</tool_call>", "", 1, w4);
    /* Plain text, and text that ends in part of the marker. */
    check_reply(H, "Paris is sunny today.", "Paris is sunny today.", 0, NULL);
    check_reply(H, "a < b and <tool", "a < b and <tool", 0, NULL);
    duet_tool_calls p;
    ck_assert_int_eq(duet_tool_calls_parse(H, "x <tool", 7, false, &p), DUET_OK);
    ck_assert_uint_eq(p.content_len, 2); /* "<tool" may open a call: held back */
    duet_tool_calls_free(&p);
    /* A call cut short (max_tokens): named, with the arguments so far; an
     * unnamed one is dropped. */
    const char *cut = "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1";
    ck_assert_int_eq(duet_tool_calls_parse(H, cut, strlen(cut), true, &p), DUET_OK);
    ck_assert_int_eq(p.n, 1);
    ck_assert_str_eq(p.call[0].arguments, "{\"x\": 1");
    ck_assert(!p.call[0].complete);
    duet_tool_calls_free(&p);
    cut = "<tool_call>{\"arguments\": {\"x\": 1}";
    ck_assert_int_eq(duet_tool_calls_parse(H, cut, strlen(cut), true, &p), DUET_OK);
    ck_assert_int_eq(p.n, 0);
    duet_tool_calls_free(&p);
    /* Broken JSON after the marker: no call. */
    cut = "<tool_call>{\"name\" 1}</tool_call>";
    ck_assert_int_eq(duet_tool_calls_parse(H, cut, strlen(cut), true, &p), DUET_OK);
    ck_assert_int_eq(p.n, 0);
    ck_assert_uint_eq(p.content_len, 0);
    duet_tool_calls_free(&p);
}
END_TEST

START_TEST(llama3_and_mistral) {
    const duet_tool_syntax L = DUET_TOOL_SYNTAX_LLAMA3, M = DUET_TOOL_SYNTAX_MISTRAL;
    want_call w1[] = {{"get_weather", "{\"city\": \"Paris\"}"}};
    check_reply(L, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", "", 1, w1);
    check_reply(L, "  <|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", "",
                1, w1);
    want_call w2[] = {{"a", "{\"n\": -1.5e3}"}, {"b", "{}"}};
    check_reply(L,
                "{\"name\": \"a\", \"parameters\": {\"n\": -1.5e3}}; {\"name\": \"b\", \"parameters\": {}}",
                "", 2, w2);
    /* JSON that is not a call, and text, are content. */
    check_reply(L, "{\"answer\": 42}", "{\"answer\": 42}", 0, NULL);
    check_reply(L, "The weather is fine.", "The weather is fine.", 0, NULL);
    check_reply(L, "{\"name\": \"only a name field\"}", "{\"name\": \"only a name field\"}", 0, NULL);

    want_call w3[] = {{"a", "{\"x\": 1}"}, {"b", "{\"y\": [true, null]}"}};
    check_reply(M,
                "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": "
                "{\"y\": [true, null]}}]",
                "", 2, w3);
    check_reply(M, "[{\"name\": \"a\", \"arguments\": {\"x\": 1}, \"id\": \"abcDEF123\"}]", "", 1, w3);
    check_reply(M, "[1, 2, 3]", "[1, 2, 3]", 0, NULL);
    check_reply(M, "Sure: [TOOL_CALLS] is a token.", "Sure: [TOOL_CALLS] is a token.", 0, NULL);
    /* Nothing parsed without a syntax. */
    check_reply(DUET_TOOL_SYNTAX_NONE, "<tool_call>{\"name\": \"a\"}</tool_call>",
                "<tool_call>{\"name\": \"a\"}</tool_call>", 0, NULL);
}
END_TEST

static bool accepts(const char *gbnf, const char *text) {
    duet_grammar *g;
    ck_assert_msg(duet_grammar_parse(gbnf, &g) == DUET_OK, "grammar: %s\n%s", duet_last_error(), gbnf);
    duet_grammar_state *s;
    ck_assert_int_eq(duet_grammar_state_new(g, &s), DUET_OK);
    bool ok = duet_grammar_accept(s, text, strlen(text)) && duet_grammar_complete(s);
    duet_grammar_state_free(s);
    duet_grammar_free(g);
    return ok;
}

START_TEST(required_call_grammar) {
    const char *tools = "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": "
                        "{\"type\": \"object\", "
                        "\"properties\": {\"city\": {\"type\": \"string\"}, \"unit\": {\"enum\": [\"c\", "
                        "\"f\"]}}, \"required\": "
                        "[\"city\"]}}}, {\"type\": \"function\", \"function\": {\"name\": \"now\"}}, "
                        "{\"type\": \"function\", "
                        "\"function\": {\"name\": \"tree\", \"parameters\": {\"$defs\": {\"n\": {\"type\": "
                        "\"object\", \"properties\": "
                        "{\"kids\": {\"type\": \"array\", \"items\": {\"$ref\": \"#/$defs/n\"}}}, "
                        "\"required\": [\"kids\"]}}, "
                        "\"$ref\": \"#/$defs/n\"}}}]";
    char *g = NULL;
    ck_assert_int_eq(duet_tool_call_grammar(DUET_TOOL_SYNTAX_HERMES, tools, NULL, &g), DUET_OK);
    ck_assert(accepts(
        g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"));
    ck_assert(accepts(g, "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"P\",\"unit\":"
                         "\"f\"}}\n</tool_call>"));
    ck_assert(accepts(g, "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"));
    ck_assert(accepts(
        g, "<tool_call>\n{\"name\": \"tree\", \"arguments\": {\"kids\": [{\"kids\": []}]}}\n</tool_call>"));
    ck_assert(!accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>"));
    ck_assert(
        !accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": 3}}\n</tool_call>"));
    ck_assert(!accepts(g, "<tool_call>\n{\"name\": \"other\", \"arguments\": {}}\n</tool_call>"));
    ck_assert(!accepts(g, "{\"name\": \"now\", \"arguments\": {}}"));
    free(g);
    /* A named function only. */
    ck_assert_int_eq(duet_tool_call_grammar(DUET_TOOL_SYNTAX_LLAMA3, tools, "now", &g), DUET_OK);
    ck_assert(accepts(g, "{\"name\": \"now\", \"parameters\": {}}"));
    ck_assert(!accepts(g, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}"));
    ck_assert(!accepts(g, "{\"name\": \"now\", \"arguments\": {}}"));
    free(g);
    ck_assert_int_eq(duet_tool_call_grammar(DUET_TOOL_SYNTAX_MISTRAL, tools, "get_weather", &g), DUET_OK);
    ck_assert(accepts(g, "[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}]"));
    free(g);
    ck_assert_int_eq(duet_tool_call_grammar(DUET_TOOL_SYNTAX_HERMES, tools, "missing", &g), DUET_BAD_REQUEST);
    ck_assert_int_eq(duet_tool_call_grammar(DUET_TOOL_SYNTAX_HERMES, "{}", NULL, &g), DUET_BAD_REQUEST);
    ck_assert_int_eq(duet_tool_call_grammar(DUET_TOOL_SYNTAX_NONE, tools, NULL, &g), DUET_UNSUPPORTED);
    ck_assert_int_eq(
        duet_tool_call_grammar(DUET_TOOL_SYNTAX_HERMES,
                               "[{\"type\": \"function\", \"function\": {\"name\": \"x\", \"parameters\": "
                               "{\"type\": \"tuple\"}}}]",
                               NULL, &g),
        DUET_BAD_REQUEST);
    /* Every call the grammar accepts parses back into that call. */
    const char *call =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    duet_tool_calls p;
    ck_assert_int_eq(duet_tool_calls_parse(DUET_TOOL_SYNTAX_HERMES, call, strlen(call), true, &p), DUET_OK);
    ck_assert_int_eq(p.n, 1);
    ck_assert_str_eq(p.call[0].arguments, "{\"city\": \"Paris\"}");
    duet_tool_calls_free(&p);
}
END_TEST

START_TEST(syntax_of_templates) {
    static const struct {
        const char *file;
        duet_tool_syntax want;
    } cases[] = {
        {"Qwen-Qwen2.5-7B-Instruct.jinja", DUET_TOOL_SYNTAX_HERMES},
        {"NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", DUET_TOOL_SYNTAX_HERMES},
        {"meta-llama-Llama-3.2-3B-Instruct.jinja", DUET_TOOL_SYNTAX_LLAMA3},
        {"meta-llama-Llama-3.3-70B-Instruct.jinja", DUET_TOOL_SYNTAX_LLAMA3},
        {"mistralai-Mistral-Nemo-Instruct-2407.jinja", DUET_TOOL_SYNTAX_MISTRAL},
        {"google-gemma-2-2b-it.jinja", DUET_TOOL_SYNTAX_NONE}, /* renders no tools */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/models/chat-templates/%s", DUET_SHARED_DIR, cases[i].file);
        duet_chat_template *t = NULL;
        ck_assert_msg(duet_chat_template_load(NULL, path, &t) == DUET_OK, "%s: %s", path, duet_last_error());
        ck_assert_msg(duet_chat_template_tool_syntax(t) == cases[i].want, "%s: %s, want %s", cases[i].file,
                      duet_tool_syntax_name(duet_chat_template_tool_syntax(t)),
                      duet_tool_syntax_name(cases[i].want));
        duet_chat_template_free(t);
    }
    duet_chat_template *t = NULL;
    ck_assert_int_eq(duet_chat_template_load(NULL, "chatml", &t), DUET_OK);
    ck_assert_int_eq(duet_chat_template_tool_syntax(t), DUET_TOOL_SYNTAX_NONE);
    duet_chat_template_free(t);
    /* A template that prints the call in a syntax of its own. */
    ck_assert_int_eq(duet_chat_template_parse("{% for m in messages %}{{ m.role }}: {{ m.content }}"
                                              "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}"
                                              "{% endfor %}\n{% endfor %}{% for t in tools or [] %}"
                                              "{{ t.function.name }}{% endfor %}",
                                              "", "", &t),
                     DUET_OK);
    ck_assert_int_eq(duet_chat_template_tool_syntax(t), DUET_TOOL_SYNTAX_NONE);
    duet_chat_template_free(t);
}
END_TEST

int main(void) {
    Suite *s = suite_create("tool_calls");
    TCase *tc = tcase_create("tool_calls");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, hermes);
    tcase_add_test(tc, llama3_and_mistral);
    tcase_add_test(tc, required_call_grammar);
    tcase_add_test(tc, syntax_of_templates);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
