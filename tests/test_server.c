/* test_server.c — `duet serve`, tested two ways:
 *
 * - its pure parts directly: request parsing and validation, chat
 *   templates, stop strings, response and stream JSON;
 * - a live server started by the test (the `duet` binary, stories260K on
 *   the CPU backend) driven with libcurl: 64 concurrent greedy streams give
 *   the outputs of the same requests run one at a time; stop strings, n,
 *   usage; disconnects free their KV blocks; malformed requests get 400s
 *   with OpenAI's error object; overload gets 429 with Retry-After; /metrics
 *   obeys the Prometheus text format; SIGTERM drains and exits 0.
 *
 * DUET_TEST_BINARY overrides the binary (default: DUET_BINARY_DIR/duet).
 */
#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

#include "../core/stop_strings.h"
#include "prom_check.h"
#include "server.h"
#include "test_util.h"

/* ======================= pure parts ===================================== */

static const srv_limits LIM = {.model_name = "m", .model_alias = "/models/m.gguf", .n_vocab = 512};

static bool parse(srv_kind kind, const char *body, srv_request *r, srv_error *e) {
    return srv_request_parse(kind, body, strlen(body), &LIM, r, e);
}

START_TEST(parse_completion_fields) {
    srv_request r;
    srv_error e;
    const char *body =
        "{\"model\":\"m\",\"prompt\":\"hello\",\"max_tokens\":7,\"temperature\":0.5,\"top_p\":0.9,\"top_k\":-"
        "1,"
        "\"min_p\":0.1,\"presence_penalty\":0.5,\"frequency_penalty\":-0.5,\"repetition_penalty\":1.1,"
        "\"seed\":42,"
        "\"n\":3,\"stop\":[\"a\",\"bc\"],\"priority\":\"batch\",\"stream\":true,\"stream_options\":"
        "{\"include_usage\":true},\"ignore_eos\":true,\"user\":\"x\",\"some_new_field\":{\"y\":1}}";
    ck_assert_msg(parse(SRV_COMPLETION, body, &r, &e), "valid request refused: %s", e.message);
    ck_assert_int_eq(r.n_prompts, 1);
    ck_assert_str_eq(r.prompts[0].text, "hello");
    ck_assert_int_eq(r.max_tokens, 7);
    ck_assert_msg(r.sampling.temperature == 0.5f && r.sampling.top_p == 0.9f && r.sampling.top_k == 0 &&
                      r.sampling.min_p == 0.1f && r.sampling.presence_penalty == 0.5f &&
                      r.sampling.frequency_penalty == -0.5f && r.sampling.repetition_penalty == 1.1f,
                  "sampling fields not carried over");
    ck_assert_msg(r.seed_set && r.sampling.seed == 42, "seed");
    ck_assert_int_eq(r.n, 3);
    ck_assert_int_eq(r.n_stop, 2);
    ck_assert_str_eq(r.stop[1], "bc");
    ck_assert_msg(r.priority == DUET_PRIORITY_BATCH, "priority \"batch\"");
    ck_assert_msg(r.stream && r.include_usage && r.ignore_eos, "stream, include_usage, ignore_eos");
    srv_request_free(&r);

    /* Defaults: OpenAI's plain sampling; nulls count as absent. */
    ck_assert(
        parse(SRV_COMPLETION, "{\"prompt\":\"x\",\"temperature\":null,\"stop\":null,\"n\":null}", &r, &e));
    ck_assert_msg(r.sampling.temperature == 1 && r.sampling.top_p == 1 && r.sampling.top_k == 0 &&
                      r.sampling.min_p == 0 && r.sampling.repetition_penalty == 1 && !r.seed_set &&
                      r.n == 1 && r.max_tokens == -1 && !r.stream && r.n_stop == 0 &&
                      r.priority == DUET_PRIORITY_INTERACTIVE,
                  "defaults are not OpenAI's");
    srv_request_free(&r);

    /* Token-id prompts, several prompts, a vLLM integer priority, the
     * model's path as its name, max_completion_tokens winning. */
    ck_assert(
        parse(SRV_COMPLETION,
              "{\"model\":\"/models/m.gguf\",\"prompt\":[[1,2,3],\"two\"],\"priority\":5,\"max_tokens\":3,"
              "\"max_completion_tokens\":9,\"stop\":\"END\",\"seed\":-1}",
              &r, &e));
    ck_assert_int_eq(r.n_prompts, 2);
    ck_assert_int_eq(r.prompts[0].n_ids, 3);
    ck_assert_int_eq(r.prompts[0].ids[2], 3);
    ck_assert_str_eq(r.prompts[1].text, "two");
    ck_assert_msg(r.priority == DUET_PRIORITY_BATCH, "integer priority > 0 is batch");
    ck_assert_int_eq(r.max_tokens, 9);
    ck_assert_int_eq(r.n_stop, 1);
    ck_assert_str_eq(r.stop[0], "END");
    ck_assert_msg(r.sampling.seed == UINT64_MAX, "seed -1 keeps its bits");
    srv_request_free(&r);
    ck_assert(parse(SRV_COMPLETION, "{\"prompt\":[5,6],\"priority\":-3}", &r, &e));
    ck_assert_msg(r.n_prompts == 1 && r.prompts[0].n_ids == 2 && r.priority == DUET_PRIORITY_INTERACTIVE,
                  "one id prompt, interactive");
    srv_request_free(&r);
}
END_TEST

START_TEST(parse_chat_messages) {
    srv_request r;
    srv_error e;
    const char *body = "{\"messages\":[{\"role\":\"developer\",\"content\":\"be brief\"},{\"role\":\"user\","
                       "\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]},"
                       "{\"role\":\"assistant\",\"content\":null},{\"role\":\"user\",\"content\":\"c\"}]}";
    ck_assert_msg(parse(SRV_CHAT, body, &r, &e), "valid chat refused: %s", e.message);
    ck_assert_int_eq(r.n_messages, 4);
    ck_assert_msg(r.messages[0].role == SRV_ROLE_SYSTEM, "developer is a system message");
    ck_assert_str_eq(r.messages[1].content, "a\nb");
    ck_assert_str_eq(r.messages[2].content, "");
    ck_assert_msg(r.messages[3].role == SRV_ROLE_USER, "user role");
    ck_assert_int_eq(r.tool_choice, SRV_TOOLS_NONE);
    srv_request_free(&r);

    /* A tool round: the call's arguments reach the template as an object,
     * the tool's answer with its call id; the tools come along. */
    body = "{\"messages\":[{\"role\":\"user\",\"content\":\"weather?\"},{\"role\":\"assistant\",\"content\":"
           "null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"w\","
           "\"arguments\":\"{\\\"city\\\":\\\"Oslo\\\"}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"call_1\","
           "\"content\":\"sunny\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"w\"}}],"
           "\"parallel_tool_calls\":false}";
    ck_assert_msg(parse(SRV_CHAT, body, &r, &e), "tool round refused: %s", e.message);
    ck_assert_int_eq(r.tool_choice, SRV_TOOLS_AUTO);
    ck_assert_msg(r.messages[2].role == SRV_ROLE_TOOL, "tool role");
    char *conv = srv_conversation_json(&r);
    cJSON *c = cJSON_Parse(conv);
    const cJSON *msgs = cJSON_GetObjectItem(c, "messages");
    const cJSON *args = cJSON_GetObjectItem(
        cJSON_GetObjectItem(
            cJSON_GetArrayItem(cJSON_GetObjectItem(cJSON_GetArrayItem(msgs, 1), "tool_calls"), 0),
            "function"),
        "arguments");
    ck_assert_msg(cJSON_IsObject(args) && !strcmp(cJSON_GetObjectItem(args, "city")->valuestring, "Oslo"),
                  "%s", conv);
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(msgs, 2), "tool_call_id")->valuestring, "call_1");
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(msgs, 2), "role")->valuestring, "tool");
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(c, "tools")), 1);
    cJSON_Delete(c);
    free(conv);
    srv_request_free(&r);
    /* tool_choice "none": the tools stay out of the prompt. */
    ck_assert(parse(SRV_CHAT,
                    "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\","
                    "\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"none\"}",
                    &r, &e));
    ck_assert_int_eq(r.tool_choice, SRV_TOOLS_NONE);
    ck_assert_ptr_null(r.tools_json);
    srv_request_free(&r);
}
END_TEST

START_TEST(parse_rejects_bad_input) {
    static const struct {
        srv_kind kind;
        const char *body, *param;
    } bad[] = {
        {SRV_COMPLETION, "{\"prompt\":\"x\"", ""},
        {SRV_COMPLETION, "{\"prompt\":\"x\"}}", ""},
        {SRV_COMPLETION, "{\"prompt\":\"x\"} {}", ""},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"timeout\":0}", "timeout"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"timeout\":\"1\"}", "timeout"},
        {SRV_COMPLETION, "[1,2]", ""},
        {SRV_COMPLETION, "", ""},
        {SRV_COMPLETION, "{}", "prompt"},
        {SRV_COMPLETION, "{\"prompt\":5}", "prompt"},
        {SRV_COMPLETION, "{\"prompt\":[]}", "prompt"},
        {SRV_COMPLETION, "{\"prompt\":[1,\"a\"]}", "prompt"},
        {SRV_COMPLETION, "{\"prompt\":[1,512]}", "prompt"},
        {SRV_COMPLETION, "{\"prompt\":[-1]}", "prompt"},
        {SRV_COMPLETION,
         "{\"prompt\":[[1],[2],[3],[4],[5],[6],[7],[8],[9],[10],[11],[12],[13],[14],[15],[16],[17]]}",
         "prompt"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"max_tokens\":-1}", "max_tokens"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"max_tokens\":0}", "max_tokens"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"max_tokens\":1.5}", "max_tokens"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"max_tokens\":\"10\"}", "max_tokens"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"max_tokens\":1e30}", "max_tokens"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"temperature\":-0.1}", "temperature"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"temperature\":2.5}", "temperature"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"temperature\":1e999}", "temperature"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", "temperature"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"temperature\":true}", "temperature"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"top_p\":0}", "top_p"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"top_p\":1.01}", "top_p"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"top_k\":-2}", "top_k"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"top_k\":2.5}", "top_k"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"min_p\":1.5}", "min_p"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"presence_penalty\":3}", "presence_penalty"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"frequency_penalty\":-2.5}", "frequency_penalty"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"repetition_penalty\":0}", "repetition_penalty"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"seed\":1.5}", "seed"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"n\":0}", "n"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"n\":17}", "n"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"best_of\":3}", "best_of"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"stop\":5}", "stop"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"stop\":[\"\"]}", "stop"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"stop\":[\"a\",7]}", "stop"},
        {SRV_COMPLETION,
         "{\"prompt\":\"x\",\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\","
         "\"12\","
         "\"13\",\"14\",\"15\",\"16\",\"17\"]}",
         "stop"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"stream\":\"yes\"}", "stream"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}", "stream_options"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{\"include_usage\":1}}",
         "stream_options.include_usage"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"model\":7}", "model"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"priority\":\"urgent\"}", "priority"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"priority\":1.5}", "priority"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"ignore_eos\":1}", "ignore_eos"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"logprobs\":21}", "logprobs"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"grammar\":5}", "grammar"},
        {SRV_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":\"xml\"}}",
         "response_format.type"},
        {SRV_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":\"json_"
         "schema\"}}",
         "response_format.json_schema"},
        {SRV_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":\"json_"
         "schema\","
         "\"json_schema\":{\"name\":\"n\",\"schema\":{\"type\":\"tuple\"}}}}",
         "response_format.json_schema"},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"echo\":1}", "echo"},
        {SRV_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":3}",
         "top_logprobs"},
        {SRV_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":21}",
         "top_logprobs"},
        {SRV_COMPLETION, "{\"prompt\":\"before\\u0000after\"}", ""},
        {SRV_COMPLETION, "{\"prompt\":\"x\",\"stop\":[\"\\\\\\u0000\"]}", ""},
        {SRV_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\\u0000there\"}]}", ""},
        {SRV_CHAT, "{}", "messages"},
        {SRV_CHAT, "{\"messages\":[]}", "messages"},
        {SRV_CHAT, "{\"messages\":\"hi\"}", "messages"},
        {SRV_CHAT, "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", "messages[0].role"},
        {SRV_CHAT, "{\"messages\":[{\"content\":\"x\"}]}", "messages[0].role"},
        {SRV_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", "messages[0].content"},
        {SRV_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}",
         "messages[0].content"},
        {SRV_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{}]}", "tools[0]"},
        {SRV_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":{}}", "tools"},
        {SRV_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\","
         "\"function\":{\"name\":\"a b\"}}]}",
         "tools[0]"},
        {SRV_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"required\"}",
         "tool_choice"},
        {SRV_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\","
         "\"function\":{\"name\":\"f\"}}],\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":"
         "\"g\"}}}",
         "tool_choice"},
        {SRV_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\","
         "\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"required\",\"grammar\":\"root ::= \\\"a\\\"\"}",
         "tool_choice"},
        {SRV_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{}}]}]}",
         "messages[0].tool_calls"},
        {SRV_CHAT, "{\"messages\":[{\"role\":\"tool\",\"content\":\"x\",\"tool_call_id\":5}]}",
         "messages[0].tool_call_id"},
        {SRV_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":-5}",
         "max_completion_tokens"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        srv_request r;
        srv_error e;
        ck_assert_msg(!parse(bad[i].kind, bad[i].body, &r, &e), "accepted bad request #%zu: %s", i,
                      bad[i].body);
        ck_assert_msg(e.http == 400, "#%zu: http %d, want 400", i, e.http);
        ck_assert_msg(!strcmp(e.param, bad[i].param), "#%zu %s: param '%s', want '%s' (%s)", i, bad[i].body,
                      e.param, bad[i].param, e.message);
        ck_assert_msg(e.message[0], "#%zu: empty message", i);
        /* The error object, as OpenAI's clients read it. */
        char *j = srv_error_json(&e);
        cJSON *o = cJSON_Parse(j), *err = cJSON_GetObjectItem(o, "error");
        ck_assert_msg(cJSON_IsString(cJSON_GetObjectItem(err, "message")) &&
                          !strcmp(cJSON_GetObjectItem(err, "type")->valuestring, "invalid_request_error") &&
                          cJSON_HasObjectItem(err, "param") && cJSON_HasObjectItem(err, "code"),
                      "#%zu: bad error object %s", i, j);
        cJSON_Delete(o);
        free(j);
    }
    /* An escaped backslash followed by "u0000" is plain text, kept whole. */
    srv_request r;
    srv_error e;
    ck_assert_msg(parse(SRV_COMPLETION, "{\"prompt\":\"a\\\\u0000b\"}", &r, &e), "%s", e.message);
    ck_assert_str_eq(r.prompts[0].text, "a\\u0000b");
    srv_request_free(&r);
}
END_TEST

