/* fuzz_request.c — libFuzzer target for the HTTP request path of `duet serve`:
 * body -> JSON -> validation (srv_request_parse), then what the server does
 * with a parsed request short of running the engine.
 *
 * Input: one selector byte, then the request body (exactly the rest of the
 * input, not NUL-terminated, so a read past the body shows up under ASan).
 *   bit 0     endpoint: 0 /v1/completions (SRV_COMPLETION),
 *             1 /v1/chat/completions (SRV_CHAT)
 *   bits 1-2  the served model's name and alias (srv_limits)
 *   bits 3-4  the model's n_vocab (1, 260, 32000, 151936)
 *   bits 5-7  the size of the streamed text deltas (1 to 4096 bytes)
 *
 * A refused body must give a 400 with a message, the "nothing to free"
 * request of srv_request_parse's contract, and an error object that
 * srv_error_json writes and cJSON reads back unchanged.
 *
 * An accepted body must give a request within the documented ranges, holding
 * no raw NUL byte (RFC 8259 allows none, and cJSON would end a string at it).
 * Chat messages are then rendered with every template family (each message's
 * text must appear in the result, which must end with the assistant's
 * opening). With the prompts (or the rendered conversation) standing in for
 * the generated text, the target writes the response the server would: the
 * whole JSON body, or the SSE stream (role deltas, text deltas, one final
 * chunk per choice, the usage chunk, [DONE]). Both are read back with cJSON
 * and must give every choice's text back, less any NUL byte.
 * Everything is freed (LeakSanitizer is on); a broken invariant aborts.
 */
#define _GNU_SOURCE /* memmem */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server.h"

static void check(bool ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "fuzz_request: %s\n", what);
        abort();
    }
}

static char long_name[301]; /* a served name longer than the error messages quote */

/* The named chat template families, loaded once. */
enum { N_FAMILIES = 8 };
static const char *const family_names[N_FAMILIES] = {"plain",   "chatml", "llama3", "llama2",
                                                     "mistral", "zephyr", "phi3",   "gemma"};
static duet_chat_template *families[N_FAMILIES];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    memset(long_name, 'm', sizeof long_name - 1);
    for (int f = 0; f < N_FAMILIES; f++)
        check(duet_chat_template_load(NULL, family_names[f], &families[f]) == DUET_OK,
              "loading a chat family");
    return 0;
}

static srv_limits limits_of(uint8_t sel) {
    static const int vocab[4] = {1, 260, 32000, 151936};
    srv_limits lim = {.n_vocab = vocab[(sel >> 3) & 3]};
    switch ((sel >> 1) & 3) {
    case 0:
        lim.model_name = "duet";
        break;
    case 1:
        lim.model_name = "tiny", lim.model_alias = "/models/tiny-f32.gguf";
        break;
    case 2:
        lim.model_name = "";
        break;
    default:
        lim.model_name = long_name, lim.model_alias = "m";
        break;
    }
    return lim;
}

/* ---- JSON read-back helpers ------------------------------------------- */

static const char *str_field(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static bool str_is(const cJSON *o, const char *key, const char *want) {
    const char *s = str_field(o, key);
    return s && !strcmp(s, want);
}

static bool num_is(const cJSON *o, const char *key, double want) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) && v->valuedouble == want;
}

/* A choice's text as the JSON must hold it: the bytes less any NUL. */
static char *without_nul(const char *s, size_t n) {
    char *c = malloc(n + 1);
    check(c != NULL, "out of memory");
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (s[i]) c[k++] = s[i];
    c[k] = 0;
    return c;
}

static void check_usage(const cJSON *o, srv_usage u) {
    const cJSON *us = cJSON_GetObjectItemCaseSensitive(o, "usage");
    check(cJSON_IsObject(us) && num_is(us, "prompt_tokens", u.prompt_tokens) &&
              num_is(us, "completion_tokens", u.completion_tokens) &&
              num_is(us, "total_tokens", u.prompt_tokens + u.completion_tokens),
          "usage object");
}

static void check_head(const cJSON *o, srv_kind kind, bool chunk, const char *id, long created,
                       const char *model) {
    const char *object =
        kind == SRV_CHAT ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion";
    check(cJSON_IsObject(o), "response is not a JSON object");
    check(str_is(o, "id", id) && str_is(o, "object", object) && str_is(o, "model", model) &&
              num_is(o, "created", (double)created),
          "response head (id, object, model, created)");
}

/* ---- a refused body ----------------------------------------------------- */

