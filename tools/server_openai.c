/* server_openai.c — the OpenAI dialect: parsing and validating request
 * bodies, stop strings, and the JSON of responses, stream chunks and errors.
 *
 * Validation follows the OpenAI API reference for ranges (temperature in
 * [0, 2], top_p in (0, 1], penalties in [-2, 2], n <= 16) and vLLM for the
 * extensions (top_k, min_p, repetition_penalty, ignore_eos, integer
 * priority). Unknown fields are ignored, as OpenAI's clients send new ones
 * freely; a known field with the wrong type or an absurd value is a 400.
 * JSON null counts as "not given".
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server.h"

/* ---- growable text ---------------------------------------------------- */

static bool text_reserve(srv_text *t, size_t extra) {
    if (t->len + extra + 1 <= t->cap) return true;
    size_t cap = t->cap ? t->cap : 64;
    while (cap < t->len + extra + 1) cap *= 2;
    char *p = realloc(t->p, cap);
    if (!p) return false;
    t->p = p;
    t->cap = cap;
    return true;
}

bool srv_text_append(srv_text *t, const char *s, size_t n) {
    if (!text_reserve(t, n)) return false;
    if (n) memcpy(t->p + t->len, s, n);
    t->len += n;
    t->p[t->len] = 0;
    return true;
}

bool srv_text_printf(srv_text *t, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || !text_reserve(t, (size_t)n)) return false;
    va_start(ap, fmt);
    vsnprintf(t->p + t->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    t->len += (size_t)n;
    return true;
}

void srv_text_free(srv_text *t) {
    free(t->p);
    memset(t, 0, sizeof *t);
}

/* ---- token text ------------------------------------------------------- */

/* Bytes of the UTF-8 sequence at s[0..n) (1..4), or 0 when it is not one. */
static int utf8_seq(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    int len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (!len || (size_t)len > n) return 0;
    uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return len;
}

size_t srv_utf8_valid_prefix(const char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        int k = utf8_seq((const unsigned char *)s + i, n - i);
        if (!k) break;
        i += (size_t)k;
    }
    return i;
}

void srv_utf8_sanitize(srv_text *t) {
    if (!t->p || srv_utf8_valid_prefix(t->p, t->len) == t->len) return;
    srv_text o = {0};
    for (size_t i = 0; i < t->len;) {
        int k = utf8_seq((const unsigned char *)t->p + i, t->len - i);
        if (k)
            srv_text_append(&o, t->p + i, (size_t)k), i += (size_t)k;
        else
            srv_text_append(&o, "\xEF\xBF\xBD", 3), i++;
    }
    srv_text_free(t);
    *t = o;
}

void *srv_token_json(const duet_model *m, int32_t id, unsigned char *bytes_out, int *n_bytes) {
    char piece[256];
    int n = duet_token_piece(m, id, piece, sizeof piece);
    if (n < 0) n = 0;
    if (n > (int)sizeof piece - 1) n = (int)sizeof piece - 1;
    piece[n] = 0;
    if (bytes_out) memcpy(bytes_out, piece, (size_t)n);
    if (n_bytes) *n_bytes = n;
    if (srv_utf8_valid_prefix(piece, (size_t)n) == (size_t)n && !memchr(piece, 0, (size_t)n))
        return cJSON_CreateString(piece);
    char esc[4 * 256 + 8] = "bytes:";
    size_t k = 6;
    for (int i = 0; i < n; i++)
        k += (size_t)snprintf(esc + k, sizeof esc - k, "\\x%02x", (unsigned char)piece[i]);
    return cJSON_CreateString(esc);
}

/* ---- errors ------------------------------------------------------------- */

bool srv_bad(srv_error *err, const char *param, const char *code, const char *fmt, ...) {
    err->http = 400;
    err->type = "invalid_request_error";
    err->code = code;
    snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    return false;
}

/* cJSON allocates with malloc by default; copying into a plain malloc'd
 * string keeps "free() it" true even if cJSON hooks are ever installed. */
static char *print_json(cJSON *o) {
    char *s = o ? cJSON_PrintUnformatted(o) : NULL;
    char *out = s ? strdup(s) : NULL;
    if (s) cJSON_free(s);
    cJSON_Delete(o);
    return out;
}

char *srv_error_json(const srv_error *err) {
    cJSON *o = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(o, "error");
    cJSON_AddStringToObject(e, "message", err->message);
    cJSON_AddStringToObject(e, "type", err->type ? err->type : "invalid_request_error");
    if (err->param[0]) cJSON_AddStringToObject(e, "param", err->param);
    else cJSON_AddNullToObject(e, "param");
    if (err->code) cJSON_AddStringToObject(e, "code", err->code);
    else cJSON_AddNullToObject(e, "code");
    return print_json(o);
}

/* ---- field readers: false with *err set on a bad value; a missing or null
 * field leaves *out alone ------------------------------------------------ */

static bool given(const cJSON *v) { return v && !cJSON_IsNull(v); }

static bool read_number(const cJSON *o, const char *key, double lo, double hi, bool lo_open, double *out,
                        srv_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!given(v)) return true;
    if (!cJSON_IsNumber(v)) return srv_bad(err, key, "invalid_type", "'%s' must be a number", key);
    double x = v->valuedouble;
    if (!isfinite(x) || x < lo || x > hi || (lo_open && x == lo))
        return srv_bad(err, key, "invalid_value", "'%s' is %g; it must be in %s%g, %g]", key, x, lo_open ? "(" : "[",
                       lo, hi);
    *out = x;
    return true;
}

static bool read_float(const cJSON *o, const char *key, double lo, double hi, bool lo_open, float *out,
                       srv_error *err) {
    double x = *out;
    if (!read_number(o, key, lo, hi, lo_open, &x, err)) return false;
    *out = (float)x;
    return true;
}

