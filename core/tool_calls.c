/* tool_calls.c — tool-call syntaxes: detection, parsing, grammars; see
 * tool_calls.h. The parser rescans the whole reply each time it is called
 * (replies are short, and a stateless parser cannot disagree with itself
 * between a stream and its final answer). */
#include "tool_calls.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "duet_internal.h"
#include "json_schema.h"

#define MAX_NEST 64

const char *duet_tool_syntax_name(duet_tool_syntax s) {
    switch (s) {
    case DUET_TOOL_SYNTAX_HERMES:
        return "hermes";
    case DUET_TOOL_SYNTAX_LLAMA3:
        return "llama3";
    case DUET_TOOL_SYNTAX_MISTRAL:
        return "mistral";
    default:
        return "none";
    }
}

/* ---- detection ----------------------------------------------------------- */

duet_tool_syntax duet__tool_syntax_detect(const char *rendered) {
    if (!rendered) return DUET_TOOL_SYNTAX_NONE;
    /* The call is the last mention of the probe's name (the tool
     * definitions, when rendered, come before it). */
    const char *call = NULL;
    for (const char *p = rendered; (p = strstr(p, DUET__TOOL_PROBE_NAME)); p++)
        call = p;
    if (!call) return DUET_TOOL_SYNTAX_NONE;
    /* What the template writes just before the call. */
    size_t back = (size_t)(call - rendered) < 96 ? (size_t)(call - rendered) : 96;
    char before[97];
    memcpy(before, call - back, back);
    before[back] = '\0';
    if (strstr(before, "<tool_call>")) return DUET_TOOL_SYNTAX_HERMES;
    if (strstr(before, "[TOOL_CALLS]")) return DUET_TOOL_SYNTAX_MISTRAL;
    /* A bare JSON object {"name": "duet_probe_fn", ...}. */
    const char *brace = strrchr(before, '{');
    if (brace && strstr(brace, "\"name\"")) {
        const char *after = call + strlen(DUET__TOOL_PROBE_NAME);
        if (strstr(after, "\"parameters\"") || strstr(after, "\"arguments\"")) return DUET_TOOL_SYNTAX_LLAMA3;
    }
    return DUET_TOOL_SYNTAX_NONE;
}

/* ---- a small JSON scanner over a growing text ---------------------------- */

typedef enum { SCAN_BAD = -1, SCAN_MORE = 0, SCAN_OK = 1 } scan;