START_TEST(stop_string_scanning) {
    const char *stops[] = {"END", "\n\n", "abcd"};
    static const struct {
        const char *text;
        size_t safe;
        bool hit;
    } cases[] = {
        {"", 0, false},
        {"hello", 5, false},
        {"hello E", 6, false},  /* "E" may start END */
        {"hello EN", 6, false}, /* "EN" too */
        {"hello END", 6, true}, /* full match */
        {"hello ENDthere", 6, true},
        {"ab\n", 2, false},       /* "\n" may start "\n\n" */
        {"abc", 0, false},        /* "abc" may start "abcd" */
        {"xabcENDabcd", 4, true}, /* the earliest match wins */
        {"x\n\nEND", 1, true},
        {"ENE", 2, false}, /* "E" at the end; "EN" is not followed by D */
        {"EEND", 1, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        bool hit;
        size_t safe = duet__stop_scan(cases[i].text, strlen(cases[i].text), stops, 3, &hit);
        ck_assert_msg(safe == cases[i].safe && hit == cases[i].hit, "scan(%s): safe %zu hit %d, want %zu %d",
                      cases[i].text, safe, hit, cases[i].safe, cases[i].hit);
    }
    bool hit;
    ck_assert_msg(duet__stop_scan("anything", 8, stops, 0, &hit) == 8 && !hit, "no stop strings: all safe");
}
END_TEST

START_TEST(response_and_chunk_json) {
    srv_choice_result ch[2] = {{.text = "Hi there", .len = 8, .finish = "stop"},
                               {.text = "Bye", .len = 3, .finish = "length"}};
    srv_usage u = {5, 11};
    char *s = srv_response_json(SRV_CHAT, "chatcmpl-1", 123, "m", ch, 2, u);
    cJSON *o = cJSON_Parse(s);
    ck_assert_msg(o, "response is not JSON: %s", s);
    ck_assert_str_eq(cJSON_GetObjectItem(o, "object")->valuestring, "chat.completion");
    cJSON *c1 = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 1);
    ck_assert_int_eq(cJSON_GetObjectItem(c1, "index")->valueint, 1);
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(c1, "message"), "content")->valuestring, "Bye");
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(c1, "message"), "role")->valuestring,
                     "assistant");
    ck_assert_str_eq(cJSON_GetObjectItem(c1, "finish_reason")->valuestring, "length");
    cJSON *us = cJSON_GetObjectItem(o, "usage");
    ck_assert_msg(cJSON_GetObjectItem(us, "prompt_tokens")->valueint == 5 &&
                      cJSON_GetObjectItem(us, "completion_tokens")->valueint == 11 &&
                      cJSON_GetObjectItem(us, "total_tokens")->valueint == 16,
                  "usage %s", s);
    cJSON_Delete(o);
    free(s);

    /* Tool calls: content null, the calls with their ids; a call's stream chunks. */
    duet_tool_calls tc = {0};
    const char *call = "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}</tool_call>";
    ck_assert_int_eq(duet_tool_calls_parse(DUET_TOOL_SYNTAX_HERMES, call, strlen(call), true, &tc), DUET_OK);
    srv_call_id ids[1] = {"call_0"};
    srv_choice_result tcr = {.text = call, .len = 0, .finish = "tool_calls", .calls = &tc, .call_ids = ids};
    s = srv_response_json(SRV_CHAT, "chatcmpl-2", 1, "m", &tcr, 1, u);
    ck_assert_msg(strstr(s, "\"message\":{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":"
                            "\"call_0\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":"
                            "\"{\\\"x\\\": 1}\"}}]}"),
                  "%s", s);
    free(s);
    duet_tool_calls_free(&tc);
    srv_text tt = {0};
    ck_assert(srv_tool_chunk_sse(&tt, "id", 1, "m", 0, 0, "call_0", "f", "", 0, false));
    ck_assert(srv_tool_chunk_sse(&tt, "id", 1, "m", 0, 0, NULL, NULL, "{\"x\"", 4, false));
    ck_assert_msg(
        strstr(tt.p, "\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_0\",\"type\":\"function\","
                     "\"function\":{\"name\":\"f\",\"arguments\":\"\"}}]}") &&
            strstr(tt.p,
                   "\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"x\\\"\"}}]}"),
        "%s", tt.p);
    srv_text_free(&tt);

    srv_choice_result nul = {.text = "a\0b\"c", .len = 5, .finish = "stop"};
    s = srv_response_json(SRV_COMPLETION, "cmpl-1", 1, "m", &nul, 1, u);
    o = cJSON_Parse(s);
    ck_assert_str_eq(
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0), "text")->valuestring,
        "ab\"c");
    ck_assert_str_eq(cJSON_GetObjectItem(o, "object")->valuestring, "text_completion");
    cJSON_Delete(o);
    free(s);

    srv_text t = {0};
    ck_assert(srv_chunk_sse(&t, SRV_CHAT, "id", 1, "m", 0, NULL, 0, NULL, true, true));
    ck_assert(srv_chunk_sse(&t, SRV_CHAT, "id", 1, "m", 0, "tok", 3, NULL, false, true));
    ck_assert(srv_chunk_sse(&t, SRV_CHAT, "id", 1, "m", 0, "", 0, "stop", false, true));
    ck_assert(srv_usage_sse(&t, SRV_CHAT, "id", 1, "m", u));
    /* Four "data: {json}\n\n" events. */
    const char *want_delta[4] = {"{\"role\":\"assistant\",\"content\":\"\"}", "{\"content\":\"tok\"}", "{}",
                                 NULL};
    char *p = t.p;
    for (int k = 0; k < 4; k++) {
        ck_assert_msg(!strncmp(p, "data: ", 6), "event %d does not start with 'data: ': %s", k, p);
        char *end = strstr(p, "\n\n");
        ck_assert_msg(end != NULL, "event %d not terminated by a blank line", k);
        *end = 0;
        cJSON *ev = cJSON_Parse(p + 6);
        ck_assert_msg(ev != NULL, "event %d is not JSON: %s", k, p + 6);
        ck_assert_str_eq(cJSON_GetObjectItem(ev, "object")->valuestring, "chat.completion.chunk");
        cJSON *choices = cJSON_GetObjectItem(ev, "choices");
        if (want_delta[k]) {
            cJSON *c = cJSON_GetArrayItem(choices, 0);
            char *d = cJSON_PrintUnformatted(cJSON_GetObjectItem(c, "delta"));
            ck_assert_msg(!strcmp(d, want_delta[k]), "event %d delta %s, want %s", k, d, want_delta[k]);
            cJSON_free(d);
            ck_assert_msg(cJSON_IsNull(cJSON_GetObjectItem(ev, "usage")), "event %d: usage must be null", k);
        } else {
            ck_assert_msg(cJSON_GetArraySize(choices) == 0, "usage event has choices");
            ck_assert_int_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(ev, "usage"), "total_tokens")->valueint,
                             16);
        }
        cJSON_Delete(ev);
        p = end + 2;
    }
    ck_assert_msg(*p == 0, "trailing bytes after the events: %s", p);
    srv_text_free(&t);
}
END_TEST

/* ======================= a live server ================================== */

typedef struct server {
    pid_t pid;
    int port;
    char log[512];
} server;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static const char *duet_binary(void) {
    const char *b = getenv("DUET_TEST_BINARY");
    return b && *b ? b : DUET_BINARY_DIR "/duet";
}

/* ---- libcurl ---- */

typedef struct xfer {
    CURL *h;
    char *buf;
    size_t len, cap;
    long code;
    CURLcode res;
    size_t abort_after; /* > 0: hang up once this many body bytes arrived */
    char retry_after[32];
    char content_type[128];
    char allow_origin[128]; /* Access-Control-Allow-Origin */
    char allow_methods[128];
    struct curl_slist *hdrs;
    bool done;
} xfer;

static size_t on_body(char *p, size_t sz, size_t n, void *user) {
    xfer *x = user;
    size_t k = sz * n;
    if (x->len + k + 1 > x->cap) {
        x->cap = (x->len + k + 1) * 2;
        x->buf = realloc(x->buf, x->cap);
    }
    memcpy(x->buf + x->len, p, k);
    x->len += k;
    x->buf[x->len] = 0;
    if (x->abort_after && x->len >= x->abort_after) return 0; /* the client hangs up */
    return k;
}

static size_t on_header(char *p, size_t sz, size_t n, void *user) {
    xfer *x = user;
    size_t k = sz * n;
    if (k > 13 && !strncasecmp(p, "Retry-After: ", 13))
        snprintf(x->retry_after, sizeof x->retry_after, "%.*s", (int)strcspn(p + 13, "\r\n"), p + 13);
    if (k > 14 && !strncasecmp(p, "Content-Type: ", 14))
        snprintf(x->content_type, sizeof x->content_type, "%.*s", (int)strcspn(p + 14, "\r\n"), p + 14);
    if (k > 29 && !strncasecmp(p, "Access-Control-Allow-Origin: ", 29))
        snprintf(x->allow_origin, sizeof x->allow_origin, "%.*s", (int)strcspn(p + 29, "\r\n"), p + 29);
    if (k > 30 && !strncasecmp(p, "Access-Control-Allow-Methods: ", 30))
        snprintf(x->allow_methods, sizeof x->allow_methods, "%.*s", (int)strcspn(p + 30, "\r\n"), p + 30);
    return k;
}

