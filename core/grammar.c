/* grammar.c — GBNF grammars, their recognizer and the vocabulary mask (see
 * grammar.h for the notation and the design). */
#include "grammar.h"

#include <assert.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "duet_internal.h"

#define MAX_STACK 512   /* positions on one stack */
#define MAX_STACKS 1024 /* stacks in one state */
#define MAX_EXPAND 4096 /* rule expansions while finding the next classes */
#define MASK_CACHE 64   /* masks remembered per state object */
#define MAX_NESTING 128 /* open parentheses (the parser recurses on them) */
#define MAX_RULES 4096  /* rules, generated ones included (checks recurse over them) */

enum { E_END, E_RULE, E_CLASS };

typedef struct elem {
    uint8_t type;
    int32_t v; /* E_RULE: rule index; E_CLASS: class index */
} elem;

typedef struct range {
    uint32_t lo, hi;
} range;

typedef struct cclass {
    bool neg;
    int first, n;  /* ranges */
    bool nonascii; /* accepts some code point >= 0x80 */
} cclass;

typedef struct rule {
    char *name;
    bool defined;
    int first_alt, n_alts; /* into alts[] (after flattening) */
} rule;

struct duet_grammar {
    elem *el;
    int n_el;
    range *rg;
    int n_rg;
    cclass *cl;
    int n_cl;
    rule *ru;
    int n_ru;
    int32_t *alts; /* element index where each alternative starts */
    int n_alts;
    int root;
};

/* ---- building ------------------------------------------------------------ */

/* A growable array of T (as bytes, element size sz). */
typedef struct vec {
    void *p;
    int n, cap;
} vec;

static void *vec_push(vec *v, size_t sz) {
    if (v->n == v->cap) {
        int cap = v->cap ? v->cap * 2 : 8;
        void *p = realloc(v->p, (size_t)cap * sz);
        if (!p) return NULL;
        v->p = p;
        v->cap = cap;
    }
    return (char *)v->p + (size_t)v->n++ * sz;
}

/* While parsing, each rule holds its alternatives as vectors of elems. */
typedef struct prule {
    char *name;
    bool defined;
    vec alts; /* of vec (elems) */
} prule;

typedef struct parser {
    const char *src, *p;
    int line;
    vec rules;  /* prule */
    vec ranges; /* range */
    vec classes;
    int nesting;
    char err[256];
    bool failed;
} parser;

static bool fail(parser *ps, const char *fmt, ...) {
    if (ps->failed) return false;
    ps->failed = true;
    int n = snprintf(ps->err, sizeof ps->err, "grammar line %d: ", ps->line);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ps->err + n, sizeof ps->err - (size_t)n, fmt, ap);
    va_end(ap);
    return false;
}

static bool oom(parser *ps) {
    return fail(ps, "out of memory");
}

static int rule_find(parser *ps, const char *name, size_t len, bool create) {
    prule *r = ps->rules.p;
    for (int i = 0; i < ps->rules.n; i++)
        if (strlen(r[i].name) == len && !memcmp(r[i].name, name, len)) return i;
    if (!create) return -1;
    if (ps->rules.n >= MAX_RULES) return fail(ps, "more than %d rules", MAX_RULES), -1;
    prule *n = vec_push(&ps->rules, sizeof *n);
    if (!n) return oom(ps), -1;
    memset(n, 0, sizeof *n);
    if (!(n->name = malloc(len + 1))) return ps->rules.n--, oom(ps), -1;
    memcpy(n->name, name, len);
    n->name[len] = 0;
    return ps->rules.n - 1;
}

static int rule_new(parser *ps, const char *base) {
    if (ps->rules.n >= MAX_RULES) return fail(ps, "more than %d rules", MAX_RULES), -1;
    char name[96];
    snprintf(name, sizeof name, "%s-%d", base, ps->rules.n);
    int r = rule_find(ps, name, strlen(name), true);
    if (r >= 0) ((prule *)ps->rules.p)[r].defined = true;
    return r;
}

/* Adds an alternative (takes the elems vector) to rule r. */
static bool rule_add_alt(parser *ps, int r, vec *seq) {
    vec *a = vec_push(&((prule *)ps->rules.p)[r].alts, sizeof *a);
    if (!a) return oom(ps);
    *a = *seq;
    memset(seq, 0, sizeof *seq);
    return true;
}

static bool seq_add(parser *ps, vec *seq, int type, int v) {
    elem *e = vec_push(seq, sizeof *e);
    if (!e) return oom(ps);
    e->type = (uint8_t)type;
    e->v = v;
    return true;
}

static int class_new(parser *ps, bool neg) {
    cclass *c = vec_push(&ps->classes, sizeof *c);
    if (!c) return oom(ps), -1;
    *c = (cclass){.neg = neg, .first = ps->ranges.n};
    return ps->classes.n - 1;
}

static bool class_add(parser *ps, int ci, uint32_t lo, uint32_t hi) {
    range *r = vec_push(&ps->ranges, sizeof *r);
    if (!r) return oom(ps);
    *r = (range){lo, hi};
    ((cclass *)ps->classes.p)[ci].n++;
    return true;
}