static bool is_ws(char c) {
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

static size_t skip_ws(const char *t, size_t len, size_t i) {
    while (i < len && is_ws(t[i]))
        i++;
    return i;
}

/* A string token at t[i] == '"': *end after its closing quote. */
static scan scan_string(const char *t, size_t len, size_t i, size_t *end) {
    for (i++; i < len; i++) {
        if (t[i] == '\\') {
            i++;
            continue;
        }
        if (t[i] == '"') return *end = i + 1, SCAN_OK;
        if ((unsigned char)t[i] < 0x20) return SCAN_BAD;
    }
    return SCAN_MORE;
}

/* Any JSON value at t[i] (no leading whitespace). A number or literal that
 * runs to the end of the text is whole only when the text is final. */
static scan scan_value(const char *t, size_t len, size_t i, bool final, size_t *end) {
    if (i >= len) return SCAN_MORE;
    if (t[i] == '"') return scan_string(t, len, i, end);
    if (t[i] == '{' || t[i] == '[') {
        char stack[MAX_NEST];
        int depth = 0;
        for (; i < len; i++) {
            char c = t[i];
            if (c == '"') {
                size_t e;
                scan s = scan_string(t, len, i, &e);
                if (s != SCAN_OK) return s;
                i = e - 1;
            } else if (c == '{' || c == '[') {
                if (depth == MAX_NEST) return SCAN_BAD;
                stack[depth++] = c == '{' ? '}' : ']';
            } else if (c == '}' || c == ']') {
                if (!depth || stack[depth - 1] != c) return SCAN_BAD;
                if (--depth == 0) return *end = i + 1, SCAN_OK;
            }
        }
        return SCAN_MORE;
    }
    size_t k = i;
    while (k < len && (strchr("+-.eE", t[k]) || (t[k] >= '0' && t[k] <= '9') || (t[k] >= 'a' && t[k] <= 'z')))
        k++;
    if (k == i) return SCAN_BAD;
    if (k == len && !final) return SCAN_MORE;
    return *end = k, SCAN_OK;
}

static bool key_is(const char *t, size_t at, size_t end, const char *name) {
    size_t n = strlen(name);
    return end - at == n + 2 && !memcmp(t + at + 1, name, n);
}

/* One call object at t[i] == '{', as far as the text goes. */
typedef struct call_scan {
    scan state; /* SCAN_OK: closed at `end` */
    size_t end;
    int first_key;            /* -1: not read yet; 1: a call's key; 0: another */
    size_t name_at, name_end; /* the name's string token, when whole (name_end > 0) */
    bool args_seen, args_whole;
    size_t args_at, args_end; /* the arguments' value, as far as it goes */
} call_scan;

static void scan_call(const char *t, size_t len, size_t i, bool final, call_scan *c) {
    memset(c, 0, sizeof *c);
    c->first_key = -1;
    c->state = SCAN_MORE;
    for (i++;;) {
        i = skip_ws(t, len, i);
        if (i >= len) return;
        if (t[i] == '}') {
            c->state = SCAN_OK, c->end = i + 1;
            return;
        }
        if (t[i] != '"') {
            c->state = SCAN_BAD;
            return;
        }
        size_t key_end;
        scan s = scan_string(t, len, i, &key_end);
        if (s != SCAN_OK) {
            c->state = s;
            return;
        }
        bool is_name = key_is(t, i, key_end, "name");
        bool is_args = key_is(t, i, key_end, "arguments") || key_is(t, i, key_end, "parameters");
        if (c->first_key < 0) c->first_key = is_name || is_args;
        i = skip_ws(t, len, key_end);
        if (i >= len) return;
        if (t[i] != ':') {
            c->state = SCAN_BAD;
            return;
        }
        i = skip_ws(t, len, i + 1);
        size_t v_end = 0;
        s = scan_value(t, len, i, final, &v_end);
        if (is_args && i < len) {
            c->args_seen = true;
            c->args_at = i;
            c->args_end = s == SCAN_OK ? v_end : len;
            c->args_whole = s == SCAN_OK;
        }
        if (s != SCAN_OK) {
            c->state = s;
            return;
        }
        if (is_name && t[i] == '"') c->name_at = i, c->name_end = v_end;
        i = skip_ws(t, len, v_end);
        if (i >= len) return;
        if (t[i] == ',') {
            i++;
            continue;
        }
        if (t[i] != '}') {
            c->state = SCAN_BAD;
            return;
        }
        c->state = SCAN_OK, c->end = i + 1;
        return;
    }
}

/* A JSON string token's decoded text (malloc'd), or NULL. */
static char *decode_string(const char *t, size_t at, size_t end) {
    cJSON *v = cJSON_ParseWithLength(t + at, end - at);
    char *s = cJSON_IsString(v) ? strdup(v->valuestring) : NULL;
    cJSON_Delete(v);
    return s;
}

static char *dup_n(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (!p) return NULL;
    memcpy(p, s, n);
    p[n] = '\0';
    return p;
}

/* Records the call c scanned from t as out's next call. */
static duet_status add_call(const char *t, const call_scan *c, bool final, duet_tool_calls *out) {
    /* The calls past the limit are dropped, and at the end a call the
     * model never named. */
    if (out->n == DUET_MAX_TOOL_CALLS || (final && !c->name_end)) return DUET_OK;
    duet_tool_call *k = &out->call[out->n];
    if (c->name_end && !(k->name = decode_string(t, c->name_at, c->name_end)))
        return duet__error(DUET_OUT_OF_MEMORY, "tool calls: out of memory");
    const char *a = "";
    size_t an = 0;
    char *decoded = NULL;
    if (c->args_seen && t[c->args_at] == '"') {
        /* Arguments written as a JSON string: its text, once whole. */
        if (c->args_whole && !(decoded = decode_string(t, c->args_at, c->args_end)))
            return duet__error(DUET_OUT_OF_MEMORY, "tool calls: out of memory");
        if (decoded) a = decoded, an = strlen(decoded);
    } else if (c->args_seen) {
        a = t + c->args_at, an = c->args_end - c->args_at;
        while (c->args_whole && an && is_ws(a[an - 1]))
            an--;
    } else if (c->state == SCAN_OK) {
        a = "{}", an = 2; /* a call without arguments */
    }
    k->arguments = dup_n(a, an);
    free(decoded);
    if (!k->arguments) return duet__error(DUET_OUT_OF_MEMORY, "tool calls: out of memory");
    k->arguments_len = an;
    k->complete = c->state == SCAN_OK;
    out->n++;
    return DUET_OK;
}

/* Length of the longest suffix of t[0..len) that is a proper prefix of m. */
static size_t partial_marker(const char *t, size_t len, const char *m) {
    size_t n = strlen(m);
    for (size_t k = n - 1; k > 0; k--)
        if (len >= k && !memcmp(t + len - k, m, k)) return k;
    return 0;
}

static bool starts_with(const char *t, size_t len, size_t i, const char *m) {
    size_t n = strlen(m);
    return len - i >= n && !memcmp(t + i, m, n);
}

/* Whether t[i..len) is a proper prefix of m (the marker may be coming). */
static bool prefix_of(const char *t, size_t len, size_t i, const char *m) {
    size_t n = strlen(m);
    return len - i < n && !memcmp(t + i, m, len - i);
}

static duet_status parse_hermes(const char *t, size_t len, bool final, duet_tool_calls *out) {
    static const char open[] = "<tool_call>", close[] = "</tool_call>";
    const char *first = NULL;
    for (size_t k = 0; !first && k + sizeof open - 1 <= len; k++)
        if (t[k] == '<' && !memcmp(t + k, open, sizeof open - 1)) first = t + k;
    if (!first) {
        out->content_len = final ? len : len - partial_marker(t, len, open);
        return DUET_OK;
    }
    out->content_len = (size_t)(first - t);
    size_t i = out->content_len;
    while (i < len && starts_with(t, len, i, open)) {
        i = skip_ws(t, len, i + sizeof open - 1);
        if (i >= len) break;
        if (t[i] != '{') break; /* not a call we can read: the rest is dropped */
        call_scan c;
        scan_call(t, len, i, final, &c);
        if (c.state == SCAN_BAD) break;
        duet_status st = add_call(t, &c, final, out);
        if (st || c.state != SCAN_OK) return st;
        i = skip_ws(t, len, c.end);
        if (starts_with(t, len, i, close)) i = skip_ws(t, len, i + sizeof close - 1);
    }
    return DUET_OK;
}

/* Llama 3 and Mistral: the whole reply is calls or it is text. */
static duet_status parse_json_calls(duet_tool_syntax syn, const char *t, size_t len, bool final,
                                    duet_tool_calls *out) {
    const char *marker = syn == DUET_TOOL_SYNTAX_MISTRAL ? "[TOOL_CALLS]" : "<|python_tag|>";
    size_t i = skip_ws(t, len, 0);
    bool marked = false;
    if (starts_with(t, len, i, marker))
        marked = true, i = skip_ws(t, len, i + strlen(marker));
    else if (!final && prefix_of(t, len, i, marker))
        return DUET_OK; /* may be the marker: hold it back */
    bool array = false;
    if (syn == DUET_TOOL_SYNTAX_MISTRAL && i < len && t[i] == '[') array = true, i = skip_ws(t, len, i + 1);
    if (i >= len) {
        /* Only whitespace (and openings) so far. */
        out->content_len = final && !marked ? len : 0;
        return DUET_OK;
    }
    if (t[i] != '{') {
        out->content_len = marked ? 0 : len;
        return DUET_OK;
    }
    for (;;) {
        call_scan c;
        scan_call(t, len, i, final, &c);
        if (out->n == 0 && !marked) {
            /* Text that only looks like JSON is content. */
            /* Undecided until the call has a name and its arguments begin. */
            if (c.state == SCAN_MORE && !final &&
                (c.first_key < 0 || (c.first_key == 1 && !(c.name_end && c.args_seen))))
                return DUET_OK;
            if (c.first_key != 1 || c.state == SCAN_BAD ||
                ((c.state == SCAN_OK || final) && !(c.name_end && c.args_seen))) {
                out->content_len = len;
                return DUET_OK;
            }
        }
        if (c.state == SCAN_BAD) return DUET_OK;
        duet_status st = add_call(t, &c, final, out);
        if (st || c.state != SCAN_OK) return st;
        i = skip_ws(t, len, c.end);
        if (i < len && t[i] == (array ? ',' : ';')) i = skip_ws(t, len, i + 1);
        if (i >= len || t[i] != '{') return DUET_OK;
    }
}

duet_status duet_tool_calls_parse(duet_tool_syntax syntax, const char *text, size_t len, bool final,
                                  duet_tool_calls *out) {
    if (!out || (!text && len))
        return duet__error(DUET_INVALID_ARGUMENT, "duet_tool_calls_parse: NULL argument");
    memset(out, 0, sizeof *out);
    if (!text) text = "";
    duet_status st;
    switch (syntax) {
    case DUET_TOOL_SYNTAX_HERMES:
        st = parse_hermes(text, len, final, out);
        break;
    case DUET_TOOL_SYNTAX_LLAMA3:
    case DUET_TOOL_SYNTAX_MISTRAL:
        st = parse_json_calls(syntax, text, len, final, out);
        break;
    default:
        out->content_len = len;
        return DUET_OK;
    }
    if (st) duet_tool_calls_free(out);
    return st;
}

void duet_tool_calls_free(duet_tool_calls *c) {
    if (!c) return;
    for (int i = 0; i < c->n; i++) {
        free(c->call[i].name);
        free(c->call[i].arguments);
    }
    memset(c, 0, sizeof *c);
}

/* ---- the grammar of one call ---------------------------------------------- */

/* The function object of tools[i] ({"type": "function", "function": {...}}). */
static const cJSON *function_of(const cJSON *tool) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(tool, "function");
    return cJSON_IsObject(f) ? f : NULL;
}