static bool read_int(const cJSON *o, const char *key, double lo, double hi, double *out, bool *present,
                     srv_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (present) *present = false;
    if (!given(v)) return true;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble != floor(v->valuedouble))
        return srv_bad(err, key, "invalid_type", "'%s' must be an integer", key);
    double x = v->valuedouble;
    if (x < lo || x > hi)
        return srv_bad(err, key, "invalid_value", "'%s' is %.0f; it must be in [%.0f, %.0f]", key, x, lo, hi);
    *out = x;
    if (present) *present = true;
    return true;
}

static bool read_bool(const cJSON *o, const char *key, bool *out, srv_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!given(v)) return true;
    if (!cJSON_IsBool(v)) return srv_bad(err, key, "invalid_type", "'%s' must be true or false", key);
    *out = cJSON_IsTrue(v);
    return true;
}

/* Fields duet does not implement: refused when they ask for something,
 * accepted when they hold their "off" value. */
static bool refuse_unsupported(const cJSON *o, srv_kind kind, srv_error *err) {
    const cJSON *v;
    v = cJSON_GetObjectItemCaseSensitive(o, "logit_bias");
    if (given(v) && !(cJSON_IsObject(v) && !v->child))
        return srv_bad(err, "logit_bias", "unsupported", "logit_bias is not supported");
    v = cJSON_GetObjectItemCaseSensitive(o, "suffix");
    if (given(v) && !(cJSON_IsString(v) && !v->valuestring[0]))
        return srv_bad(err, "suffix", "unsupported", "suffix is not supported");
    (void)kind;
    return true;
}

/* Completions: "logprobs": N (0..20) and "echo". Chat: "logprobs": true
 * and "top_logprobs": N (0..20, only with logprobs). */
static bool parse_logprobs(const cJSON *o, srv_request *r, srv_error *err) {
    double x = 0;
    bool present;
    if (r->kind == SRV_COMPLETION) {
        if (!read_int(o, "logprobs", 0, DUET_MAX_TOP_LOGPROBS, &x, &present, err)) return false;
        r->logprobs = present;
        r->top_logprobs = (int)x;
        return read_bool(o, "echo", &r->echo, err);
    }
    if (!read_bool(o, "logprobs", &r->logprobs, err)) return false;
    if (!read_int(o, "top_logprobs", 0, DUET_MAX_TOP_LOGPROBS, &x, &present, err)) return false;
    if (present && x > 0 && !r->logprobs)
        return srv_bad(err, "top_logprobs", "invalid_value", "'top_logprobs' needs \"logprobs\": true");
    r->top_logprobs = (int)x;
    return true;
}

/* "response_format": {"type": "text" | "json_object" | "json_schema",
 * "json_schema": {"name", "schema", "strict"}}, and llama.cpp's "grammar"
 * (GBNF text): either becomes r->grammar. */
static bool parse_structured(const cJSON *o, srv_request *r, srv_error *err) {
    const cJSON *g = cJSON_GetObjectItemCaseSensitive(o, "grammar");
    if (given(g)) {
        if (!cJSON_IsString(g))
            return srv_bad(err, "grammar", "invalid_type", "'grammar' must be a string (GBNF)");
        if (!(r->grammar = strdup(g->valuestring))) return srv_bad(err, "grammar", NULL, "out of memory");
    }
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "response_format");
    if (!given(v)) return true;
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(v, "type");
    if (!cJSON_IsObject(v) || !cJSON_IsString(ty))
        return srv_bad(err, "response_format", "invalid_type",
                       "'response_format' must be an object with a string 'type'");
    if (!strcmp(ty->valuestring, "text")) return true;
    bool object = !strcmp(ty->valuestring, "json_object");
    if (!object && strcmp(ty->valuestring, "json_schema"))
        return srv_bad(err, "response_format.type", "invalid_value",
                       "response_format type '%.64s' is not text, json_object or json_schema",
                       ty->valuestring);
    if (r->grammar)
        return srv_bad(err, "grammar", "invalid_value",
                       "'grammar' and a JSON 'response_format' exclude each other");
    char *schema = NULL;
    if (!object) {
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(v, "json_schema");
        if (!cJSON_IsObject(js))
            return srv_bad(err, "response_format.json_schema", "invalid_type",
                           "'json_schema' must be an object {\"name\", \"schema\"}");
        const cJSON *sc = cJSON_GetObjectItemCaseSensitive(js, "schema");
        if (given(sc) && !(schema = cJSON_PrintUnformatted(sc)))
            return srv_bad(err, "response_format", NULL, "out of memory");
    }
    duet_status st = duet_json_schema_to_gbnf(schema, &r->grammar);
    if (schema) cJSON_free(schema);
    if (st)
        return srv_bad(err, "response_format.json_schema", st == DUET_OUT_OF_MEMORY ? NULL : "invalid_value",
                       "%s", duet_last_error());
    return true;
}

static bool parse_stop(const cJSON *o, srv_request *r, srv_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "stop");
    if (!given(v)) return true;
    const cJSON *one = cJSON_IsString(v) ? v : NULL;
    if (!one && !cJSON_IsArray(v))
        return srv_bad(err, "stop", "invalid_type", "'stop' must be a string or an array of strings");
    if (!one && cJSON_GetArraySize(v) > SRV_MAX_STOP)
        return srv_bad(err, "stop", "invalid_value", "at most %d stop strings", SRV_MAX_STOP);
    const cJSON *it = one ? one : v->child;
    for (; it; it = one ? NULL : it->next) {
        if (!cJSON_IsString(it)) return srv_bad(err, "stop", "invalid_type", "every stop sequence must be a string");
        size_t n = strlen(it->valuestring);
        if (n == 0) return srv_bad(err, "stop", "invalid_value", "a stop sequence must not be empty");
        if (n > SRV_MAX_STOP_LEN)
            return srv_bad(err, "stop", "invalid_value", "a stop sequence may be at most %d bytes", SRV_MAX_STOP_LEN);
        if (!(r->stop[r->n_stop++] = strdup(it->valuestring)))
            return srv_bad(err, "stop", NULL, "out of memory");
    }
    return true;
}