static bool is_word(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

/* Skips spaces, tabs and comments, and newlines when `newlines`. */
static void skip_space(parser *ps, bool newlines) {
    for (;;) {
        char c = *ps->p;
        if (c == ' ' || c == '\t' || c == '\r')
            ps->p++;
        else if (c == '#')
            while (*ps->p && *ps->p != '\n')
                ps->p++;
        else if (c == '\n' && newlines)
            ps->p++, ps->line++;
        else
            break;
    }
}

/* One UTF-8 character of the source. */
static uint32_t decode_utf8(parser *ps) {
    const unsigned char *s = (const unsigned char *)ps->p;
    uint32_t c = s[0];
    int n = c < 0x80 ? 0 : (c & 0xE0) == 0xC0 ? 1 : (c & 0xF0) == 0xE0 ? 2 : (c & 0xF8) == 0xF0 ? 3 : -1;
    if (n < 0) return fail(ps, "invalid UTF-8"), 0;
    if (n) c &= 0x3F >> n;
    for (int i = 1; i <= n; i++) {
        if ((s[i] & 0xC0) != 0x80) return fail(ps, "invalid UTF-8"), 0;
        c = c << 6 | (s[i] & 0x3F);
    }
    ps->p += n + 1;
    return c;
}

static int hexval(char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* A character of a literal or class, escapes decoded. */
static uint32_t parse_char(parser *ps) {
    if (*ps->p != '\\') return decode_utf8(ps);
    ps->p++;
    char c = *ps->p++;
    int digits = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
    if (digits) {
        uint32_t v = 0;
        for (int i = 0; i < digits; i++) {
            int h = hexval(*ps->p);
            if (h < 0) return fail(ps, "bad \\%c escape", c), 0;
            v = v << 4 | (uint32_t)h;
            ps->p++;
        }
        return v;
    }
    switch (c) {
    case 'n':
        return '\n';
    case 'r':
        return '\r';
    case 't':
        return '\t';
    case '0':
        return 0;
    case '\\':
    case '"':
    case '[':
    case ']':
    case '-':
    case '\'':
    case '/':
    case '^':
        return (uint32_t)c;
    default:
        return fail(ps, "unknown escape \\%c", c ? c : '0'), 0;
    }
}

static bool parse_alternates(parser *ps, int rule, bool nested);

/* Wraps the atom atom[0..n) of seq (starting at index at) into a rule of its
 * own when it is more than one element, so an operator can repeat it. */
static int atom_rule(parser *ps, vec *seq, int at) {
    elem *e = seq->p;
    if (seq->n - at == 1 && e[at].type == E_RULE) return e[at].v;
    int r = rule_new(ps, "atom");
    if (r < 0) return -1;
    vec alt = {0};
    for (int i = at; i < seq->n; i++)
        if (!seq_add(ps, &alt, e[i].type, e[i].v)) return free(alt.p), -1;
    if (!rule_add_alt(ps, r, &alt)) return free(alt.p), -1;
    seq->n = at;
    return r;
}

/* R ::= X R | empty (X*), or R ::= X | empty (X?). */
static int repeat_rule(parser *ps, int x, bool star) {
    int r = rule_new(ps, star ? "star" : "opt");
    if (r < 0) return -1;
    vec a = {0}, b = {0};
    if (!seq_add(ps, &a, E_RULE, x) || (star && !seq_add(ps, &a, E_RULE, r)) || !rule_add_alt(ps, r, &a) ||
        !rule_add_alt(ps, r, &b)) {
        free(a.p);
        return -1;
    }
    return r;
}

static bool parse_sequence(parser *ps, vec *seq, bool nested) {
    for (;;) {
        skip_space(ps, nested);
        int at = seq->n;
        char c = *ps->p;
        if (c == '"') {
            ps->p++;
            while (*ps->p && *ps->p != '"' && !ps->failed) {
                if (*ps->p == '\n') return fail(ps, "a literal ends at the end of its line");
                uint32_t ch = parse_char(ps);
                int ci = class_new(ps, false);
                if (ci < 0 || !class_add(ps, ci, ch, ch) || !seq_add(ps, seq, E_CLASS, ci)) return false;
            }
            if (*ps->p != '"') return fail(ps, "unterminated literal");
            ps->p++;
        } else if (c == '[') {
            ps->p++;
            bool neg = *ps->p == '^';
            if (neg) ps->p++;
            int ci = class_new(ps, neg);
            if (ci < 0) return false;
            while (*ps->p && *ps->p != ']' && !ps->failed) {
                if (*ps->p == '\n') return fail(ps, "a class ends at the end of its line");
                uint32_t lo = parse_char(ps), hi = lo;
                if (ps->p[0] == '-' && ps->p[1] && ps->p[1] != ']') {
                    ps->p++;
                    hi = parse_char(ps);
                }
                if (hi < lo) return fail(ps, "range %u-%u is empty", lo, hi);
                if (!class_add(ps, ci, lo, hi)) return false;
            }
            if (*ps->p != ']') return fail(ps, "unterminated class");
            ps->p++;
            if (!seq_add(ps, seq, E_CLASS, ci)) return false;
        } else if (c == '.') {
            ps->p++;
            int ci = class_new(ps, true);
            if (ci < 0 || !seq_add(ps, seq, E_CLASS, ci)) return false;
        } else if (c == '(') {
            ps->p++;
            if (++ps->nesting > MAX_NESTING) return fail(ps, "parentheses nest deeper than %d", MAX_NESTING);
            int r = rule_new(ps, "group");
            if (r < 0 || !parse_alternates(ps, r, true)) return false;
            ps->nesting--;
            skip_space(ps, true);
            if (*ps->p != ')') return fail(ps, "expected ')'");
            ps->p++;
            if (!seq_add(ps, seq, E_RULE, r)) return false;
        } else if (is_word(c)) {
            const char *s = ps->p;
            while (is_word(*ps->p))
                ps->p++;
            /* The next rule's definition: this sequence ends here. */
            const char *q = ps->p;
            while (*q == ' ' || *q == '\t')
                q++;
            if (q[0] == ':' && q[1] == ':' && q[2] == '=') {
                ps->p = s;
                return true;
            }
            int r = rule_find(ps, s, (size_t)(ps->p - s), true);
            if (r < 0 || !seq_add(ps, seq, E_RULE, r)) return false;
        } else {
            return !ps->failed;
        }
        if (ps->failed) return false;
        /* Postfix operators. */
        c = *ps->p;
        if (c == '*' || c == '+' || c == '?') {
            ps->p++;
            int x = atom_rule(ps, seq, at);
            if (x < 0) return false;
            seq->n = at;
            if (c == '+' && !seq_add(ps, seq, E_RULE, x)) return false;
            int r = repeat_rule(ps, x, c != '?');
            if (r < 0 || !seq_add(ps, seq, E_RULE, r)) return false;
        } else if (c == '{') {
            ps->p++;
            char *end;
            long m = strtol(ps->p, &end, 10), n = m;
            if (end == ps->p || m < 0 || m > 1000) return fail(ps, "bad repetition count");
            ps->p = end;
            skip_space(ps, false);
            if (*ps->p == ',') {
                ps->p++;
                skip_space(ps, false);
                if (*ps->p == '}')
                    n = -1;
                else {
                    n = strtol(ps->p, &end, 10);
                    if (end == ps->p || n < m || n > 1000) return fail(ps, "bad repetition bound");
                    ps->p = end;
                }
            }
            skip_space(ps, false);
            if (*ps->p != '}') return fail(ps, "expected '}'");
            ps->p++;
            int x = atom_rule(ps, seq, at);
            if (x < 0) return false;
            seq->n = at;
            for (long i = 0; i < m; i++)
                if (!seq_add(ps, seq, E_RULE, x)) return false;
            if (n < 0) {
                int r = repeat_rule(ps, x, true);
                if (r < 0 || !seq_add(ps, seq, E_RULE, r)) return false;
            } else if (n > m) {
                /* O_k ::= X O_{k-1} | empty, O_1 ::= X | empty. */
                int o = repeat_rule(ps, x, false);
                for (long k = 2; o >= 0 && k <= n - m; k++) {
                    int r = rule_new(ps, "upto");
                    vec a = {0}, b = {0};
                    if (r < 0 || !seq_add(ps, &a, E_RULE, x) || !seq_add(ps, &a, E_RULE, o) ||
                        !rule_add_alt(ps, r, &a) || !rule_add_alt(ps, r, &b)) {
                        free(a.p);
                        return false;
                    }
                    o = r;
                }
                if (o < 0 || !seq_add(ps, seq, E_RULE, o)) return false;
            }
        }
    }
}

static bool parse_alternates(parser *ps, int rule, bool nested) {
    for (;;) {
        vec seq = {0};
        if (!parse_sequence(ps, &seq, nested) || !rule_add_alt(ps, rule, &seq)) {
            free(seq.p);
            return false;
        }
        skip_space(ps, nested);
        if (!nested) {
            /* A `|` that begins the next line continues the rule. */
            const char *save = ps->p;
            int line = ps->line;
            skip_space(ps, true);
            if (*ps->p != '|') ps->p = save, ps->line = line;
        }
        if (*ps->p != '|') return true;
        ps->p++;
        skip_space(ps, true);
    }
}

static void parser_free(parser *ps) {
    prule *r = ps->rules.p;
    for (int i = 0; i < ps->rules.n; i++) {
        vec *a = r[i].alts.p;
        for (int k = 0; k < r[i].alts.n; k++)
            free(a[k].p);
        free(r[i].alts.p);
        free(r[i].name);
    }
    free(ps->rules.p);
    free(ps->ranges.p);
    free(ps->classes.p);
}

/* Left recursion: a rule that can reach itself without consuming a
 * character would expand forever. */
static bool left_recursive(const duet_grammar *g, const bool *nullable, int r, int target, char *seen) {
    if (seen[r]) return false;
    seen[r] = 1;
    for (int a = 0; a < g->ru[r].n_alts; a++)
        for (int p = g->alts[g->ru[r].first_alt + a]; g->el[p].type == E_RULE; p++) {
            int s = g->el[p].v;
            if (s == target || left_recursive(g, nullable, s, target, seen)) return true;
            if (!nullable[s]) break;
        }
    return false;
}

void duet_grammar_free(duet_grammar *g) {
    if (!g) return;
    for (int i = 0; i < g->n_ru; i++)
        free(g->ru[i].name);
    free(g->ru);
    free(g->el);
    free(g->rg);
    free(g->cl);
    free(g->alts);
    free(g);
}

int duet_grammar_n_rules(const duet_grammar *g) {
    return g->n_ru;
}

duet_status duet_grammar_parse(const char *gbnf, duet_grammar **out) {
    *out = NULL;
    if (!gbnf) return duet__error(DUET_INVALID_ARGUMENT, "grammar: NULL text");
    parser ps = {.src = gbnf, .p = gbnf, .line = 1};
    for (;;) {
        skip_space(&ps, true);
        if (!*ps.p) break;
        const char *s = ps.p;
        while (is_word(*ps.p))
            ps.p++;
        if (ps.p == s) {
            fail(&ps, "expected a rule name, found '%c'", *ps.p);
            break;
        }
        int r = rule_find(&ps, s, (size_t)(ps.p - s), true);
        if (r < 0) break;
        prule *pr = &((prule *)ps.rules.p)[r];
        if (pr->defined) {
            fail(&ps, "rule '%s' is defined twice", pr->name);
            break;
        }
        pr->defined = true;
        skip_space(&ps, false);
        if (strncmp(ps.p, "::=", 3)) {
            fail(&ps, "expected '::=' after '%s'", pr->name);
            break;
        }
        ps.p += 3;
        skip_space(&ps, true);
        if (!parse_alternates(&ps, r, false)) break;
        skip_space(&ps, false);
        if (*ps.p && *ps.p != '\n' && !is_word(*ps.p)) {
            fail(&ps, "unexpected '%c'", *ps.p);
            break;
        }
    }
    prule *pr = ps.rules.p;
    for (int i = 0; !ps.failed && i < ps.rules.n; i++)
        if (!pr[i].defined) fail(&ps, "rule '%s' is used but not defined", pr[i].name);
    int root = ps.failed ? -1 : rule_find(&ps, "root", 4, false);
    if (!ps.failed && root < 0) fail(&ps, "no 'root' rule");
    if (ps.failed) {
        parser_free(&ps);
        return duet__error(DUET_BAD_REQUEST, "%s", ps.err);
    }
    /* Flatten: every alternative's elements, then E_END. */
    duet_grammar *g = calloc(1, sizeof *g);
    int n_el = 0, n_alts = 0;
    for (int i = 0; i < ps.rules.n; i++) {
        vec *a = pr[i].alts.p;
        for (int k = 0; k < pr[i].alts.n; k++)
            n_el += a[k].n + 1;
        n_alts += pr[i].alts.n;
    }
    if (g) {
        g->el = malloc((size_t)(n_el + 1) * sizeof *g->el);
        g->alts = malloc((size_t)(n_alts + 1) * sizeof *g->alts);
        g->ru = calloc((size_t)ps.rules.n, sizeof *g->ru);
    }
    if (!g || !g->el || !g->alts || !g->ru) {
        duet_grammar_free(g);
        parser_free(&ps);
        return duet__error(DUET_OUT_OF_MEMORY, "grammar: out of memory");
    }
    g->n_ru = ps.rules.n;
    for (int i = 0; i < ps.rules.n; i++) {
        vec *a = pr[i].alts.p;
        g->ru[i].name = pr[i].name;
        pr[i].name = NULL;
        g->ru[i].first_alt = g->n_alts;
        g->ru[i].n_alts = pr[i].alts.n;
        for (int k = 0; k < pr[i].alts.n; k++) {
            g->alts[g->n_alts++] = g->n_el;
            if (a[k].n) /* an empty alternative has no array (memcpy wants one even for 0 bytes) */
                memcpy(g->el + g->n_el, a[k].p, (size_t)a[k].n * sizeof *g->el);
            g->n_el += a[k].n;
            g->el[g->n_el++] = (elem){E_END, 0};
        }
    }
    g->rg = ps.ranges.p, g->n_rg = ps.ranges.n, ps.ranges.p = NULL;
    g->cl = ps.classes.p, g->n_cl = ps.classes.n, ps.classes.p = NULL;
    g->root = root;
    parser_free(&ps);
    for (int i = 0; i < g->n_cl; i++) {
        cclass *c = &g->cl[i];
        bool any = c->neg; /* a negated class leaves out finitely many characters */
        for (int k = 0; k < c->n && !any; k++)
            any = g->rg[c->first + k].hi >= 0x80;
        c->nonascii = any;
    }
    /* Nullable rules (fixed point), then left recursion. */
    bool *nullable = calloc((size_t)g->n_ru, sizeof *nullable);
    char *seen = malloc((size_t)g->n_ru);
    if (!nullable || !seen) {
        free(nullable), free(seen);
        duet_grammar_free(g);
        return duet__error(DUET_OUT_OF_MEMORY, "grammar: out of memory");
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (int r = 0; r < g->n_ru; r++) {
            if (nullable[r]) continue;
            for (int a = 0; a < g->ru[r].n_alts && !nullable[r]; a++) {
                int p = g->alts[g->ru[r].first_alt + a];
                while (g->el[p].type == E_RULE && nullable[g->el[p].v])
                    p++;
                if (g->el[p].type == E_END) nullable[r] = changed = true;
            }
        }
    }
    for (int r = 0; r < g->n_ru; r++) {
        memset(seen, 0, (size_t)g->n_ru);
        if (left_recursive(g, nullable, r, r, seen)) {
            char name[64];
            snprintf(name, sizeof name, "%s", g->ru[r].name);
            free(nullable), free(seen);
            duet_grammar_free(g);
            return duet__error(DUET_BAD_REQUEST, "grammar: rule '%s' is left-recursive", name);
        }
    }
    free(nullable), free(seen);
    *out = g;
    return DUET_OK;
}

/* ---- recognizer ------------------------------------------------------------ */

/* A state is an int32 array: [0] the code point gathered so far from a
 * character's leading bytes, [1] the bytes it still needs (0: none), [2] the
 * stack count, then each stack as its length and its positions (top
 * last). States live in a growable buffer and are referred to by offset. */
typedef struct ibuf {
    int32_t *a;
    size_t n, cap;
} ibuf;

static bool ibuf_reserve(ibuf *b, size_t extra) {
    if (b->n + extra <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 1024;
    while (cap < b->n + extra)
        cap *= 2;
    int32_t *a = realloc(b->a, cap * sizeof *a);
    if (!a) return false;
    b->a = a;
    b->cap = cap;
    return true;
}

typedef struct cache_entry {
    int32_t *key;
    size_t len;
    uint64_t hash;
    uint32_t *mask;
    int allowed;
} cache_entry;

struct duet_grammar_state {
    const duet_grammar *g;
    int32_t *cur; /* the committed state */
    size_t cur_len;
    ibuf buf; /* scratch for advancing */
    int32_t work[MAX_STACK + 2];
    int expansions;
    bool overflow;
    cache_entry cache[MASK_CACHE];
    int cache_next;
};

static bool class_match(const duet_grammar *g, int ci, uint32_t c) {
    const cclass *k = &g->cl[ci];
    bool in = false;
    for (int i = 0; i < k->n && !in; i++)
        in = c >= g->rg[k->first + i].lo && c <= g->rg[k->first + i].hi;
    return in != k->neg;
}

/* Appends stack work[0..len) to the state being built at b->a[at..] unless
 * it is there already. */
static void emit_stack(duet_grammar_state *s, size_t at, const int32_t *work, int len) {
    ibuf *b = &s->buf;
    int32_t *st = b->a + at;
    size_t off = at + 3;
    for (int i = 0; i < st[2]; i++) {
        int32_t l = b->a[off];
        if (l == len && !memcmp(b->a + off + 1, work, (size_t)len * sizeof *work)) return;
        off += 1 + (size_t)l;
    }
    if (st[2] >= MAX_STACKS || !ibuf_reserve(b, (size_t)len + 1)) {
        s->overflow = true;
        return;
    }
    st = b->a + at;
    b->a[b->n++] = len;
    memcpy(b->a + b->n, work, (size_t)len * sizeof *work);
    b->n += (size_t)len;
    st[2]++;
}

/* Expands the stack work[0..len) until its top is a character class (or it
 * is empty) and emits every result. */
static void expand(duet_grammar_state *s, size_t at, int len) {
    const duet_grammar *g = s->g;
    int32_t *w = s->work;
    if (++s->expansions > MAX_EXPAND) {
        s->overflow = true;
        return;
    }
    if (len == 0) {
        emit_stack(s, at, w, 0);
        return;
    }
    int32_t p = w[len - 1];
    const elem *e = &g->el[p];
    if (e->type == E_CLASS) {
        emit_stack(s, at, w, len);
    } else if (e->type == E_END) {
        expand(s, at, len - 1); /* the rule ends: continue below */
        w[len - 1] = p;
    } else {
        const rule *r = &g->ru[e->v];
        bool tail = g->el[p + 1].type == E_END;
        if (!tail && len + 1 > MAX_STACK) {
            s->overflow = true;
            return;
        }
        for (int a = 0; a < r->n_alts; a++) {
            int32_t start = g->alts[r->first_alt + a];
            if (tail) {
                w[len - 1] = start;
                expand(s, at, len);
            } else {
                w[len - 1] = p + 1;
                w[len] = start;
                expand(s, at, len + 1);
            }
        }
        w[len - 1] = p;
    }
}

/* Starts a state at the end of the buffer; returns its offset. */
static size_t state_begin(duet_grammar_state *s, int32_t cp, int32_t need) {
    ibuf *b = &s->buf;
    if (!ibuf_reserve(b, 3)) {
        s->overflow = true;
        return b->n;
    }
    size_t at = b->n;
    b->a[b->n++] = cp;
    b->a[b->n++] = need;
    b->a[b->n++] = 0;
    return at;
}

/* Advances the state at b->a[src] over code point c into a new state at the
 * buffer's end; returns its offset, or -1 when no stack accepts c. */
static long advance_cp(duet_grammar_state *s, size_t src, uint32_t c) {
    const duet_grammar *g = s->g;
    size_t at = state_begin(s, 0, 0);
    if (s->overflow) return -1;
    s->expansions = 0;
    size_t off = src + 3;
    int n = s->buf.a[src + 2];
    for (int i = 0; i < n; i++) {
        int32_t len = s->buf.a[off];
        if (len > 0) {
            int32_t top = s->buf.a[off + (size_t)len];
            if (class_match(g, g->el[top].v, c)) {
                memcpy(s->work, s->buf.a + off + 1, (size_t)len * sizeof(int32_t));
                s->work[len - 1] = top + 1;
                expand(s, at, len);
            }
        }
        off = src + 3;
        /* The buffer may have moved: find stack i + 1 again. */
        for (int k = 0; k <= i; k++)
            off += 1 + (size_t)s->buf.a[off];
    }
    if (s->overflow || s->buf.a[at + 2] == 0) {
        s->buf.n = at;
        return -1;
    }
    return (long)at;
}

/* Whether some stack's top accepts a character >= 0x80. */
static bool wants_nonascii(const duet_grammar_state *s, size_t src) {
    const duet_grammar *g = s->g;
    size_t off = src + 3;
    for (int i = 0; i < s->buf.a[src + 2]; i++) {
        int32_t len = s->buf.a[off];
        if (len > 0 && g->cl[g->el[s->buf.a[off + (size_t)len]].v].nonascii) return true;
        off += 1 + (size_t)len;
    }
    return false;
}

/* Advances over one byte; returns the new state's offset or -1. */
static long advance_byte(duet_grammar_state *s, size_t src, unsigned char byte) {
    int32_t cp = s->buf.a[src], need = s->buf.a[src + 1];
    if (need == 0) {
        if (byte < 0x80) return advance_cp(s, src, byte);
        int k = (byte & 0xE0) == 0xC0 ? 1 : (byte & 0xF0) == 0xE0 ? 2 : (byte & 0xF8) == 0xF0 ? 3 : 0;
        if (!k || byte == 0xC0 || byte == 0xC1 || byte > 0xF4 || !wants_nonascii(s, src)) return -1;
        cp = byte & (0x3F >> k);
        need = k;
    } else {
        if ((byte & 0xC0) != 0x80) return -1;
        cp = cp << 6 | (byte & 0x3F);
        if (--need == 0) {
            /* The character is whole: stacks advance from a copy without the partial. */
            return advance_cp(s, src, (uint32_t)cp);
        }
    }
    /* Same stacks, more of a character gathered. */
    size_t len = 0, off = src + 3;
    for (int i = 0; i < s->buf.a[src + 2]; i++) {
        len += 1 + (size_t)s->buf.a[off];
        off += 1 + (size_t)s->buf.a[off];
    }
    if (!ibuf_reserve(&s->buf, len + 3)) return -1;
    size_t at = s->buf.n;
    s->buf.a[at] = cp;
    s->buf.a[at + 1] = need;
    memmove(s->buf.a + at + 2, s->buf.a + src + 2, (len + 1) * sizeof(int32_t));
    s->buf.n += len + 3;
    return (long)at;
}

static size_t state_len(const int32_t *st) {
    size_t off = 3;
    for (int i = 0; i < st[2]; i++)
        off += 1 + (size_t)st[off];
    return off;
}

/* Puts the committed state at the start of the scratch buffer. */
static bool load_cur(duet_grammar_state *s) {
    s->buf.n = 0;
    if (!ibuf_reserve(&s->buf, s->cur_len)) return false;
    memcpy(s->buf.a, s->cur, s->cur_len * sizeof *s->cur);
    s->buf.n = s->cur_len;
    return true;
}

static bool commit(duet_grammar_state *s, size_t at) {
    size_t len = state_len(s->buf.a + at);
    int32_t *c = malloc(len * sizeof *c);
    if (!c) return false;
    memcpy(c, s->buf.a + at, len * sizeof *c);
    free(s->cur);
    s->cur = c;
    s->cur_len = len;
    return true;
}

void duet_grammar_state_reset(duet_grammar_state *s) {
    s->buf.n = 0;
    s->overflow = false;
    s->expansions = 0;
    size_t at = state_begin(s, 0, 0);
    const rule *r = &s->g->ru[s->g->root];
    for (int a = 0; a < r->n_alts && !s->overflow; a++) {
        s->work[0] = s->g->alts[r->first_alt + a];
        expand(s, at, 1);
    }
    if (!s->overflow) commit(s, at);
}

duet_status duet_grammar_state_new(const duet_grammar *g, duet_grammar_state **out) {
    *out = NULL;
    duet_grammar_state *s = calloc(1, sizeof *s);
    if (!s) return duet__error(DUET_OUT_OF_MEMORY, "grammar: out of memory");
    s->g = g;
    duet_grammar_state_reset(s);
    if (!s->cur) {
        bool of = s->overflow;
        duet_grammar_state_free(s);
        return of ? duet__error(DUET_BAD_REQUEST, "grammar: its start expands past %d stacks", MAX_STACKS)
                  : duet__error(DUET_OUT_OF_MEMORY, "grammar: out of memory");
    }
    *out = s;
    return DUET_OK;
}

void duet_grammar_state_free(duet_grammar_state *s) {
    if (!s) return;
    for (int i = 0; i < MASK_CACHE; i++)
        free(s->cache[i].key), free(s->cache[i].mask);
    free(s->cur);
    free(s->buf.a);
    free(s);
}

/* Advances the committed state over bytes into the scratch buffer; returns
 * the result's offset or -1. */
static long walk_bytes(duet_grammar_state *s, const char *bytes, size_t n) {
    if (!load_cur(s)) return -1;
    s->overflow = false;
    long at = 0;
    for (size_t i = 0; i < n && at >= 0; i++)
        at = advance_byte(s, (size_t)at, (unsigned char)bytes[i]);
    return at;
}

bool duet_grammar_accept(duet_grammar_state *s, const char *bytes, size_t n) {
    long at = walk_bytes(s, bytes, n);
    return at >= 0 && commit(s, (size_t)at);
}

bool duet_grammar_complete(const duet_grammar_state *s) {
    if (s->cur[1]) return false;
    size_t off = 3;
    for (int i = 0; i < s->cur[2]; i++) {
        if (s->cur[off] == 0) return true;
        off += 1 + (size_t)s->cur[off];
    }
    return false;
}

bool duet_grammar_can_continue(const duet_grammar_state *s) {
    size_t off = 3;
    for (int i = 0; i < s->cur[2]; i++) {
        if (s->cur[off] > 0) return true;
        off += 1 + (size_t)s->cur[off];
    }
    return false;
}

/* ---- the vocabulary and its trie ------------------------------------------- */

typedef struct tnode {
    int first_child, next_sibling;
    int first_tok, n_tok; /* into sorted[] */
    unsigned char byte;
} tnode;

struct duet_vocab {
    int n;
    char *blob;
    size_t *off;
    int *len;
    bool *eog;
    tnode *nodes;
    int n_nodes;
    int32_t *sorted; /* token ids by their bytes */
};

static const duet_vocab *sort_vocab; /* qsort has no context argument in C11 */

static int cmp_tok(const void *a, const void *b) {
    const duet_vocab *v = sort_vocab;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    int lx = v->len[x], ly = v->len[y];
    int c = memcmp(v->blob + v->off[x], v->blob + v->off[y], (size_t)(lx < ly ? lx : ly));
    if (c) return c;
    return lx != ly ? lx - ly : x - y;
}

void duet_vocab_free(duet_vocab *v) {
    if (!v) return;
    free(v->blob), free(v->off), free(v->len), free(v->eog), free(v->nodes), free(v->sorted);
    free(v);
}

int duet_vocab_size(const duet_vocab *v) {
    return v->n;
}

bool duet_vocab_is_eog(const duet_vocab *v, int32_t id) {
    return id >= 0 && id < v->n && v->eog[id];
}

duet_status duet_vocab_new(int n, const char *const *bytes, const int *len, const bool *eog,
                           duet_vocab **out) {
    static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER;
    *out = NULL;
    duet_vocab *v = calloc(1, sizeof *v);
    size_t total = 0, nodes_max = 1;
    for (int i = 0; i < n; i++)
        total += (size_t)(len[i] > 0 ? len[i] : 0), nodes_max += (size_t)(len[i] > 0 ? len[i] : 0);
    if (v) {
        v->n = n;
        v->blob = malloc(total + 1);
        v->off = malloc((size_t)n * sizeof *v->off);
        v->len = malloc((size_t)n * sizeof *v->len);
        v->eog = malloc((size_t)n * sizeof *v->eog);
        v->sorted = malloc((size_t)n * sizeof *v->sorted);
        v->nodes = malloc(nodes_max * sizeof *v->nodes);
    }
    if (!v || !v->blob || !v->off || !v->len || !v->eog || !v->sorted || !v->nodes) {
        duet_vocab_free(v);
        return duet__error(DUET_OUT_OF_MEMORY, "vocab: out of memory");
    }
    size_t at = 0;
    int n_sorted = 0;
    for (int i = 0; i < n; i++) {
        int l = len[i] > 0 ? len[i] : 0;
        v->off[i] = at;
        v->len[i] = l;
        v->eog[i] = eog && eog[i];
        if (l) memcpy(v->blob + at, bytes[i], (size_t)l);
        at += (size_t)l;
        if (l) v->sorted[n_sorted++] = i;
    }
    pthread_mutex_lock(&sort_mu);
    sort_vocab = v;
    qsort(v->sorted, (size_t)n_sorted, sizeof *v->sorted, cmp_tok);
    pthread_mutex_unlock(&sort_mu);
    /* The trie, from the sorted tokens: each shares its prefix with the one before. */
    int *path = malloc(((size_t)(total ? total : 1) + 1) * sizeof *path),
        *last = malloc(nodes_max * sizeof *last);
    if (!path || !last) {
        free(path), free(last);
        duet_vocab_free(v);
        return duet__error(DUET_OUT_OF_MEMORY, "vocab: out of memory");
    }
    v->nodes[0] = (tnode){-1, -1, 0, 0, 0};
    last[0] = -1;
    v->n_nodes = 1;
    path[0] = 0;
    int prev = -1;
    for (int k = 0; k < n_sorted; k++) {
        int t = v->sorted[k], l = v->len[t];
        const unsigned char *b = (const unsigned char *)v->blob + v->off[t];
        int lcp = 0;
        if (prev >= 0) {
            const unsigned char *pb = (const unsigned char *)v->blob + v->off[prev];
            int pl = v->len[prev];
            while (lcp < l && lcp < pl && b[lcp] == pb[lcp])
                lcp++;
        }
        for (int d = lcp; d < l; d++) {
            int id = v->n_nodes++, parent = path[d];
            v->nodes[id] = (tnode){-1, -1, 0, 0, b[d]};
            last[id] = -1;
            if (last[parent] < 0)
                v->nodes[parent].first_child = id;
            else
                v->nodes[last[parent]].next_sibling = id;
            last[parent] = id;
            path[d + 1] = id;
        }
        tnode *nd = &v->nodes[path[l]];
        if (!nd->n_tok) nd->first_tok = k;
        nd->n_tok++;
        prev = t;
    }
    free(path), free(last);
    *out = v;
    return DUET_OK;
}

bool duet_grammar_allows(duet_grammar_state *s, const duet_vocab *v, int32_t id) {
    if (id < 0 || id >= v->n) return false;
    if (v->eog[id]) return duet_grammar_complete(s);
    if (!v->len[id]) return false;
    return walk_bytes(s, v->blob + v->off[id], (size_t)v->len[id]) >= 0;
}

bool duet_grammar_accept_token(duet_grammar_state *s, const duet_vocab *v, int32_t id) {
    if (id < 0 || id >= v->n) return false;
    if (v->eog[id]) return duet_grammar_complete(s);
    return v->len[id] && duet_grammar_accept(s, v->blob + v->off[id], (size_t)v->len[id]);
}

/* Depth first over the trie below `node` from the state at offset st. */
static int walk_trie(duet_grammar_state *s, const duet_vocab *v, int node, size_t st, uint32_t *mask) {
    int allowed = 0;
    for (int c = v->nodes[node].first_child; c >= 0; c = v->nodes[c].next_sibling) {
        size_t mark = s->buf.n;
        s->overflow = false;
        long ns = advance_byte(s, st, v->nodes[c].byte);
        if (ns >= 0) {
            const tnode *t = &v->nodes[c];
            for (int k = 0; k < t->n_tok; k++) {
                int32_t id = v->sorted[t->first_tok + k];
                mask[id >> 5] |= 1u << (id & 31);
            }
            allowed += t->n_tok;
            if (t->first_child >= 0) allowed += walk_trie(s, v, c, (size_t)ns, mask);
        }
        s->buf.n = mark;
    }
    return allowed;
}

static uint64_t hash_state(const int32_t *a, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint32_t)a[i]) * 1099511628211ull;
    return h;
}

int duet_grammar_mask(duet_grammar_state *s, const duet_vocab *v, uint32_t *mask) {
    size_t words = ((size_t)v->n + 31) / 32;
    uint64_t h = hash_state(s->cur, s->cur_len);
    for (int i = 0; i < MASK_CACHE; i++) {
        cache_entry *e = &s->cache[i];
        if (e->mask && e->hash == h && e->len == s->cur_len &&
            !memcmp(e->key, s->cur, e->len * sizeof *e->key)) {
            memcpy(mask, e->mask, words * sizeof *mask);
            return e->allowed;
        }
    }
    memset(mask, 0, words * sizeof *mask);
    int allowed = 0;
    if (load_cur(s)) allowed = walk_trie(s, v, 0, 0, mask);
    if (duet_grammar_complete(s))
        for (int i = 0; i < v->n; i++)
            if (v->eog[i]) {
                mask[i >> 5] |= 1u << (i & 31);
                allowed++;
            }
    cache_entry *e = &s->cache[s->cache_next];
    int32_t *key = malloc(s->cur_len * sizeof *key);
    uint32_t *m = e->mask ? e->mask : malloc(words * sizeof *m);
    if (key && m) {
        free(e->key);
        memcpy(key, s->cur, s->cur_len * sizeof *key);
        memcpy(m, mask, words * sizeof *m);
        *e = (cache_entry){key, s->cur_len, h, m, allowed};
        s->cache_next = (s->cache_next + 1) % MASK_CACHE;
    } else {
        free(key);
        if (m != e->mask) free(m);
    }
    return allowed;
}