static void xfer_init(xfer *x, int port, const char *method, const char *path, const char *body) {
    memset(x, 0, sizeof *x);
    x->h = curl_easy_init();
    char url[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
    curl_easy_setopt(x->h, CURLOPT_URL, url);
    curl_easy_setopt(x->h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(x->h, CURLOPT_WRITEDATA, x);
    curl_easy_setopt(x->h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(x->h, CURLOPT_HEADERDATA, x);
    curl_easy_setopt(x->h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(x->h, CURLOPT_TIMEOUT, 300L);
    if (body) {
        x->hdrs = curl_slist_append(NULL, "Content-Type: application/json");
        curl_easy_setopt(x->h, CURLOPT_HTTPHEADER, x->hdrs);
        curl_easy_setopt(x->h, CURLOPT_COPYPOSTFIELDS, body);
    }
    if (strcmp(method, body ? "POST" : "GET")) curl_easy_setopt(x->h, CURLOPT_CUSTOMREQUEST, method);
}

/* Replaces the request's headers (NULL-terminated list). */
static void xfer_headers(xfer *x, const char *const *hdrs) {
    curl_slist_free_all(x->hdrs);
    x->hdrs = NULL;
    for (; *hdrs; hdrs++)
        x->hdrs = curl_slist_append(x->hdrs, *hdrs);
    curl_easy_setopt(x->h, CURLOPT_HTTPHEADER, x->hdrs);
}

/* One blocking request with the given headers; returns the HTTP code. */
static long http_with(int port, const char *method, const char *path, const char *body,
                      const char *const *hdrs, xfer *x);

static void xfer_finish(xfer *x) {
    curl_easy_getinfo(x->h, CURLINFO_RESPONSE_CODE, &x->code);
    x->done = true;
}

static void xfer_free(xfer *x) {
    if (x->h) curl_easy_cleanup(x->h);
    curl_slist_free_all(x->hdrs);
    free(x->buf);
    memset(x, 0, sizeof *x);
}

/* One blocking request; returns the HTTP code (0 when it never connected). */
static long http(int port, const char *method, const char *path, const char *body, xfer *x) {
    xfer_init(x, port, method, path, body);
    x->res = curl_easy_perform(x->h);
    xfer_finish(x);
    return x->code;
}

static long http_with(int port, const char *method, const char *path, const char *body,
                      const char *const *hdrs, xfer *x) {
    xfer_init(x, port, method, path, body);
    xfer_headers(x, hdrs);
    x->res = curl_easy_perform(x->h);
    xfer_finish(x);
    return x->code;
}

/* Drives transfers together; `tick` (may be NULL) runs every loop. */
static void run_multi(xfer *xs, int n, void (*tick)(void *), void *arg) {
    CURLM *m = curl_multi_init();
    for (int i = 0; i < n; i++)
        curl_multi_add_handle(m, xs[i].h);
    int running = n;
    while (running) {
        curl_multi_perform(m, &running);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(m, &left)))
            if (msg->msg == CURLMSG_DONE)
                for (int i = 0; i < n; i++)
                    if (xs[i].h == msg->easy_handle) {
                        xs[i].res = msg->data.result;
                        xfer_finish(&xs[i]);
                    }
        if (tick) tick(arg);
        if (running) curl_multi_poll(m, NULL, 0, 20, NULL);
    }
    for (int i = 0; i < n; i++)
        curl_multi_remove_handle(m, xs[i].h);
    curl_multi_cleanup(m);
}

/* ---- the server process ---- */

static char *read_log(const server *s) {
    char *t = test_read_file(s->log, NULL);
    return t ? t : strdup("(no log)");
}

static void server_start(server *s, const char *name, const char *const *extra) {
    memset(s, 0, sizeof *s);
    snprintf(s->log, sizeof s->log, "%s/test_server_%s_%d.log", DUET_BINARY_DIR, name, (int)getpid());
    const char *argv[64] = {duet_binary(), "serve", "-m",     test_shared_path("models/stories260K.gguf"),
                            "--backend",   "cpu",   "--port", "0",
                            "-c",          "1024"};
    int argc = 10;
    for (int i = 0; extra && extra[i]; i++)
        argv[argc++] = extra[i];
    argv[argc] = NULL;
    int log_fd = open(s->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ck_assert_msg(log_fd >= 0, "cannot create %s", s->log);
    s->pid = fork();
    ck_assert_msg(s->pid >= 0, "fork: %s", strerror(errno));
    if (s->pid == 0) {
        /* The server dies with the test process, even when a check fails. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        dup2(log_fd, 1);
        dup2(log_fd, 2);
        execv(argv[0], (char *const *)argv);
        fprintf(stderr, "cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(log_fd);
    /* The server prints "... on http://HOST:PORT" once it listens. */
    for (double t0 = now_s(); now_s() - t0 < 120; sleep_ms(20)) {
        char *log = read_log(s);
        char *at = strstr(log, " on http://");
        if (at && strchr(at, '\n')) {
            char *colon = strrchr(strtok(at + 11, "\n"), ':');
            s->port = colon ? atoi(colon + 1) : 0;
        }
        int status;
        if (!s->port && waitpid(s->pid, &status, WNOHANG) == s->pid) {
            s->pid = 0;
            ck_abort_msg("duet serve exited during start-up:\n%s", log);
        }
        free(log);
        if (s->port) break;
    }
    ck_assert_msg(s->port > 0, "duet serve did not report its port within 120 s");
    xfer x;
    long code = http(s->port, "GET", "/health", NULL, &x);
    ck_assert_msg(code == 200 && strstr(x.buf, "\"ok\""), "/health: %ld %s", code, x.buf ? x.buf : "");
    xfer_free(&x);
    /* Ready as soon as it listens: the model was loaded and warmed before. */
    code = http(s->port, "GET", "/ready", NULL, &x);
    ck_assert_msg(code == 200 && strstr(x.buf, "\"ready\""), "/ready: %ld %s", code, x.buf ? x.buf : "");
    xfer_free(&x);
}

/* SIGTERM and wait; returns the exit status (or -1 when killed / timed out). */
static int server_stop(server *s, double timeout_s) {
    if (!s->pid) return -1;
    kill(s->pid, SIGTERM);
    int status = 0;
    for (double t0 = now_s(); now_s() - t0 < timeout_s; sleep_ms(20))
        if (waitpid(s->pid, &status, WNOHANG) == s->pid) {
            s->pid = 0;
            if (WIFEXITED(status)) {
                if (WEXITSTATUS(status) == 0) unlink(s->log); /* else keep it for the post-mortem */
                return WEXITSTATUS(status);
            }
            return -1;
        }
    kill(s->pid, SIGKILL);
    waitpid(s->pid, &status, 0);
    s->pid = 0;
    return -1;
}

/* ---- streams ---- */

typedef struct stream_result {
    char text[SRV_MAX_N][8192];
    char finish[SRV_MAX_N][16];
    int n_chunks;
    bool done_marker;
    int usage_prompt, usage_completion;
    char error[256];
} stream_result;

/* Parses an SSE body into per-choice text; fails the test on bad framing. */
static void parse_stream(const char *body, bool chat, stream_result *r) {
    memset(r, 0, sizeof *r);
    r->usage_prompt = r->usage_completion = -1;
    const char *p = body ? body : "";
    while (*p) {
        const char *end = strstr(p, "\n\n");
        ck_assert_msg(end != NULL, "unterminated SSE event: %.200s", p);
        ck_assert_msg(!strncmp(p, "data: ", 6), "SSE event without 'data: ': %.200s", p);
        ck_assert_msg(!r->done_marker, "an event after [DONE]");
        size_t n = (size_t)(end - p - 6);
        if (n == 6 && !strncmp(p + 6, "[DONE]", 6)) {
            r->done_marker = true;
            p = end + 2;
            continue;
        }
        cJSON *o = cJSON_ParseWithLength(p + 6, n);
        ck_assert_msg(o != NULL, "SSE data is not JSON: %.*s", (int)n, p + 6);
        cJSON *err = cJSON_GetObjectItem(o, "error");
        if (err) snprintf(r->error, sizeof r->error, "%s", cJSON_GetObjectItem(err, "message")->valuestring);
        cJSON *u = cJSON_GetObjectItem(o, "usage");
        if (cJSON_IsObject(u)) {
            r->usage_prompt = cJSON_GetObjectItem(u, "prompt_tokens")->valueint;
            r->usage_completion = cJSON_GetObjectItem(u, "completion_tokens")->valueint;
        }
        cJSON *c;
        cJSON_ArrayForEach(c, cJSON_GetObjectItem(o, "choices")) {
            int i = cJSON_GetObjectItem(c, "index")->valueint;
            ck_assert_msg(i >= 0 && i < SRV_MAX_N, "choice index %d", i);
            cJSON *t = chat ? cJSON_GetObjectItem(cJSON_GetObjectItem(c, "delta"), "content")
                            : cJSON_GetObjectItem(c, "text");
            if (cJSON_IsString(t))
                strncat(r->text[i], t->valuestring, sizeof r->text[i] - strlen(r->text[i]) - 1);
            cJSON *f = cJSON_GetObjectItem(c, "finish_reason");
            if (cJSON_IsString(f)) {
                ck_assert_msg(!r->finish[i][0], "choice %d finished twice", i);
                snprintf(r->finish[i], sizeof r->finish[i], "%s", f->valuestring);
            }
        }
        r->n_chunks++;
        cJSON_Delete(o);
        p = end + 2;
    }
}

static const char *choice_text(cJSON *resp, int i, bool chat) {
    cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(resp, "choices"), i);
    cJSON *t = chat ? cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "content")
                    : cJSON_GetObjectItem(c, "text");
    return cJSON_IsString(t) ? t->valuestring : NULL;
}

static const char *choice_finish(cJSON *resp, int i) {
    cJSON *f =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(resp, "choices"), i), "finish_reason");
    return cJSON_IsString(f) ? f->valuestring : "";
}

static int usage_of(cJSON *resp, const char *key) {
    cJSON *v = cJSON_GetObjectItem(cJSON_GetObjectItem(resp, "usage"), key);
    return cJSON_IsNumber(v) ? v->valueint : -1;
}

/* ---- metrics ---- */

static double scrape(int port, const char *name, const char *filter) {
    xfer x;
    long code = http(port, "GET", "/metrics", NULL, &x);
    ck_assert_msg(code == 200, "/metrics: %ld", code);
    prom_doc d;
    char err[256];
    ck_assert_msg(prom_parse(x.buf, &d, err, sizeof err), "/metrics breaks the text format: %s", err);
    double v;
    ck_assert_msg(prom_sum(&d, name, filter, &v) > 0, "/metrics has no %s{%s}", name, filter);
    prom_free(&d);
    xfer_free(&x);
    return v;
}

/* Polls until name{filter} == want or the timeout passes; returns the last value. */
static double await_metric(int port, const char *name, const char *filter, double want, double timeout_s) {
    double v = scrape(port, name, filter);
    for (double t0 = now_s(); v != want && now_s() - t0 < timeout_s; sleep_ms(20))
        v = scrape(port, name, filter);
    return v;
}

/* ---- the live tests ---- */

static const char *const subjects[8] = {"Once upon a time", "The little dog", "Lily wanted",
                                        "Tom and his mom",  "The sun",        "A big bear",
                                        "The cat",          "One day"};
static const char *const endings[8] = {"",     " and",      " went to", " saw a",
                                       " was", " liked to", " found a", " said"};