static bool parse_priority(const cJSON *o, srv_request *r, srv_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "priority");
    if (!given(v)) return true;
    if (cJSON_IsString(v)) {
        if (!strcmp(v->valuestring, "interactive")) r->priority = DUET_PRIORITY_INTERACTIVE;
        else if (!strcmp(v->valuestring, "batch")) r->priority = DUET_PRIORITY_BATCH;
        else return srv_bad(err, "priority", "invalid_value", "'priority' must be \"interactive\" or \"batch\"");
        return true;
    }
    /* vLLM: an integer, lower is served first, default 0. */
    double x = 0;
    if (!read_int(o, "priority", -1e9, 1e9, &x, NULL, err))
        return srv_bad(err, "priority", "invalid_type", "'priority' must be \"interactive\", \"batch\" or an integer");
    r->priority = x > 0 ? DUET_PRIORITY_BATCH : DUET_PRIORITY_INTERACTIVE;
    return true;
}

/* One completion prompt: a string or an array of token ids. */
static bool parse_one_prompt(const cJSON *v, const srv_limits *lim, srv_prompt *p, srv_error *err) {
    if (cJSON_IsString(v)) {
        if (!(p->text = strdup(v->valuestring))) return srv_bad(err, "prompt", NULL, "out of memory");
        return true;
    }
    int n = cJSON_GetArraySize(v);
    if (n == 0) return srv_bad(err, "prompt", "invalid_value", "a token-id prompt must not be empty");
    if (!(p->ids = malloc((size_t)n * sizeof *p->ids))) return srv_bad(err, "prompt", NULL, "out of memory");
    for (const cJSON *it = v->child; it; it = it->next) {
        double x = cJSON_IsNumber(it) ? it->valuedouble : -1;
        if (!cJSON_IsNumber(it) || x != floor(x) || x < 0 || x >= lim->n_vocab)
            return srv_bad(err, "prompt", "invalid_value", "prompt token ids must be integers in [0, %d)", lim->n_vocab);
        p->ids[p->n_ids++] = (int32_t)x;
    }
    return true;
}

static bool is_id_array(const cJSON *v) { return cJSON_IsArray(v) && v->child && cJSON_IsNumber(v->child); }

static bool parse_prompts(const cJSON *o, const srv_limits *lim, srv_request *r, srv_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "prompt");
    if (!given(v)) return srv_bad(err, "prompt", "missing_required_parameter", "'prompt' is required");
    /* A string, an array of ids, or an array of either (several prompts). */
    if (cJSON_IsString(v) || is_id_array(v)) {
        r->n_prompts = 1;
        return parse_one_prompt(v, lim, &r->prompts[0], err);
    }
    if (!cJSON_IsArray(v) || !v->child)
        return srv_bad(err, "prompt", "invalid_type",
                       "'prompt' must be a string, an array of strings, or an array of token ids");
    if (cJSON_GetArraySize(v) > SRV_MAX_PROMPTS)
        return srv_bad(err, "prompt", "invalid_value", "at most %d prompts per request", SRV_MAX_PROMPTS);
    for (const cJSON *it = v->child; it; it = it->next) {
        if (!cJSON_IsString(it) && !is_id_array(it))
            return srv_bad(err, "prompt", "invalid_type",
                           "'prompt' must be a string, an array of strings, or an array of token ids");
        if (!parse_one_prompt(it, lim, &r->prompts[r->n_prompts++], err)) return false;
    }
    return true;
}

/* Message content: a string, null, or an array of {"type":"text"} parts
 * (joined with newlines, as vLLM does). */
static bool parse_content(const cJSON *c, int i, char **out, srv_error *err) {
    char param[32];
    snprintf(param, sizeof param, "messages[%d].content", i);
    if (!given(c)) return (*out = strdup("")) != NULL || srv_bad(err, param, NULL, "out of memory");
    if (cJSON_IsString(c)) return (*out = strdup(c->valuestring)) != NULL || srv_bad(err, param, NULL, "out of memory");
    if (!cJSON_IsArray(c)) return srv_bad(err, param, "invalid_type", "content must be a string or an array of parts");
    srv_text t = {0};
    for (const cJSON *part = c->child; part; part = part->next) {
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *tx = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(ty) || strcmp(ty->valuestring, "text") || !cJSON_IsString(tx)) {
            srv_text_free(&t);
            return srv_bad(err, param, "unsupported", "only text content parts are supported");
        }
        if ((t.len && !srv_text_append(&t, "\n", 1)) || !srv_text_append(&t, tx->valuestring, strlen(tx->valuestring))) {
            srv_text_free(&t);
            return srv_bad(err, param, NULL, "out of memory");
        }
    }
    *out = t.p ? t.p : strdup("");
    return *out != NULL || srv_bad(err, param, NULL, "out of memory");
}

/* An assistant message's "tool_calls" as the template reads them: each
 * {"id", "type": "function", "function": {"name", "arguments"}} with the
 * arguments (a JSON string in OpenAI's API) as the object they spell,
 * which is what templates print with tojson (transformers passes dicts). */
