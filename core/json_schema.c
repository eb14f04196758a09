/* json_schema.c — JSON Schema (the common subset) to GBNF; see json_schema.h. */
#include "json_schema.h"

#include <cjson/cJSON.h>
#include <math.h>
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

/* ---- numeric bounds ---------------------------------------------------- */

#define MAX_DIGITS 16 /* what the base rules' integer allows */

/* The decimal numbers of n digits from a to b (digit strings, a <= b), as
 * a GBNF group: equal leading digits are literal, then the lower edge, the
 * full middle and the upper edge. */
static void put_same_len(out_text *t, const char *a, const char *b, int n) {
    if (n == 0) return;
    if (a[0] == b[0]) {
        put(t, "\"%c\" ", a[0]);
        put_same_len(t, a + 1, b + 1, n - 1);
        return;
    }
    bool a_zeros = true, b_nines = true;
    for (int i = 1; i < n; i++)
        a_zeros &= a[i] == '0', b_nines &= b[i] == '9';
    char lo = a_zeros ? a[0] : (char)(a[0] + 1), hi = b_nines ? b[0] : (char)(b[0] - 1);
    char nines[MAX_DIGITS + 1], zeros[MAX_DIGITS + 1];
    memset(nines, '9', sizeof nines);
    memset(zeros, '0', sizeof zeros);
    put(t, "(");
    bool alt = false;
    if (!a_zeros) {
        put(t, "\"%c\" (", a[0]);
        put_same_len(t, a + 1, nines, n - 1);
        put(t, ")");
        alt = true;
    }
    if (lo <= hi) {
        put(t, "%s[%c-%c]", alt ? " | " : "", lo, hi);
        if (n > 1) put(t, " [0-9]{%d}", n - 1);
        alt = true;
    }
    if (!b_nines) {
        put(t, "%s\"%c\" (", alt ? " | " : "", b[0]);
        put_same_len(t, zeros, b + 1, n - 1);
        put(t, ")");
    }
    put(t, ") ");
}

/* The non-negative integers lo..hi (no leading zeros) as alternatives. */
static void put_uint_range(out_text *t, unsigned long long lo, unsigned long long hi) {
    bool first = true;
    for (int n = 1; n <= MAX_DIGITS && lo <= hi; n++) {
        unsigned long long top = 1;
        for (int i = 0; i < n; i++)
            top *= 10;
        top -= 1; /* the largest n-digit number */
        if (lo > top) continue;
        unsigned long long end = hi < top ? hi : top;
        char a[MAX_DIGITS + 2], b[MAX_DIGITS + 2];
        snprintf(a, sizeof a, "%0*llu", n, lo);
        snprintf(b, sizeof b, "%0*llu", n, end);
        put(t, first ? "(" : " | (");
        put_same_len(t, a, b, n);
        put(t, ")");
        first = false;
        if (end == hi) break;
        lo = end + 1;
    }
}

/* Integer bounds: minimum/maximum, and exclusiveMinimum/exclusiveMaximum as
 * numbers (JSON Schema 6+). False when the schema sets none. */
static bool int_bounds(const cJSON *s, double *lo, double *hi) {
    const double lim = 9999999999999999.0; /* MAX_DIGITS nines */
    *lo = -lim, *hi = lim;
    const cJSON *v;
    bool any = false;
    if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(s, "minimum")))
        *lo = fmax(*lo, ceil(v->valuedouble)), any = true;
    if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(s, "exclusiveMinimum")))
        *lo = fmax(*lo, floor(v->valuedouble) + 1), any = true;
    if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(s, "maximum")))
        *hi = fmin(*hi, floor(v->valuedouble)), any = true;
    if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(s, "exclusiveMaximum")))
        *hi = fmin(*hi, ceil(v->valuedouble) - 1), any = true;
    *lo = fmax(*lo, -lim), *hi = fmin(*hi, lim);
    return any;
}