static void check_refusal(const srv_request *r, const srv_error *err) {
    /* 404 only for a model that is not served (OpenAI's and vLLM's answer). */
    check(err->http == 400 || (err->http == 404 && err->code && !strcmp(err->code, "model_not_found")),
          "a refused body must be a 400 (or a 404 model_not_found)");
    check(err->type && !strcmp(err->type, "invalid_request_error"), "error type");
    check(err->message[0] != 0, "empty error message");
    check(memchr(err->message, 0, sizeof err->message) && memchr(err->param, 0, sizeof err->param),
          "unterminated error text");
    check(!r->n_prompts && !r->messages && !r->n_messages && !r->n_stop,
          "a refused request holds something to free");

    char *js = srv_error_json(err);
    check(js != NULL, "srv_error_json failed");
    cJSON *o = cJSON_Parse(js);
    check(o != NULL, "srv_error_json wrote invalid JSON");
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(o, "error");
    check(cJSON_IsObject(e), "no error object");
    check(str_is(e, "message", err->message) && str_is(e, "type", err->type),
          "error message or type changed");
    const cJSON *param = cJSON_GetObjectItemCaseSensitive(e, "param");
    check(err->param[0] ? str_is(e, "param", err->param) : cJSON_IsNull(param), "error param");
    const cJSON *code = cJSON_GetObjectItemCaseSensitive(e, "code");
    check(err->code ? str_is(e, "code", err->code) : cJSON_IsNull(code), "error code");
    cJSON_Delete(o);
    free(js);
}

/* ---- an accepted body --------------------------------------------------- */

static void check_request(const srv_request *r, srv_kind kind, const srv_limits *lim) {
    check(r->kind == kind, "kind changed");
    check(r->n >= 1 && r->n <= SRV_MAX_N, "n out of range");
    check(r->max_tokens == -1 || (r->max_tokens > 0 && r->max_tokens <= 1 << 24), "max_tokens out of range");
    check(r->n_stop >= 0 && r->n_stop <= SRV_MAX_STOP, "n_stop out of range");
    for (int i = 0; i < r->n_stop; i++) {
        size_t n = r->stop[i] ? strlen(r->stop[i]) : 0;
        check(n >= 1 && n <= SRV_MAX_STOP_LEN, "stop string empty or too long");
    }
    /* The server adds the template's end-of-turn markers to the request's. */
    for (int f = 0; f < N_FAMILIES; f++) {
        int n = r->n_stop;
        for (const char *const *t = duet_chat_template_stops(families[f]); *t; t++)
            n++;
        check(n <= SRV_MAX_STOP + 4, "stop strings overflow the server's job");
    }
    check(!r->include_usage || r->stream, "include_usage without stream");
    check(r->priority == DUET_PRIORITY_INTERACTIVE || r->priority == DUET_PRIORITY_BATCH, "priority");
    const duet_sampling *s = &r->sampling;
    check(s->temperature >= 0 && s->temperature <= 2, "temperature out of range");
    check(s->top_p > 0 && s->top_p <= 1, "top_p out of range");
    check(s->min_p >= 0 && s->min_p <= 1, "min_p out of range");
    check(s->presence_penalty >= -2 && s->presence_penalty <= 2, "presence_penalty out of range");
    check(s->frequency_penalty >= -2 && s->frequency_penalty <= 2, "frequency_penalty out of range");
    check(s->repetition_penalty > 0 && s->repetition_penalty <= 10, "repetition_penalty out of range");
    check(s->top_k >= 0, "top_k negative");

    if (kind == SRV_COMPLETION) {
        check(r->n_prompts >= 1 && r->n_prompts <= SRV_MAX_PROMPTS, "n_prompts out of range");
        check(r->n * r->n_prompts <= 4 * SRV_MAX_N, "n times prompts out of range");
        check(!r->messages && !r->n_messages, "a completion with messages");
        for (int p = 0; p < r->n_prompts; p++) {
            const srv_prompt *pr = &r->prompts[p];
            check(pr->text ? !pr->ids && !pr->n_ids : pr->ids && pr->n_ids > 0,
                  "prompt neither text nor ids");
            for (int i = 0; i < pr->n_ids; i++)
                check(pr->ids[i] >= 0 && pr->ids[i] < lim->n_vocab, "token id out of range");
        }
    } else {
        check(!r->n_prompts, "a chat request with prompts");
        check(r->n_messages >= 1 && r->n_messages <= 4096 && r->messages, "n_messages out of range");
        for (int i = 0; i < r->n_messages; i++) {
            check(r->messages[i].content != NULL, "message without content");
            check(r->messages[i].role == SRV_ROLE_SYSTEM || r->messages[i].role == SRV_ROLE_USER ||
                      r->messages[i].role == SRV_ROLE_ASSISTANT || r->messages[i].role == SRV_ROLE_TOOL,
                  "message role");
        }
    }
}