static bool copy_tool_calls(const cJSON *tc, int i, cJSON *msg, srv_error *err) {
    char param[48];
    snprintf(param, sizeof param, "messages[%d].tool_calls", i);
    if (!cJSON_IsArray(tc)) return srv_bad(err, param, "invalid_type", "'tool_calls' must be an array");
    cJSON *arr = cJSON_AddArrayToObject(msg, "tool_calls");
    if (!arr) return srv_bad(err, param, NULL, "out of memory");
    for (const cJSON *c = tc->child; c; c = c->next) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(c, "id");
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(c, "function");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(f, "name");
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(f, "arguments");
        if (!cJSON_IsObject(c) || !cJSON_IsObject(f) || !cJSON_IsString(name) ||
            (given(id) && !cJSON_IsString(id)) ||
            (given(args) && !cJSON_IsString(args) && !cJSON_IsObject(args)))
            return srv_bad(err, param, "invalid_type",
                           "each tool call must be {\"id\": string, \"type\": \"function\", \"function\": "
                           "{\"name\": string, \"arguments\": string}}");
        cJSON *call = cJSON_CreateObject(), *fn = NULL, *a = NULL;
        if (!call || !cJSON_AddItemToArray(arr, call))
            return cJSON_Delete(call), srv_bad(err, param, NULL, "out of memory");
        if (cJSON_IsString(args)) a = cJSON_Parse(args->valuestring);
        if (cJSON_IsString(args) && !cJSON_IsObject(a))
            cJSON_Delete(a), a = cJSON_CreateString(args->valuestring);
        if (cJSON_IsObject(args)) a = cJSON_Duplicate(args, true);
        if (!given(args)) a = cJSON_CreateObject();
        bool ok = (!given(id) || cJSON_AddStringToObject(call, "id", id->valuestring)) &&
                  cJSON_AddStringToObject(call, "type", "function") &&
                  (fn = cJSON_AddObjectToObject(call, "function")) &&
                  cJSON_AddStringToObject(fn, "name", name->valuestring);
        if (!ok || !a || !cJSON_AddItemToObject(fn, "arguments", a)) {
            cJSON_Delete(a);
            return srv_bad(err, param, NULL, "out of memory");
        }
    }
    return true;
}

static bool parse_messages(const cJSON *o, srv_request *r, srv_error *err) {
    static const char *const role_names[] = {"system", "user", "assistant", "tool"};
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "messages");
    if (!given(v)) return srv_bad(err, "messages", "missing_required_parameter", "'messages' is required");
    if (!cJSON_IsArray(v) || !v->child)
        return srv_bad(err, "messages", "invalid_type", "'messages' must be a non-empty array");
    int n = cJSON_GetArraySize(v);
    if (n > 4096) return srv_bad(err, "messages", "invalid_value", "at most 4096 messages");
    if (!(r->messages = calloc((size_t)n, sizeof *r->messages))) return srv_bad(err, "messages", NULL, "out of memory");
    cJSON *out = cJSON_CreateArray();
    if (!out) return srv_bad(err, "messages", NULL, "out of memory");
    int i = 0;
    bool ok = true;
    for (const cJSON *m = v->child; ok && m; m = m->next, i++) {
        char param[40];
        snprintf(param, sizeof param, "messages[%d].role", i);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsObject(m) || !cJSON_IsString(role)) {
            ok = srv_bad(err, param, "invalid_type", "each message must be an object with a string 'role'");
            break;
        }
        const char *s = role->valuestring;
        srv_message *msg = &r->messages[i];
        if (!strcmp(s, "system") || !strcmp(s, "developer")) msg->role = SRV_ROLE_SYSTEM;
        else if (!strcmp(s, "user")) msg->role = SRV_ROLE_USER;
        else if (!strcmp(s, "assistant")) msg->role = SRV_ROLE_ASSISTANT;
        else if (!strcmp(s, "tool"))
            msg->role = SRV_ROLE_TOOL;
        else {
            ok = srv_bad(err, param, "invalid_value",
                         "role '%.64s' is not supported (system, user, assistant, tool)", s);
            break;
        }
        r->n_messages = i + 1;
        if (!(ok = parse_content(cJSON_GetObjectItemCaseSensitive(m, "content"), i, &msg->content, err)))
            break;
        cJSON *c = cJSON_CreateObject();
        if (!c || !cJSON_AddItemToArray(out, c)) {
            cJSON_Delete(c);
            ok = srv_bad(err, "messages", NULL, "out of memory");
            break;
        }
        if (!cJSON_AddStringToObject(c, "role", role_names[msg->role]) ||
            !cJSON_AddStringToObject(c, "content", msg->content)) {
            ok = srv_bad(err, "messages", NULL, "out of memory");
            break;
        }
        /* What tool turns carry besides their text. */
        const cJSON *tc = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
        if (msg->role == SRV_ROLE_ASSISTANT && given(tc) && !(ok = copy_tool_calls(tc, i, c, err))) break;
        static const char *const strings[] = {"tool_call_id", "name"};
        for (int k = 0; ok && k < 2; k++) {
            const cJSON *x = cJSON_GetObjectItemCaseSensitive(m, strings[k]);
            if (!given(x)) continue;
            snprintf(param, sizeof param, "messages[%d].%s", i, strings[k]);
            if (!cJSON_IsString(x))
                ok = srv_bad(err, param, "invalid_type", "'%s' must be a string", strings[k]);
            else if (!cJSON_AddStringToObject(c, strings[k], x->valuestring))
                ok = srv_bad(err, param, NULL, "out of memory");
        }
    }
    if (ok && !(r->messages_json = cJSON_PrintUnformatted(out)))
        ok = srv_bad(err, "messages", NULL, "out of memory");
    cJSON_Delete(out);
    return ok;
}

/* A function name as OpenAI allows it: [a-zA-Z0-9_-]{1,64}. */
static bool function_name_ok(const char *s) {
    size_t n = strlen(s);
    if (n < 1 || n > 64) return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') ||
              s[i] == '_' || s[i] == '-'))
            return false;
    return true;
}

