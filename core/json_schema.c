/* json_schema.c — JSON Schema (the common subset) to GBNF; see json_schema.h. */
#include "json_schema.h"

#include <cjson/cJSON.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "duet_internal.h"

#define MAX_DEPTH 64

typedef struct out_text {
    char *p;
    size_t len, cap;
    bool oom;
} out_text;

static void put(out_text *t, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || t->oom) return;
    if (t->len + (size_t)n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 1024;
        while (cap < t->len + (size_t)n + 1)
            cap *= 2;
        char *p = realloc(t->p, cap);
        if (!p) {
            t->oom = true;
            return;
        }
        t->p = p;
        t->cap = cap;
    }
    va_start(ap, fmt);
    vsnprintf(t->p + t->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    t->len += (size_t)n;
}

/* Text as a GBNF literal ("..." with escapes). */
static void put_literal(out_text *t, const char *s) {
    put(t, "\"");
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\')
            put(t, "\\%c", *c);
        else if (*c == '\n')
            put(t, "\\n");
        else if (*c == '\t')
            put(t, "\\t");
        else if (*c == '\r')
            put(t, "\\r");
        else if (*c < 0x20)
            put(t, "\\x%02x", *c);
        else
            put(t, "%c", *c);
    }
    put(t, "\"");
}

typedef struct ctx {
    const cJSON *root;
    out_text rules;
    int next;
    char err[256];
    bool failed;
    /* $refs already given a rule (so recursion terminates). */
    const char *ref_names[256];
    int ref_rules[256];
    int n_refs;
} ctx;

static int gen(ctx *c, const cJSON *s, int depth);

static int fail(ctx *c, const char *fmt, ...) {
    if (!c->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, sizeof c->err, fmt, ap);
        va_end(ap);
        c->failed = true;
    }
    return -1;
}

/* A JSON value as a GBNF literal of its compact text. */
static void put_json_literal(ctx *c, out_text *t, const cJSON *v) {
    char *s = cJSON_PrintUnformatted(v);
    if (!s) {
        c->rules.oom = true;
        return;
    }
    put_literal(t, s);
    cJSON_free(s);
}

static int int_of(const cJSON *s, const char *key, int dflt) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
    if (!cJSON_IsNumber(v) || v->valuedouble < 0) return dflt;
    return v->valuedouble > 1000 ? 1000 : (int)v->valuedouble;
}

/* New rule name "s<N>" whose body follows in c->rules. */
static int rule_open(ctx *c) {
    int r = c->next++;
    put(&c->rules, "s%d ::= ", r);
    return r;
}

static int gen_object(ctx *c, const cJSON *s, int depth) {
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    if (!cJSON_IsObject(props) || !props->child) {
        int r = rule_open(c);
        put(&c->rules, "object\n");
        return r;
    }
    /* Each property's value rule first (they write rules of their own). */
    int n = cJSON_GetArraySize(props);
    int *val = malloc((size_t)n * sizeof *val);
    bool *required = calloc((size_t)n, sizeof *required);
    if (!val || !required) {
        free(val), free(required);
        c->rules.oom = true;
        return -1;
    }
    int i = 0, n_req = 0;
    for (const cJSON *p = props->child; p; p = p->next, i++) {
        val[i] = gen(c, p, depth + 1);
        for (const cJSON *q = cJSON_IsArray(req) ? req->child : NULL; q; q = q->next)
            if (cJSON_IsString(q) && !strcmp(q->valuestring, p->string)) required[i] = true;
        n_req += required[i];
    }
    if (c->failed) {
        free(val), free(required);
        return -1;
    }
    /* kv<r>_<i> ::= "\"key\"" ws ":" ws value ws */
    int base = c->next;
    c->next += n;
    i = 0;
    for (const cJSON *p = props->child; p; p = p->next, i++) {
        put(&c->rules, "s%d ::= ", base + i);
        cJSON *key = cJSON_CreateString(p->string);
        put_json_literal(c, &c->rules, key);
        cJSON_Delete(key);
        put(&c->rules, " ws \":\" ws s%d ws\n", val[i]);
    }
    int r;
    if (n_req) {
        r = rule_open(c);
        put(&c->rules, "\"{\" ws");
        bool first = true;
        for (i = 0; i < n; i++)
            if (required[i]) {
                put(&c->rules, first ? " s%d" : " \",\" ws s%d", base + i);
                first = false;
            }
        for (i = 0; i < n; i++)
            if (!required[i]) put(&c->rules, " (\",\" ws s%d)?", base + i);
        put(&c->rules, " \"}\"\n");
    } else {
        /* F_i ::= kv_i ("," ws kv_j)?... | F_{i+1}, the last F empty. */
        int f = c->next;
        c->next += n + 1;
        for (i = 0; i < n; i++) {
            put(&c->rules, "s%d ::= s%d", f + i, base + i);
            for (int j = i + 1; j < n; j++)
                put(&c->rules, " (\",\" ws s%d)?", base + j);
            put(&c->rules, " | s%d\n", f + i + 1);
        }
        put(&c->rules, "s%d ::= \"\"\n", f + n);
        r = rule_open(c);
        put(&c->rules, "\"{\" ws s%d \"}\"\n", f);
    }
    free(val), free(required);
    return r;
}