/* An integer rule within the schema's bounds; -1 when it has none. */
static int gen_int_range(ctx *c, const cJSON *s) {
    double lo, hi;
    if (!int_bounds(s, &lo, &hi)) return -1;
    if (lo > hi) return fail(c, "no integer lies within the bounds");
    int r = rule_open(c);
    bool alt = false;
    if (lo < 0) { /* the negatives: -(max(1, -hi)) .. -(-lo) */
        put(&c->rules, "\"-\" (");
        put_uint_range(&c->rules, hi < 0 ? (unsigned long long)-hi : 1, (unsigned long long)-lo);
        put(&c->rules, ")");
        alt = true;
    }
    if (hi >= 0) {
        if (alt) put(&c->rules, " | ");
        put_uint_range(&c->rules, lo > 0 ? (unsigned long long)lo : 0, (unsigned long long)hi);
    }
    put(&c->rules, "\n");
    return r;
}

/* A number within [minimum, maximum] when both are non-negative integers
 * (the common case: scores, ratios, percentages): the integer part below
 * the maximum with any fraction, or the maximum itself. Other bounds on
 * numbers are left free; -1 then. */
static int gen_number_range(ctx *c, const cJSON *s) {
    const cJSON *mn = cJSON_GetObjectItemCaseSensitive(s, "minimum"),
                *mx = cJSON_GetObjectItemCaseSensitive(s, "maximum");
    if (!cJSON_IsNumber(mn) || !cJSON_IsNumber(mx) ||
        cJSON_GetObjectItemCaseSensitive(s, "exclusiveMinimum") ||
        cJSON_GetObjectItemCaseSensitive(s, "exclusiveMaximum"))
        return -1;
    double lo = mn->valuedouble, hi = mx->valuedouble;
    if (lo != floor(lo) || hi != floor(hi) || lo < 0 || hi > 9999999999999999.0) return -1;
    if (lo > hi) return fail(c, "minimum %g > maximum %g", lo, hi);
    int r = rule_open(c);
    if (lo < hi) {
        put(&c->rules, "(");
        put_uint_range(&c->rules, (unsigned long long)lo, (unsigned long long)hi - 1);
        put(&c->rules, ") (\".\" [0-9]{1,16})? | ");
    }
    put(&c->rules, "\"%.0f\" (\".\" \"0\"{1,16})?\n", hi);
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
    if (!strcmp(type, "integer") && (r = gen_int_range(c, s)) >= 0) return r;
    if (!strcmp(type, "number") && (r = gen_number_range(c, s)) >= 0) return r;
    if (c->failed) return -1;
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
    return duet__json_schema_to_gbnf_wrapped(schema_json, NULL, NULL, out);
}

/* root ::= prefix sN suffix, the literals left out when empty. */
static void put_root(out_text *t, const char *prefix, const char *body, const char *suffix) {
    put(t, "root ::= ");
    if (prefix && *prefix) put_literal(t, prefix), put(t, " ");
    put(t, "%s", body);
    if (suffix && *suffix) put(t, " "), put_literal(t, suffix);
    put(t, "\n");
}

duet_status duet__json_schema_to_gbnf_wrapped(const char *schema_json, const char *prefix, const char *suffix,
                                              char **out) {
    *out = NULL;
    ctx c = {0};
    cJSON *schema = NULL;
    put(&c.rules, "%s", base_rules);
    if (!schema_json) {
        put_root(&c.rules, prefix, "object", suffix);
    } else {
        schema = cJSON_Parse(schema_json);
        if (!schema) {
            free(c.rules.p);
            return duet__error(DUET_BAD_REQUEST, "json schema: not valid JSON");
        }
        c.root = schema;
        int r = gen(&c, schema, 0);
        char body[32];
        snprintf(body, sizeof body, "s%d", r);
        if (r >= 0) put_root(&c.rules, prefix, body, suffix);
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