/* "tools": [{"type": "function", "function": {"name", "description",
 * "parameters"}}], "tool_choice": "none" | "auto" | "required" |
 * {"type": "function", "function": {"name"}}, "parallel_tool_calls". */
static bool parse_tools(const cJSON *o, srv_request *r, srv_error *err) {
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(o, "tools");
    const cJSON *choice = cJSON_GetObjectItemCaseSensitive(o, "tool_choice");
    const cJSON *par = cJSON_GetObjectItemCaseSensitive(o, "parallel_tool_calls");
    if (given(par) && !cJSON_IsBool(par))
        return srv_bad(err, "parallel_tool_calls", "invalid_type",
                       "'parallel_tool_calls' must be true or false");
    int n = 0;
    if (given(tools)) {
        if (!cJSON_IsArray(tools)) return srv_bad(err, "tools", "invalid_type", "'tools' must be an array");
        n = cJSON_GetArraySize(tools);
        if (n > SRV_MAX_TOOLS)
            return srv_bad(err, "tools", "invalid_value", "at most %d tools", SRV_MAX_TOOLS);
        int i = 0;
        for (const cJSON *t = tools->child; t; t = t->next, i++) {
            char param[32];
            snprintf(param, sizeof param, "tools[%d]", i);
            const cJSON *ty = cJSON_GetObjectItemCaseSensitive(t, "type");
            const cJSON *f = cJSON_GetObjectItemCaseSensitive(t, "function");
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(f, "name");
            const cJSON *desc = cJSON_GetObjectItemCaseSensitive(f, "description");
            const cJSON *params = cJSON_GetObjectItemCaseSensitive(f, "parameters");
            if (!cJSON_IsObject(t) || !cJSON_IsString(ty) || strcmp(ty->valuestring, "function") ||
                !cJSON_IsObject(f) || !cJSON_IsString(name) || (given(desc) && !cJSON_IsString(desc)) ||
                (given(params) && !cJSON_IsObject(params)))
                return srv_bad(err, param, "invalid_type",
                               "each tool must be {\"type\": \"function\", \"function\": {\"name\": string, "
                               "\"description\": string, \"parameters\": JSON Schema object}}");
            if (!function_name_ok(name->valuestring))
                return srv_bad(err, param, "invalid_value",
                               "a function name must match ^[a-zA-Z0-9_-]{1,64}$");
        }
    }
    r->tool_choice = n ? SRV_TOOLS_AUTO : SRV_TOOLS_NONE;
    if (given(choice)) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(choice, "function");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(f, "name");
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(choice, "type");
        if (cJSON_IsString(choice) && !strcmp(choice->valuestring, "none"))
            r->tool_choice = SRV_TOOLS_NONE;
        else if (cJSON_IsString(choice) && !strcmp(choice->valuestring, "auto"))
            r->tool_choice = n ? SRV_TOOLS_AUTO : SRV_TOOLS_NONE;
        else if (cJSON_IsString(choice) && !strcmp(choice->valuestring, "required"))
            r->tool_choice = SRV_TOOLS_REQUIRED;
        else if (cJSON_IsObject(choice) && cJSON_IsString(ty) && !strcmp(ty->valuestring, "function") &&
                 cJSON_IsString(name)) {
            r->tool_choice = SRV_TOOLS_NAMED;
            snprintf(r->tool_name, sizeof r->tool_name, "%.64s", name->valuestring);
            bool found = false;
            for (const cJSON *t = n ? tools->child : NULL; t && !found; t = t->next) {
                const cJSON *tn =
                    cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(t, "function"), "name");
                found = !strcmp(tn->valuestring, name->valuestring);
            }
            if (!found)
                return srv_bad(err, "tool_choice", "invalid_value",
                               "tool_choice names '%.64s', which is not in 'tools'", name->valuestring);
        } else {
            return srv_bad(
                err, "tool_choice", "invalid_value",
                "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                "\"function\": {\"name\": string}}");
        }
        if (r->tool_choice == SRV_TOOLS_REQUIRED && !n)
            return srv_bad(err, "tool_choice", "invalid_value", "tool_choice \"required\" needs 'tools'");
    }
    if (r->tool_choice == SRV_TOOLS_NONE) return true;
    if ((r->tool_choice == SRV_TOOLS_REQUIRED || r->tool_choice == SRV_TOOLS_NAMED) && r->grammar)
        return srv_bad(err, "tool_choice", "invalid_value",
                       "a required tool call and a 'grammar' or JSON 'response_format' exclude each other");
    if (!(r->tools_json = cJSON_PrintUnformatted(tools))) return srv_bad(err, "tools", NULL, "out of memory");
    return true;
}

static bool parse_model(const cJSON *o, const srv_limits *lim, srv_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "model");
    if (!given(v)) return true; /* curl users may leave it out: there is one model */
    if (!cJSON_IsString(v)) return srv_bad(err, "model", "invalid_type", "'model' must be a string");
    if (!strcmp(v->valuestring, lim->model_name) || (lim->model_alias && !strcmp(v->valuestring, lim->model_alias)))
        return true;
    /* OpenAI and vLLM answer an unknown model with 404. */
    srv_bad(err, "model", "model_not_found", "The model '%.200s' does not exist; this server serves '%.200s'",
            v->valuestring, lim->model_name);
    err->http = 404;
    return false;
}