static int gen_array(ctx *c, const cJSON *s, int depth) {
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
    int item = -1;
    if (items && !cJSON_IsBool(items)) item = gen(c, items, depth + 1);
    if (c->failed) return -1;
    int lo = int_of(s, "minItems", 0), hi = int_of(s, "maxItems", -1);
    if (hi >= 0 && hi < lo) return fail(c, "maxItems %d < minItems %d", hi, lo);
    char it[32];
    if (item >= 0)
        snprintf(it, sizeof it, "s%d", item);
    else
        snprintf(it, sizeof it, "value");
    int r = rule_open(c);
    if (hi == 0) {
        put(&c->rules, "\"[\" ws \"]\"\n");
        return r;
    }
    put(&c->rules, "\"[\" ws ");
    if (lo == 0) put(&c->rules, "(");
    put(&c->rules, "%s ws", it);
    int rlo = lo > 1 ? lo - 1 : 0;
    if (hi < 0)
        put(&c->rules, " (\",\" ws %s ws){%d,}", it, rlo);
    else if (hi > 1)
        put(&c->rules, " (\",\" ws %s ws){%d,%d}", it, rlo, hi - 1);
    if (lo == 0) put(&c->rules, ")?");
    put(&c->rules, " \"]\"\n");
    return r;
}

static int gen_typed(ctx *c, const cJSON *s, const char *type, int depth) {
    if (!strcmp(type, "object")) return gen_object(c, s, depth);
    if (!strcmp(type, "array")) return gen_array(c, s, depth);
    int r;
    if (!strcmp(type, "string")) {
        int lo = int_of(s, "minLength", 0), hi = int_of(s, "maxLength", -1);
        r = rule_open(c);
        if (lo == 0 && hi < 0)
            put(&c->rules, "string\n");
        else if (hi < 0)
            put(&c->rules, "\"\\\"\" char{%d,} \"\\\"\"\n", lo);
        else if (hi < lo)
            return fail(c, "maxLength %d < minLength %d", hi, lo);
        else
            put(&c->rules, "\"\\\"\" char{%d,%d} \"\\\"\"\n", lo, hi);
        return r;
    }
    static const char *const simple[] = {"number", "integer", "boolean", "null"};
    for (int i = 0; i < 4; i++)
        if (!strcmp(type, simple[i])) {
            r = rule_open(c);
            put(&c->rules, "%s\n", simple[i]);
            return r;
        }
    return fail(c, "unknown type '%.64s'", type);
}

static const cJSON *resolve_ref(ctx *c, const char *ref) {
    const char *name = NULL;
    const cJSON *defs = NULL;
    if (!strncmp(ref, "#/$defs/", 8))
        name = ref + 8, defs = cJSON_GetObjectItemCaseSensitive(c->root, "$defs");
    else if (!strncmp(ref, "#/definitions/", 14))
        name = ref + 14, defs = cJSON_GetObjectItemCaseSensitive(c->root, "definitions");
    else if (!strcmp(ref, "#"))
        return c->root;
    return name && defs ? cJSON_GetObjectItemCaseSensitive(defs, name) : NULL;
}