static bool is_space(char c) {
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

static bool ends_with(const srv_text *t, const char *tail) {
    size_t n = strlen(tail);
    return t->len >= n && !memcmp(t->p + t->len - n, tail, n);
}

/* Renders the conversation with family f, as the server does before
 * tokenizing, and checks what every family promises. */
static void render(int f, const srv_request *r, srv_text *out) {
    char *conv = srv_conversation_json(r), *text = NULL;
    check(conv != NULL, "out of memory");
    /* The families know no tool turns (they refuse them: a 400). */
    for (int i = 0; i < r->n_messages; i++)
        if (r->messages[i].role == SRV_ROLE_TOOL) {
            check(duet_chat_template_apply(families[f], conv, true, &text) != DUET_OK,
                  "a family rendered a tool turn");
            free(conv);
            out->p = strdup("");
            out->len = 0;
            return;
        }
    check(duet_chat_template_apply(families[f], conv, true, &text) == DUET_OK,
          "duet_chat_template_apply failed");
    free(conv);
    out->p = text;
    out->len = strlen(text);
    check(!strcmp(duet_chat_template_name(families[f]), family_names[f]), "chat family name round trip");
    for (int i = 0; i < r->n_messages; i++) {
        /* Some families strip the content; all keep its text. */
        const char *c = r->messages[i].content;
        size_t n = strlen(c);
        while (n && is_space(*c))
            c++, n--;
        while (n && is_space(c[n - 1]))
            n--;
        check(!n || memmem(out->p, out->len, c, n), "a message's text is missing from the rendered chat");
    }
    static const char *const opening[N_FAMILIES] = {
        "Assistant:",
        "<|im_start|>assistant\n",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        NULL,
        NULL,
        "<|assistant|>\n",
        "<|assistant|>\n",
        "<start_of_turn>model\n",
    };
    if (opening[f])
        check(ends_with(out, opening[f]), "rendered chat does not end with the assistant's opening");
    else if (r->messages[r->n_messages - 1].role == SRV_ROLE_USER)
        check(ends_with(out, " [/INST]"), "[INST] chat does not end with the user's turn");
}

/* What the server would send back. Slot i holds choice i of prompt i / n. */
typedef struct gen {
    srv_kind kind;
    const char *id, *model;
    long created;
    int n_slots;
    srv_choice_result *res;
    srv_usage usage;
} gen;

static void check_response(const gen *g) {
    char *js = srv_response_json(g->kind, g->id, g->created, g->model, g->res, g->n_slots, g->usage);
    check(js != NULL, "srv_response_json failed");
    cJSON *o = cJSON_Parse(js);
    check(o != NULL, "srv_response_json wrote invalid JSON");
    check_head(o, g->kind, false, g->id, g->created, g->model);
    const cJSON *choices = cJSON_GetObjectItemCaseSensitive(o, "choices");
    check(cJSON_IsArray(choices) && cJSON_GetArraySize(choices) == g->n_slots, "choices array");
    int i = 0;
    for (const cJSON *c = choices->child; c; c = c->next, i++) {
        check(num_is(c, "index", i) && str_is(c, "finish_reason", g->res[i].finish),
              "choice index or finish");
        check(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(c, "logprobs")), "choice logprobs");
        const cJSON *holder = c;
        if (g->kind == SRV_CHAT) {
            holder = cJSON_GetObjectItemCaseSensitive(c, "message");
            check(str_is(holder, "role", "assistant"), "message role");
        }
        char *want = without_nul(g->res[i].text, g->res[i].len);
        check(str_is(holder, g->kind == SRV_CHAT ? "content" : "text", want), "choice text changed");
        free(want);
    }
    check_usage(o, g->usage);
    cJSON_Delete(o);
    free(js);
}

/* Writes the stream the way stream_fill does (deltas of `stride` bytes,
 * round robin over the slots), then reads it back event by event. */