static bool parse_fields(const cJSON *o, const srv_limits *lim, srv_request *r, srv_error *err) {
    if (!parse_model(o, lim, err) || !refuse_unsupported(o, r->kind, err)) return false;
    if (r->kind == SRV_COMPLETION ? !parse_prompts(o, lim, r, err) : !parse_messages(o, r, err)) return false;

    /* Tokens: max_completion_tokens (chat's newer name) wins over max_tokens. */
    double x;
    bool present;
    if (!read_int(o, "max_tokens", 1, 1 << 24, &x, &present, err)) return false;
    if (present) r->max_tokens = (int)x;
    if (!read_int(o, "max_completion_tokens", 1, 1 << 24, &x, &present, err)) return false;
    if (present) r->max_tokens = (int)x;

    duet_sampling *s = &r->sampling;
    if (!read_float(o, "temperature", 0, 2, false, &s->temperature, err)) return false;
    if (!read_float(o, "top_p", 0, 1, true, &s->top_p, err)) return false;
    if (!read_float(o, "min_p", 0, 1, false, &s->min_p, err)) return false;
    if (!read_float(o, "presence_penalty", -2, 2, false, &s->presence_penalty, err)) return false;
    if (!read_float(o, "frequency_penalty", -2, 2, false, &s->frequency_penalty, err)) return false;
    if (!read_float(o, "repetition_penalty", 0, 10, true, &s->repetition_penalty, err)) return false;
    /* top_k: vLLM's -1 and 0 both mean off. */
    x = 0;
    if (!read_int(o, "top_k", -1, 1 << 24, &x, &present, err)) return false;
    if (present) s->top_k = x < 0 ? 0 : (int)x;
    /* seed: any 64-bit integer; the bits are what the sampler uses. */
    if (!read_int(o, "seed", -9223372036854775808.0, 18446744073709551615.0, &x, &r->seed_set, err)) return false;
    if (r->seed_set) s->seed = x < 0 ? (uint64_t)(int64_t)x : (x >= 18446744073709551615.0 ? UINT64_MAX : (uint64_t)x);

    x = 1;
    if (!read_int(o, "n", 1, SRV_MAX_N, &x, NULL, err)) return false;
    r->n = (int)x;
    /* best_of (completions) only as a synonym of n. */
    double best_of = r->n;
    if (!read_int(o, "best_of", 1, SRV_MAX_N, &best_of, NULL, err)) return false;
    if ((int)best_of != r->n) return srv_bad(err, "best_of", "unsupported", "best_of other than n is not supported");
    if (r->n * (r->kind == SRV_COMPLETION ? r->n_prompts : 1) > SRV_MAX_N * 4)
        return srv_bad(err, "n", "invalid_value", "n times the number of prompts may be at most %d", SRV_MAX_N * 4);

    if (!read_bool(o, "stream", &r->stream, err) || !read_bool(o, "ignore_eos", &r->ignore_eos, err)) return false;
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(o, "stream_options");
    if (given(so)) {
        if (!cJSON_IsObject(so)) return srv_bad(err, "stream_options", "invalid_type", "'stream_options' must be an object");
        if (!r->stream)
            return srv_bad(err, "stream_options", "invalid_value", "'stream_options' is only allowed with \"stream\": true");
        const cJSON *iu = cJSON_GetObjectItemCaseSensitive(so, "include_usage");
        if (given(iu) && !cJSON_IsBool(iu))
            return srv_bad(err, "stream_options.include_usage", "invalid_type", "'include_usage' must be true or false");
        r->include_usage = cJSON_IsTrue(iu);
    }
    /* timeout: duet's own field, seconds until the server gives up on it. */
    if (!read_number(o, "timeout", 0, 86400 * 7, true, &r->timeout_s, err)) return false;
    return parse_stop(o, r, err) && parse_priority(o, r, err) && parse_logprobs(o, r, err) &&
           parse_structured(o, r, err) && (r->kind != SRV_CHAT || parse_tools(o, r, err));
}

/* True when a JSON string in body holds the escape \u0000. cJSON decodes
 * it into a NUL that ends the C string, so the text after it would vanish
 * without a word; escapes are skipped in pairs, so "\\u0000" (a
 * backslash, then "u0000") is not one. */
static bool has_nul_escape(const char *body, size_t len) {
    for (size_t i = 0; i + 1 < len; i++) {
        if (body[i] != '\\') continue;
        if (body[i + 1] == 'u' && i + 5 < len && !memcmp(body + i + 2, "0000", 4)) return true;
        i++; /* the escaped character */
    }
    return false;
}

bool srv_request_parse(srv_kind kind, const char *body, size_t len, const srv_limits *lim, srv_request *out,
                       srv_error *err) {
    memset(out, 0, sizeof *out);
    memset(err, 0, sizeof *err);
    out->kind = kind;
    out->max_tokens = -1;
    out->n = 1;
    /* OpenAI's defaults, not the CLI's: plain sampling at temperature 1. */
    duet_sampling *s = &out->sampling;
    *s = duet_sampling_default();
    s->temperature = 1;
    s->top_k = 0;
    s->top_p = 1;
    s->min_p = 0;
    s->repetition_penalty = 1;
    s->presence_penalty = 0;
    s->frequency_penalty = 0;
    s->penalty_last_n = 0;

    /* A raw NUL byte is not JSON anywhere (RFC 8259), and cJSON would end
     * the string holding it there: "pres\0..." would drop the field. */
    if (memchr(body, 0, len))
        return srv_bad(err, NULL, "invalid_json", "the request body is not valid JSON (it holds a NUL byte)");
    if (has_nul_escape(body, len))
        return srv_bad(err, NULL, "invalid_value", "a string in the request contains U+0000 (\\u0000), which duet does not accept");
    /* One JSON value and nothing after it but whitespace: cJSON stops at
     * the value's end, and `{"prompt":"a"}}` must not pass as valid. */
    const char *end = NULL;
    cJSON *o = cJSON_ParseWithLengthOpts(body, len, &end, false);
    while (o && end < body + len && (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r'))
        end++;
    if (o && end != body + len) {
        cJSON_Delete(o);
        return srv_bad(err, NULL, "invalid_json", "the request body has bytes after its JSON value");
    }
    if (!o) return srv_bad(err, NULL, "invalid_json", "the request body is not valid JSON");
    bool ok = cJSON_IsObject(o) ? parse_fields(o, lim, out, err)
                                : srv_bad(err, NULL, "invalid_json", "the request body must be a JSON object");
    cJSON_Delete(o);
    if (!ok) srv_request_free(out);
    return ok;
}

void srv_request_free(srv_request *r) {
    for (int i = 0; i < r->n_prompts; i++) free(r->prompts[i].text), free(r->prompts[i].ids);
    for (int i = 0; i < r->n_messages; i++) free(r->messages[i].content);
    free(r->messages);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->grammar);
    cJSON_free(r->messages_json);
    cJSON_free(r->tools_json);
    memset(r, 0, sizeof *r);
}


/* ---- responses ------------------------------------------------------ */

static const char *object_name(srv_kind kind, bool chunk) {
    if (kind == SRV_CHAT) return chunk ? "chat.completion.chunk" : "chat.completion";
    return "text_completion";
}

static cJSON *response_head(srv_kind kind, bool chunk, const char *id, long created, const char *model) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddStringToObject(o, "object", object_name(kind, chunk));
    cJSON_AddNumberToObject(o, "created", (double)created);
    cJSON_AddStringToObject(o, "model", model);
    return o;
}

