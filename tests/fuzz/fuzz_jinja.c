/* fuzz_jinja.c — libFuzzer target for the Jinja interpreter (core/jinja.c),
 * which runs the chat template inside every GGUF file a user loads.
 *
 * Input: the template text (exactly the input, not NUL-terminated, so a read
 * past it shows up under ASan). It is parsed and, when it parses, rendered
 * with a conversation that has tools and a tool call, under small limits.
 * Whatever the text, the interpreter must return one of its result codes,
 * never crash or hang: a failure has a message, a success a NUL-terminated
 * output of the reported length within the output limit. Everything is
 * freed (LeakSanitizer is on); a broken invariant aborts.
 */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja.h"

static void check(bool ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "fuzz_jinja: %s\n", what);
        abort();
    }
}

static const char vars_json[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"Hi "
    "<b> & 'x'\"}, {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"c1\", \"type\": "
    "\"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"a\": 1, \"b\": [true, null, 2.5]}}}]}, "
    "{\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \"42\"}], \"tools\": [{\"type\": \"function\", "
    "\"function\": {\"name\": \"f\", \"description\": \"d\", \"parameters\": {\"type\": \"object\"}}}], "
    "\"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static cJSON *vars;
    if (!vars) vars = cJSON_Parse(vars_json);
    check(vars != NULL, "the variables do not parse");
    char *src = malloc(size ? size : 1);
    check(src != NULL, "out of memory");
    memcpy(src, data, size);
    char err[256];
    duet__jinja_template *t = NULL;
    duet__jinja_result r = duet__jinja_parse(src, size, &t, err, sizeof err);
    if (r != DUET__JINJA_OK) {
        check(r == DUET__JINJA_SYNTAX || r == DUET__JINJA_NOMEM, "parse: unexpected result");
        check(t == NULL, "parse: a template after a failure");
        check(err[0] != 0, "parse: a failure without a message");
        free(src);
        return 0;
    }
    free(src); /* the template must not point into its source */
    duet__jinja_options opt = {.now = 0, .max_output = 1 << 16, .max_steps = 20000, .max_memory = 32 << 20};
    char *out = NULL;
    size_t len = 0;
    r = duet__jinja_render(t, vars, &opt, &out, &len, err, sizeof err);
    if (r == DUET__JINJA_OK) {
        check(out != NULL && strlen(out) <= len && len <= opt.max_output, "render: bad output");
        free(out);
    } else {
        check(r == DUET__JINJA_RENDER || r == DUET__JINJA_RAISED || r == DUET__JINJA_LIMIT || r == DUET__JINJA_NOMEM,
              "render: unexpected result");
        check(out == NULL, "render: output after a failure");
        check(err[0] != 0 || r == DUET__JINJA_RAISED, "render: a failure without a message");
    }
    duet__jinja_free(t);
    return 0;
}