static void check_stream(const gen *g, bool include_usage, size_t stride) {
    srv_text out = {0};
    bool ok = true;
    if (g->kind == SRV_CHAT)
        for (int i = 0; i < g->n_slots; i++)
            ok = ok && srv_chunk_sse(&out, g->kind, g->id, g->created, g->model, i, NULL, 0, NULL, true,
                                     include_usage);
    size_t *off = calloc((size_t)g->n_slots, sizeof *off), *step = calloc((size_t)g->n_slots, sizeof *step);
    check(off && step, "out of memory");
    /* At most ~64 deltas per choice, so long texts stay quick. */
    for (int i = 0; i < g->n_slots; i++)
        step[i] = stride > (g->res[i].len + 63) / 64 ? stride : (g->res[i].len + 63) / 64;
    for (bool more = true; more && ok;) {
        more = false;
        for (int i = 0; i < g->n_slots && ok; i++) {
            size_t n = g->res[i].len - off[i] < step[i] ? g->res[i].len - off[i] : step[i];
            if (!n) continue;
            ok = srv_chunk_sse(&out, g->kind, g->id, g->created, g->model, i, g->res[i].text + off[i], n,
                               NULL, false, include_usage);
            off[i] += n;
            more = true;
        }
    }
    for (int i = 0; i < g->n_slots && ok; i++)
        ok = srv_chunk_sse(&out, g->kind, g->id, g->created, g->model, i, "", 0, g->res[i].finish, false,
                           include_usage);
    if (ok && include_usage) ok = srv_usage_sse(&out, g->kind, g->id, g->created, g->model, g->usage);
    ok = ok && srv_text_printf(&out, "data: [DONE]\n\n");
    check(ok && out.p && strlen(out.p) == out.len, "writing the stream failed");

    /* Read it back. cJSON escapes newlines, so "\n\n" only ends events. */
    srv_text *got = calloc((size_t)g->n_slots, sizeof *got);
    int *roles = calloc((size_t)g->n_slots, sizeof *roles),
        *finals = calloc((size_t)g->n_slots, sizeof *finals);
    check(got && roles && finals, "out of memory");
    bool done = false, usage_seen = false;
    for (const char *ev = out.p; *ev;) {
        check(!done, "an event after [DONE]");
        const char *end = strstr(ev, "\n\n");
        check(!strncmp(ev, "data: ", 6) && end, "SSE framing");
        const char *data = ev + 6;
        size_t n = (size_t)(end - data);
        check(!memchr(data, '\n', n), "a raw newline inside an event");
        ev = end + 2;
        if (n == 6 && !memcmp(data, "[DONE]", 6)) {
            done = true;
            continue;
        }
        check(!usage_seen, "an event after the usage chunk");
        cJSON *o = cJSON_ParseWithLength(data, n);
        check(o != NULL, "an event is not JSON");
        check_head(o, g->kind, true, g->id, g->created, g->model);
        const cJSON *choices = cJSON_GetObjectItemCaseSensitive(o, "choices");
        check(cJSON_IsArray(choices), "chunk choices");
        if (!choices->child) { /* the usage chunk */
            check(include_usage, "a usage chunk without include_usage");
            check_usage(o, g->usage);
            usage_seen = true;
            cJSON_Delete(o);
            continue;
        }
        check(!choices->child->next, "a chunk with two choices");
        const cJSON *usage = cJSON_GetObjectItemCaseSensitive(o, "usage");
        check(include_usage ? cJSON_IsNull(usage) : usage == NULL, "chunk usage");
        const cJSON *c = choices->child, *index = cJSON_GetObjectItemCaseSensitive(c, "index");
        check(cJSON_IsNumber(index) && index->valuedouble >= 0 && index->valuedouble < g->n_slots,
              "chunk index");
        int i = (int)index->valuedouble;
        check(!finals[i], "a chunk after the choice's final chunk");
        const cJSON *finish = cJSON_GetObjectItemCaseSensitive(c, "finish_reason");
        const cJSON *holder = c;
        if (g->kind == SRV_CHAT) {
            holder = cJSON_GetObjectItemCaseSensitive(c, "delta");
            check(cJSON_IsObject(holder), "chunk delta");
            if (str_field(holder, "role")) {
                check(str_is(holder, "role", "assistant") && str_is(holder, "content", "") && !roles[i] &&
                          !got[i].len && cJSON_IsNull(finish),
                      "role delta");
                roles[i] = 1;
                cJSON_Delete(o);
                continue;
            }
            check(roles[i], "a chat delta before the role delta");
        }
        if (cJSON_IsString(finish)) {
            check(!strcmp(finish->valuestring, g->res[i].finish), "finish_reason changed");
            check(g->kind == SRV_CHAT ? !holder->child : str_is(holder, "text", ""),
                  "final chunk carries text");
            finals[i] = 1;
        } else {
            check(cJSON_IsNull(finish), "chunk finish_reason");
            const char *t = str_field(holder, g->kind == SRV_CHAT ? "content" : "text");
            check(t != NULL, "text delta");
            check(srv_text_append(&got[i], t, strlen(t)), "out of memory");
        }
        cJSON_Delete(o);
    }
    check(done && usage_seen == include_usage, "stream end ([DONE], usage)");
    for (int i = 0; i < g->n_slots; i++) {
        char *want = without_nul(g->res[i].text, g->res[i].len);
        check(finals[i] == 1 && (g->kind != SRV_CHAT || roles[i]), "a choice without its final chunk");
        check(!strcmp(got[i].p ? got[i].p : "", want), "streamed text changed");
        free(want);
        srv_text_free(&got[i]);
    }
    free(got);
    free(roles);
    free(finals);
    free(off);
    free(step);
    srv_text_free(&out);
}