/* A slice of text as a JSON string. cJSON strings end at NUL, so a NUL
 * byte the model wrote is dropped rather than cutting the text short. */
static cJSON *string_n(const char *s, size_t n) {
    char *c = malloc(n + 1);
    if (!c) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (s[i]) c[k++] = s[i];
    c[k] = 0;
    cJSON *v = cJSON_CreateString(c);
    free(c);
    return v;
}

static void add_usage(cJSON *o, srv_usage u) {
    cJSON *us = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(us, "prompt_tokens", u.prompt_tokens);
    cJSON_AddNumberToObject(us, "completion_tokens", u.completion_tokens);
    cJSON_AddNumberToObject(us, "total_tokens", u.prompt_tokens + u.completion_tokens);
}

char *srv_response_json(srv_kind kind, const char *id, long created, const char *model,
                        const srv_choice_result *choices, int n, srv_usage usage) {
    cJSON *o = response_head(kind, false, id, created, model);
    cJSON *arr = cJSON_AddArrayToObject(o, "choices");
    for (int i = 0; i < n; i++) {
        cJSON *c = cJSON_CreateObject();
        cJSON_AddNumberToObject(c, "index", i);
        cJSON *text = string_n(choices[i].text ? choices[i].text : "", choices[i].text ? choices[i].len : 0);
        if (kind == SRV_CHAT) {
            cJSON *m = cJSON_AddObjectToObject(c, "message");
            cJSON_AddStringToObject(m, "role", "assistant");
            const duet_tool_calls *tc = choices[i].calls;
            if (tc && tc->n && !choices[i].len) {
                cJSON_Delete(text);
                cJSON_AddNullToObject(m, "content");
            } else {
                cJSON_AddItemToObject(m, "content", text);
            }
            if (tc && tc->n) {
                cJSON *calls = cJSON_AddArrayToObject(m, "tool_calls");
                for (int k = 0; k < tc->n; k++) {
                    cJSON *call = cJSON_CreateObject(), *fn;
                    cJSON_AddItemToArray(calls, call);
                    cJSON_AddStringToObject(call, "id", choices[i].call_ids[k]);
                    cJSON_AddStringToObject(call, "type", "function");
                    fn = cJSON_AddObjectToObject(call, "function");
                    cJSON_AddStringToObject(fn, "name", tc->call[k].name ? tc->call[k].name : "");
                    cJSON_AddItemToObject(fn, "arguments",
                                          string_n(tc->call[k].arguments, tc->call[k].arguments_len));
                }
            }
        } else {
            cJSON_AddItemToObject(c, "text", text);
        }
        if (choices[i].logprobs)
            cJSON_AddItemToObject(
                c, "logprobs", srv_logprobs_json(kind, choices[i].model, choices[i].lp, choices[i].n_lp, 0));
        else
            cJSON_AddNullToObject(c, "logprobs");
        cJSON_AddStringToObject(c, "finish_reason", choices[i].finish);
        cJSON_AddItemToArray(arr, c);
    }
    add_usage(o, usage);
    return print_json(o);
}

static bool append_sse(srv_text *out, cJSON *o) {
    char *s = print_json(o);
    if (!s) return false;
    bool ok = srv_text_printf(out, "data: %s\n\n", s);
    free(s);
    return ok;
}

bool srv_chunk_sse(srv_text *out, srv_kind kind, const char *id, long created, const char *model, int index,
                   const char *text, size_t len, const char *finish, bool role, bool null_usage) {
    return srv_chunk_sse_lp(out, kind, id, created, model, index, text, len, finish, role, null_usage, NULL,
                            0);
}

/* OpenAI writes -inf as -9999. */
static double lp_num(float x) {
    return isfinite(x) ? x : -9999.0;
}

static cJSON *bytes_array(const unsigned char *b, int n) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(b[i]));
    return a;
}