/* Copies each entry of src's $defs (or definitions) into defs. */
static bool merge_defs(cJSON *defs, const cJSON *params) {
    static const char *const keys[] = {"$defs", "definitions"};
    for (int k = 0; k < 2; k++) {
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(params, keys[k]), *e;
        if (!cJSON_IsObject(d)) continue;
        cJSON_ArrayForEach(e, d) {
            cJSON_DeleteItemFromObjectCaseSensitive(defs, e->string);
            cJSON *copy = cJSON_Duplicate(e, true);
            if (!copy || !cJSON_AddItemToObject(defs, e->string, copy)) return cJSON_Delete(copy), false;
        }
    }
    return true;
}

duet_status duet_tool_call_grammar(duet_tool_syntax syntax, const char *tools_json, const char *name,
                                   char **out) {
    if (!out || !tools_json)
        return duet__error(DUET_INVALID_ARGUMENT, "duet_tool_call_grammar: NULL argument");
    *out = NULL;
    if (syntax == DUET_TOOL_SYNTAX_NONE)
        return duet__error(DUET_UNSUPPORTED,
                           "tool calls: the chat template has no tool-call syntax duet knows");
    cJSON *tools = cJSON_Parse(tools_json);
    if (!cJSON_IsArray(tools)) {
        cJSON_Delete(tools);
        return duet__error(DUET_BAD_REQUEST, "tool calls: 'tools' must be a JSON array");
    }
    const char *args_key = syntax == DUET_TOOL_SYNTAX_LLAMA3 ? "parameters" : "arguments";
    /* {"$defs": {...}, "anyOf": [{"type": "object", "properties": {"name":
     * {"const": N}, ARGS: PARAMS}, "required": ["name", ARGS]}, ...]} */
    cJSON *schema = cJSON_CreateObject();
    cJSON *defs = cJSON_AddObjectToObject(schema, "$defs");
    cJSON *alts = cJSON_AddArrayToObject(schema, "anyOf");
    bool ok = schema && defs && alts;
    int found = 0;
    const cJSON *tool;
    cJSON_ArrayForEach(tool, tools) {
        const cJSON *f = function_of(tool);
        const cJSON *fname = cJSON_GetObjectItemCaseSensitive(f, "name");
        if (!ok || !cJSON_IsString(fname) || (name && strcmp(fname->valuestring, name))) continue;
        const cJSON *params = cJSON_GetObjectItemCaseSensitive(f, "parameters");
        cJSON *alt = cJSON_CreateObject(), *props, *nm, *req;
        ok = alt && cJSON_AddItemToArray(alts, alt) && cJSON_AddStringToObject(alt, "type", "object") &&
             (props = cJSON_AddObjectToObject(alt, "properties")) &&
             (nm = cJSON_AddObjectToObject(props, "name")) &&
             cJSON_AddStringToObject(nm, "const", fname->valuestring) &&
             (req = cJSON_AddArrayToObject(alt, "required")) &&
             cJSON_AddItemToArray(req, cJSON_CreateString("name")) &&
             cJSON_AddItemToArray(req, cJSON_CreateString(args_key));
        if (ok && cJSON_IsObject(params) && params->child) {
            cJSON *p = cJSON_Duplicate(params, true);
            ok = p && cJSON_AddItemToObject(props, args_key, p) && merge_defs(defs, params);
            if (ok) {
                cJSON_DeleteItemFromObjectCaseSensitive(p, "$defs");
                cJSON_DeleteItemFromObjectCaseSensitive(p, "definitions");
            }
        } else if (ok) {
            /* No parameters: any object. */
            cJSON *p = cJSON_AddObjectToObject(props, args_key);
            ok = p && cJSON_AddStringToObject(p, "type", "object");
        }
        found++;
    }
    cJSON_Delete(tools);
    char *schema_text = ok && found ? cJSON_PrintUnformatted(schema) : NULL;
    cJSON_Delete(schema);
    if (!ok || (found && !schema_text)) {
        cJSON_free(schema_text);
        return duet__error(DUET_OUT_OF_MEMORY, "tool calls: out of memory");
    }
    if (!found && name)
        return duet__error(DUET_BAD_REQUEST, "tool calls: no function named '%.64s' in 'tools'", name);
    if (!found) return duet__error(DUET_BAD_REQUEST, "tool calls: 'tools' names no function");
    const char *prefix = "", *suffix = "";
    if (syntax == DUET_TOOL_SYNTAX_HERMES) prefix = "<tool_call>\n", suffix = "\n</tool_call>";
    if (syntax == DUET_TOOL_SYNTAX_MISTRAL) prefix = "[", suffix = "]";
    duet_status st = duet__json_schema_to_gbnf_wrapped(schema_text, prefix, suffix, out);
    cJSON_free(schema_text);
    return st;
}