START_TEST(concurrent_streams_match_sequential_runs) {
    server s;
    server_start(&s, "concurrent", NULL);
    enum { N = 64 };
    static char bodies[N][256];
    static stream_result seq[N], con[N];
    for (int i = 0; i < N; i++)
        snprintf(bodies[i], sizeof bodies[i],
                 "{\"model\":\"stories260K\",\"prompt\":\"%s%s\",\"max_tokens\":%d,\"temperature\":0,"
                 "\"stream\":true,"
                 "\"stream_options\":{\"include_usage\":true}}",
                 subjects[i % 8], endings[i / 8], 24 + (i % 5) * 8);
    /* One at a time: batch size 1. */
    double t_seq = now_s();
    for (int i = 0; i < N; i++) {
        xfer x;
        long code = http(s.port, "POST", "/v1/completions", bodies[i], &x);
        ck_assert_msg(code == 200, "sequential request %d: HTTP %ld %s", i, code, x.buf ? x.buf : "");
        ck_assert_msg(strstr(x.content_type, "text/event-stream") != NULL, "stream content type '%s'",
                      x.content_type);
        parse_stream(x.buf, false, &seq[i]);
        xfer_free(&x);
        ck_assert_msg(seq[i].done_marker && seq[i].finish[0][0] && seq[i].usage_completion > 0,
                      "sequential stream %d incomplete (done=%d finish='%s' usage=%d)", i, seq[i].done_marker,
                      seq[i].finish[0], seq[i].usage_completion);
    }
    t_seq = now_s() - t_seq;
    /* All 64 at once. */
    static xfer xs[N];
    for (int i = 0; i < N; i++)
        xfer_init(&xs[i], s.port, "POST", "/v1/completions", bodies[i]);
    double t0 = now_s();
    run_multi(xs, N, NULL, NULL);
    double secs = now_s() - t0;
    int differ = 0;
    for (int i = 0; i < N; i++) {
        ck_assert_msg(xs[i].res == CURLE_OK && xs[i].code == 200, "concurrent request %d: curl %d HTTP %ld",
                      i, (int)xs[i].res, xs[i].code);
        parse_stream(xs[i].buf, false, &con[i]);
        ck_assert_msg(con[i].done_marker, "concurrent stream %d has no [DONE]", i);
        if (strcmp(con[i].text[0], seq[i].text[0]) || strcmp(con[i].finish[0], seq[i].finish[0]) ||
            con[i].usage_completion != seq[i].usage_completion) {
            if (!differ++)
                fprintf(stderr, "request %d differs:\n  alone:   [%s] %s %d\n  batched: [%s] %s %d\n", i,
                        seq[i].text[0], seq[i].finish[0], seq[i].usage_completion, con[i].text[0],
                        con[i].finish[0], con[i].usage_completion);
        }
        xfer_free(&xs[i]);
    }
    ck_assert_msg(differ == 0, "%d of %d concurrent greedy streams differ from their sequential runs", differ,
                  N);
    fprintf(stderr, "test_server: 64 streams one at a time in %.2f s, all at once in %.2f s\n", t_seq, secs);
    /* Batching happened: some step ran more than one sequence. */
    double steps = scrape(s.port, "duet_batch_size_count", ""),
           seqs = scrape(s.port, "duet_batch_size_sum", "");
    ck_assert_msg(seqs > steps, "no step had more than one sequence (%g sequences in %g steps)", seqs, steps);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

START_TEST(completions_stop_n_usage_and_chat) {
    server s;
    server_start(&s, "features", NULL);
    xfer x;
    /* The plain greedy text, then the same with a stop string from its middle. */
    long code = http(s.port, "POST", "/v1/completions",
                     "{\"prompt\":\"Once upon a time\",\"max_tokens\":40,\"temperature\":0}", &x);
    ck_assert_msg(code == 200, "HTTP %ld %s", code, x.buf);
    ck_assert_msg(strstr(x.content_type, "application/json") != NULL, "content type '%s'", x.content_type);
    cJSON *full = cJSON_Parse(x.buf);
    xfer_free(&x);
    const char *text = choice_text(full, 0, false);
    ck_assert_msg(text && strlen(text) > 20, "greedy text too short: %s", text ? text : "(none)");
    ck_assert_int_eq(usage_of(full, "completion_tokens"), 40);
    ck_assert_str_eq(choice_finish(full, 0), "length");
    ck_assert_msg(usage_of(full, "prompt_tokens") > 0 &&
                      usage_of(full, "total_tokens") == usage_of(full, "prompt_tokens") + 40,
                  "usage totals");
    /* Stop at a word two thirds in. */
    const char *cut = text + strlen(text) * 2 / 3;
    while (*cut && *cut != ' ')
        cut++;
    char stop[16] = "";
    snprintf(stop, sizeof stop, "%.*s", (int)(strcspn(cut + 1, " ") + 1), cut);
    ck_assert_msg(strlen(stop) >= 2, "no word to stop at in: %s", text);
    size_t prefix = (size_t)(strstr(text, stop) - text);
    char body[512];
    for (int stream = 0; stream < 2; stream++) {
        /* Built with cJSON: the stop word may hold quotes. */
        cJSON *req = cJSON_CreateObject();
        cJSON_AddStringToObject(req, "prompt", "Once upon a time");
        cJSON_AddNumberToObject(req, "max_tokens", 40);
        cJSON_AddNumberToObject(req, "temperature", 0);
        cJSON *stops = cJSON_AddArrayToObject(req, "stop");
        cJSON_AddItemToArray(stops, cJSON_CreateString("zzz"));
        cJSON_AddItemToArray(stops, cJSON_CreateString(stop));
        cJSON_AddBoolToObject(req, "stream", stream);
        char *js = cJSON_PrintUnformatted(req);
        snprintf(body, sizeof body, "%s", js);
        cJSON_free(js);
        cJSON_Delete(req);
        code = http(s.port, "POST", "/v1/completions", body, &x);
        ck_assert_msg(code == 200, "stop request: HTTP %ld %s", code, x.buf);
        const char *got, *finish;
        cJSON *o = NULL;
        stream_result sr;
        if (stream) {
            parse_stream(x.buf, false, &sr);
            got = sr.text[0];
            finish = sr.finish[0];
        } else {
            o = cJSON_Parse(x.buf);
            got = choice_text(o, 0, false);
            finish = choice_finish(o, 0);
            ck_assert_msg(usage_of(o, "completion_tokens") < 40, "stopped early, yet %d tokens counted",
                          usage_of(o, "completion_tokens"));
        }
        ck_assert_msg(strlen(got) == prefix && !strncmp(got, text, prefix),
                      "stop '%s' (stream=%d): got [%s], want the first %zu bytes of [%s]", stop, stream, got,
                      prefix, text);
        ck_assert_msg(!strcmp(finish, "stop"), "finish_reason '%s' after a stop string", finish);
        cJSON_Delete(o);
        xfer_free(&x);
    }
    cJSON_Delete(full);

    /* n choices with a seed: reproducible, indexed, and the stream agrees. */
    const char *nb = "{\"prompt\":\"The cat\",\"max_tokens\":16,\"temperature\":1.0,\"seed\":7,\"n\":3}";
    code = http(s.port, "POST", "/v1/completions", nb, &x);
    cJSON *a = cJSON_Parse(x.buf);
    xfer_free(&x);
    http(s.port, "POST", "/v1/completions", nb, &x);
    cJSON *b = cJSON_Parse(x.buf);
    xfer_free(&x);
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(a, "choices")), 3);
    int distinct = 0;
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(
            cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(a, "choices"), i), "index")->valueint,
            i);
        ck_assert_msg(!strcmp(choice_text(a, i, false), choice_text(b, i, false)),
                      "seeded choice %d not reproducible", i);
        if (i && strcmp(choice_text(a, i, false), choice_text(a, 0, false))) distinct++;
    }
    ck_assert_msg(distinct > 0, "n=3 sampled choices are all identical: the seed is not varied per choice");
    code = http(
        s.port, "POST", "/v1/completions",
        "{\"prompt\":\"The cat\",\"max_tokens\":16,\"temperature\":1.0,\"seed\":7,\"n\":3,\"stream\":true,"
        "\"stream_options\":{\"include_usage\":true}}",
        &x);
    stream_result sr;
    parse_stream(x.buf, false, &sr);
    xfer_free(&x);
    for (int i = 0; i < 3; i++)
        ck_assert_msg(!strcmp(sr.text[i], choice_text(a, i, false)), "streamed choice %d [%s] != [%s]", i,
                      sr.text[i], choice_text(a, i, false));
    ck_assert_int_eq(sr.usage_completion, usage_of(a, "completion_tokens"));
    ck_assert_int_eq(sr.usage_prompt, usage_of(a, "prompt_tokens"));
    cJSON_Delete(a);
    cJSON_Delete(b);

    /* Chat: the template-rendered prompt; streamed equals non-streamed. */
    const char *cb =
        "{\"messages\":[{\"role\":\"system\",\"content\":\"Tell stories.\"},{\"role\":\"user\","
        "\"content\":\"A story about a dog\"}],\"max_completion_tokens\":20,\"temperature\":0%s}";
    snprintf(body, sizeof body, cb, "");
    code = http(s.port, "POST", "/v1/chat/completions", body, &x);
    ck_assert_msg(code == 200, "chat: HTTP %ld %s", code, x.buf);
    cJSON *chat = cJSON_Parse(x.buf);
    xfer_free(&x);
    ck_assert_str_eq(cJSON_GetObjectItem(chat, "object")->valuestring, "chat.completion");
    ck_assert_msg(!strncmp(cJSON_GetObjectItem(chat, "id")->valuestring, "chatcmpl-", 9), "chat id prefix");
    snprintf(body, sizeof body, cb, ",\"stream\":true");
    http(s.port, "POST", "/v1/chat/completions", body, &x);
    parse_stream(x.buf, true, &sr);
    xfer_free(&x);
    ck_assert_msg(!strcmp(sr.text[0], choice_text(chat, 0, true)), "chat stream [%s] != [%s]", sr.text[0],
                  choice_text(chat, 0, true));
    ck_assert_msg(!strcmp(sr.finish[0], choice_finish(chat, 0)), "chat finish reasons differ");
    cJSON_Delete(chat);

    /* Several prompts in one completion request: choices in prompt order. */
    code = http(s.port, "POST", "/v1/completions",
                "{\"prompt\":[\"The sun\",\"One day\"],\"max_tokens\":8,\"temperature\":0,\"n\":2}", &x);
    cJSON *mp = cJSON_Parse(x.buf);
    xfer_free(&x);
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(mp, "choices")), 4);
    ck_assert_msg(!strcmp(choice_text(mp, 0, false), choice_text(mp, 1, false)) &&
                      strcmp(choice_text(mp, 1, false), choice_text(mp, 2, false)),
                  "greedy n=2 choices of one prompt must agree and differ from the next prompt's");
    cJSON_Delete(mp);

    /* The model list. */
    code = http(s.port, "GET", "/v1/models", NULL, &x);
    cJSON *ml = cJSON_Parse(x.buf);
    ck_assert_msg(code == 200 && !strcmp(cJSON_GetObjectItem(
                                             cJSON_GetArrayItem(cJSON_GetObjectItem(ml, "data"), 0), "id")
                                             ->valuestring,
                                         "stories260K"),
                  "/v1/models: %s", x.buf);
    cJSON_Delete(ml);
    xfer_free(&x);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

START_TEST(malformed_requests_get_400) {
    server s;
    server_start(&s, "malformed", NULL);
    /* A prompt longer than the 1024-token context. */
    static char huge[64 * 1024];
    strcpy(huge, "{\"prompt\":\"");
    for (int i = 0; i < 3000; i++)
        strcat(huge, "dog ");
    strcat(huge, "\"}");
    static const struct {
        const char *method, *path, *body, *param, *code;
        long http;
    } cases[] = {
        {"POST", "/v1/completions", "{\"prompt\": \"x\",", "", "invalid_json", 400},
        {"POST", "/v1/completions", "not json at all", "", "invalid_json", 400},
        {"POST", "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":\"lots\"}", "max_tokens",
         "invalid_type", 400},
        {"POST", "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":-3}", "max_tokens", "invalid_value",
         400},
        {"POST", "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":5000}", "max_tokens",
         "context_length_exceeded", 400},
        {"POST", "/v1/completions", "{\"prompt\":\"x\",\"temperature\":1e400}", "temperature",
         "invalid_value", 400},
        {"POST", "/v1/completions", "{\"prompt\":\"x\",\"top_p\":0}", "top_p", "invalid_value", 400},
        {"POST", "/v1/completions", "{\"prompt\":\"x\",\"n\":100}", "n", "invalid_value", 400},
        {"POST", "/v1/completions", "{\"prompt\":\"x\",\"model\":\"gpt-5\"}", "model", "model_not_found",
         404},
        {"POST", "/v1/completions", huge, "prompt", "context_length_exceeded", 400},
        {"POST", "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\"}],\"stream\":1}", "stream",
         "invalid_type", 400},
        {"POST", "/v1/chat/completions", "{\"messages\":{}}", "messages", "invalid_type", 400},
        {"GET", "/v1/completions", NULL, "", "method_not_allowed", 405},
        {"POST", "/v1/nothing", "{}", "", "not_found", 404},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        xfer x;
        long code = http(s.port, cases[i].method, cases[i].path, cases[i].body, &x);
        ck_assert_msg(code == cases[i].http, "case %zu (%s %s): HTTP %ld, want %ld: %s", i, cases[i].method,
                      cases[i].path, code, cases[i].http, x.buf ? x.buf : "");
        cJSON *o = cJSON_Parse(x.buf), *e = cJSON_GetObjectItem(o, "error");
        ck_assert_msg(cJSON_IsObject(e), "case %zu: no error object in %s", i, x.buf);
        cJSON *msg = cJSON_GetObjectItem(e, "message"), *ty = cJSON_GetObjectItem(e, "type"),
              *param = cJSON_GetObjectItem(e, "param"), *cd = cJSON_GetObjectItem(e, "code");
        ck_assert_msg(cJSON_IsString(msg) && msg->valuestring[0], "case %zu: no message", i);
        ck_assert_msg(cJSON_IsString(ty) && !strcmp(ty->valuestring, "invalid_request_error"),
                      "case %zu: type", i);
        const char *pv = cJSON_IsString(param) ? param->valuestring : "";
        ck_assert_msg(param && !strcmp(pv, cases[i].param), "case %zu: param '%s', want '%s'", i, pv,
                      cases[i].param);
        ck_assert_msg(cJSON_IsString(cd) && !strcmp(cd->valuestring, cases[i].code),
                      "case %zu: code %s, want %s", i, cJSON_IsString(cd) ? cd->valuestring : "null",
                      cases[i].code);
        cJSON_Delete(o);
        xfer_free(&x);
    }
    /* Deep nesting: cJSON's depth limit, on a connection thread's stack. */
    static char deep[8192];
    strcpy(deep, "{\"prompt\":");
    for (int i = 0; i < 990; i++)
        strcat(deep, "[");
    for (int i = 0; i < 990; i++)
        strcat(deep, "]");
    strcat(deep, "}");
    for (int k = 0; k < 2; k++) {
        xfer x;
        long code = http(s.port, "POST", "/v1/completions",
                         k ? "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[" : deep, &x);
        ck_assert_msg(code == 400 && strstr(x.buf, "\"error\""), "deeply nested JSON #%d: HTTP %ld", k, code);
        xfer_free(&x);
    }
    /* The server is unharmed: a good request still works. */
    xfer x;
    ck_assert_int_eq(http(s.port, "POST", "/v1/completions", "{\"prompt\":\"The dog\",\"max_tokens\":4}", &x),
                     200);
    xfer_free(&x);
    ck_assert_msg(scrape(s.port, "duet_http_requests_total", "path=\"/v1/completions\",code=\"400\"") >= 11,
                  "400s are not counted in duet_http_requests_total");
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