void *srv_logprobs_json(srv_kind kind, const duet_model *m, const srv_lp *lp, int n, size_t text_offset0) {
    cJSON *o = cJSON_CreateObject();
    unsigned char bytes[256];
    int nb;
    if (kind == SRV_CHAT) {
        cJSON *content = cJSON_AddArrayToObject(o, "content");
        for (int i = 0; i < n; i++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddItemToObject(e, "token", srv_token_json(m, lp[i].token, bytes, &nb));
            cJSON_AddNumberToObject(e, "logprob", lp_num(lp[i].logprob));
            cJSON_AddItemToObject(e, "bytes", bytes_array(bytes, nb));
            cJSON *top = cJSON_AddArrayToObject(e, "top_logprobs");
            for (int k = 0; k < lp[i].n_top; k++) {
                cJSON *t = cJSON_CreateObject();
                cJSON_AddItemToObject(t, "token", srv_token_json(m, lp[i].top[k].token, bytes, &nb));
                cJSON_AddNumberToObject(t, "logprob", lp_num(lp[i].top[k].logprob));
                cJSON_AddItemToObject(t, "bytes", bytes_array(bytes, nb));
                cJSON_AddItemToArray(top, t);
            }
            cJSON_AddItemToArray(content, e);
        }
        return o;
    }
    cJSON *tokens = cJSON_AddArrayToObject(o, "tokens"), *tlp = cJSON_AddArrayToObject(o, "token_logprobs");
    cJSON *top = cJSON_AddArrayToObject(o, "top_logprobs"), *off = cJSON_AddArrayToObject(o, "text_offset");
    size_t at = text_offset0;
    for (int i = 0; i < n; i++) {
        cJSON *name = srv_token_json(m, lp[i].token, bytes, &nb);
        cJSON_AddItemToArray(off, cJSON_CreateNumber((double)at));
        at += (size_t)nb;
        if (!lp[i].has) {
            cJSON_AddItemToArray(tokens, name);
            cJSON_AddItemToArray(tlp, cJSON_CreateNull());
            cJSON_AddItemToArray(top, cJSON_CreateNull());
            continue;
        }
        /* The top tokens as {text: logprob}, with the chosen one added as
         * vLLM does (a dict keeps one entry per distinct text). */
        cJSON *d = cJSON_CreateObject();
        for (int k = 0; k < lp[i].n_top; k++) {
            cJSON *t = srv_token_json(m, lp[i].top[k].token, NULL, NULL);
            if (t && !cJSON_GetObjectItemCaseSensitive(d, t->valuestring))
                cJSON_AddNumberToObject(d, t->valuestring, lp_num(lp[i].top[k].logprob));
            cJSON_Delete(t);
        }
        if (lp[i].n_top > 0 && !cJSON_GetObjectItemCaseSensitive(d, name->valuestring))
            cJSON_AddNumberToObject(d, name->valuestring, lp_num(lp[i].logprob));
        cJSON_AddItemToArray(tokens, name);
        cJSON_AddItemToArray(tlp, cJSON_CreateNumber(lp_num(lp[i].logprob)));
        cJSON_AddItemToArray(top, d);
    }
    return o;
}

bool srv_chunk_sse_lp(srv_text *out, srv_kind kind, const char *id, long created, const char *model,
                      int index, const char *text, size_t len, const char *finish, bool role, bool null_usage,
                      const srv_choice_result *lp, size_t text_offset0) {
    cJSON *o = response_head(kind, true, id, created, model);
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", index);
    if (kind == SRV_CHAT) {
        cJSON *d = cJSON_AddObjectToObject(c, "delta");
        if (role) {
            cJSON_AddStringToObject(d, "role", "assistant");
            cJSON_AddStringToObject(d, "content", "");
        } else if (!finish) {
            cJSON_AddItemToObject(d, "content", string_n(text ? text : "", text ? len : 0));
        }
    } else {
        cJSON_AddItemToObject(c, "text", string_n(text ? text : "", text ? len : 0));
    }
    if (lp && lp->logprobs && !role)
        cJSON_AddItemToObject(c, "logprobs",
                              srv_logprobs_json(kind, lp->model, lp->lp, lp->n_lp, text_offset0));
    else
        cJSON_AddNullToObject(c, "logprobs");
    if (finish) cJSON_AddStringToObject(c, "finish_reason", finish);
    else cJSON_AddNullToObject(c, "finish_reason");
    cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "choices"), c);
    if (null_usage) cJSON_AddNullToObject(o, "usage");
    return append_sse(out, o);
}

bool srv_tool_chunk_sse(srv_text *out, const char *id, long created, const char *model, int index, int call,
                        const char *call_id, const char *name, const char *args, size_t args_len,
                        bool null_usage) {
    cJSON *o = response_head(SRV_CHAT, true, id, created, model);
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", index);
    cJSON *d = cJSON_AddObjectToObject(c, "delta");
    cJSON *tc = cJSON_CreateObject();
    cJSON_AddItemToArray(cJSON_AddArrayToObject(d, "tool_calls"), tc);
    cJSON_AddNumberToObject(tc, "index", call);
    if (call_id) {
        cJSON_AddStringToObject(tc, "id", call_id);
        cJSON_AddStringToObject(tc, "type", "function");
    }
    cJSON *fn = cJSON_AddObjectToObject(tc, "function");
    if (name) cJSON_AddStringToObject(fn, "name", name);
    cJSON_AddItemToObject(fn, "arguments", string_n(args ? args : "", args ? args_len : 0));
    cJSON_AddNullToObject(c, "logprobs");
    cJSON_AddNullToObject(c, "finish_reason");
    cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "choices"), c);
    if (null_usage) cJSON_AddNullToObject(o, "usage");
    return append_sse(out, o);
}

bool srv_usage_sse(srv_text *out, srv_kind kind, const char *id, long created, const char *model, srv_usage u) {
    cJSON *o = response_head(kind, true, id, created, model);
    cJSON_AddArrayToObject(o, "choices");
    add_usage(o, u);
    return append_sse(out, o);
}

char *srv_conversation_json(const srv_request *r) {
    srv_text t = {0};
    bool ok = srv_text_printf(&t, "{\"messages\":%s", r->messages_json ? r->messages_json : "[]") &&
              (!r->tools_json || srv_text_printf(&t, ",\"tools\":%s", r->tools_json)) &&
              srv_text_append(&t, "}", 1);
    if (!ok) srv_text_free(&t);
    return t.p;
}