static int gen(ctx *c, const cJSON *s, int depth) {
    if (c->failed) return -1;
    if (depth > MAX_DEPTH) return fail(c, "the schema nests deeper than %d", MAX_DEPTH);
    if (cJSON_IsTrue(s) || (cJSON_IsObject(s) && !s->child)) {
        int r = rule_open(c);
        put(&c->rules, "value\n");
        return r;
    }
    if (!cJSON_IsObject(s)) return fail(c, "a schema must be an object or true");
    const cJSON *v;
    if ((v = cJSON_GetObjectItemCaseSensitive(s, "$ref"))) {
        if (!cJSON_IsString(v)) return fail(c, "$ref must be a string");
        for (int i = 0; i < c->n_refs; i++)
            if (!strcmp(c->ref_names[i], v->valuestring)) return c->ref_rules[i];
        const cJSON *target = resolve_ref(c, v->valuestring);
        if (!target) return fail(c, "$ref '%.100s' is not in #/$defs or #/definitions", v->valuestring);
        if (c->n_refs == 256) return fail(c, "too many $refs");
        /* The rule's name is taken first, so a recursive reference finds it. */
        int r = c->next++;
        c->ref_names[c->n_refs] = v->valuestring;
        c->ref_rules[c->n_refs++] = r;
        int body = gen(c, target, depth + 1);
        if (body >= 0) put(&c->rules, "s%d ::= s%d\n", r, body);
        return r;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(s, "const"))) {
        int r = rule_open(c);
        put_json_literal(c, &c->rules, v);
        put(&c->rules, "\n");
        return r;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(s, "enum"))) {
        if (!cJSON_IsArray(v) || !v->child) return fail(c, "enum must be a non-empty array");
        int r = rule_open(c);
        for (const cJSON *e = v->child; e; e = e->next) {
            put_json_literal(c, &c->rules, e);
            put(&c->rules, e->next ? " | " : "\n");
        }
        return r;
    }
    const char *alts_key = cJSON_GetObjectItemCaseSensitive(s, "anyOf")   ? "anyOf"
                           : cJSON_GetObjectItemCaseSensitive(s, "oneOf") ? "oneOf"
                                                                          : NULL;
    if (alts_key) {
        v = cJSON_GetObjectItemCaseSensitive(s, alts_key);
        if (!cJSON_IsArray(v) || !v->child) return fail(c, "%s must be a non-empty array", alts_key);
        int n = cJSON_GetArraySize(v), k = 0;
        int *sub = malloc((size_t)n * sizeof *sub);
        if (!sub) return c->rules.oom = true, -1;
        for (const cJSON *e = v->child; e; e = e->next)
            sub[k++] = gen(c, e, depth + 1);
        int r = -1;
        if (!c->failed) {
            r = rule_open(c);
            for (k = 0; k < n; k++)
                put(&c->rules, k + 1 < n ? "s%d | " : "s%d\n", sub[k]);
        }
        free(sub);
        return r;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(s, "allOf"))) {
        if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != 1)
            return fail(c, "allOf is supported with one schema only");
        return gen(c, v->child, depth + 1);
    }
    v = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (cJSON_IsString(v)) return gen_typed(c, s, v->valuestring, depth);
    if (cJSON_IsArray(v) && v->child) {
        int n = cJSON_GetArraySize(v), k = 0;
        int *sub = malloc((size_t)n * sizeof *sub);
        if (!sub) return c->rules.oom = true, -1;
        for (const cJSON *e = v->child; e; e = e->next)
            sub[k++] =
                cJSON_IsString(e) ? gen_typed(c, s, e->valuestring, depth) : fail(c, "type must name types");
        int r = -1;
        if (!c->failed) {
            r = rule_open(c);
            for (k = 0; k < n; k++)
                put(&c->rules, k + 1 < n ? "s%d | " : "s%d\n", sub[k]);
        }
        free(sub);
        return r;
    }
    if (v) return fail(c, "type must be a string or an array of strings");
    /* No type: what its keywords imply, else anything. */
    if (cJSON_GetObjectItemCaseSensitive(s, "properties")) return gen_typed(c, s, "object", depth);
    if (cJSON_GetObjectItemCaseSensitive(s, "items")) return gen_typed(c, s, "array", depth);
    int r = rule_open(c);
    put(&c->rules, "value\n");
    return r;
}

static const char *const base_rules =
    "ws ::= ([ \\t]{0,2} | \"\\n\" [ \\t]{0,20})\n"
    "value ::= object | array | string | number | boolean | null\n"
    "object ::= \"{\" ws ( member (\",\" ws member)* )? \"}\"\n"
    "member ::= string ws \":\" ws value ws\n"
    "array ::= \"[\" ws ( value ws (\",\" ws value ws)* )? \"]\"\n"
    "string ::= \"\\\"\" char* \"\\\"\"\n"
    "char ::= [^\"\\\\\\x00-\\x1f] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4})\n"
    "integer ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15})\n"
    "number ::= integer (\".\" [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?\n"
    "boolean ::= \"true\" | \"false\"\n"
    "null ::= \"null\"\n";

duet_status duet_json_schema_to_gbnf(const char *schema_json, char **out) {
    *out = NULL;
    ctx c = {0};
    cJSON *schema = NULL;
    put(&c.rules, "%s", base_rules);
    if (!schema_json) {
        put(&c.rules, "root ::= object\n");
    } else {
        schema = cJSON_Parse(schema_json);
        if (!schema) {
            free(c.rules.p);
            return duet__error(DUET_BAD_REQUEST, "json schema: not valid JSON");
        }
        c.root = schema;
        int r = gen(&c, schema, 0);
        if (r >= 0) put(&c.rules, "root ::= s%d\n", r);
    }
    cJSON_Delete(schema);
    if (c.failed) {
        free(c.rules.p);
        return duet__error(DUET_BAD_REQUEST, "json schema: %s", c.err);
    }
    if (c.rules.oom) {
        free(c.rules.p);
        return duet__error(DUET_OUT_OF_MEMORY, "json schema: out of memory");
    }
    *out = c.rules.p;
    return DUET_OK;
}