static void serve(const srv_request *r, const srv_limits *lim, uint8_t sel) {
    static const size_t strides[8] = {1, 2, 3, 5, 8, 16, 64, 4096};
    srv_text rendered[N_FAMILIES] = {0};
    int n_prompts = r->kind == SRV_CHAT ? 1 : r->n_prompts;
    gen g = {.kind = r->kind,
             .id = r->kind == SRV_CHAT ? "chatcmpl-0123456789abcdef" : "cmpl-0123456789abcdef",
             .model = lim->model_name,
             .created = 1796083200,
             .n_slots = n_prompts * r->n};
    g.res = calloc((size_t)g.n_slots, sizeof *g.res);
    check(g.res != NULL, "out of memory");
    char *id_bytes[SRV_MAX_PROMPTS] = {0}; /* token-id prompts as bytes */

    if (r->kind == SRV_CHAT) {
        for (int f = 0; f < N_FAMILIES; f++)
            render(f, r, &rendered[f]);
        g.usage.prompt_tokens = (int)rendered[0].len;
        /* Choice 0 echoes the last message; the others a rendered chat. */
        for (int i = 0; i < g.n_slots; i++) {
            const char *t = r->messages[r->n_messages - 1].content;
            size_t n = strlen(t);
            if (i) t = rendered[i % N_FAMILIES].p, n = rendered[i % N_FAMILIES].len;
            g.res[i] = (srv_choice_result){.text = t, .len = n, .finish = i % 2 ? "length" : "stop"};
        }
    } else {
        for (int p = 0; p < n_prompts; p++) {
            const srv_prompt *pr = &r->prompts[p];
            if (!pr->text) { /* the ids' low bytes: NULs and invalid UTF-8 */
                id_bytes[p] = malloc((size_t)pr->n_ids);
                check(id_bytes[p] != NULL, "out of memory");
                for (int i = 0; i < pr->n_ids; i++)
                    id_bytes[p][i] = (char)(uint8_t)pr->ids[i];
            }
            g.usage.prompt_tokens += pr->text ? (int)strlen(pr->text) : pr->n_ids;
        }
        for (int i = 0; i < g.n_slots; i++) {
            const srv_prompt *pr = &r->prompts[i / r->n];
            g.res[i] = (srv_choice_result){.text = pr->text ? pr->text : id_bytes[i / r->n],
                                           .len = pr->text ? strlen(pr->text) : (size_t)pr->n_ids,
                                           .finish = i % 2 ? "length" : "stop"};
        }
    }
    for (int i = 0; i < g.n_slots; i++)
        g.usage.completion_tokens += (int)g.res[i].len;

    if (r->stream)
        check_stream(&g, r->include_usage, strides[sel >> 5]);
    else
        check_response(&g);

    for (int f = 0; f < N_FAMILIES; f++)
        srv_text_free(&rendered[f]);
    for (int p = 0; p < SRV_MAX_PROMPTS; p++)
        free(id_bytes[p]);
    free(g.res);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    uint8_t sel = data[0];
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    srv_kind kind = sel & 1 ? SRV_CHAT : SRV_COMPLETION;
    srv_limits lim = limits_of(sel);

    srv_request r;
    srv_error err;
    if (srv_request_parse(kind, body, len, &lim, &r, &err)) {
        check(!memchr(body, 0, len), "accepted a body holding a NUL byte");
        check_request(&r, kind, &lim);
        serve(&r, &lim, sel);
    } else {
        check_refusal(&r, &err);
    }
    srv_request_free(&r);
    return 0;
}