START_TEST(disconnects_free_their_blocks) {
    server s;
    server_start(&s, "disconnect", NULL);
    const char *long_stream = "{\"prompt\":\"Once upon a time\",\"max_tokens\":1000,\"ignore_eos\":true,"
                              "\"temperature\":0,\"stream\":true}";
    /* 16 choices of 1000 tokens: enough work that no backend finishes it
     * before the client's 100 ms timeout. */
    const char *long_plain =
        "{\"prompt\":\"The dog\",\"max_tokens\":1000,\"n\":16,\"ignore_eos\":true,\"temperature\":0}";
    enum { PLAIN_N = 16 };
    double gen0 = scrape(s.port, "vllm:generation_tokens_total", "");
    enum { N = 5 };
    xfer xs[N];
    for (int i = 0; i < N - 1; i++) {
        xfer_init(&xs[i], s.port, "POST", "/v1/completions", long_stream);
        xs[i].abort_after = 600; /* a few chunks, then hang up */
    }
    /* A non-streamed request whose client gives up after 100 ms. */
    xfer_init(&xs[N - 1], s.port, "POST", "/v1/completions", long_plain);
    curl_easy_setopt(xs[N - 1].h, CURLOPT_TIMEOUT_MS, 100L);
    run_multi(xs, N, NULL, NULL);
    for (int i = 0; i < N; i++) {
        ck_assert_msg(xs[i].res != CURLE_OK, "transfer %d was not cut short (HTTP %ld: %.200s)", i,
                      xs[i].code, xs[i].buf ? xs[i].buf : "");
        xfer_free(&xs[i]);
    }
    /* Every sequence ends and its KV blocks return. */
    double running = await_metric(s.port, "vllm:num_requests_running", "", 0, 10);
    double kv = await_metric(s.port, "vllm:kv_cache_usage_perc", "", 0, 10);
    const int n_engine = N - 1 + PLAIN_N; /* engine requests: one per choice */
    double cancelled = await_metric(s.port, "duet_requests_total", "status=\"cancelled\"", n_engine, 10);
    ck_assert_msg(running == 0, "%g requests still running after their clients left", running);
    ck_assert_msg(kv == 0, "KV cache usage %g after every client left; want 0", kv);
    ck_assert_msg(cancelled == n_engine, "%g cancelled requests, want %d", cancelled, n_engine);
    /* They stopped early: far fewer tokens than were asked for. */
    double gen = scrape(s.port, "vllm:generation_tokens_total", "") - gen0;
    ck_assert_msg(gen < ((N - 1) * 1000 + PLAIN_N * 1000) / 2,
                  "%g tokens generated for disconnected clients; cancellation came too late", gen);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

START_TEST(overload_gets_429) {
    server s;
    const char *args[] = {"--max-batch-seqs", "1", "--max-waiting", "1", NULL};
    server_start(&s, "overload", args);
    enum { N = 12 };
    xfer xs[N];
    for (int i = 0; i < N; i++)
        xfer_init(&xs[i], s.port, "POST", "/v1/completions",
                  "{\"prompt\":\"The cat\",\"max_tokens\":300,\"ignore_eos\":true,\"temperature\":0}");
    run_multi(xs, N, NULL, NULL);
    int ok = 0, busy = 0;
    for (int i = 0; i < N; i++) {
        if (xs[i].code == 200) ok++;
        if (xs[i].code == 429) {
            busy++;
            ck_assert_msg(xs[i].retry_after[0] && atoi(xs[i].retry_after) >= 1, "429 without Retry-After");
            cJSON *o = cJSON_Parse(xs[i].buf);
            cJSON *e = cJSON_GetObjectItem(o, "error");
            ck_assert_msg(cJSON_IsString(cJSON_GetObjectItem(e, "message")) && cJSON_HasObjectItem(e, "type"),
                          "429 body is not an error object: %s", xs[i].buf);
            cJSON_Delete(o);
        }
        ck_assert_msg(xs[i].code == 200 || xs[i].code == 429, "request %d: HTTP %ld %s", i, xs[i].code,
                      xs[i].buf);
        xfer_free(&xs[i]);
    }
    /* How many are served depends on timing (the first may still be waiting
     * when the second arrives); some must be served and some refused. */
    ck_assert_msg(ok >= 1 && busy >= 1 && ok <= N - 1, "%d served and %d refused; want both", ok, busy);
    double rejected = scrape(s.port, "duet_requests_total", "status=\"rejected\"");
    ck_assert_msg(rejected == busy, "duet_requests_total{status=rejected} %g, want %d", rejected, busy);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

START_TEST(metrics_are_prometheus_text) {
    server s;
    const char *args[] = {"--served-model-name", "tiny-stories", NULL};
    server_start(&s, "metrics", args);
    xfer x;
    ck_assert_int_eq(http(s.port, "POST", "/v1/completions",
                          "{\"prompt\":\"The sun\",\"max_tokens\":12,\"temperature\":0,"
                          "\"ignore_eos\":true,\"priority\":\"batch\"}",
                          &x),
                     200);
    xfer_free(&x);
    ck_assert_int_eq(http(s.port, "GET", "/metrics", NULL, &x), 200);
    ck_assert_msg(strstr(x.content_type, "text/plain") && strstr(x.content_type, "version=0.0.4"),
                  "/metrics content type '%s'", x.content_type);
    prom_doc d;
    char err[256];
    ck_assert_msg(prom_parse(x.buf, &d, err, sizeof err), "/metrics breaks the format: %s", err);
    static const char *const families[] = {"vllm:num_requests_running",
                                           "vllm:num_requests_waiting",
                                           "vllm:kv_cache_usage_perc",
                                           "vllm:time_to_first_token_seconds",
                                           "vllm:inter_token_latency_seconds",
                                           "vllm:e2e_request_latency_seconds",
                                           "vllm:request_queue_time_seconds",
                                           "vllm:prompt_tokens_total",
                                           "vllm:generation_tokens_total",
                                           "vllm:request_success_total",
                                           "duet_batch_size",
                                           "duet_batch_tokens",
                                           "duet_device_busy_ratio",
                                           "duet_requests_waiting",
                                           "duet_max_batch_seqs",
                                           "duet_http_requests_total"};
    for (size_t i = 0; i < sizeof families / sizeof *families; i++)
        ck_assert_msg(prom_type(&d, families[i])[0], "/metrics lacks the family %s", families[i]);
    double v;
    prom_sum(&d, "duet_requests_total", "priority=\"batch\",status=\"length\"", &v);
    ck_assert_msg(v == 1, "the batch-priority request is not counted (%g)", v);
    prom_sum(&d, "vllm:generation_tokens_total", "", &v);
    ck_assert_msg(v == 12, "generation tokens %g, want 12", v);
    /* The engine's metrics name the model as the API does (--served-model-name). */
    prom_sum(&d, "vllm:generation_tokens_total", "model_name=\"tiny-stories\"", &v);
    ck_assert_msg(v == 12, "generation tokens labelled model_name=\"tiny-stories\": %g, want 12", v);
    ck_assert_msg(prom_sum(&d, "vllm:num_requests_running", "model_name=\"tiny-stories\"", &v) == 1,
                  "vllm:num_requests_running is not labelled with the served name");
    prom_free(&d);
    xfer_free(&x);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

static int run_serve(const char *const *args, char *out, size_t size);

/* --draft: the server speculates with a draft model (stories260K drafting
 * for itself, so every greedy draft is kept) and says so in the vLLM
 * metrics; the completion equals the one without speculation. A draft
 * with another vocabulary stops the server at start-up, by name. */
START_TEST(draft_model_speculates) {
    const char *body =
        "{\"prompt\":\"Once upon a time\",\"max_tokens\":24,\"temperature\":0,\"ignore_eos\":true}";
    server s;
    server_start(&s, "nodraft", NULL);
    xfer plain;
    ck_assert_int_eq(http(s.port, "POST", "/v1/completions", body, &plain), 200);
    ck_assert_int_eq(server_stop(&s, 60), 0);
    const char *args[] = {"--draft", test_shared_path("models/stories260K.gguf"), "--spec-max-batch", "-1",
                          NULL};
    server_start(&s, "draft", args);
    xfer x;
    ck_assert_int_eq(http(s.port, "POST", "/v1/completions", body, &x), 200);
    const char *a = strstr(plain.buf, "\"text\""), *b = strstr(x.buf, "\"text\"");
    ck_assert_msg(a && b && !strncmp(a, b, strcspn(a, "}")), "with a draft: %s\nwithout: %s", x.buf,
                  plain.buf);
    double drafted = scrape(s.port, "vllm:spec_decode_num_draft_tokens_total", "");
    ck_assert_msg(drafted > 0, "no draft tokens counted");
    ck_assert_double_eq(scrape(s.port, "vllm:spec_decode_num_accepted_tokens_total", ""), drafted);
    ck_assert_msg(scrape(s.port, "vllm:spec_decode_num_drafts_total", "") > 0, "no drafts counted");
    xfer_free(&x), xfer_free(&plain);
    ck_assert_int_eq(server_stop(&s, 60), 0);
    char out[4096];
    const char *bad[] = {"-m",      test_shared_path("models/stories260K.gguf"),
                         "--draft", test_shared_path("models/smollm2-135m-instruct-q4_k_m.gguf"),
                         "--port",  "0",
                         NULL};
    ck_assert_msg(run_serve(bad, out, sizeof out) != 0 && strstr(out, "vocabulary"),
                  "a draft with another vocabulary must stop the server: %s", out);
}
END_TEST

/* Runs `duet serve ARGS...` to completion (for option errors); returns
 * the exit code and leaves its stderr in out. */
static int run_serve(const char *const *args, char *out, size_t size) {
    char log[512];
    snprintf(log, sizeof log, "%s/test_server_opts_%d.log", DUET_BINARY_DIR, (int)getpid());
    const char *argv[32] = {duet_binary(), "serve"};
    int argc = 2;
    for (int i = 0; args[i]; i++)
        argv[argc++] = args[i];
    argv[argc] = NULL;
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    char *t = test_read_file(log, NULL);
    snprintf(out, size, "%s", t ? t : "");
    free(t);
    unlink(log);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

START_TEST(config_file_and_command_line_knobs) {
    char cfg[512], out[16384]; /* --help is longer than 4 KiB */
    snprintf(cfg, sizeof cfg, "%s/test_server_config_%d.json", DUET_BINARY_DIR, (int)getpid());
    FILE *f = fopen(cfg, "w");
    fprintf(f, "{\"max_batch_seqs\": 2, \"prefill-chunk\": 64, \"batch_timeout_ms\": 5, \"max_waiting\": 7,"
               " \"served_model_name\": \"tiny-stories\", \"verbose\": true}");
    fclose(f);
    /* The file sets the knobs; the command line overrides one of them. */
    server s;
    const char *args[] = {"--config", cfg, "--max-batch-seqs", "3", NULL};
    server_start(&s, "config", args);
    ck_assert_msg(scrape(s.port, "duet_max_batch_seqs", "") == 3,
                  "the command line must override the config file");
    ck_assert_msg(scrape(s.port, "duet_prefill_chunk", "") == 64, "prefill_chunk from the config file");
    ck_assert_msg(scrape(s.port, "duet_batch_timeout_seconds", "") == 0.005,
                  "batch_timeout_ms from the config file");
    xfer x;
    ck_assert_int_eq(http(s.port, "POST", "/v1/completions",
                          "{\"model\":\"tiny-stories\",\"prompt\":\"x\",\"max_tokens\":2}", &x),
                     200);
    xfer_free(&x);
    ck_assert_int_eq(server_stop(&s, 60), 0);

    /* Mistakes are refused before anything starts, with exit code 2. */
    f = fopen(cfg, "w");
    fprintf(f, "{\"max_batch_seqs\": 2, \"max_bach_tokens\": 64}");
    fclose(f);
    const char *typo[] = {"-m", test_shared_path("models/stories260K.gguf"), "--config", cfg, NULL};
    ck_assert_msg(run_serve(typo, out, sizeof out) == 2 && strstr(out, "max_bach_tokens"),
                  "an unknown config key must be refused by name: %s", out);
    f = fopen(cfg, "w");
    fprintf(f, "{\"max_batch_seqs\": \"many\"}");
    fclose(f);
    ck_assert_msg(run_serve(typo, out, sizeof out) == 2, "a non-numeric knob must be refused: %s", out);
    const char *bad_flag[] = {"-m", test_shared_path("models/stories260K.gguf"), "--max-batch-seqs", "0",
                              NULL};
    ck_assert_msg(run_serve(bad_flag, out, sizeof out) == 2, "--max-batch-seqs 0 must be refused: %s", out);
    const char *help[] = {"--help", NULL};
    ck_assert_msg(run_serve(help, out, sizeof out) == 0 && strstr(out, "--max-batch-tokens") &&
                      strstr(out, "--config"),
                  "--help: %s", out);
    unlink(cfg);
}
END_TEST

static int tcp_connect(int port);

/* GET /ready on an open connection (kept alive): the response, or "" when
 * none came within 2 s. */
static void ready_on(int fd, char *buf, size_t cap) {
    static const char req[] = "GET /ready HTTP/1.1\r\nHost: x\r\n\r\n";
    size_t len = 0;
    buf[0] = 0;
    if (fd < 0 || send(fd, req, sizeof req - 1, MSG_NOSIGNAL) != (ssize_t)(sizeof req - 1)) return;
    struct timeval tv = {0, 100000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    for (double t0 = now_s(); now_s() - t0 < 2 && len + 1 < cap;) {
        ssize_t n = recv(fd, buf + len, cap - 1 - len, 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return;
        if (n > 0) buf[len += (size_t)n] = 0;
        const char *body = strstr(buf, "\r\n\r\n");
        if (body && strchr(body, '}')) return;
    }
}

typedef struct drain_state {
    server *s;
    xfer *xs;
    int n;
    bool signalled;
    double t_signal;
    bool probe_ready; /* ask /ready on a connection opened before the signal */
    int ready_fd;
    char ready_before[512], ready_after[512]; /* its answers before the signal and during the drain */
    bool ready_probed;
    long late_code;
    CURLcode late_res;
    bool probed;
} drain_state;

/* Once every stream has data, SIGTERM; a little later, try a new request. */
static void drain_tick(void *arg) {
    drain_state *st = arg;
    if (!st->signalled) {
        for (int i = 0; i < st->n; i++)
            if (st->xs[i].len < 200) return;
        if (st->probe_ready) {
            st->ready_fd = tcp_connect(st->s->port);
            ready_on(st->ready_fd, st->ready_before, sizeof st->ready_before);
        }
        kill(st->s->pid, SIGTERM);
        st->signalled = true;
        st->t_signal = now_s();
    } else if (st->probe_ready && !st->ready_probed && now_s() - st->t_signal > 0.05) {
        ready_on(st->ready_fd, st->ready_after, sizeof st->ready_after);
        /* A loaded machine may not have run the signal thread yet: ask again. */
        st->ready_probed = strncmp(st->ready_after, "HTTP/1.1 200", 12) || now_s() - st->t_signal > 5;
    } else if (!st->probed && now_s() - st->t_signal > 0.3) {
        xfer x;
        xfer_init(&x, st->s->port, "GET", "/health", NULL);
        curl_easy_setopt(x.h, CURLOPT_TIMEOUT_MS, 2000L);
        st->late_res = curl_easy_perform(x.h);
        xfer_finish(&x);
        st->late_code = x.code;
        xfer_free(&x);
        st->probed = true;
    }
}

START_TEST(sigterm_drains_then_exits_0) {
    server s;
    server_start(&s, "drain", NULL);
    enum { N = 4 };
    xfer xs[N];
    for (int i = 0; i < N; i++)
        xfer_init(&xs[i], s.port, "POST", "/v1/completions",
                  "{\"prompt\":\"One "
                  "day\",\"max_tokens\":900,\"ignore_eos\":true,\"temperature\":0,\"stream\":true,"
                  "\"stream_options\":{\"include_usage\":true}}");
    drain_state st = {.s = &s, .xs = xs, .n = N, .probe_ready = true, .ready_fd = -1};
    run_multi(xs, N, drain_tick, &st);
    ck_assert_msg(st.signalled, "the streams never started");
    /* Readiness goes first: 200 before the signal, 503 on the same
     * connection as soon as the drain starts (new connections are refused). */
    if (st.ready_fd >= 0) close(st.ready_fd);
    ck_assert_msg(!strncmp(st.ready_before, "HTTP/1.1 200", 12) && strstr(st.ready_before, "\"ready\""),
                  "/ready before SIGTERM: %s", st.ready_before);
    ck_assert_msg(!strncmp(st.ready_after, "HTTP/1.1 503", 12) && strstr(st.ready_after, "\"draining\""),
                  "/ready during the drain: %s", st.ready_after);
    for (int i = 0; i < N; i++) {
        ck_assert_msg(xs[i].res == CURLE_OK && xs[i].code == 200, "stream %d: curl %d HTTP %ld", i,
                      (int)xs[i].res, xs[i].code);
        stream_result r;
        parse_stream(xs[i].buf, false, &r);
        ck_assert_msg(r.done_marker && !strcmp(r.finish[0], "length") && r.usage_completion == 900,
                      "stream %d cut by SIGTERM: done=%d finish='%s' tokens=%d", i, r.done_marker,
                      r.finish[0], r.usage_completion);
        xfer_free(&xs[i]);
    }
    /* New work was refused while draining: no connection, or 503. */
    ck_assert_msg(st.probed, "no request was tried during the drain");
    ck_assert_msg(st.late_res == CURLE_COULDNT_CONNECT || st.late_code == 503,
                  "a request during the drain got curl %d HTTP %ld", (int)st.late_res, st.late_code);
    int status = 0;
    for (double t0 = now_s(); now_s() - t0 < 30; sleep_ms(20))
        if (waitpid(s.pid, &status, WNOHANG) == s.pid) break;
    char *log = read_log(&s);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "duet serve did not exit 0 after draining:\n%s", log);
    ck_assert_msg(strstr(log, "duet: loaded in ") && strstr(log, "duet: ready in "),
                  "start-up did not report its progress:\n%s", log);
    free(log);
    unlink(s.log);
}
END_TEST

/* A request ended by a stop string is counted as "stop", once, by the
 * engine (it used to be cancelled from the HTTP layer and counted as
 * "cancelled" / "abort"), streamed or not, and its text ends before the
 * stop string. */
START_TEST(stop_strings_count_as_stop) {
    server s;
    server_start(&s, "stop_count", NULL);
    xfer x;
    const char *plain =
        "{\"prompt\":\"Once upon a time\",\"max_tokens\":48,\"temperature\":0,\"ignore_eos\":true}";
    ck_assert_int_eq(http(s.port, "POST", "/v1/completions", plain, &x), 200);
    cJSON *o = cJSON_Parse(x.buf);
    const char *text =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0), "text")->valuestring;
    ck_assert_msg(strlen(text) > 24, "greedy text too short: '%s'", text);
    /* A stop string taken from the text itself: it must hit. */
    char stop[8], want[64];
    snprintf(stop, sizeof stop, "%.5s", text + 16);
    const char *first = strstr(text, stop);
    snprintf(want, sizeof want, "%.*s", (int)(first - text), text);
    cJSON_Delete(o);
    xfer_free(&x);
    for (int streamed = 0; streamed < 2; streamed++) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"prompt\":\"Once upon a time\",\"max_tokens\":48,\"temperature\":0,\"ignore_eos\":true,"
                 "\"stop\":[\"%s\"],\"stream\":%s}",
                 stop, streamed ? "true" : "false");
        ck_assert_int_eq(http(s.port, "POST", "/v1/completions", body, &x), 200);
        if (streamed) {
            stream_result r;
            parse_stream(x.buf, false, &r);
            ck_assert_msg(r.done_marker && !strcmp(r.finish[0], "stop") && !strcmp(r.text[0], want),
                          "streamed with stop '%s': finish '%s' text '%s', want '%s'", stop, r.finish[0],
                          r.text[0], want);
        } else {
            o = cJSON_Parse(x.buf);
            cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
            ck_assert_msg(!strcmp(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "stop") &&
                              !strcmp(cJSON_GetObjectItem(c, "text")->valuestring, want),
                          "stop '%s': %s, want text '%s'", stop, x.buf, want);
            cJSON_Delete(o);
        }
        xfer_free(&x);
    }
    /* One request ran to its length, two ended on the stop string; none was cancelled. */
    ck_assert_int_eq((int)await_metric(s.port, "duet_requests_total", "status=\"stop\"", 2, 10), 2);
    ck_assert_int_eq((int)scrape(s.port, "duet_requests_total", "status=\"length\""), 1);
    ck_assert_int_eq((int)scrape(s.port, "duet_requests_total", "status=\"cancelled\""), 0);
    ck_assert_int_eq((int)scrape(s.port, "vllm:request_success_total", "finished_reason=\"stop\""), 2);
    ck_assert_int_eq((int)scrape(s.port, "vllm:request_success_total", "finished_reason=\"abort\""), 0);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

/* A KV pool smaller than one context (--kv-blocks): a request without
 * max_tokens gets its default clamped to what the pool can hold, and one
 * asking for more than that gets a 400 naming the real limit. */
START_TEST(default_max_tokens_fits_a_small_pool) {
    server s;
    const char *args[] = {"--kv-blocks", "4", NULL}; /* 4 blocks of 16: 64 tokens */
    server_start(&s, "small_pool", args);
    xfer x;
    ck_assert_int_eq(http(s.port, "GET", "/v1/models", NULL, &x), 200);
    ck_assert_msg(strstr(x.buf, "\"max_model_len\":64"), "/v1/models: %s", x.buf);
    xfer_free(&x);
    long code = http(
        s.port, "POST", "/v1/chat/completions",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"temperature\":0,\"ignore_eos\":true}", &x);
    ck_assert_msg(code == 200, "chat without max_tokens on a 64-token pool: HTTP %ld %s", code, x.buf);
    cJSON *o = cJSON_Parse(x.buf), *u = cJSON_GetObjectItem(o, "usage");
    const int total = cJSON_GetObjectItem(u, "total_tokens")->valueint;
    ck_assert_msg(total == 64, "prompt + completion = %d tokens, want the pool's 64: %s", total, x.buf);
    cJSON_Delete(o);
    xfer_free(&x);
    code = http(s.port, "POST", "/v1/completions", "{\"prompt\":\"Hi\",\"max_tokens\":100}", &x);
    ck_assert_msg(code == 400 && strstr(x.buf, "64"), "max_tokens past the pool: HTTP %ld %s", code, x.buf);
    xfer_free(&x);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

/* Streams still generating when --drain-timeout passes are cancelled: each
 * ends with its final event (finish_reason and [DONE]) at the deadline,
 * not cut off when the server closes its connections. A few fast streams
 * (tokens every few milliseconds) are the hard case: their connections
 * are never idle long enough to look at the server's state. Drain 0: the
 * deadline is the signal itself. */
START_TEST(drain_timeout_ends_every_stream) {
    server s;
    const char *args[] = {"--drain-timeout", "0", NULL};
    server_start(&s, "drain_deadline", args);
    enum { N = 4 };
    xfer xs[N];
    for (int i = 0; i < N; i++)
        xfer_init(&xs[i], s.port, "POST", "/v1/completions",
                  "{\"prompt\":\"One "
                  "day\",\"max_tokens\":1000,\"ignore_eos\":true,\"temperature\":0,\"stream\":true}");
    drain_state st = {.s = &s, .xs = xs, .n = N};
    run_multi(xs, N, drain_tick, &st);
    const double ended = now_s() - st.t_signal;
    ck_assert_msg(st.signalled, "the streams never started");
    int aborted = 0;
    for (int i = 0; i < N; i++) {
        ck_assert_msg(xs[i].res == CURLE_OK && xs[i].code == 200, "stream %d: curl %d HTTP %ld", i,
                      (int)xs[i].res, xs[i].code);
        stream_result r;
        parse_stream(xs[i].buf, false, &r);
        ck_assert_msg(r.done_marker && (!strcmp(r.finish[0], "abort") || !strcmp(r.finish[0], "length")),
                      "stream %d ended without its final event: done=%d finish='%s'", i, r.done_marker,
                      r.finish[0]);
        aborted += !strcmp(r.finish[0], "abort");
        xfer_free(&xs[i]);
    }
    /* The cancel takes one engine step. */
    ck_assert_msg(ended < 1.5, "the streams ended %.1f s after SIGTERM with --drain-timeout 0", ended);
    printf("drain: streams ended %.3f s after SIGTERM, %d of %d aborted\n", ended, aborted, N);
    ck_assert_msg(aborted > 0, "no stream was still running at the deadline: the test needs longer streams");
    int status = 0;
    for (double t0 = now_s(); now_s() - t0 < 30; sleep_ms(20))
        if (waitpid(s.pid, &status, WNOHANG) == s.pid) break;
    char *log = read_log(&s);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "duet serve did not exit 0:\n%s", log);
    free(log);
    unlink(s.log);
}
END_TEST

/* ======================= connections (hostile and idle clients) ========= */

/* A TCP connection to the server, or -1. */
static int tcp_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Reads what the server sends until it closes or `timeout_s` passes; the
 * bytes read (NUL-terminated) in buf, and whether the server closed. */
static bool read_until_close(int fd, char *buf, size_t cap, double timeout_s) {
    size_t len = 0;
    buf[0] = 0;
    struct timeval tv = {0, 100000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    for (double t0 = now_s(); now_s() - t0 < timeout_s;) {
        ssize_t n = recv(fd, buf + len, cap - 1 - len, 0);
        if (n == 0) return true;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return true; /* reset */
        if (n > 0) {
            len += (size_t)n;
            buf[len] = 0;
            if (len + 1 == cap) return false;
        }
    }
    return false;
}

/* Raises this process's open-file limit to hold `n` sockets. */
static void need_fds(rlim_t n) {
    struct rlimit rl;
    ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
    if (rl.rlim_cur >= n) return;
    ck_assert_msg(rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= n,
                  "the hard open-file limit %llu is below the %llu this test needs (ulimit -Hn)",
                  (unsigned long long)rl.rlim_max, (unsigned long long)n);
    rl.rlim_cur = n;
    ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &rl), 0);
}

/* 1100 idle connections (more than select() can watch) and a slowloris of
 * 200 more that send half a request each, all at default limits: a normal
 * completion still gets its answer. */
START_TEST(idle_and_slow_clients_do_not_lock_others_out) {
    enum { IDLE = 1100, SLOW = 200 };
    need_fds(IDLE + SLOW + 256);
    server s;
    server_start(&s, "crowd", NULL);
    static int fds[IDLE + SLOW];
    int opened = 0;
    for (int i = 0; i < IDLE + SLOW; i++) {
        fds[i] = tcp_connect(s.port);
        ck_assert_msg(fds[i] >= 0, "connection %d refused: %s", i, strerror(errno));
        opened++;
        if (i >= IDLE) {
            static const char half[] =
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro";
            ck_assert_int_eq(send(fds[i], half, sizeof half - 1, MSG_NOSIGNAL), (ssize_t)(sizeof half - 1));
        }
    }
    sleep_ms(500);
    xfer x;
    xfer_init(&x, s.port, "POST", "/v1/completions",
              "{\"prompt\":\"Once\",\"max_tokens\":4,\"temperature\":0}");
    curl_easy_setopt(x.h, CURLOPT_TIMEOUT, 60L);
    x.res = curl_easy_perform(x.h);
    xfer_finish(&x);
    ck_assert_msg(x.res == CURLE_OK && x.code == 200,
                  "with %d idle and %d slow connections open: %s, HTTP %ld %s", IDLE, SLOW,
                  curl_easy_strerror(x.res), x.code, x.buf ? x.buf : "");
    xfer_free(&x);
    for (int i = 0; i < opened; i++)
        close(fds[i]);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

/* Past --max-connections a request gets 503 (not silence), and the server
 * serves again once connections close. */
START_TEST(connection_cap_answers_503) {
    enum { CAP = 20 };
    server s;
    const char *args[] = {"--max-connections", "20", NULL};
    server_start(&s, "cap", args);
    int fds[CAP];
    for (int i = 0; i < CAP; i++)
        ck_assert_msg((fds[i] = tcp_connect(s.port)) >= 0, "connect %d", i);
    sleep_ms(300);
    int fd = tcp_connect(s.port);
    ck_assert_msg(fd >= 0, "connection %d refused outright", CAP + 1);
    static const char req[] = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
    ck_assert_int_eq(send(fd, req, sizeof req - 1, MSG_NOSIGNAL), (ssize_t)(sizeof req - 1));
    char buf[4096];
    bool closed = read_until_close(fd, buf, sizeof buf, 10);
    close(fd);
    ck_assert_msg(strncmp(buf, "HTTP/1.1 503", 12) == 0 && strstr(buf, "max-connections"),
                  "over the cap: want 503 naming --max-connections, got (closed %d): %.300s", closed, buf);
    for (int i = 0; i < CAP; i++)
        close(fds[i]);
    sleep_ms(300);
    xfer x;
    long code = http(s.port, "GET", "/v1/models", NULL, &x);
    ck_assert_msg(code == 200, "after the crowd left: HTTP %ld", code);
    xfer_free(&x);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

/* An idle connection is closed after --idle-timeout; so is one whose body
 * stops short of its Content-Length. */
START_TEST(idle_connections_time_out) {
    server s;
    const char *args[] = {"--idle-timeout", "1", NULL};
    server_start(&s, "idle", args);
    int quiet = tcp_connect(s.port), short_body = tcp_connect(s.port);
    ck_assert(quiet >= 0 && short_body >= 0);
    static const char half[] =
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro";
    ck_assert_int_eq(send(short_body, half, sizeof half - 1, MSG_NOSIGNAL), (ssize_t)(sizeof half - 1));
    char buf[1024];
    double t0 = now_s();
    ck_assert_msg(read_until_close(quiet, buf, sizeof buf, 10), "an idle connection stayed open 10 s");
    ck_assert_msg(read_until_close(short_body, buf, sizeof buf, 10), "a short body held its connection 10 s");
    ck_assert_msg(now_s() - t0 < 8, "closed only after %.1f s", now_s() - t0);
    close(quiet), close(short_body);
    ck_assert_int_eq(server_stop(&s, 60), 0);

    /* A request in work is not idle: with one slot and SmolLM2 (tens of
     * tokens a second), the second and third requests wait seconds before
     * their first byte, past the 1 s idle timeout, and must still be
     * answered whole (libmicrohttpd used to cut them: "partial file"). */
    const char *slow[] = {"--idle-timeout",
                          "1",
                          "--max-batch-seqs",
                          "1",
                          "--threads",
                          "1",
                          "-m",
                          test_shared_path("models/smollm2-135m-instruct-q4_k_m.gguf"),
                          NULL};
    server_start(&s, "idle-queued", slow);
    const char *stream =
        "{\"prompt\":\"Once upon a time\",\"max_tokens\":60,\"ignore_eos\":true,\"stream\":true}";
    const char *plain = "{\"prompt\":\"Once upon a time\",\"max_tokens\":60,\"ignore_eos\":true}";
    static xfer xs[3];
    const char *bodies[3] = {stream, stream, plain};
    for (int i = 0; i < 3; i++)
        xfer_init(&xs[i], s.port, "POST", "/v1/completions", bodies[i]);
    t0 = now_s();
    run_multi(xs, 3, NULL, NULL);
    double secs = now_s() - t0;
    for (int i = 0; i < 3; i++) {
        ck_assert_msg(xs[i].res == CURLE_OK && xs[i].code == 200, "queued request %d: curl %d HTTP %ld", i,
                      (int)xs[i].res, xs[i].code);
        if (bodies[i] == stream) {
            stream_result r;
            parse_stream(xs[i].buf, false, &r);
            ck_assert_msg(r.done_marker && !strcmp(r.finish[0], "length"),
                          "queued stream %d: done %d finish '%s'", i, r.done_marker, r.finish[0]);
        } else {
            ck_assert_msg(strstr(xs[i].buf, "\"finish_reason\":\"length\""), "queued answer: %s", xs[i].buf);
        }
        xfer_free(&xs[i]);
    }
    fprintf(stderr, "idle timeout 1 s: three queued requests on one slot answered in %.1f s\n", secs);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

/* Two Content-Length headers that disagree get 400 (a proxy in front may
 * have framed the body by the other one), and the server keeps serving. */
START_TEST(conflicting_content_length_gets_400) {
    server s;
    server_start(&s, "smuggle", NULL);
    int fd = tcp_connect(s.port);
    ck_assert(fd >= 0);
    static const char req[] = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              "Content-Length: 29\r\nContent-Length: 30\r\nConnection: close\r\n\r\n"
                              "{\"prompt\":\"a\",\"max_tokens\":1} "; /* valid by either length */
    ck_assert_int_eq(send(fd, req, sizeof req - 1, MSG_NOSIGNAL), (ssize_t)(sizeof req - 1));
    char buf[4096];
    read_until_close(fd, buf, sizeof buf, 10);
    close(fd);
    ck_assert_msg(strncmp(buf, "HTTP/1.1 400", 12) == 0 && strstr(buf, "Content-Length headers"),
                  "conflicting Content-Length: want 400, got: %.300s", buf);
    xfer x;
    ck_assert_int_eq(http(s.port, "GET", "/health", NULL, &x), 200);
    xfer_free(&x);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

/* A second server on a port in use fails with a clear error instead of
 * sharing the port (SO_REUSEPORT) and taking part of the first's traffic. */
START_TEST(second_server_on_a_port_fails) {
    server a;
    server_start(&a, "first", NULL);
    char port[16], log[512];
    snprintf(port, sizeof port, "%d", a.port);
    snprintf(log, sizeof log, "%s/test_server_second_%d.log", DUET_BINARY_DIR, (int)getpid());
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1), dup2(fd, 2);
        execl(duet_binary(), duet_binary(), "serve", "-m", test_shared_path("models/stories260K.gguf"),
              "--backend", "cpu", "--port", port, "-c", "256", (char *)NULL);
        _exit(127);
    }
    int status = 0;
    bool exited = false;
    for (double t0 = now_s(); now_s() - t0 < 60 && !exited; sleep_ms(50))
        exited = waitpid(pid, &status, WNOHANG) == pid;
    if (!exited) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
    }
    char *text = test_read_file(log, NULL);
    ck_assert_msg(exited && WIFEXITED(status) && WEXITSTATUS(status) != 0,
                  "a second server on port %s started (exited %d):\n%s", port, exited, text ? text : "");
    ck_assert_msg(text && strstr(text, "cannot listen") && strstr(text, "in use"), "unclear error:\n%s",
                  text ? text : "");
    free(text);
    unlink(log);
    xfer x;
    ck_assert_int_eq(http(a.port, "GET", "/health", NULL, &x), 200);
    xfer_free(&x);
    ck_assert_int_eq(server_stop(&a, 60), 0);
}
END_TEST

/* ======================= hardening (issue: hostile clients, accounting) === */

/* Sends a raw request; with half_close, shuts the write side after it (the
 * client still reads). Returns what the server sent until it closed. */
static void raw_exchange(int port, const char *req, bool half_close, char *buf, size_t cap,
                         double timeout_s) {
    int fd = tcp_connect(port);
    ck_assert_msg(fd >= 0, "connect: %s", strerror(errno));
    size_t len = strlen(req);
    ck_assert_int_eq(send(fd, req, len, MSG_NOSIGNAL), (ssize_t)len);
    if (half_close) shutdown(fd, SHUT_WR);
    bool closed = read_until_close(fd, buf, cap, timeout_s);
    close(fd);
    ck_assert_msg(closed, "the server did not close within %.0f s; got: %.300s", timeout_s, buf);
}

/* A client that half-closes after sending its request (shutdown SHUT_WR,
 * as some HTTP/1.0 clients and scripts do) still gets the whole answer,
 * streamed or not; its request is not counted as cancelled. */
START_TEST(half_closed_clients_get_their_answer) {
    server s;
    server_start(&s, "half_close", NULL);
    static char buf[1 << 20];
    char req[1024];
    const char *bodies[2] = {
        "{\"prompt\":\"Once upon a time\",\"max_tokens\":900,\"ignore_eos\":true,\"temperature\":0}",
        "{\"prompt\":\"Once upon a "
        "time\",\"max_tokens\":900,\"ignore_eos\":true,\"temperature\":0,\"stream\":true}"};
    for (int streamed = 0; streamed < 2; streamed++) {
        snprintf(req, sizeof req,
                 "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: %zu\r\n\r\n%s",
                 strlen(bodies[streamed]), bodies[streamed]);
        raw_exchange(s.port, req, true, buf, sizeof buf, 120);
        ck_assert_msg(!strncmp(buf, "HTTP/1.1 200", 12), "half-closed client (stream %d): %.300s", streamed,
                      buf);
        if (streamed) {
            ck_assert_msg(strstr(buf, "data: [DONE]") && strstr(buf, "\"finish_reason\":\"length\""),
                          "the half-closed stream was cut: %.300s",
                          buf + (strlen(buf) > 300 ? strlen(buf) - 300 : 0));
        } else {
            const char *json = strstr(buf, "{\"id\"");
            ck_assert_msg(json, "no answer in: %.300s", buf);
            ck_assert_msg(strstr(json, "\"completion_tokens\":900") &&
                              strstr(json, "\"finish_reason\":\"length\""),
                          "the half-closed client's answer is not whole: %.400s", json);
        }
    }
    ck_assert_int_eq((int)await_metric(s.port, "duet_requests_total", "status=\"length\"", 2, 10), 2);
    ck_assert_int_eq((int)scrape(s.port, "duet_requests_total", "status=\"cancelled\""), 0);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

/* Sends one byte every 200 ms until the server closes or `give_up_s`
 * passes; returns the seconds it took the server to close (or -1). */
static double drip(int port, const char *text, double give_up_s) {
    int fd = tcp_connect(port);
    ck_assert(fd >= 0);
    struct timeval tv = {0, 200000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    double t0 = now_s();
    for (size_t i = 0; now_s() - t0 < give_up_s; i++) {
        if (send(fd, text + i % strlen(text), 1, MSG_NOSIGNAL) != 1) break;
        char b[256];
        ssize_t n = recv(fd, b, sizeof b, 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;
    }
    double took = now_s() - t0;
    close(fd);
    return took < give_up_s ? took : -1;
}

/* A request that trickles in (headers or body, a byte every 200 ms: the
 * idle timeout never fires) is cut at --read-timeout; others are served. */
START_TEST(slow_requests_are_cut_at_the_read_timeout) {
    server s;
    const char *args[] = {"--read-timeout", "2", "--idle-timeout", "60", NULL};
    server_start(&s, "read_timeout", args);
    double headers =
        drip(s.port, "POST /v1/completions HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", 20);
    ck_assert_msg(headers > 0, "a client trickling its headers held the connection 20 s");
    char body_req[] = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      "Content-Length: 100000\r\n\r\n";
    int fd = tcp_connect(s.port);
    ck_assert(fd >= 0);
    ck_assert_int_eq(send(fd, body_req, strlen(body_req), MSG_NOSIGNAL), (ssize_t)strlen(body_req));
    close(fd);
    double body = drip(s.port, "{\"prompt\":\"aaaaaaaaaaaaaaaaaaaaaaaaaaaa", 20);
    ck_assert_msg(body > 0, "a client trickling its body held the connection 20 s");
    printf("read timeout 2 s: trickled headers cut after %.1f s, body after %.1f s\n", headers, body);
    ck_assert_msg(headers >= 1.5 && body >= 1.5, "cut too early (%.1f s, %.1f s) for a 2 s deadline", headers,
                  body);
    xfer x;
    ck_assert_int_eq(http(s.port, "POST", "/v1/completions", "{\"prompt\":\"Once\",\"max_tokens\":4}", &x),
                     200);
    xfer_free(&x);
    ck_assert_msg(scrape(s.port, "duet_server_read_timeouts_total", "") >= 2, "read timeouts not counted");
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

/* --api-key: every endpoint but /health wants the key (401 otherwise, with
 * WWW-Authenticate); --allowed-origins: CORS headers for listed origins,
 * 403 for others, preflights answered; POST bodies must be JSON (415). */
START_TEST(api_key_origins_and_json_only) {
    server s;
    const char *args[] = {"--api-key", "sekret", "--allowed-origins",
                          "http://ok.example, http://also.example", NULL};
    server_start(&s, "auth", args);
    xfer x;
    const char *none[] = {NULL}, *wrong[] = {"Authorization: Bearer sekreT", NULL},
               *longer[] = {"Authorization: Bearer sekret2", NULL},
               *key[] = {"Authorization: Bearer sekret", NULL};
    ck_assert_int_eq(http_with(s.port, "GET", "/health", NULL, none, &x), 200);
    xfer_free(&x);
    const char *paths[] = {"/v1/models", "/metrics"};
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(http_with(s.port, "GET", paths[i], NULL, none, &x), 401);
        ck_assert_msg(strstr(x.buf, "invalid_api_key"), "%s without a key: %s", paths[i], x.buf);
        xfer_free(&x);
        ck_assert_int_eq(http_with(s.port, "GET", paths[i], NULL, wrong, &x), 401);
        xfer_free(&x);
        ck_assert_int_eq(http_with(s.port, "GET", paths[i], NULL, longer, &x), 401);
        xfer_free(&x);
        ck_assert_int_eq(http_with(s.port, "GET", paths[i], NULL, key, &x), 200);
        xfer_free(&x);
    }
    const char *body = "{\"prompt\":\"Once\",\"max_tokens\":2}";
    const char *json_nokey[] = {"Content-Type: application/json", NULL},
               *json[] = {"Authorization: Bearer sekret", "Content-Type: application/json; charset=utf-8",
                          NULL},
               *text[] = {"Authorization: Bearer sekret", "Content-Type: text/plain", NULL},
               *form[] = {"Authorization: Bearer sekret", "Content-Type: application/x-www-form-urlencoded",
                          NULL},
               *evil[] = {"Authorization: Bearer sekret", "Content-Type: application/json",
                          "Origin: http://evil.example", NULL},
               *ok[] = {"Authorization: Bearer sekret", "Content-Type: application/json",
                        "Origin: http://also.example", NULL},
               *preflight[] = {"Origin: http://ok.example", "Access-Control-Request-Method: POST",
                               "Access-Control-Request-Headers: authorization, content-type", NULL};
    ck_assert_int_eq(http_with(s.port, "POST", "/v1/completions", body, json_nokey, &x), 401);
    xfer_free(&x);
    ck_assert_int_eq(http_with(s.port, "POST", "/v1/completions", body, json, &x), 200);
    ck_assert_msg(!x.allow_origin[0], "CORS header without an Origin: %s", x.allow_origin);
    xfer_free(&x);
    ck_assert_int_eq(http_with(s.port, "POST", "/v1/completions", body, text, &x), 415);
    ck_assert_msg(strstr(x.buf, "application/json"), "415 body: %s", x.buf);
    xfer_free(&x);
    ck_assert_int_eq(http_with(s.port, "POST", "/v1/chat/completions", body, form, &x), 415);
    xfer_free(&x);
    ck_assert_int_eq(http_with(s.port, "POST", "/v1/completions", body, evil, &x), 403);
    ck_assert_msg(!x.allow_origin[0], "CORS header for a refused origin");
    xfer_free(&x);
    ck_assert_int_eq(http_with(s.port, "POST", "/v1/completions", body, ok, &x), 200);
    ck_assert_str_eq(x.allow_origin, "http://also.example");
    xfer_free(&x);
    ck_assert_int_eq(http_with(s.port, "OPTIONS", "/v1/chat/completions", NULL, preflight, &x), 204);
    ck_assert_str_eq(x.allow_origin, "http://ok.example");
    ck_assert_msg(strstr(x.allow_methods, "POST"), "preflight methods: '%s'", x.allow_methods);
    xfer_free(&x);
    ck_assert_int_eq(server_stop(&s, 60), 0);

    /* The key from DUET_API_KEY, with /metrics left open; no CORS at all. */
    setenv("DUET_API_KEY", "from-env", 1);
    const char *args2[] = {"--metrics-public", NULL};
    server_start(&s, "auth_env", args2);
    unsetenv("DUET_API_KEY");
    const char *env_key[] = {"Authorization: Bearer from-env", NULL},
               *any_origin[] = {"Authorization: Bearer from-env", "Origin: http://ok.example", NULL};
    ck_assert_int_eq(http_with(s.port, "GET", "/metrics", NULL, none, &x), 200);
    xfer_free(&x);
    ck_assert_int_eq(http_with(s.port, "GET", "/v1/models", NULL, none, &x), 401);
    xfer_free(&x);
    ck_assert_int_eq(http_with(s.port, "GET", "/v1/models", NULL, env_key, &x), 200);
    xfer_free(&x);
    ck_assert_int_eq(http_with(s.port, "GET", "/v1/models", NULL, any_origin, &x), 403);
    xfer_free(&x);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

/* A request past its deadline (the request's "timeout", at most the
 * server's --request-timeout) is cancelled and answered: 408 with
 * request_timeout, or an error event then [DONE] on a stream. */
START_TEST(request_deadlines_answer_408) {
    server s;
    const char *args[] = {"--request-timeout", "0.2", NULL};
    server_start(&s, "deadline", args);
    xfer x;
    const char *slow = "{\"prompt\":\"Once\",\"max_tokens\":1000,\"ignore_eos\":true}";
    const char *slow_own = "{\"prompt\":\"Once\",\"max_tokens\":1000,\"ignore_eos\":true,\"timeout\":0.05}";
    const char *asks_more =
        "{\"prompt\":\"Once\",\"max_tokens\":1000,\"ignore_eos\":true,\"timeout\":1000,\"stream\":true}";
    const char *bodies[] = {slow, slow_own};
    for (int i = 0; i < 2; i++) {
        long code = http(s.port, "POST", "/v1/completions", bodies[i], &x);
        ck_assert_msg(code == 408 && strstr(x.buf, "request_timeout"), "%s: HTTP %ld %s", bodies[i], code,
                      x.buf);
        xfer_free(&x);
    }
    ck_assert_int_eq(http(s.port, "POST", "/v1/completions", asks_more, &x), 200);
    stream_result r;
    parse_stream(x.buf, false, &r);
    ck_assert_msg(r.done_marker && strstr(r.error, "timeout"), "stream past its deadline: error '%s' done %d",
                  r.error, r.done_marker);
    xfer_free(&x);
    ck_assert_int_eq(http(s.port, "POST", "/v1/completions", "{\"prompt\":\"Once\",\"max_tokens\":2}", &x),
                     200);
    xfer_free(&x);
    ck_assert_int_eq(
        (int)await_metric(s.port, "duet_server_requests_finished_total", "outcome=\"cancelled\"", 3, 10), 3);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

typedef struct big_state {
    xfer *small;
    double t0, small_done;
} big_state;

static void note_small(void *arg) {
    big_state *b = arg;
    if (!b->small_done && b->small->done) b->small_done = now_s() - b->t0;
}

/* Four prompts of 7.8 MB (far past any context) are refused with 400
 * without being tokenized whole, while a small request is served. */
START_TEST(huge_prompts_are_refused_early) {
    server s;
    server_start(&s, "huge", NULL);
    enum { BIG = 4, WORDS = 460000 };
    static const char word[] = "Once upon a time ";
    size_t cap = 64 + WORDS * (sizeof word - 1);
    char *body = malloc(cap);
    ck_assert(body);
    size_t len = (size_t)snprintf(body, cap, "{\"max_tokens\":4,\"prompt\":\"");
    for (int i = 0; i < WORDS; i++)
        memcpy(body + len, word, sizeof word - 1), len += sizeof word - 1;
    snprintf(body + len, cap - len, "\"}");
    xfer xs[BIG + 1];
    for (int i = 0; i < BIG; i++)
        xfer_init(&xs[i], s.port, "POST", "/v1/completions", body);
    xfer_init(&xs[BIG], s.port, "POST", "/v1/completions", "{\"prompt\":\"Once\",\"max_tokens\":4}");
    big_state b = {.small = &xs[BIG], .t0 = now_s()};
    run_multi(xs, BIG + 1, note_small, &b);
    double all = now_s() - b.t0;
    for (int i = 0; i < BIG; i++) {
        /* "more (N bytes)": refused on its size, not after tokenizing it all. */
        ck_assert_msg(xs[i].code == 400 && strstr(xs[i].buf, "context_length_exceeded") &&
                          strstr(xs[i].buf, "bytes)"),
                      "huge prompt %d: HTTP %ld %.200s", i, xs[i].code, xs[i].buf ? xs[i].buf : "");
        xfer_free(&xs[i]);
    }
    ck_assert_int_eq(xs[BIG].code, 200);
    xfer_free(&xs[BIG]);
    printf("huge prompts: %d x %.1f MB refused in %.2f s in all; the small request took %.2f s\n", BIG,
           (double)strlen(body) / 1e6, all, b.small_done);
    free(body);
    /* A body declared past the 8 MB limit is refused at its headers, not
     * read (and buffered) first. */
    static char buf[4096];
    raw_exchange(s.port,
                 "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: 9000000\r\n\r\n{\"prompt\":\"",
                 false, buf, sizeof buf, 10);
    ck_assert_msg(!strncmp(buf, "HTTP/1.1 413", 12) && strstr(buf, "9000000"), "declared 9 MB body: %.300s",
                  buf);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

/* Every generation request the server receives is counted once by how it
 * ended: received = stop + length + cancelled + failed + rejected + invalid,
 * and each count is what the clients saw. */
START_TEST(every_request_is_counted_once) {
    server s;
    const char *args[] = {"--max-batch-seqs", "1", "--max-waiting", "1", NULL};
    server_start(&s, "accounting", args);
    const char *json[] = {"Content-Type: application/json", NULL},
               *text[] = {"Content-Type: text/plain", NULL};
    enum { N = 14 };
    xfer xs[N];
    int want[6] = {0}; /* by outcome, as the clients see it: stop length cancelled failed rejected invalid */
    int n = 0;
    /* Phase 1, one at a time: length, stop, invalid (bad JSON, wrong type, wrong model, not JSON). */
    xfer x;
    ck_assert_int_eq(http(s.port, "POST", "/v1/completions",
                          "{\"prompt\":\"Once\",\"max_tokens\":5,\"ignore_eos\":true}", &x),
                     200);
    xfer_free(&x), want[1]++, n++;
    ck_assert_int_eq(http(s.port, "POST", "/v1/chat/completions",
                          "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":50,\"stop\":"
                          "[\" \",\"e\"]}",
                          &x),
                     200);
    ck_assert_msg(strstr(x.buf, "\"finish_reason\":\"stop\""), "stop: %s", x.buf);
    xfer_free(&x), want[0]++, n++;
    ck_assert_int_eq(http(s.port, "POST", "/v1/completions", "{\"prompt\":", &x), 400);
    xfer_free(&x), want[5]++, n++;
    ck_assert_int_eq(http(s.port, "POST", "/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":\"x\"}", &x),
                     400);
    xfer_free(&x), want[5]++, n++;
    ck_assert_int_eq(
        http_with(s.port, "POST", "/v1/completions", "{\"prompt\":\"a\",\"model\":\"nope\"}", json, &x), 404);
    xfer_free(&x), want[5]++, n++;
    ck_assert_int_eq(http_with(s.port, "POST", "/v1/completions", "{\"prompt\":\"a\"}", text, &x), 415);
    xfer_free(&x), want[5]++, n++;
    /* Phase 2: two clients hang up mid-stream (cancelled); then long
     * streams together on a one-sequence engine with one waiting place:
     * whatever finds the place taken is rejected (429). */
    const char *stream = "{\"prompt\":\"Once\",\"max_tokens\":400,\"ignore_eos\":true,\"stream\":true}";
    for (int i = 0; i < 2; i++) { /* one at a time: with one waiting place, a second arrival may be refused */
        xfer_init(&xs[i], s.port, "POST", "/v1/completions", stream);
        xs[i].abort_after = 400;
        run_multi(&xs[i], 1, NULL, NULL);
    }
    for (int i = 2; i < N; i++)
        xfer_init(&xs[i], s.port, "POST", "/v1/completions", stream);
    run_multi(xs + 2, N - 2, NULL, NULL);
    for (int i = 0; i < N; i++, n++) {
        if (xs[i].code == 429)
            want[4]++;
        else if (xs[i].res != CURLE_OK)
            want[2]++;
        else {
            stream_result r;
            parse_stream(xs[i].buf, false, &r);
            ck_assert_msg(xs[i].code == 200 && !strcmp(r.finish[0], "length"),
                          "stream %d: HTTP %ld finish '%s'", i, xs[i].code, r.finish[0]);
            want[1]++;
        }
        xfer_free(&xs[i]);
    }
    ck_assert_msg(want[4] > 0 && want[2] == 2, "the mix did not happen: %d rejected, %d cancelled", want[4],
                  want[2]);
    double received = await_metric(s.port, "duet_server_requests_received_total", "", n, 10);
    double finished = 0;
    for (double t0 = now_s(); now_s() - t0 < 10; sleep_ms(50))
        if ((finished = scrape(s.port, "duet_server_requests_finished_total", "")) == n) break;
    ck_assert_msg(received == n && finished == n, "sent %d generation requests; received %g, finished %g", n,
                  received, finished);
    static const char *const names[6] = {"stop", "length", "cancelled", "failed", "rejected", "invalid"};
    for (int o = 0; o < 6; o++) {
        char filter[64];
        snprintf(filter, sizeof filter, "outcome=\"%s\"", names[o]);
        double got = scrape(s.port, "duet_server_requests_finished_total", filter);
        ck_assert_msg(got == want[o], "%s: counted %g, the clients saw %d", names[o], got, want[o]);
    }
    printf("accounting: %d received = %d stop + %d length + %d cancelled + %d failed + %d rejected + %d "
           "invalid\n",
           n, want[0], want[1], want[2], want[3], want[4], want[5]);
    ck_assert_int_eq(server_stop(&s, 60), 0);
}
END_TEST

int main(void) {
    curl_global_init(CURL_GLOBAL_DEFAULT);
    signal(SIGPIPE, SIG_IGN);
    Suite *su = suite_create("server");
    TCase *unit = tcase_create("unit");
    tcase_add_test(unit, parse_completion_fields);
    tcase_add_test(unit, parse_chat_messages);
    tcase_add_test(unit, parse_rejects_bad_input);
    tcase_add_test(unit, stop_string_scanning);
    tcase_add_test(unit, response_and_chunk_json);
    suite_add_tcase(su, unit);
    TCase *live = tcase_create("live");
    tcase_set_timeout(live, 600);
    tcase_add_test(live, concurrent_streams_match_sequential_runs);
    tcase_add_test(live, completions_stop_n_usage_and_chat);
    tcase_add_test(live, malformed_requests_get_400);
    tcase_add_test(live, disconnects_free_their_blocks);
    tcase_add_test(live, overload_gets_429);
    tcase_add_test(live, metrics_are_prometheus_text);
    tcase_add_test(live, draft_model_speculates);
    tcase_add_test(live, config_file_and_command_line_knobs);
    tcase_add_test(live, sigterm_drains_then_exits_0);
    tcase_add_test(live, drain_timeout_ends_every_stream);
    tcase_add_test(live, default_max_tokens_fits_a_small_pool);
    tcase_add_test(live, stop_strings_count_as_stop);
    suite_add_tcase(su, live);
    TCase *conns = tcase_create("connections");
    tcase_set_timeout(conns, 300);
    tcase_add_test(conns, idle_and_slow_clients_do_not_lock_others_out);
    tcase_add_test(conns, connection_cap_answers_503);
    tcase_add_test(conns, idle_connections_time_out);
    tcase_add_test(conns, second_server_on_a_port_fails);
    tcase_add_test(conns, conflicting_content_length_gets_400);
    suite_add_tcase(su, conns);

    TCase *hard = tcase_create("hardening");
    tcase_set_timeout(hard, 300);
    tcase_add_test(hard, half_closed_clients_get_their_answer);
    tcase_add_test(hard, slow_requests_are_cut_at_the_read_timeout);
    tcase_add_test(hard, api_key_origins_and_json_only);
    tcase_add_test(hard, request_deadlines_answer_408);
    tcase_add_test(hard, huge_prompts_are_refused_early);
    tcase_add_test(hard, every_request_is_counted_once);
    suite_add_tcase(su, hard);
    int rc = test_run_suite(su);
    curl_global_cleanup();
    return rc;
}
