/* jinja.c — a Jinja interpreter for chat templates; see jinja.h.
 *
 * Three stages, each written against jinja2's documented behaviour:
 *
 * 1. lex: the template's text and its tags become one token stream (text,
 *    tag begin and end, and the expression tokens inside tags), applying
 *    jinja2's whitespace rules as its lexer does: `{%-`/`-%}` strip all
 *    whitespace on their side, trim_blocks drops the newline after a block
 *    or comment tag, lstrip_blocks drops the spaces and tabs before a block
 *    or comment tag that starts a line, and the source's last newline goes.
 * 2. parse: recursive descent to an AST with jinja2's precedence (ternary,
 *    or, and, not, comparisons, + -, ~, * / // %, **, unary, postfix, and
 *    filters and tests binding tightest).
 * 3. render: a tree walk over values with Python's semantics (truthiness,
 *    int/float arithmetic, str() and repr() of every type).
 *
 * Errors unwind with longjmp: the parser's AST and every render value live
 * in arenas, so nothing leaks; the render's output buffer is freed by the
 * caller of the jump.
 */
#include "jinja.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- arena -------------------------------------------------------------- */

typedef struct arena_blk {
    struct arena_blk *next;
    size_t used, cap;
    max_align_t data[];
} arena_blk;

typedef struct arena {
    arena_blk *head;
    size_t total, limit;
} arena;

static void arena_free(arena *a) {
    for (arena_blk *b = a->head, *n; b; b = n) {
        n = b->next;
        free(b);
    }
    a->head = NULL;
    a->total = 0;
}

/* NULL when the limit is reached or malloc fails. */
static void *arena_try_alloc(arena *a, size_t n) {
    n = (n + sizeof(max_align_t) - 1) & ~(sizeof(max_align_t) - 1);
    if (!n) n = sizeof(max_align_t);
    arena_blk *b = a->head;
    if (!b || b->cap - b->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->limit && a->total + cap > a->limit) return NULL;
        b = malloc(sizeof *b + cap);
        if (!b) return NULL;
        b->next = a->head;
        b->used = 0;
        b->cap = cap;
        a->head = b;
        a->total += cap;
    }
    void *p = (char *)b->data + b->used;
    b->used += n;
    return p;
}

/* ---- values ------------------------------------------------------------- */

typedef enum vtype {
    V_UNDEF,
    V_NONE,
    V_BOOL,
    V_INT,
    V_FLOAT,
    V_STR,
    V_LIST,
    V_DICT,
    V_NS, /* namespace(): a dict whose attributes may be set */
    V_MACRO,
    V_FUNC,   /* a global function: range, namespace, dict, raise_exception, ... */
    V_METHOD, /* obj.name for a method of str, list or dict, not yet called */
    V_LOOP,   /* the `loop` variable of a for loop */
} vtype;

struct list;
struct dict;
struct node;
struct frame;
struct loopstate;

typedef struct val {
    uint8_t t;
    uint8_t safe; /* V_STR: a Markup string (from |safe or |e); `+` escapes a plain operand */
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *p;
            size_t n;
        } s;
        struct list *l;
        struct dict *d;
        struct macro *m;
        struct method *me;
        struct loopstate *lp;
        int fn;
    } u;
} val;

/* What a V_LIST stands for in Python: their printing, JSON and len() differ. */
enum { L_LIST, L_TUPLE, L_GEN /* map, select, ... return generators */, L_VIEW /* dict.items() */, L_RANGE };

typedef struct list {
    val *v;
    size_t n, cap;
    int kind;
    int64_t start, stop, step; /* L_RANGE: what it prints as */
} list;

typedef struct dict {
    val *k, *v;
    size_t n, cap;
} dict;

typedef struct macro {
    const struct node *def;
    struct frame *closure;
} macro;

typedef struct method {
    val obj;
    const char *name;
} method;

typedef struct loopstate {
    const list *items;
    size_t index0;
} loopstate;

enum { FN_RANGE, FN_NAMESPACE, FN_DICT, FN_RAISE, FN_STRFTIME, FN_CYCLER, FN_JOINER, FN_LIPSUM };

/* ---- AST ---------------------------------------------------------------- */

typedef enum nkind {
    /* expressions */
    E_LIT,
    E_NAME,
    E_ATTR,
    E_INDEX,
    E_SLICE,
    E_CALL,
    E_FILTER,
    E_TEST,
    E_NEG,
    E_POS,
    E_NOT,
    E_AND,
    E_OR,
    E_BIN,
    E_CMP,
    E_COND,
    E_LIST,
    E_DICT,
    /* statements */
    S_TEXT,
    S_OUT,
    S_IF,
    S_FOR,
    S_SET,
    S_SETBLOCK,
    S_MACRO,
    S_BREAK,
    S_CONTINUE,
    S_FILTERBLOCK,
    S_BLOCK,
} nkind;

typedef enum binop {
    OP_ADD,
    OP_SUB,
    OP_MUL,
    OP_DIV,
    OP_FLOORDIV,
    OP_MOD,
    OP_POW,
    OP_CONCAT,
    OP_EQ,
    OP_NE,
    OP_LT,
    OP_LE,
    OP_GT,
    OP_GE,
    OP_IN,
    OP_NOTIN,
} binop;

typedef struct nlist {
    struct node **v;
    int n;
} nlist;

typedef struct node {
    nkind kind;
    int line;
    int op;                 /* binop; E_TEST: negated */
    const char *name;       /* E_NAME, E_ATTR, E_FILTER, E_TEST, S_MACRO, S_SET(BLOCK) target */
    const char *attr;       /* S_SET(BLOCK): namespace attribute or NULL */
    val lit;                /* E_LIT */
    struct node *a, *b, *c; /* operands; S_FOR: iter, cond; S_IF: cond */
    nlist args;         /* call/filter/test positional arguments; E_LIST items; E_DICT keys; E_CMP operands */
    nlist kwv;          /* keyword argument values; E_DICT values; S_MACRO defaults */
    const char **kwn;   /* keyword argument names; S_MACRO / S_FOR / S_SET target names */
    int nkw;            /* count of kwn */
    int *ops;           /* E_CMP operators */
    nlist body, orelse; /* statements; S_IF: body, else (an elif is an S_IF in else) */
    struct node *filters; /* S_SETBLOCK / S_FILTERBLOCK: a filter chain applied to the placeholder c;
                             E_SLICE: the sliced object (a, b, c: start, stop, step) */
} node;

struct duet__jinja_template {
    arena ar;
    nlist body;
};

/* ---- errors ------------------------------------------------------------- */

typedef struct errstate {
    jmp_buf jb;
    duet__jinja_result code;
    char *msg;
    size_t msglen;
} errstate;

static void fail_at(errstate *e, duet__jinja_result code, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 4, 5)));

static void fail_at(errstate *e, duet__jinja_result code, int line, const char *fmt, ...) {
    if (e->msg && e->msglen) {
        int k = line > 0 ? snprintf(e->msg, e->msglen, "line %d: ", line) : 0;
        if (k < 0) k = 0;
        if ((size_t)k < e->msglen) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(e->msg + k, e->msglen - (size_t)k, fmt, ap);
            va_end(ap);
        }
    }
    e->code = code;
    longjmp(e->jb, 1);
}

/* ---- lexer -------------------------------------------------------------- */

typedef enum tkind {
    TK_TEXT,
    TK_VBEGIN,
    TK_VEND,
    TK_BBEGIN,
    TK_BEND,
    TK_NAME,
    TK_STR,
    TK_INT,
    TK_FLOAT,
    TK_OP,
    TK_EOF
} tkind;

typedef struct token {
    tkind t;
    int line;
    const char *p; /* TK_NAME, TK_OP: in the (normalised) source; TK_STR, TK_TEXT: decoded, in the arena */
    size_t n;
    int64_t i;
    double f;
} token;

typedef struct lexer {
    errstate *e;
    arena *ar;
    const char *s;
    size_t n, pos;
    int line;
    token *tok;
    size_t ntok, captok;
} lexer;

static void *lx_alloc(lexer *L, size_t n) {
    void *p = arena_try_alloc(L->ar, n);
    if (!p) fail_at(L->e, DUET__JINJA_NOMEM, L->line, "out of memory");
    return p;
}

static token *lx_push(lexer *L, tkind t, int line) {
    if (L->ntok == L->captok) {
        size_t cap = L->captok ? L->captok * 2 : 256;
        token *nt = lx_alloc(L, cap * sizeof *nt);
        if (L->ntok) memcpy(nt, L->tok, L->ntok * sizeof *nt);
        L->tok = nt;
        L->captok = cap;
    }
    token *k = &L->tok[L->ntok++];
    memset(k, 0, sizeof *k);
    k->t = t;
    k->line = line;
    return k;
}

static bool is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static int count_nl(const char *p, size_t n) {
    int k = 0;
    for (size_t i = 0; i < n; i++)
        k += p[i] == '\n';
    return k;
}

static void lx_text(lexer *L, const char *p, size_t n, int line) {
    if (!n) return;
    token *k = lx_push(L, TK_TEXT, line);
    k->p = p;
    k->n = n;
}

/* Applies jinja2's left-side whitespace rules to the text before a tag whose
 * begin is followed by SIGN ('-', '+' or 0); VAR: the tag is {{. */
static size_t strip_before(const char *text, size_t n, char sign, bool var, bool line_starting) {
    if (sign == '-') {
        while (n && is_space(text[n - 1]))
            n--;
        return n;
    }
    if (sign == '+' || var) return n;
    size_t l = n;
    while (l && text[l - 1] != '\n')
        l--;
    if (l > 0 || line_starting) {
        if (l == n) return n; /* \s+ needs one character */
        for (size_t i = l; i < n; i++)
            if (!is_space(text[i])) return n;
        return l;
    }
    return n;
}

/* At the end of a block or comment tag (P at its last '}'), consumes what
 * jinja2's block end consumes; returns the position after it. DASH/PLUS: the
 * character before the closing pair. */
static size_t tag_end_after(const lexer *L, size_t after, char before) {
    if (before == '-') {
        while (after < L->n && is_space(L->s[after]))
            after++;
    } else if (before != '+') {
        if (after < L->n && L->s[after] == '\n') after++;
    }
    return after;
}

static bool lx_match_word(const lexer *L, size_t p, const char *w, size_t *end) {
    size_t k = strlen(w);
    if (p + k > L->n || memcmp(L->s + p, w, k)) return false;
    *end = p + k;
    return true;
}

/* Decodes a string literal body as Python's unicode-escape does. */
static void lx_string(lexer *L, token *k, const char *p, size_t n) {
    char *o = lx_alloc(L, n + 1);
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        char c = p[i];
        if (c != '\\' || i + 1 >= n) {
            o[j++] = c;
            continue;
        }
        char d = p[++i];
        switch (d) {
        case 'n':
            o[j++] = '\n';
            break;
        case 't':
            o[j++] = '\t';
            break;
        case 'r':
            o[j++] = '\r';
            break;
        case '\\':
            o[j++] = '\\';
            break;
        case '\'':
            o[j++] = '\'';
            break;
        case '"':
            o[j++] = '"';
            break;
        case 'a':
            o[j++] = '\a';
            break;
        case 'b':
            o[j++] = '\b';
            break;
        case 'f':
            o[j++] = '\f';
            break;
        case 'v':
            o[j++] = '\v';
            break;
        case '\n':
            break;
        case '0':
        case '1':
        case '2':
        case '3':
        case '4':
        case '5':
        case '6':
        case '7': {
            unsigned v = 0;
            int m = 0;
            while (m < 3 && i < n && p[i] >= '0' && p[i] <= '7')
                v = v * 8 + (unsigned)(p[i++] - '0'), m++;
            i--;
            o[j++] = (char)v; /* code points 0-255; >127 are rare in templates */
            break;
        }
        case 'x':
        case 'u':
        case 'U': {
            int digits = d == 'x' ? 2 : d == 'u' ? 4 : 8;
            if (i + (size_t)digits >= n) {
                o[j++] = '\\';
                o[j++] = d;
                break;
            }
            unsigned long cp = 0;
            bool ok = true;
            for (int m = 1; m <= digits; m++) {
                char h = p[i + (size_t)m];
                if (!isxdigit((unsigned char)h)) ok = false;
                cp = cp * 16 + (unsigned long)(isdigit((unsigned char)h)
                                                   ? h - '0'
                                                   : (tolower((unsigned char)h) - 'a' + 10));
            }
            if (!ok) fail_at(L->e, DUET__JINJA_SYNTAX, L->line, "bad \\%c escape in a string", d);
            i += (size_t)digits;
            if (cp < 0x80) {
                o[j++] = (char)cp;
            } else if (cp < 0x800) {
                o[j++] = (char)(0xC0 | (cp >> 6));
                o[j++] = (char)(0x80 | (cp & 63));
            } else if (cp < 0x10000) {
                o[j++] = (char)(0xE0 | (cp >> 12));
                o[j++] = (char)(0x80 | ((cp >> 6) & 63));
                o[j++] = (char)(0x80 | (cp & 63));
            } else {
                o[j++] = (char)(0xF0 | (cp >> 18));
                o[j++] = (char)(0x80 | ((cp >> 12) & 63));
                o[j++] = (char)(0x80 | ((cp >> 6) & 63));
                o[j++] = (char)(0x80 | (cp & 63));
            }
            break;
        }
        default:
            o[j++] = '\\';
            o[j++] = d;
        }
    }
    o[j] = 0;
    k->p = o;
    k->n = j;
}

static const char *const ops2[] = {"//", "**", "==", "!=", ">=", "<=", NULL};
static const char ops1[] = "+-*/%~<>=()[]{},.:|";

/* Lexes the inside of a {{ }} or {% %} tag starting at L->pos; stops after
 * the end. Returns the position right after the closing pair (before any
 * whitespace the end consumed) via *close and sets *line_starting. */
static void lx_tag(lexer *L, bool block, bool *line_starting) {
    int depth = 0;
    for (;;) {
        while (L->pos < L->n && is_space(L->s[L->pos])) {
            if (L->s[L->pos] == '\n') L->line++;
            L->pos++;
        }
        if (L->pos >= L->n)
            fail_at(L->e, DUET__JINJA_SYNTAX, L->line, "unexpected end of template inside a tag");
        const char *s = L->s + L->pos;
        size_t left = L->n - L->pos;
        char close = block ? '%' : '}';
        if (depth == 0) {
            /* -%} / +%} / %} (and -}} / }}) */
            size_t k = 0;
            char sign = 0;
            if ((s[0] == '-' || (s[0] == '+' && block)) && left >= 3 && s[1] == close && s[2] == '}')
                sign = s[0], k = 1;
            if (left >= k + 2 && s[k] == close && s[k + 1] == '}') {
                size_t after = L->pos + k + 2;
                size_t end = block ? tag_end_after(L, after, sign)
                                   : (sign == '-' ? tag_end_after(L, after, '-') : after);
                L->line += count_nl(L->s + after, end - after);
                *line_starting = end > 0 && L->s[end - 1] == '\n' && end > after;
                lx_push(L, block ? TK_BEND : TK_VEND, L->line);
                L->pos = end;
                return;
            }
        }
        char c = s[0];
        if (isalpha((unsigned char)c) || c == '_') {
            size_t k = 1;
            while (k < left && (isalnum((unsigned char)s[k]) || s[k] == '_'))
                k++;
            token *t = lx_push(L, TK_NAME, L->line);
            t->p = s;
            t->n = k;
            L->pos += k;
            continue;
        }
        if (isdigit((unsigned char)c)) {
            size_t k = 0;
            while (k < left && (isdigit((unsigned char)s[k]) || s[k] == '_'))
                k++;
            bool isf = false;
            if (k + 1 < left && s[k] == '.' && isdigit((unsigned char)s[k + 1])) {
                isf = true;
                k++;
                while (k < left && (isdigit((unsigned char)s[k]) || s[k] == '_'))
                    k++;
            }
            if (k < left && (s[k] == 'e' || s[k] == 'E')) {
                size_t m = k + 1;
                if (m < left && (s[m] == '+' || s[m] == '-')) m++;
                if (m < left && isdigit((unsigned char)s[m])) {
                    isf = true;
                    k = m;
                    while (k < left && isdigit((unsigned char)s[k]))
                        k++;
                }
            }
            char buf[64];
            size_t j = 0;
            for (size_t m = 0; m < k && j < sizeof buf - 1; m++)
                if (s[m] != '_') buf[j++] = s[m];
            buf[j] = 0;
            token *t = lx_push(L, isf ? TK_FLOAT : TK_INT, L->line);
            if (isf) {
                t->f = strtod(buf, NULL);
            } else {
                char *endp;
                unsigned long long v = strtoull(buf, &endp, 10);
                if (v > INT64_MAX) fail_at(L->e, DUET__JINJA_SYNTAX, L->line, "integer literal too large");
                t->i = (int64_t)v;
            }
            L->pos += k;
            continue;
        }
        if (c == '\'' || c == '"') {
            size_t k = 1;
            while (k < left && s[k] != c) {
                if (s[k] == '\\') k++;
                k++;
            }
            if (k >= left) fail_at(L->e, DUET__JINJA_SYNTAX, L->line, "unterminated string");
            token *t = lx_push(L, TK_STR, L->line);
            lx_string(L, t, s + 1, k - 1);
            L->line += count_nl(s, k);
            L->pos += k + 1;
            continue;
        }
        size_t k = 0;
        for (int m = 0; ops2[m]; m++)
            if (left >= 2 && s[0] == ops2[m][0] && s[1] == ops2[m][1]) k = 2;
        if (!k && strchr(ops1, c) && c) k = 1;
        if (!k) fail_at(L->e, DUET__JINJA_SYNTAX, L->line, "unexpected character '%c'", c);
        if (k == 1 && (c == '(' || c == '[' || c == '{')) depth++;
        if (k == 1 && (c == ')' || c == ']' || c == '}')) {
            if (!depth) fail_at(L->e, DUET__JINJA_SYNTAX, L->line, "unexpected '%c'", c);
            depth--;
        }
        token *t = lx_push(L, TK_OP, L->line);
        t->p = s;
        t->n = k;
        L->pos += k;
    }
}

/* Finds "{%[-+]?\s*endraw\s*[-+]?%}" from P; returns its start or n. */
static size_t find_endraw(const lexer *L, size_t p, size_t *tag_end, char *sign_l, char *sign_r) {
    for (size_t q = p; q + 1 < L->n; q++) {
        if (L->s[q] != '{' || L->s[q + 1] != '%') continue;
        size_t r = q + 2;
        char sl = 0;
        if (r < L->n && (L->s[r] == '-' || L->s[r] == '+')) sl = L->s[r++];
        while (r < L->n && is_space(L->s[r]))
            r++;
        size_t e;
        if (!lx_match_word(L, r, "endraw", &e)) continue;
        r = e;
        while (r < L->n && is_space(L->s[r]))
            r++;
        char sr = 0;
        if (r < L->n && (L->s[r] == '-' || L->s[r] == '+')) sr = L->s[r++];
        if (r + 1 < L->n && L->s[r] == '%' && L->s[r + 1] == '}') {
            *tag_end = r + 2;
            *sign_l = sl;
            *sign_r = sr;
            return q;
        }
    }
    return L->n;
}

static void lex(lexer *L) {
    bool line_starting = true;
    while (L->pos < L->n) {
        /* the next tag start */
        size_t q = L->pos;
        while (q + 1 < L->n &&
               !(L->s[q] == '{' && (L->s[q + 1] == '{' || L->s[q + 1] == '%' || L->s[q + 1] == '#')))
            q++;
        if (q + 1 >= L->n) {
            lx_text(L, L->s + L->pos, L->n - L->pos, L->line);
            L->line += count_nl(L->s + L->pos, L->n - L->pos);
            L->pos = L->n;
            break;
        }
        char kind = L->s[q + 1];
        char sign = q + 2 < L->n && (L->s[q + 2] == '-' || L->s[q + 2] == '+') ? L->s[q + 2] : 0;
        size_t inner = q + 2 + (sign ? 1 : 0);
        const char *text = L->s + L->pos;
        size_t tn = q - L->pos;
        int text_line = L->line;
        L->line += count_nl(text, tn);
        /* {% raw %} */
        bool raw = false;
        size_t raw_end = 0;
        if (kind == '%') {
            size_t r = inner, e;
            while (r < L->n && is_space(L->s[r]))
                r++;
            if (lx_match_word(L, r, "raw", &e)) {
                r = e;
                while (r < L->n && is_space(L->s[r]))
                    r++;
                if (r + 2 < L->n && L->s[r] == '-' && L->s[r + 1] == '%' && L->s[r + 2] == '}') {
                    raw = true;
                    raw_end = r + 3;
                    while (raw_end < L->n && is_space(L->s[raw_end]))
                        raw_end++;
                } else if (r + 1 < L->n && L->s[r] == '%' && L->s[r + 1] == '}') {
                    raw = true;
                    raw_end = r + 2;
                }
            }
        }
        tn = strip_before(text, tn, sign, kind == '{', line_starting);
        lx_text(L, text, tn, text_line);
        if (raw) {
            L->line += count_nl(L->s + q, raw_end - q);
            line_starting = raw_end > 0 && L->s[raw_end - 1] == '\n';
            size_t tag_end;
            char sl, sr;
            size_t er = find_endraw(L, raw_end, &tag_end, &sl, &sr);
            if (er >= L->n) fail_at(L->e, DUET__JINJA_SYNTAX, L->line, "missing end of raw directive");
            size_t rn = strip_before(L->s + raw_end, er - raw_end, sl, false, line_starting);
            lx_text(L, L->s + raw_end, rn, L->line);
            L->line += count_nl(L->s + raw_end, er - raw_end);
            size_t end = tag_end_after(L, tag_end, sr);
            L->line += count_nl(L->s + er, end - er);
            line_starting = end > tag_end && L->s[end - 1] == '\n';
            L->pos = end;
            continue;
        }
        if (kind == '#') {
            size_t r = inner;
            while (r + 1 < L->n && !(L->s[r] == '#' && L->s[r + 1] == '}'))
                r++;
            if (r + 1 >= L->n) fail_at(L->e, DUET__JINJA_SYNTAX, L->line, "missing end of comment tag");
            char before = r > inner ? L->s[r - 1] : 0;
            size_t end = tag_end_after(L, r + 2, before);
            L->line += count_nl(L->s + q, end - q);
            line_starting = end > r + 2 && L->s[end - 1] == '\n';
            L->pos = end;
            continue;
        }
        lx_push(L, kind == '{' ? TK_VBEGIN : TK_BBEGIN, L->line);
        L->pos = inner;
        lx_tag(L, kind == '%', &line_starting);
    }
    lx_push(L, TK_EOF, L->line);
}

/* ---- parser ------------------------------------------------------------- */

typedef struct parser {
    errstate *e;
    arena *ar;
    token *tok;
    size_t i, n;
    int depth;
    bool soft; /* inside an if: jinja2 reports unknown filters and tests only when they run */
} parser;

static void *ps_alloc(parser *P, size_t n) {
    void *p = arena_try_alloc(P->ar, n);
    if (!p) fail_at(P->e, DUET__JINJA_NOMEM, 0, "out of memory");
    memset(p, 0, n);
    return p;
}

static token *cur(parser *P) {
    return &P->tok[P->i];
}
static token *peek(parser *P, size_t k) {
    return &P->tok[P->i + k < P->n ? P->i + k : P->n - 1];
}

static bool tok_is(const token *t, tkind k, const char *s) {
    if (t->t != k) return false;
    if (!s) return true;
    return strlen(s) == t->n && !memcmp(t->p, s, t->n);
}
static bool is_op(parser *P, const char *s) {
    return tok_is(cur(P), TK_OP, s);
}
static bool is_name(parser *P, const char *s) {
    return tok_is(cur(P), TK_NAME, s);
}

static const char *tok_desc(const token *t) {
    static const char *const names[] = {"text",   "'{{'",    "'}}'",  "'{%'",     "'%}'",           "name",
                                        "string", "integer", "float", "operator", "end of template"};
    return names[t->t];
}

static void __attribute__((noreturn)) ps_fail(parser *P, const char *what) {
    token *t = cur(P);
    if (t->t == TK_NAME || t->t == TK_OP)
        fail_at(P->e, DUET__JINJA_SYNTAX, t->line, "%s, got '%.*s'", what, (int)t->n, t->p);
    fail_at(P->e, DUET__JINJA_SYNTAX, t->line, "%s, got %s", what, tok_desc(t));
}

static void expect_op(parser *P, const char *s) {
    if (!is_op(P, s)) {
        char m[64];
        snprintf(m, sizeof m, "expected '%s'", s);
        ps_fail(P, m);
    }
    P->i++;
}

static const char *ps_strdup(parser *P, const char *p, size_t n) {
    char *s = ps_alloc(P, n + 1);
    memcpy(s, p, n);
    s[n] = 0;
    return s;
}

static const char *expect_name(parser *P) {
    if (cur(P)->t != TK_NAME) ps_fail(P, "expected a name");
    token *t = cur(P);
    P->i++;
    return ps_strdup(P, t->p, t->n);
}

static node *mk(parser *P, nkind k, int line) {
    node *n = ps_alloc(P, sizeof *n);
    n->kind = k;
    n->line = line;
    return n;
}

static void nl_push(parser *P, nlist *l, node *x) {
    if ((l->n & (l->n - 1)) == 0) { /* grow at powers of two */
        int cap = l->n ? l->n * 2 : 4;
        if (cap < 4) cap = 4;
        node **v = ps_alloc(P, (size_t)cap * sizeof *v);
        if (l->n) memcpy(v, l->v, (size_t)l->n * sizeof *v);
        l->v = v;
    }
    l->v[l->n++] = x;
}

static void names_push(parser *P, node *n, const char *s) {
    const char **v = ps_alloc(P, (size_t)(n->nkw + 1) * sizeof *v);
    if (n->nkw) memcpy(v, n->kwn, (size_t)n->nkw * sizeof *v);
    v[n->nkw++] = s;
    n->kwn = v;
}

static node *parse_expr(parser *P, bool with_cond);
static node *parse_unary(parser *P, bool with_filter);
static node *parse_or(parser *P);

static const char *const known_filters[] = {
    "abs",      "attribute", "batch",      "capitalize", "center",     "count",       "d",       "default",
    "dictsort", "e",         "escape",     "first",      "float",      "forceescape", "format",  "groupby",
    "indent",   "int",       "items",      "join",       "last",       "length",      "list",    "lower",
    "map",      "max",       "min",        "reject",     "rejectattr", "replace",     "reverse", "round",
    "safe",     "select",    "selectattr", "sort",       "string",     "striptags",   "sum",     "title",
    "tojson",   "trim",      "truncate",   "unique",     "upper",      "wordcount",   NULL};
static const char *const known_tests[] = {
    "boolean",  "callable", "defined", "divisibleby", "eq",     "equalto",     "escaped", "even",
    "false",    "filter",   "float",   "ge",          "gt",     "greaterthan", "in",      "integer",
    "iterable", "le",       "lower",   "lessthan",    "lt",     "mapping",     "ne",      "none",
    "number",   "odd",      "sameas",  "sequence",    "string", "test",        "true",    "undefined",
    "upper",    "==",       "!=",      "<",           "<=",     ">",           ">=",      NULL};

static bool in_names(const char *const *names, const char *s) {
    for (int i = 0; names[i]; i++)
        if (!strcmp(names[i], s)) return true;
    return false;
}

/* (args) after a callee, filter or test: positional and keyword arguments. */
static void parse_call_args(parser *P, node *n) {
    expect_op(P, "(");
    while (!is_op(P, ")")) {
        if (n->args.n || n->nkw) expect_op(P, ",");
        if (is_op(P, ")")) break;
        if (is_op(P, "*") || is_op(P, "**")) ps_fail(P, "*args and **kwargs in calls are not supported");
        if (cur(P)->t == TK_NAME && tok_is(peek(P, 1), TK_OP, "=")) {
            names_push(P, n, expect_name(P));
            P->i++;
            nl_push(P, &n->kwv, parse_expr(P, true));
        } else {
            if (n->nkw) ps_fail(P, "positional argument after a keyword argument");
            nl_push(P, &n->args, parse_expr(P, true));
        }
    }
    P->i++;
}

static node *parse_tuple(parser *P, bool with_cond, bool explicit_parens) {
    int line = cur(P)->line;
    node *first = NULL;
    node *lst = NULL;
    for (;;) {
        if (lst && (is_op(P, ")") || cur(P)->t == TK_BEND || cur(P)->t == TK_VEND || is_op(P, "]"))) break;
        if (explicit_parens && !first && is_op(P, ")")) {
            node *t = mk(P, E_LIST, line); /* () is an empty tuple */
            t->op = 1;
            return t;
        }
        node *x = with_cond ? parse_expr(P, true) : parse_or(P);
        if (!first) {
            first = x;
        } else {
            if (!lst) {
                lst = mk(P, E_LIST, line);
                lst->op = 1;
                nl_push(P, &lst->args, first);
            }
            nl_push(P, &lst->args, x);
        }
        if (!is_op(P, ",")) break;
        P->i++;
        if (!lst) {
            lst = mk(P, E_LIST, line);
            lst->op = 1;
            nl_push(P, &lst->args, first);
        }
    }
    return lst ? lst : first;
}

static node *parse_primary(parser *P) {
    token *t = cur(P);
    int line = t->line;
    if (t->t == TK_NAME) {
        P->i++;
        node *n = mk(P, E_LIT, line);
        if (tok_is(t, TK_NAME, "true") || tok_is(t, TK_NAME, "True")) {
            n->lit.t = V_BOOL;
            n->lit.u.b = true;
        } else if (tok_is(t, TK_NAME, "false") || tok_is(t, TK_NAME, "False")) {
            n->lit.t = V_BOOL;
            n->lit.u.b = false;
        } else if (tok_is(t, TK_NAME, "none") || tok_is(t, TK_NAME, "None")) {
            n->lit.t = V_NONE;
        } else {
            n->kind = E_NAME;
            n->name = ps_strdup(P, t->p, t->n);
        }
        return n;
    }
    if (t->t == TK_STR) {
        /* adjacent literals concatenate */
        size_t total = 0, k = P->i;
        while (P->tok[k].t == TK_STR)
            total += P->tok[k++].n;
        char *s = ps_alloc(P, total + 1);
        size_t j = 0;
        while (cur(P)->t == TK_STR) {
            memcpy(s + j, cur(P)->p, cur(P)->n);
            j += cur(P)->n;
            P->i++;
        }
        node *n = mk(P, E_LIT, line);
        n->lit.t = V_STR;
        n->lit.u.s.p = s;
        n->lit.u.s.n = total;
        return n;
    }
    if (t->t == TK_INT || t->t == TK_FLOAT) {
        P->i++;
        node *n = mk(P, E_LIT, line);
        if (t->t == TK_INT) {
            n->lit.t = V_INT;
            n->lit.u.i = t->i;
        } else {
            n->lit.t = V_FLOAT;
            n->lit.u.f = t->f;
        }
        return n;
    }
    if (is_op(P, "(")) {
        P->i++;
        node *n = parse_tuple(P, true, true);
        expect_op(P, ")");
        return n;
    }
    if (is_op(P, "[")) {
        P->i++;
        node *n = mk(P, E_LIST, line);
        while (!is_op(P, "]")) {
            if (n->args.n) expect_op(P, ",");
            if (is_op(P, "]")) break;
            nl_push(P, &n->args, parse_expr(P, true));
        }
        P->i++;
        return n;
    }
    if (is_op(P, "{")) {
        P->i++;
        node *n = mk(P, E_DICT, line);
        while (!is_op(P, "}")) {
            if (n->args.n) expect_op(P, ",");
            if (is_op(P, "}")) break;
            nl_push(P, &n->args, parse_expr(P, true));
            expect_op(P, ":");
            nl_push(P, &n->kwv, parse_expr(P, true));
        }
        P->i++;
        return n;
    }
    ps_fail(P, "expected an expression");
}

static node *parse_subscript_arg(parser *P) {
    /* a[x], a[x:y], a[x:y:z], a[::-1] */
    int line = cur(P)->line;
    node *parts[3] = {NULL, NULL, NULL};
    bool slice = false;
    int k = 0;
    for (;;) {
        if (!is_op(P, ":") && !is_op(P, "]")) parts[k] = parse_expr(P, true);
        if (is_op(P, ":") && k < 2) {
            slice = true;
            k++;
            P->i++;
            continue;
        }
        break;
    }
    if (!slice) {
        if (!parts[0]) ps_fail(P, "expected an expression");
        return parts[0];
    }
    node *n = mk(P, E_SLICE, line);
    n->a = parts[0];
    n->b = parts[1];
    n->c = parts[2];
    return n;
}

static node *parse_postfix(parser *P, node *x) {
    for (;;) {
        int line = cur(P)->line;
        if (is_op(P, ".")) {
            P->i++;
            node *n = mk(P, E_ATTR, line);
            n->a = x;
            if (cur(P)->t == TK_INT) { /* a.0 is a[0] */
                n->kind = E_INDEX;
                node *lit = mk(P, E_LIT, line);
                lit->lit.t = V_INT;
                lit->lit.u.i = cur(P)->i;
                P->i++;
                n->b = lit;
            } else {
                n->name = expect_name(P);
            }
            x = n;
        } else if (is_op(P, "[")) {
            P->i++;
            node *arg = parse_subscript_arg(P);
            expect_op(P, "]");
            node *n;
            if (arg->kind == E_SLICE) {
                n = arg;
                n->args.n = 0;
                node *obj = x;
                n->filters = obj; /* the sliced object */
            } else {
                n = mk(P, E_INDEX, line);
                n->a = x;
                n->b = arg;
            }
            x = n;
        } else if (is_op(P, "(")) {
            node *n = mk(P, E_CALL, line);
            n->a = x;
            parse_call_args(P, n);
            x = n;
        } else {
            return x;
        }
    }
}

static node *parse_filter(parser *P, node *x) {
    /* after '|' */
    int line = cur(P)->line;
    const char *name = expect_name(P);
    while (is_op(P, ".")) { /* dotted names are not builtins */
        P->i++;
        expect_name(P);
        fail_at(P->e, DUET__JINJA_SYNTAX, line, "no filter named '%s...'", name);
    }
    if (!in_names(known_filters, name) && !P->soft)
        fail_at(P->e, DUET__JINJA_SYNTAX, line, "no filter named '%s'", name);
    node *n = mk(P, E_FILTER, line);
    n->name = name;
    n->a = x;
    if (is_op(P, "(")) parse_call_args(P, n);
    return n;
}

static node *parse_filter_expr(parser *P, node *x) {
    for (;;) {
        int line = cur(P)->line;
        if (is_op(P, "|")) {
            P->i++;
            x = parse_filter(P, x);
        } else if (is_name(P, "is")) {
            P->i++;
            node *n = mk(P, E_TEST, line);
            if (is_name(P, "not")) {
                P->i++;
                n->op = 1;
            }
            const char *name;
            if (cur(P)->t == TK_NAME) {
                name = expect_name(P);
            } else if (cur(P)->t == TK_OP && (is_op(P, "==") || is_op(P, "!=") || is_op(P, "<") ||
                                              is_op(P, "<=") || is_op(P, ">") || is_op(P, ">="))) {
                name = ps_strdup(P, cur(P)->p, cur(P)->n);
                P->i++;
            } else {
                ps_fail(P, "expected a test name");
            }
            if (!in_names(known_tests, name) && !P->soft)
                fail_at(P->e, DUET__JINJA_SYNTAX, line, "no test named '%s'", name);
            n->name = name;
            n->a = x;
            token *t = cur(P);
            if (is_op(P, "(")) {
                parse_call_args(P, n);
            } else if ((t->t == TK_NAME || t->t == TK_STR || t->t == TK_INT || t->t == TK_FLOAT ||
                        is_op(P, "[") || is_op(P, "{")) &&
                       !is_name(P, "else") && !is_name(P, "or") && !is_name(P, "and")) {
                if (is_name(P, "is")) ps_fail(P, "you cannot chain multiple tests with is");
                node *arg = parse_postfix(P, parse_primary(P));
                nl_push(P, &n->args, arg);
            }
            x = n;
        } else if (is_op(P, "(")) {
            node *n = mk(P, E_CALL, line);
            n->a = x;
            parse_call_args(P, n);
            x = n;
        } else {
            return x;
        }
    }
}

static node *parse_unary(parser *P, bool with_filter) {
    int line = cur(P)->line;
    if (++P->depth > 200) fail_at(P->e, DUET__JINJA_SYNTAX, line, "expression nested too deeply");
    node *x;
    if (is_op(P, "-") || is_op(P, "+")) {
        bool neg = is_op(P, "-");
        P->i++;
        x = mk(P, neg ? E_NEG : E_POS, line);
        x->a = parse_unary(P, false);
    } else {
        x = parse_primary(P);
    }
    x = parse_postfix(P, x);
    if (with_filter) x = parse_filter_expr(P, x);
    P->depth--;
    return x;
}

static node *mkbin(parser *P, int op, node *a, node *b, int line) {
    node *n = mk(P, E_BIN, line);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static node *parse_pow(parser *P) {
    node *x = parse_unary(P, true);
    while (is_op(P, "**")) {
        int line = cur(P)->line;
        P->i++;
        x = mkbin(P, OP_POW, x, parse_unary(P, true), line);
    }
    return x;
}

static node *parse_math2(parser *P) {
    node *x = parse_pow(P);
    for (;;) {
        int line = cur(P)->line, op;
        if (is_op(P, "*"))
            op = OP_MUL;
        else if (is_op(P, "/"))
            op = OP_DIV;
        else if (is_op(P, "//"))
            op = OP_FLOORDIV;
        else if (is_op(P, "%"))
            op = OP_MOD;
        else
            return x;
        P->i++;
        x = mkbin(P, op, x, parse_pow(P), line);
    }
}

static node *parse_concat(parser *P) {
    node *x = parse_math2(P);
    while (is_op(P, "~")) {
        int line = cur(P)->line;
        P->i++;
        x = mkbin(P, OP_CONCAT, x, parse_math2(P), line);
    }
    return x;
}

static node *parse_math1(parser *P) {
    node *x = parse_concat(P);
    for (;;) {
        int line = cur(P)->line, op;
        if (is_op(P, "+"))
            op = OP_ADD;
        else if (is_op(P, "-"))
            op = OP_SUB;
        else
            return x;
        P->i++;
        x = mkbin(P, op, x, parse_concat(P), line);
    }
}

static node *parse_compare(parser *P) {
    int line = cur(P)->line;
    node *x = parse_math1(P);
    node *cmp = NULL;
    for (;;) {
        int op;
        if (is_op(P, "=="))
            op = OP_EQ;
        else if (is_op(P, "!="))
            op = OP_NE;
        else if (is_op(P, "<"))
            op = OP_LT;
        else if (is_op(P, "<="))
            op = OP_LE;
        else if (is_op(P, ">"))
            op = OP_GT;
        else if (is_op(P, ">="))
            op = OP_GE;
        else if (is_name(P, "in"))
            op = OP_IN;
        else if (is_name(P, "not") && tok_is(peek(P, 1), TK_NAME, "in"))
            op = OP_NOTIN, P->i++;
        else
            break;
        P->i++;
        if (!cmp) {
            cmp = mk(P, E_CMP, line);
            nl_push(P, &cmp->args, x);
        }
        int *ops = ps_alloc(P, (size_t)cmp->args.n * sizeof *ops);
        if (cmp->args.n > 1) memcpy(ops, cmp->ops, (size_t)(cmp->args.n - 1) * sizeof *ops);
        ops[cmp->args.n - 1] = op;
        cmp->ops = ops;
        nl_push(P, &cmp->args, parse_math1(P));
    }
    return cmp ? cmp : x;
}

static node *parse_not(parser *P) {
    if (is_name(P, "not")) {
        int line = cur(P)->line;
        P->i++;
        node *n = mk(P, E_NOT, line);
        n->a = parse_not(P);
        return n;
    }
    return parse_compare(P);
}

static node *parse_and(parser *P) {
    node *x = parse_not(P);
    while (is_name(P, "and")) {
        int line = cur(P)->line;
        P->i++;
        node *n = mk(P, E_AND, line);
        n->a = x;
        n->b = parse_not(P);
        x = n;
    }
    return x;
}

static node *parse_or(parser *P) {
    node *x = parse_and(P);
    while (is_name(P, "or")) {
        int line = cur(P)->line;
        P->i++;
        node *n = mk(P, E_OR, line);
        n->a = x;
        n->b = parse_and(P);
        x = n;
    }
    return x;
}

static node *parse_expr(parser *P, bool with_cond) {
    if (++P->depth > 200) fail_at(P->e, DUET__JINJA_SYNTAX, cur(P)->line, "expression nested too deeply");
    node *x = parse_or(P);
    if (with_cond) {
        while (is_name(P, "if")) {
            int line = cur(P)->line;
            P->i++;
            node *n = mk(P, E_COND, line);
            n->b = x;
            n->a = parse_or(P);
            if (is_name(P, "else")) {
                P->i++;
                n->c = parse_expr(P, true);
            }
            x = n;
        }
    }
    P->depth--;
    return x;
}

/* ---- statements ---- */

static void expect_bend(parser *P) {
    if (cur(P)->t != TK_BEND) ps_fail(P, "expected the end of the block tag");
    P->i++;
}

/* Parses statements until a {% NAME %} with NAME in ENDS (NULL-terminated);
 * leaves P at that NAME and returns its index in ENDS. */
static int parse_body(parser *P, nlist *body, const char *const *ends, const char *what, int open_line);

static node *parse_set_target(parser *P, node *n) {
    n->name = expect_name(P);
    if (is_op(P, ".")) {
        P->i++;
        n->attr = expect_name(P);
    } else if (is_op(P, ",")) {
        names_push(P, n, n->name);
        while (is_op(P, ",")) {
            P->i++;
            names_push(P, n, expect_name(P));
        }
    }
    return n;
}

static node *parse_statement_(parser *P);

/* jinja2 compiles an if (test and bodies) in a "soft" frame and every
 * other block in a fresh one. */
static node *parse_statement(parser *P) {
    bool soft = P->soft;
    if (tok_is(cur(P), TK_NAME, "if"))
        P->soft = true;
    else if (!tok_is(cur(P), TK_NAME, "set"))
        P->soft = false; /* a plain set has no frame of its own */
    node *n = parse_statement_(P);
    P->soft = soft;
    return n;
}

static node *parse_statement_(parser *P) {
    token *bt = cur(P);
    int line = bt->line;
    if (bt->t != TK_NAME) ps_fail(P, "expected a tag name");
    const char *kw = ps_strdup(P, bt->p, bt->n);
    P->i++;
    if (!strcmp(kw, "if")) {
        node *n = mk(P, S_IF, line);
        n->a = parse_expr(P, true);
        expect_bend(P);
        node *tail = n;
        for (;;) {
            static const char *const ends[] = {"elif", "else", "endif", NULL};
            int w = parse_body(P, &tail->body, ends, "if", line);
            P->i++;
            if (w == 0) {
                node *e = mk(P, S_IF, cur(P)->line);
                e->a = parse_expr(P, true);
                expect_bend(P);
                nl_push(P, &tail->orelse, e);
                tail = e;
                continue;
            }
            if (w == 1) {
                expect_bend(P);
                static const char *const ends2[] = {"endif", NULL};
                parse_body(P, &tail->orelse, ends2, "if", line);
                P->i++;
            }
            expect_bend(P);
            return n;
        }
    }
    if (!strcmp(kw, "for")) {
        node *n = mk(P, S_FOR, line);
        names_push(P, n, expect_name(P));
        while (is_op(P, ",")) {
            P->i++;
            names_push(P, n, expect_name(P));
        }
        if (!is_name(P, "in")) ps_fail(P, "expected 'in'");
        P->i++;
        n->a = parse_tuple(P, false, false);
        if (is_name(P, "if")) {
            P->i++;
            n->b = parse_expr(P, true);
        }
        if (is_name(P, "recursive")) ps_fail(P, "recursive loops are not supported");
        expect_bend(P);
        static const char *const ends[] = {"else", "endfor", NULL};
        int w = parse_body(P, &n->body, ends, "for", line);
        P->i++;
        if (w == 0) {
            expect_bend(P);
            static const char *const ends2[] = {"endfor", NULL};
            parse_body(P, &n->orelse, ends2, "for", line);
            P->i++;
        }
        expect_bend(P);
        return n;
    }
    if (!strcmp(kw, "set")) {
        node *n = mk(P, S_SET, line);
        parse_set_target(P, n);
        if (is_op(P, "=")) {
            P->i++;
            n->a = parse_tuple(P, true, false);
            expect_bend(P);
            return n;
        }
        if (n->nkw) ps_fail(P, "expected '='");
        n->kind = S_SETBLOCK;
        P->soft = false;
        if (is_op(P, "|")) {
            node *ph = mk(P, E_LIT, line); /* placeholder for the captured text */
            node *x = ph;
            while (is_op(P, "|")) {
                P->i++;
                x = parse_filter(P, x);
            }
            n->filters = x;
            n->c = ph;
        }
        expect_bend(P);
        static const char *const ends[] = {"endset", NULL};
        parse_body(P, &n->body, ends, "set", line);
        P->i++;
        expect_bend(P);
        return n;
    }
    if (!strcmp(kw, "macro")) {
        node *n = mk(P, S_MACRO, line);
        n->name = expect_name(P);
        expect_op(P, "(");
        while (!is_op(P, ")")) {
            if (n->nkw) expect_op(P, ",");
            if (is_op(P, ")")) break;
            names_push(P, n, expect_name(P));
            if (is_op(P, "=")) {
                P->i++;
                node *d = parse_expr(P, true);
                while (n->kwv.n < n->nkw - 1)
                    nl_push(P, &n->kwv, NULL);
                nl_push(P, &n->kwv, d);
            } else if (n->kwv.n) {
                ps_fail(P, "non-default argument follows default argument");
            }
        }
        P->i++;
        while (n->kwv.n < n->nkw)
            nl_push(P, &n->kwv, NULL);
        expect_bend(P);
        static const char *const ends[] = {"endmacro", NULL};
        parse_body(P, &n->body, ends, "macro", line);
        P->i++;
        if (cur(P)->t == TK_NAME) P->i++; /* {% endmacro name %} */
        expect_bend(P);
        return n;
    }
    if (!strcmp(kw, "break") || !strcmp(kw, "continue")) {
        node *n = mk(P, kw[0] == 'b' ? S_BREAK : S_CONTINUE, line);
        expect_bend(P);
        return n;
    }
    if (!strcmp(kw, "filter")) {
        node *n = mk(P, S_FILTERBLOCK, line);
        node *ph = mk(P, E_LIT, line);
        node *x = parse_filter(P, ph);
        while (is_op(P, "|")) {
            P->i++;
            x = parse_filter(P, x);
        }
        n->filters = x;
        n->c = ph;
        expect_bend(P);
        static const char *const ends[] = {"endfilter", NULL};
        parse_body(P, &n->body, ends, "filter", line);
        P->i++;
        expect_bend(P);
        return n;
    }
    if (!strcmp(kw, "generation")) { /* transformers' assistant-mask tag: a plain block */
        node *n = mk(P, S_BLOCK, line);
        expect_bend(P);
        static const char *const ends[] = {"endgeneration", NULL};
        parse_body(P, &n->body, ends, "generation", line);
        P->i++;
        expect_bend(P);
        return n;
    }
    fail_at(P->e, DUET__JINJA_SYNTAX, line, "unsupported tag '%s'", kw);
}

static int parse_body(parser *P, nlist *body, const char *const *ends, const char *what, int open_line) {
    for (;;) {
        token *t = cur(P);
        switch (t->t) {
        case TK_EOF:
            if (ends)
                fail_at(P->e, DUET__JINJA_SYNTAX, t->line,
                        "unexpected end of template: the '%s' tag of line %d is not closed", what, open_line);
            return -1;
        case TK_TEXT: {
            node *n = mk(P, S_TEXT, t->line);
            n->lit.t = V_STR;
            n->lit.u.s.p = t->p;
            n->lit.u.s.n = t->n;
            nl_push(P, body, n);
            P->i++;
            break;
        }
        case TK_VBEGIN: {
            P->i++;
            node *n = mk(P, S_OUT, t->line);
            n->a = parse_tuple(P, true, false);
            if (cur(P)->t != TK_VEND) ps_fail(P, "expected '}}'");
            P->i++;
            nl_push(P, body, n);
            break;
        }
        case TK_BBEGIN: {
            P->i++;
            token *k = cur(P);
            if (k->t == TK_NAME && ends) {
                for (int w = 0; ends[w]; w++)
                    if (tok_is(k, TK_NAME, ends[w])) return w;
            }
            if (k->t == TK_NAME && k->n > 3 && !memcmp(k->p, "end", 3))
                fail_at(P->e, DUET__JINJA_SYNTAX, k->line, "unexpected '%.*s'%s%s%s", (int)k->n, k->p,
                        ends ? " inside '" : "", ends ? what : "", ends ? "'" : "");
            if (k->t == TK_NAME && ends && (tok_is(k, TK_NAME, "elif") || tok_is(k, TK_NAME, "else")))
                fail_at(P->e, DUET__JINJA_SYNTAX, k->line, "unexpected '%.*s' inside '%s'", (int)k->n, k->p,
                        what);
            nl_push(P, body, parse_statement(P));
            break;
        }
        default:
            ps_fail(P, "unexpected token");
        }
    }
}

duet__jinja_result duet__jinja_parse(const char *src, size_t len, duet__jinja_template **out, char *err,
                                     size_t errlen) {
    *out = NULL;
    if (err && errlen) err[0] = 0;
    duet__jinja_template *t = calloc(1, sizeof *t);
    if (!t) return DUET__JINJA_NOMEM;
    t->ar.limit = 0;
    errstate e = {.msg = err, .msglen = errlen};
    if (setjmp(e.jb)) {
        arena_free(&t->ar);
        free(t);
        return e.code;
    }
    /* Newlines are normalised to \n and the last one goes. */
    char *s = arena_try_alloc(&t->ar, len + 1);
    if (!s) fail_at(&e, DUET__JINJA_NOMEM, 0, "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            s[n++] = src[i];
        }
    }
    if (n && s[n - 1] == '\n') n--;
    s[n] = 0;
    lexer L = {.e = &e, .ar = &t->ar, .s = s, .n = n, .line = 1};
    lex(&L);
    parser P = {.e = &e, .ar = &t->ar, .tok = L.tok, .n = L.ntok};
    parse_body(&P, &t->body, NULL, NULL, 0);
    *out = t;
    return DUET__JINJA_OK;
}

void duet__jinja_free(duet__jinja_template *t) {
    if (!t) return;
    arena_free(&t->ar);
    free(t);
}

/* ---- render: context ---------------------------------------------------- */

typedef struct frame {
    struct frame *parent;
    dict *vars;
} frame;

typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

typedef struct ctx {
    errstate e;
    arena ar;
    size_t max_output, max_steps, steps;
    int64_t now;
    bool jinja2_tojson;
    sbuf *out;
    frame *root;
    int depth, line;
    int loop_ctl; /* 1: break, 2: continue */
} ctx;

static void __attribute__((noreturn, format(printf, 2, 3))) rfail(ctx *c, const char *fmt, ...) {
    char m[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    fail_at(&c->e, DUET__JINJA_RENDER, c->line, "%s", m);
}

static void *ralloc(ctx *c, size_t n) {
    void *p = arena_try_alloc(&c->ar, n);
    if (!p)
        fail_at(&c->e, DUET__JINJA_LIMIT, c->line, "the template used more than %zu MiB of memory",
                c->ar.limit >> 20);
    return p;
}

static void sb_add(ctx *c, sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        if (b->n + n > c->max_output)
            fail_at(&c->e, DUET__JINJA_LIMIT, c->line, "the output is longer than %zu bytes", c->max_output);
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = ralloc(c, cap);
        if (b->n) memcpy(p, b->p, b->n);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void sb_puts(ctx *c, sbuf *b, const char *s) {
    sb_add(c, b, s, strlen(s));
}
static void sb_putc(ctx *c, sbuf *b, char ch) {
    sb_add(c, b, &ch, 1);
}

static void step(ctx *c) {
    if (++c->steps > c->max_steps)
        fail_at(&c->e, DUET__JINJA_LIMIT, c->line, "the template ran more than %zu loop iterations and calls",
                c->max_steps);
}

/* ---- render: values ------------------------------------------------------ */

static val v_undef(void) {
    return (val){.t = V_UNDEF};
}
static val v_none(void) {
    return (val){.t = V_NONE};
}
static val v_bool(bool b) {
    return (val){.t = V_BOOL, .u.b = b};
}
static val v_int(int64_t i) {
    return (val){.t = V_INT, .u.i = i};
}
static val v_float(double f) {
    return (val){.t = V_FLOAT, .u.f = f};
}
static val v_strn(const char *p, size_t n) {
    val v = {.t = V_STR};
    v.u.s.p = p;
    v.u.s.n = n;
    return v;
}
static val v_str(const char *p) {
    return v_strn(p, strlen(p));
}
static val v_sb(sbuf *b) {
    return v_strn(b->p ? b->p : "", b->n);
}

/* A string value's bytes, NUL-terminated (values made by slicing, split,
 * strip... point into other strings without a terminator). */
static const char *zstr(ctx *c, val s) {
    char *p = ralloc(c, s.u.s.n + 1);
    memcpy(p, s.u.s.p, s.u.s.n);
    p[s.u.s.n] = 0;
    return p;
}

static list *list_new(ctx *c, size_t cap) {
    list *l = ralloc(c, sizeof *l);
    l->n = 0;
    l->kind = L_LIST;
    l->cap = cap ? cap : 4;
    l->v = ralloc(c, l->cap * sizeof *l->v);
    return l;
}
static void list_push(ctx *c, list *l, val v) {
    if (l->n == l->cap) {
        val *nv = ralloc(c, l->cap * 2 * sizeof *nv);
        memcpy(nv, l->v, l->n * sizeof *nv);
        l->v = nv;
        l->cap *= 2;
    }
    l->v[l->n++] = v;
}
static val v_list(list *l) {
    return (val){.t = V_LIST, .u.l = l};
}

static dict *dict_new(ctx *c) {
    dict *d = ralloc(c, sizeof *d);
    d->n = 0;
    d->cap = 4;
    d->k = ralloc(c, d->cap * sizeof *d->k);
    d->v = ralloc(c, d->cap * sizeof *d->v);
    return d;
}
static val v_dict(dict *d) {
    return (val){.t = V_DICT, .u.d = d};
}

static bool veq(const val *a, const val *b);

static val *dict_find(const dict *d, const val *k) {
    for (size_t i = 0; i < d->n; i++)
        if (veq(&d->k[i], k)) return &d->v[i];
    return NULL;
}
static val *dict_finds(const dict *d, const char *s, size_t n) {
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].t == V_STR && d->k[i].u.s.n == n && !memcmp(d->k[i].u.s.p, s, n)) return &d->v[i];
    return NULL;
}
static void dict_set(ctx *c, dict *d, val k, val v) {
    val *slot = dict_find(d, &k);
    if (slot) {
        *slot = v;
        return;
    }
    if (d->n == d->cap) {
        val *nk = ralloc(c, d->cap * 2 * sizeof *nk), *nv = ralloc(c, d->cap * 2 * sizeof *nv);
        memcpy(nk, d->k, d->n * sizeof *nk);
        memcpy(nv, d->v, d->n * sizeof *nv);
        d->k = nk;
        d->v = nv;
        d->cap *= 2;
    }
    d->k[d->n] = k;
    d->v[d->n++] = v;
}
static void dict_sets(ctx *c, dict *d, const char *k, val v) {
    dict_set(c, d, v_str(k), v);
}

static bool is_num(const val *v) {
    return v->t == V_INT || v->t == V_FLOAT || v->t == V_BOOL;
}
static double num_f(const val *v) {
    return v->t == V_FLOAT ? v->u.f : v->t == V_INT ? (double)v->u.i : v->u.b;
}
static int64_t num_i(const val *v) {
    return v->t == V_INT ? v->u.i : v->t == V_BOOL ? v->u.b : (int64_t)v->u.f;
}

static bool vtrue(const val *v) {
    switch (v->t) {
    case V_UNDEF:
    case V_NONE:
        return false;
    case V_BOOL:
        return v->u.b;
    case V_INT:
        return v->u.i != 0;
    case V_FLOAT:
        return v->u.f != 0;
    case V_STR:
        return v->u.s.n != 0;
    case V_LIST:
        return v->u.l->kind == L_GEN || v->u.l->n != 0;
    case V_DICT:
        return v->u.d->n != 0;
    default:
        return true;
    }
}

static bool veq(const val *a, const val *b) {
    if (is_num(a) && is_num(b)) {
        if (a->t == V_FLOAT || b->t == V_FLOAT) return num_f(a) == num_f(b);
        return num_i(a) == num_i(b);
    }
    if (a->t != b->t) {
        if ((a->t == V_DICT || a->t == V_NS) && (b->t == V_DICT || b->t == V_NS)) return false;
        return false;
    }
    switch (a->t) {
    case V_UNDEF:
    case V_NONE:
        return true;
    case V_STR:
        return a->u.s.n == b->u.s.n && !memcmp(a->u.s.p, b->u.s.p, a->u.s.n);
    case V_LIST:
        if (a->u.l->kind == L_GEN || b->u.l->kind == L_GEN) return a->u.l == b->u.l;
        if (a->u.l->kind != b->u.l->kind || a->u.l->n != b->u.l->n) return false;
        for (size_t i = 0; i < a->u.l->n; i++)
            if (!veq(&a->u.l->v[i], &b->u.l->v[i])) return false;
        return true;
    case V_DICT:
        if (a->u.d->n != b->u.d->n) return false;
        for (size_t i = 0; i < a->u.d->n; i++) {
            val *o = dict_find(b->u.d, &a->u.d->k[i]);
            if (!o || !veq(&a->u.d->v[i], o)) return false;
        }
        return true;
    case V_NS:
        return a->u.d == b->u.d;
    case V_MACRO:
        return a->u.m == b->u.m;
    case V_FUNC:
        return a->u.fn == b->u.fn;
    default:
        return false;
    }
}

static const char *type_name(const val *v) {
    static const char *const n[] = {"Undefined",  "NoneType", "bool",     "int",
                                    "float",      "str",      "list",     "dict",
                                    "Namespace",  "Macro",    "function", "builtin_function_or_method",
                                    "LoopContext"};
    return n[v->t];
}

/* Python's ordering; a TypeError for mixed types. */
static int vcmp(ctx *c, const val *a, const val *b, const char *op) {
    if (is_num(a) && is_num(b)) {
        if (a->t == V_FLOAT || b->t == V_FLOAT) {
            double x = num_f(a), y = num_f(b);
            return x < y ? -1 : x > y;
        }
        int64_t x = num_i(a), y = num_i(b);
        return x < y ? -1 : x > y;
    }
    if (a->t == V_STR && b->t == V_STR) {
        size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        int r = memcmp(a->u.s.p, b->u.s.p, n);
        if (r) return r < 0 ? -1 : 1;
        return a->u.s.n < b->u.s.n ? -1 : a->u.s.n > b->u.s.n;
    }
    if (a->t == V_LIST && b->t == V_LIST && a->u.l->kind == b->u.l->kind &&
        (a->u.l->kind == L_LIST || a->u.l->kind == L_TUPLE)) {
        for (size_t i = 0; i < a->u.l->n && i < b->u.l->n; i++) {
            if (veq(&a->u.l->v[i], &b->u.l->v[i])) continue;
            return vcmp(c, &a->u.l->v[i], &b->u.l->v[i], op);
        }
        return a->u.l->n < b->u.l->n ? -1 : a->u.l->n > b->u.l->n;
    }
    if (a->t == V_UNDEF || b->t == V_UNDEF) rfail(c, "'%s' is undefined", "value");
    rfail(c, "'%s' not supported between instances of '%s' and '%s'", op, type_name(a), type_name(b));
}

/* ---- str() and repr() ---- */

static void fmt_float(char *buf, size_t cap, double d, bool json) {
    if (isnan(d)) {
        snprintf(buf, cap, json ? "NaN" : "nan");
        return;
    }
    if (isinf(d)) {
        snprintf(buf, cap, d < 0 ? (json ? "-Infinity" : "-inf") : (json ? "Infinity" : "inf"));
        return;
    }
    /* shortest round trip, laid out as Python's float.__repr__ */
    char e[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, d);
        if (strtod(e, NULL) == d) break;
    }
    /* e = [-]D[.DDD]e[+-]XX */
    char digits[24];
    int nd = 0;
    const char *p = e;
    bool neg = false;
    if (*p == '-') neg = true, p++;
    for (; *p && *p != 'e'; p++)
        if (isdigit((unsigned char)*p)) digits[nd++] = *p;
    int exp = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    char *o = buf;
    size_t left = cap;
#define PUT(ch)                                                                                              \
    do {                                                                                                     \
        if (left > 1) {                                                                                      \
            *o++ = (ch);                                                                                     \
            left--;                                                                                          \
        }                                                                                                    \
    } while (0)
    if (neg) PUT('-');
    if (exp >= -5 + 1 && exp < 16) {
        if (exp < 0) {
            PUT('0');
            PUT('.');
            for (int i = 0; i < -exp - 1; i++)
                PUT('0');
            for (int i = 0; i < nd; i++)
                PUT(digits[i]);
        } else {
            for (int i = 0; i <= exp; i++)
                PUT(i < nd ? digits[i] : '0');
            PUT('.');
            if (nd > exp + 1)
                for (int i = exp + 1; i < nd; i++)
                    PUT(digits[i]);
            else
                PUT('0');
        }
    } else {
        PUT(digits[0]);
        if (nd > 1) {
            PUT('.');
            for (int i = 1; i < nd; i++)
                PUT(digits[i]);
        }
        PUT('e');
        PUT(exp < 0 ? '-' : '+');
        char x[16];
        snprintf(x, sizeof x, "%02d", exp < 0 ? -exp : exp);
        for (char *q = x; *q; q++)
            PUT(*q);
    }
#undef PUT
    *o = 0;
}

static void repr_str(ctx *c, sbuf *b, const char *s, size_t n) {
    bool has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    sb_putc(c, b, q);
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        char esc[8];
        if (ch == '\\')
            sb_puts(c, b, "\\\\");
        else if (ch == (unsigned char)q) {
            sb_putc(c, b, '\\');
            sb_putc(c, b, q);
        } else if (ch == '\n')
            sb_puts(c, b, "\\n");
        else if (ch == '\r')
            sb_puts(c, b, "\\r");
        else if (ch == '\t')
            sb_puts(c, b, "\\t");
        else if (ch < 0x20 || ch == 0x7f) {
            snprintf(esc, sizeof esc, "\\x%02x", ch);
            sb_puts(c, b, esc);
        } else
            sb_putc(c, b, (char)ch);
    }
    sb_putc(c, b, q);
}

static void to_str(ctx *c, sbuf *b, const val *v, bool repr);

static void to_str(ctx *c, sbuf *b, const val *v, bool repr) {
    char buf[64];
    switch (v->t) {
    case V_UNDEF:
        if (!repr) return;
        sb_puts(c, b, "Undefined");
        return;
    case V_NONE:
        sb_puts(c, b, "None");
        return;
    case V_BOOL:
        sb_puts(c, b, v->u.b ? "True" : "False");
        return;
    case V_INT:
        snprintf(buf, sizeof buf, "%lld", (long long)v->u.i);
        sb_puts(c, b, buf);
        return;
    case V_FLOAT:
        fmt_float(buf, sizeof buf, v->u.f, false);
        sb_puts(c, b, buf);
        return;
    case V_STR:
        if (repr)
            repr_str(c, b, v->u.s.p, v->u.s.n);
        else
            sb_add(c, b, v->u.s.p, v->u.s.n);
        return;
    case V_LIST: {
        int kind = v->u.l->kind;
        if (kind == L_RANGE) {
            const list *l = v->u.l;
            if (l->step == 1)
                snprintf(buf, sizeof buf, "range(%lld, %lld)", (long long)l->start, (long long)l->stop);
            else
                snprintf(buf, sizeof buf, "range(%lld, %lld, %lld)", (long long)l->start, (long long)l->stop,
                         (long long)l->step);
            sb_puts(c, b, buf);
            return;
        }
        if (kind == L_GEN || kind == L_VIEW)
            rfail(c, "printing a %s is not supported", kind == L_GEN ? "generator" : "dict view");
        if (++c->depth > 100) rfail(c, "values nested too deeply");
        sb_putc(c, b, kind == L_TUPLE ? '(' : '[');
        for (size_t i = 0; i < v->u.l->n; i++) {
            if (i) sb_puts(c, b, ", ");
            to_str(c, b, &v->u.l->v[i], true);
        }
        if (kind == L_TUPLE && v->u.l->n == 1) sb_putc(c, b, ',');
        sb_putc(c, b, kind == L_TUPLE ? ')' : ']');
        c->depth--;
        return;
    }
    case V_DICT:
        if (++c->depth > 100) rfail(c, "values nested too deeply");
        sb_putc(c, b, '{');
        for (size_t i = 0; i < v->u.d->n; i++) {
            if (i) sb_puts(c, b, ", ");
            to_str(c, b, &v->u.d->k[i], true);
            sb_puts(c, b, ": ");
            to_str(c, b, &v->u.d->v[i], true);
        }
        sb_putc(c, b, '}');
        c->depth--;
        return;
    case V_NS:
        sb_puts(c, b, "<Namespace>");
        return;
    default:
        rfail(c, "cannot print a %s", type_name(v));
    }
}

static val vstr(ctx *c, const val *v) {
    if (v->t == V_STR) return *v;
    sbuf b = {0};
    to_str(c, &b, v, false);
    return v_sb(&b);
}

/* ---- tojson, as Python's json.dumps ---- */

typedef struct jsonopt {
    int indent; /* < 0: none */
    const char *item_sep, *key_sep;
    bool sort_keys, ensure_ascii;
} jsonopt;

static void json_str(ctx *c, sbuf *b, const char *s, size_t n, bool ascii) {
    sb_putc(c, b, '"');
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        char esc[16];
        switch (ch) {
        case '"':
            sb_puts(c, b, "\\\"");
            continue;
        case '\\':
            sb_puts(c, b, "\\\\");
            continue;
        case '\n':
            sb_puts(c, b, "\\n");
            continue;
        case '\r':
            sb_puts(c, b, "\\r");
            continue;
        case '\t':
            sb_puts(c, b, "\\t");
            continue;
        case '\b':
            sb_puts(c, b, "\\b");
            continue;
        case '\f':
            sb_puts(c, b, "\\f");
            continue;
        }
        if (ch < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", ch);
            sb_puts(c, b, esc);
        } else if (ch >= 0x80 && ascii) {
            /* decode one UTF-8 sequence */
            unsigned cp = 0;
            int extra = ch >= 0xF0 ? 3 : ch >= 0xE0 ? 2 : ch >= 0xC0 ? 1 : 0;
            cp = ch & (0x3F >> extra);
            for (int k = 0; k < extra && i + 1 < n; k++)
                cp = (cp << 6) | ((unsigned char)s[++i] & 0x3F);
            if (cp >= 0x10000) {
                cp -= 0x10000;
                snprintf(esc, sizeof esc, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
            } else {
                snprintf(esc, sizeof esc, "\\u%04x", cp);
            }
            sb_puts(c, b, esc);
        } else {
            sb_putc(c, b, (char)ch);
        }
    }
    sb_putc(c, b, '"');
}

static void json_nl(ctx *c, sbuf *b, const jsonopt *o, int level) {
    sb_putc(c, b, '\n');
    for (int i = 0; i < o->indent * level; i++)
        sb_putc(c, b, ' ');
}

static void to_json(ctx *c, sbuf *b, const val *v, const jsonopt *o, int level) {
    char buf[64];
    switch (v->t) {
    case V_NONE:
        sb_puts(c, b, "null");
        return;
    case V_BOOL:
        sb_puts(c, b, v->u.b ? "true" : "false");
        return;
    case V_INT:
        snprintf(buf, sizeof buf, "%lld", (long long)v->u.i);
        sb_puts(c, b, buf);
        return;
    case V_FLOAT:
        fmt_float(buf, sizeof buf, v->u.f, true);
        sb_puts(c, b, buf);
        return;
    case V_STR:
        json_str(c, b, v->u.s.p, v->u.s.n, o->ensure_ascii);
        return;
    case V_LIST:
        if (v->u.l->kind == L_GEN || v->u.l->kind == L_VIEW || v->u.l->kind == L_RANGE)
            rfail(c, "Object of type %s is not JSON serializable",
                  v->u.l->kind == L_GEN     ? "generator"
                  : v->u.l->kind == L_RANGE ? "range"
                                            : "dict_items");
        if (++c->depth > 100) rfail(c, "values nested too deeply");
        if (!v->u.l->n) {
            sb_puts(c, b, "[]");
            c->depth--;
            return;
        }
        sb_putc(c, b, '[');
        for (size_t i = 0; i < v->u.l->n; i++) {
            if (i) sb_puts(c, b, o->item_sep);
            if (o->indent >= 0) json_nl(c, b, o, level + 1);
            to_json(c, b, &v->u.l->v[i], o, level + 1);
        }
        if (o->indent >= 0) json_nl(c, b, o, level);
        sb_putc(c, b, ']');
        c->depth--;
        return;
    case V_DICT: {
        if (++c->depth > 100) rfail(c, "values nested too deeply");
        const dict *d = v->u.d;
        if (!d->n) {
            sb_puts(c, b, "{}");
            c->depth--;
            return;
        }
        size_t *order = ralloc(c, d->n * sizeof *order);
        for (size_t i = 0; i < d->n; i++)
            order[i] = i;
        if (o->sort_keys) {
            /* insertion sort on keys (stable; dicts in templates are small) */
            for (size_t i = 1; i < d->n; i++) {
                size_t x = order[i], j = i;
                while (j > 0 && vcmp(c, &d->k[order[j - 1]], &d->k[x], "<") > 0) {
                    order[j] = order[j - 1];
                    j--;
                }
                order[j] = x;
            }
        }
        sb_putc(c, b, '{');
        for (size_t i = 0; i < d->n; i++) {
            const val *k = &d->k[order[i]];
            if (i) sb_puts(c, b, o->item_sep);
            if (o->indent >= 0) json_nl(c, b, o, level + 1);
            if (k->t == V_STR) {
                json_str(c, b, k->u.s.p, k->u.s.n, o->ensure_ascii);
            } else if (k->t == V_INT || k->t == V_FLOAT || k->t == V_BOOL || k->t == V_NONE) {
                sb_putc(c, b, '"');
                if (k->t == V_BOOL)
                    sb_puts(c, b, k->u.b ? "true" : "false");
                else if (k->t == V_NONE)
                    sb_puts(c, b, "null");
                else
                    to_str(c, b, k, false);
                sb_putc(c, b, '"');
            } else {
                rfail(c, "keys must be str, int, float, bool or None, not %s", type_name(k));
            }
            sb_puts(c, b, o->key_sep);
            to_json(c, b, &d->v[order[i]], o, level + 1);
        }
        if (o->indent >= 0) json_nl(c, b, o, level);
        sb_putc(c, b, '}');
        c->depth--;
        return;
    }
    default:
        rfail(c, "Object of type %s is not JSON serializable", type_name(v));
    }
}

/* ---- cJSON to values ---- */

static val from_cjson(ctx *c, const cJSON *j, int depth) {
    if (depth > 200) rfail(c, "the variables are nested too deeply");
    if (cJSON_IsNull(j)) return v_none();
    if (cJSON_IsBool(j)) return v_bool(cJSON_IsTrue(j));
    if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        if (d == floor(d) && fabs(d) < 9007199254740992.0) return v_int((int64_t)d);
        return v_float(d);
    }
    if (cJSON_IsString(j)) {
        size_t n = strlen(j->valuestring);
        char *p = ralloc(c, n + 1);
        memcpy(p, j->valuestring, n + 1);
        return v_strn(p, n);
    }
    if (cJSON_IsArray(j)) {
        list *l = list_new(c, (size_t)cJSON_GetArraySize(j) + 1);
        for (const cJSON *x = j->child; x; x = x->next)
            list_push(c, l, from_cjson(c, x, depth + 1));
        return v_list(l);
    }
    if (cJSON_IsObject(j)) {
        dict *d = dict_new(c);
        for (const cJSON *x = j->child; x; x = x->next) {
            size_t n = strlen(x->string);
            char *p = ralloc(c, n + 1);
            memcpy(p, x->string, n + 1);
            dict_set(c, d, v_strn(p, n), from_cjson(c, x, depth + 1));
        }
        return v_dict(d);
    }
    return v_undef();
}

/* ---- sorting (stable, like Python's) ---- */

typedef int (*cmp_fn)(ctx *, const val *, const val *, void *);

static void sort_vals(ctx *c, val *v, size_t n, cmp_fn cmp, void *arg) {
    if (n < 2) return;
    val *tmp = ralloc(c, n * sizeof *tmp);
    for (size_t width = 1; width < n; width *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * width) {
            size_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi)
                tmp[k++] = cmp(c, &v[j], &v[i], arg) < 0 ? v[j++] : v[i++];
            while (i < mid)
                tmp[k++] = v[i++];
            while (j < hi)
                tmp[k++] = v[j++];
        }
        memcpy(v, tmp, n * sizeof *v);
    }
}

/* ---- UTF-8 ---- */

static size_t u8_count(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

/* byte offset of code point CP (n when past the end) */
static size_t u8_off(const char *s, size_t n, size_t cp) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (((unsigned char)s[i] & 0xC0) != 0x80) {
            if (k == cp) return i;
            k++;
        }
    }
    return n;
}

/* ---- scopes ---- */

static frame *frame_new(ctx *c, frame *parent) {
    frame *f = ralloc(c, sizeof *f);
    f->parent = parent;
    f->vars = dict_new(c);
    return f;
}

typedef struct scope {
    frame *f;
} scope;

static const struct {
    const char *name;
    int fn;
} builtin_funcs[] = {{"range", FN_RANGE},           {"namespace", FN_NAMESPACE},   {"dict", FN_DICT},
                     {"raise_exception", FN_RAISE}, {"strftime_now", FN_STRFTIME}, {"cycler", FN_CYCLER},
                     {"joiner", FN_JOINER},         {"lipsum", FN_LIPSUM}};

static val lookup(ctx *c, frame *f, const char *name) {
    size_t n = strlen(name);
    for (; f; f = f->parent) {
        val *v = dict_finds(f->vars, name, n);
        if (v) return *v;
    }
    for (size_t i = 0; i < sizeof builtin_funcs / sizeof *builtin_funcs; i++)
        if (!strcmp(builtin_funcs[i].name, name)) return (val){.t = V_FUNC, .u.fn = builtin_funcs[i].fn};
    return v_undef();
}

/* ---- attribute and item access ---- */

static const char *const str_methods[] = {
    "strip",      "lstrip",     "rstrip",       "split",        "rsplit",      "startswith", "endswith",
    "upper",      "lower",      "title",        "capitalize",   "replace",     "find",       "rfind",
    "count",      "format",     "join",         "splitlines",   "isdigit",     "isalpha",    "isspace",
    "isalnum",    "isupper",    "islower",      "index",        "rindex",      "partition",  "rpartition",
    "zfill",      "center",     "ljust",        "rjust",        "swapcase",    "casefold",   "encode",
    "expandtabs", "isdecimal",  "isidentifier", "isnumeric",    "isprintable", "istitle",    "maketrans",
    "translate",  "format_map", "removeprefix", "removesuffix", NULL};
static const char *const list_methods[] = {"index",  "count", "append",  "pop",   "insert", "extend",
                                           "remove", "sort",  "reverse", "clear", "copy",   NULL};
static const char *const dict_methods[] = {"items",      "keys",  "values",  "get",  "pop",      "update",
                                           "setdefault", "clear", "popitem", "copy", "fromkeys", NULL};
static const char *const unsafe_methods[] = {"append",  "pop",   "insert", "extend",     "remove",  "sort",
                                             "reverse", "clear", "update", "setdefault", "popitem", NULL};

static val mk_method(ctx *c, val obj, const char *name) {
    method *m = ralloc(c, sizeof *m);
    m->obj = obj;
    m->name = name;
    return (val){.t = V_METHOD, .u.me = m};
}

static val loop_attr(ctx *c, const loopstate *lp, const char *name) {
    int64_t n = (int64_t)lp->items->n, i = (int64_t)lp->index0;
    if (!strcmp(name, "index")) return v_int(i + 1);
    if (!strcmp(name, "index0")) return v_int(i);
    if (!strcmp(name, "revindex")) return v_int(n - i);
    if (!strcmp(name, "revindex0")) return v_int(n - i - 1);
    if (!strcmp(name, "first")) return v_bool(i == 0);
    if (!strcmp(name, "last")) return v_bool(i == n - 1);
    if (!strcmp(name, "length")) return v_int(n);
    if (!strcmp(name, "depth")) return v_int(1);
    if (!strcmp(name, "depth0")) return v_int(0);
    if (!strcmp(name, "previtem")) return i > 0 ? lp->items->v[i - 1] : v_undef();
    if (!strcmp(name, "nextitem")) return i + 1 < n ? lp->items->v[i + 1] : v_undef();
    if (!strcmp(name, "cycle")) return mk_method(c, (val){.t = V_LOOP, .u.lp = (loopstate *)lp}, "cycle");
    return v_undef();
}

static val getattr_v(ctx *c, val obj, const char *name) {
    switch (obj.t) {
    case V_UNDEF:
        rfail(c, "cannot read attribute '%s' of an undefined value", name);
    case V_DICT: {
        if (in_names(dict_methods, name)) return mk_method(c, obj, name);
        val *v = dict_finds(obj.u.d, name, strlen(name));
        return v ? *v : v_undef();
    }
    case V_NS: {
        val *v = dict_finds(obj.u.d, name, strlen(name));
        return v ? *v : v_undef();
    }
    case V_STR:
        return in_names(str_methods, name) ? mk_method(c, obj, name) : v_undef();
    case V_LIST:
        return in_names(list_methods, name) ? mk_method(c, obj, name) : v_undef();
    case V_LOOP:
        return loop_attr(c, obj.u.lp, name);
    default:
        return v_undef();
    }
}

static bool norm_index(int64_t *i, size_t n) {
    if (*i < 0) *i += (int64_t)n;
    return *i >= 0 && *i < (int64_t)n;
}

static val getitem_v(ctx *c, val obj, val key) {
    switch (obj.t) {
    case V_UNDEF:
        rfail(c, "cannot index an undefined value");
    case V_DICT:
    case V_NS: {
        val *v = dict_find(obj.u.d, &key);
        if (v) return *v;
        if (key.t == V_STR && obj.t == V_DICT && in_names(dict_methods, zstr(c, key)))
            return mk_method(c, obj, zstr(c, key));
        return v_undef();
    }
    case V_LIST:
        if (obj.u.l->kind == L_GEN || obj.u.l->kind == L_VIEW) return v_undef();
        if (key.t == V_INT || key.t == V_BOOL) {
            int64_t i = num_i(&key);
            if (norm_index(&i, obj.u.l->n)) return obj.u.l->v[i];
        }
        return v_undef();
    case V_STR:
        if (key.t == V_INT || key.t == V_BOOL) {
            int64_t i = num_i(&key);
            size_t n = u8_count(obj.u.s.p, obj.u.s.n);
            if (norm_index(&i, n)) {
                size_t a = u8_off(obj.u.s.p, obj.u.s.n, (size_t)i),
                       b = u8_off(obj.u.s.p, obj.u.s.n, (size_t)i + 1);
                return v_strn(obj.u.s.p + a, b - a);
            }
        }
        return v_undef();
    case V_LOOP:
        if (key.t == V_STR) return loop_attr(c, obj.u.lp, zstr(c, key));
        return v_undef();
    default:
        return v_undef();
    }
}

/* Python's slice indices for length n. */
static void slice_indices(ctx *c, const val *a, const val *b, const val *s, int64_t n, int64_t *start,
                          int64_t *stop, int64_t *stepv) {
    int64_t st = 1;
    if (s && s->t != V_NONE) {
        if (!is_num(s) || s->t == V_FLOAT) rfail(c, "slice indices must be integers or None");
        st = num_i(s);
    }
    if (st == 0) rfail(c, "slice step cannot be zero");
    int64_t lo, hi;
    if (!a || a->t == V_NONE)
        lo = st < 0 ? n - 1 : 0;
    else {
        if (!is_num(a) || a->t == V_FLOAT) rfail(c, "slice indices must be integers or None");
        lo = num_i(a);
        if (lo < 0) lo += n;
        if (lo < 0) lo = st < 0 ? -1 : 0;
        if (lo >= n) lo = st < 0 ? n - 1 : n;
    }
    if (!b || b->t == V_NONE)
        hi = st < 0 ? -1 : n;
    else {
        if (!is_num(b) || b->t == V_FLOAT) rfail(c, "slice indices must be integers or None");
        hi = num_i(b);
        if (hi < 0) hi += n;
        if (hi < 0) hi = st < 0 ? -1 : 0;
        if (hi >= n) hi = st < 0 ? n - 1 : n;
    }
    *start = lo;
    *stop = hi;
    *stepv = st;
}

static val do_slice(ctx *c, val obj, const val *a, const val *b, const val *s) {
    int64_t lo, hi, st;
    if (obj.t == V_LIST && (obj.u.l->kind == L_GEN || obj.u.l->kind == L_VIEW))
        rfail(c, "'%s' object is not subscriptable", obj.u.l->kind == L_GEN ? "generator" : "dict_items");
    if (obj.t == V_LIST) {
        slice_indices(c, a, b, s, (int64_t)obj.u.l->n, &lo, &hi, &st);
        list *l = list_new(c, 4);
        for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st)
            list_push(c, l, obj.u.l->v[i]);
        if (obj.u.l->kind == L_TUPLE || obj.u.l->kind == L_RANGE) {
            const list *r = obj.u.l;
            l->kind = r->kind;
            l->start = r->start + lo * r->step;
            l->stop = r->start + hi * r->step;
            l->step = r->step * st;
        }
        return v_list(l);
    }
    if (obj.t == V_STR) {
        const char *p = obj.u.s.p;
        size_t n = obj.u.s.n, cps = u8_count(p, n);
        slice_indices(c, a, b, s, (int64_t)cps, &lo, &hi, &st);
        if (st == 1) {
            if (hi <= lo) return v_str("");
            size_t x = u8_off(p, n, (size_t)lo), y = u8_off(p, n, (size_t)hi);
            return v_strn(p + x, y - x);
        }
        sbuf o = {0};
        for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st) {
            size_t x = u8_off(p, n, (size_t)i), y = u8_off(p, n, (size_t)i + 1);
            sb_add(c, &o, p + x, y - x);
        }
        return o.p ? v_sb(&o) : v_str("");
    }
    if (obj.t == V_UNDEF) rfail(c, "cannot slice an undefined value");
    rfail(c, "'%s' object is not subscriptable", type_name(&obj));
}

/* ---- iteration ---- */

static list *iter_list(ctx *c, val v) {
    switch (v.t) {
    case V_UNDEF:
        return list_new(c, 1);
    case V_LIST:
        return v.u.l;
    case V_DICT: {
        list *l = list_new(c, v.u.d->n + 1);
        for (size_t i = 0; i < v.u.d->n; i++)
            list_push(c, l, v.u.d->k[i]);
        return l;
    }
    case V_STR: {
        list *l = list_new(c, v.u.s.n + 1);
        const char *p = v.u.s.p;
        size_t n = v.u.s.n;
        for (size_t i = 0; i < n;) {
            size_t j = i + 1;
            while (j < n && ((unsigned char)p[j] & 0xC0) == 0x80)
                j++;
            list_push(c, l, v_strn(p + i, j - i));
            i = j;
        }
        return l;
    }
    default:
        rfail(c, "'%s' object is not iterable", type_name(&v));
    }
}

/* ---- arguments ---- */

typedef struct args {
    val *pos;
    int npos;
    const char **kwn;
    val *kwv;
    int nkw;
    const char *what; /* for messages */
} args;

static val eval(ctx *c, frame *f, const node *n);

static args eval_args(ctx *c, frame *f, const node *n, const char *what) {
    args a = {.npos = n->args.n, .nkw = n->nkw, .kwn = n->kwn, .what = what};
    a.pos = ralloc(c, (size_t)(a.npos + 1) * sizeof *a.pos);
    a.kwv = ralloc(c, (size_t)(a.nkw + 1) * sizeof *a.kwv);
    for (int i = 0; i < a.npos; i++)
        a.pos[i] = eval(c, f, n->args.v[i]);
    for (int i = 0; i < a.nkw; i++)
        a.kwv[i] = eval(c, f, n->kwv.v[i]);
    return a;
}

/* Argument IDX (positional) or NAME (keyword); DEF when absent. */
static val arg(ctx *c, const args *a, int idx, const char *name, val def) {
    if (idx >= 0 && idx < a->npos) {
        for (int k = 0; k < a->nkw; k++)
            if (name && !strcmp(a->kwn[k], name))
                rfail(c, "%s got multiple values for argument '%s'", a->what, name);
        return a->pos[idx];
    }
    for (int k = 0; k < a->nkw; k++)
        if (name && !strcmp(a->kwn[k], name)) return a->kwv[k];
    return def;
}

static void check_args(ctx *c, const args *a, int maxpos, const char *const *names) {
    if (a->npos > maxpos)
        rfail(c, "%s takes at most %d positional arguments (%d given)", a->what, maxpos, a->npos);
    for (int k = 0; k < a->nkw; k++) {
        bool ok = false;
        for (int i = 0; names && names[i]; i++)
            ok |= !strcmp(names[i], a->kwn[k]);
        if (!ok) rfail(c, "%s got an unexpected keyword argument '%s'", a->what, a->kwn[k]);
    }
}

static val need_str(ctx *c, val v, const char *what) {
    if (v.t != V_STR) rfail(c, "%s must be a string, not %s", what, type_name(&v));
    return v;
}

/* ---- string helpers ---- */

static bool py_space(unsigned char ch) {
    return is_space((char)ch) || (ch >= 0x1c && ch <= 0x1f);
}

/* Decodes the UTF-8 sequence at p[i] (n bytes in all); *len gets its byte
 * length. Invalid bytes decode as themselves, one byte long. */
static uint32_t u8_decode(const char *p, size_t n, size_t i, size_t *len) {
    unsigned char ch = (unsigned char)p[i];
    int extra = ch >= 0xF0 ? 3 : ch >= 0xE0 ? 2 : ch >= 0xC0 ? 1 : 0;
    if (i + (size_t)extra >= n) extra = 0;
    uint32_t cp = extra ? ch & (0x3F >> extra) : ch;
    for (int k = 1; k <= extra; k++) {
        unsigned char cc = (unsigned char)p[i + (size_t)k];
        if ((cc & 0xC0) != 0x80) {
            *len = 1;
            return ch;
        }
        cp = (cp << 6) | (cc & 0x3F);
    }
    *len = (size_t)extra + 1;
    return cp;
}

static bool cp_space(uint32_t cp) {
    return cp < 0x80 ? py_space((unsigned char)cp)
                     : cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
                           cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/* Byte length of the Python whitespace character at p[i], or 0. */
static size_t ws_at(const char *p, size_t n, size_t i) {
    size_t len;
    uint32_t cp = u8_decode(p, n, i, &len);
    return cp_space(cp) ? len : 0;
}

/* Byte length of the Python whitespace character that ends at p[i], or 0. */
static size_t ws_before(const char *p, size_t i) {
    size_t k = i - 1;
    while (k > 0 && i - k < 4 && ((unsigned char)p[k] & 0xC0) == 0x80)
        k--;
    size_t len;
    uint32_t cp = u8_decode(p, i, k, &len);
    return k + len == i && cp_space(cp) ? len : 0;
}

static val str_strip(ctx *c, val s, val chars, int sides) {
    const char *p = s.u.s.p;
    size_t a = 0, b = s.u.s.n;
    if (chars.t == V_NONE || chars.t == V_UNDEF) {
        size_t k;
        if (sides & 1)
            while (a < b && (k = ws_at(p, b, a)))
                a += k;
        if (sides & 2)
            while (b > a && (k = ws_before(p + a, b - a)))
                b -= k;
    } else {
        chars = need_str(c, chars, "strip's argument");
        /* chars are compared as code points */
        list *set = iter_list(c, chars);
        for (;;) {
            bool moved = false;
            for (size_t i = 0; (sides & 1) && i < set->n && a < b; i++) {
                const val *ch = &set->v[i];
                if (b - a >= ch->u.s.n && !memcmp(p + a, ch->u.s.p, ch->u.s.n)) a += ch->u.s.n, moved = true;
            }
            for (size_t i = 0; (sides & 2) && i < set->n && b > a; i++) {
                const val *ch = &set->v[i];
                if (b - a >= ch->u.s.n && !memcmp(p + b - ch->u.s.n, ch->u.s.p, ch->u.s.n))
                    b -= ch->u.s.n, moved = true;
            }
            if (!moved) break;
        }
    }
    return v_strn(p + a, b - a);
}

static const char *memmem_(const char *h, size_t hn, const char *nd, size_t nn) {
    if (!nn) return h;
    for (size_t i = 0; i + nn <= hn; i++)
        if (h[i] == nd[0] && !memcmp(h + i, nd, nn)) return h + i;
    return NULL;
}

static val str_split(ctx *c, val s, val sep, int64_t maxsplit) {
    list *l = list_new(c, 4);
    const char *p = s.u.s.p;
    size_t n = s.u.s.n;
    if (sep.t == V_NONE || sep.t == V_UNDEF) {
        size_t i = 0, k;
        while (i < n) {
            while (i < n && (k = ws_at(p, n, i)))
                i += k;
            if (i >= n) break;
            if (maxsplit >= 0 && (int64_t)l->n >= maxsplit) {
                size_t e = n;
                while (e > i && (k = ws_before(p + i, e - i)))
                    e -= k;
                list_push(c, l, v_strn(p + i, e - i));
                break;
            }
            size_t j = i;
            while (j < n && !ws_at(p, n, j)) {
                size_t len;
                u8_decode(p, n, j, &len);
                j += len;
            }
            list_push(c, l, v_strn(p + i, j - i));
            i = j;
        }
        return v_list(l);
    }
    sep = need_str(c, sep, "the separator");
    if (!sep.u.s.n) rfail(c, "empty separator");
    size_t i = 0;
    for (;;) {
        const char *q =
            maxsplit >= 0 && (int64_t)l->n >= maxsplit ? NULL : memmem_(p + i, n - i, sep.u.s.p, sep.u.s.n);
        if (!q) {
            list_push(c, l, v_strn(p + i, n - i));
            break;
        }
        list_push(c, l, v_strn(p + i, (size_t)(q - (p + i))));
        i = (size_t)(q - p) + sep.u.s.n;
    }
    return v_list(l);
}

static val str_replace(ctx *c, val s, val old, val new_, int64_t count) {
    old = need_str(c, old, "replace's first argument");
    new_ = need_str(c, new_, "replace's second argument");
    sbuf o = {0};
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, i = 0;
    int64_t done = 0;
    if (!old.u.s.n) { /* inserts between every character */
        list *chars = iter_list(c, s);
        for (size_t k = 0; k <= chars->n; k++) {
            if (count < 0 || done < count) sb_add(c, &o, new_.u.s.p, new_.u.s.n), done++;
            if (k < chars->n) sb_add(c, &o, chars->v[k].u.s.p, chars->v[k].u.s.n);
        }
        return o.p ? v_sb(&o) : v_str("");
    }
    while (i <= n) {
        const char *q = count >= 0 && done >= count ? NULL : memmem_(p + i, n - i, old.u.s.p, old.u.s.n);
        if (!q) {
            sb_add(c, &o, p + i, n - i);
            break;
        }
        sb_add(c, &o, p + i, (size_t)(q - (p + i)));
        sb_add(c, &o, new_.u.s.p, new_.u.s.n);
        i = (size_t)(q - p) + old.u.s.n;
        done++;
    }
    return o.p ? v_sb(&o) : v_str("");
}

/* Python's upper (UPPER) or lower case of CP, for ASCII, Latin-1, Latin
 * Extended-A, Greek and Cyrillic, and the caseless scripts (CJK, Arabic,
 * Hebrew, Indic, symbols, emoji...); *cased: whether Python counts CP as a
 * cased letter. Returns UINT32_MAX for a character whose mapping is not
 * known here (or depends on context, like Greek final sigma): the caller
 * refuses rather than guess. */
static uint32_t cp_case(uint32_t cp, bool upper, bool *cased) {
    *cased = false;
    if (cp < 0x80) {
        *cased = isalpha((int)cp) != 0;
        return (uint32_t)(upper ? toupper((int)cp) : tolower((int)cp));
    }
    if (cp < 0x100) {
        if (cp == 0xAA || cp == 0xBA || cp == 0xDF)
            return UINT32_MAX; /* ª º (cased, no pair); ß uppers to SS */
        if (cp == 0xB5) return *cased = true, upper ? 0x39C : cp;
        if (cp < 0xC0 || cp == 0xD7 || cp == 0xF7) return cp;
        *cased = true;
        if (cp == 0xFF) return upper ? 0x178 : cp;
        return cp < 0xDF ? (upper ? cp : cp + 0x20) : (upper ? cp - 0x20 : cp);
    }
    if (cp < 0x180) {
        *cased = true;
        if (cp == 0x130 || cp == 0x131 || cp == 0x149)
            return UINT32_MAX;      /* İ ı ŉ: multi-character or Turkic */
        if (cp == 0x138) return cp; /* ĸ */
        if (cp == 0x178) return upper ? cp : 0xFF;
        if (cp == 0x17F) return upper ? 'S' : cp;
        bool odd_upper = (cp >= 0x139 && cp <= 0x148) || (cp >= 0x179 && cp <= 0x17E);
        bool is_up = odd_upper ? (cp & 1) : !(cp & 1);
        return upper ? (is_up ? cp : cp - 1) : (is_up ? cp + 1 : cp);
    }
    if (cp >= 0x391 && cp <= 0x3C9 && cp != 0x3A2) {
        *cased = true;
        if (cp == 0x3A3 && !upper) return UINT32_MAX; /* Σ: σ or final ς */
        if (cp == 0x3C2) return upper ? 0x3A3 : cp;
        if (cp <= 0x3A9) return upper ? cp : cp + 0x20;
        if (cp >= 0x3B1) return upper ? cp - 0x20 : cp;
        return UINT32_MAX; /* accented capitals 0x3AA-0x3B0 */
    }
    if (cp >= 0x400 && cp <= 0x45F) {
        *cased = true;
        if (cp < 0x410) return upper ? cp : cp + 0x50;
        if (cp < 0x430) return upper ? cp : cp + 0x20;
        if (cp < 0x450) return upper ? cp - 0x20 : cp;
        return upper ? cp - 0x50 : cp;
    }
    /* scripts and symbols without case */
    if ((cp >= 0x590 && cp <= 0x109F) || (cp >= 0x1100 && cp <= 0x11FF) || (cp >= 0x2000 && cp <= 0x20CF) ||
        (cp >= 0x2190 && cp <= 0x245F) || (cp >= 0x2500 && cp <= 0x2BFF) || (cp >= 0x2E80 && cp <= 0xA4CF) ||
        (cp >= 0xAC00 && cp <= 0xD7AF) || (cp >= 0xE000 && cp <= 0xFAFF) || (cp >= 0xFE00 && cp <= 0xFE6F) ||
        (cp >= 0xFF01 && cp <= 0xFF20) || (cp >= 0xFF3B && cp <= 0xFF40) || (cp >= 0xFF5B && cp <= 0xFFEF) ||
        (cp >= 0x1F000 && cp <= 0x1FAFF) || (cp >= 0x20000 && cp <= 0x3FFFF))
        return cp;
    return UINT32_MAX;
}

static void sb_cp(ctx *c, sbuf *b, uint32_t cp) {
    char o[4];
    size_t n;
    if (cp < 0x80)
        o[0] = (char)cp, n = 1;
    else if (cp < 0x800)
        o[0] = (char)(0xC0 | (cp >> 6)), o[1] = (char)(0x80 | (cp & 63)), n = 2;
    else if (cp < 0x10000)
        o[0] = (char)(0xE0 | (cp >> 12)), o[1] = (char)(0x80 | ((cp >> 6) & 63)),
        o[2] = (char)(0x80 | (cp & 63)), n = 3;
    else
        o[0] = (char)(0xF0 | (cp >> 18)), o[1] = (char)(0x80 | ((cp >> 12) & 63)),
        o[2] = (char)(0x80 | ((cp >> 6) & 63)), o[3] = (char)(0x80 | (cp & 63)), n = 4;
    sb_add(c, b, o, n);
}

/* Case changes as Python's str methods make them: 0 upper, 1 lower, 2
 * title (str.title), 3 capitalize, 4 swapcase; 5 is jinja2's title filter
 * (each word's first character upper, the rest lower, words split at
 * whitespace and -({[<). */
static val str_case(ctx *c, val s, int mode) {
    sbuf o = {0};
    bool prev_cased = false, word_start = true;
    for (size_t i = 0; i < s.u.s.n;) {
        size_t len;
        uint32_t cp = u8_decode(s.u.s.p, s.u.s.n, i, &len);
        bool cased, up;
        switch (mode) {
        case 0:
            up = true;
            break;
        case 1:
            up = false;
            break;
        case 2:
            up = !prev_cased;
            break;
        case 3:
            up = i == 0;
            break;
        case 4: {
            bool c2;
            uint32_t lo = cp_case(cp, false, &c2);
            up = lo == cp; /* lower case (or caseless): swap to upper */
            break;
        }
        default:
            up = word_start;
            break;
        }
        uint32_t m = cp_case(cp, up, &cased);
        if (m == UINT32_MAX) rfail(c, "changing the case of U+%04X is not supported", (unsigned)cp);
        sb_cp(c, &o, m);
        prev_cased = cased;
        word_start = cp_space(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
        i += len;
    }
    val r = o.p ? v_sb(&o) : v_str("");
    return r;
}

static bool str_has_affix(ctx *c, val s, val affix, bool end) {
    if (affix.t == V_LIST) {
        for (size_t i = 0; i < affix.u.l->n; i++)
            if (str_has_affix(c, s, affix.u.l->v[i], end)) return true;
        return false;
    }
    affix = need_str(c, affix, end ? "endswith's argument" : "startswith's argument");
    if (affix.u.s.n > s.u.s.n) return false;
    return !memcmp(s.u.s.p + (end ? s.u.s.n - affix.u.s.n : 0), affix.u.s.p, affix.u.s.n);
}

/* '{} {0} {name}'.format(...) with plain fields (no format specs). */
static val str_format(ctx *c, val s, const args *a) {
    sbuf o = {0};
    const char *p = s.u.s.p;
    size_t n = s.u.s.n;
    int auto_idx = 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '{' && i + 1 < n && p[i + 1] == '{') {
            sb_putc(c, &o, '{');
            i++;
            continue;
        }
        if (p[i] == '}' && i + 1 < n && p[i + 1] == '}') {
            sb_putc(c, &o, '}');
            i++;
            continue;
        }
        if (p[i] == '}') rfail(c, "Single '}' encountered in format string");
        if (p[i] != '{') {
            sb_putc(c, &o, p[i]);
            continue;
        }
        size_t j = i + 1;
        while (j < n && p[j] != '}')
            j++;
        if (j >= n) rfail(c, "Single '{' encountered in format string");
        const char *f = p + i + 1;
        size_t fn = j - i - 1;
        if (memchr(f, ':', fn) || memchr(f, '!', fn) || memchr(f, '.', fn) || memchr(f, '[', fn))
            rfail(c, "format specifications in str.format are not supported");
        val v;
        if (!fn) {
            if (auto_idx >= a->npos)
                rfail(c, "Replacement index %d out of range for positional args tuple", auto_idx);
            v = a->pos[auto_idx++];
        } else if (isdigit((unsigned char)f[0])) {
            int k = atoi(f);
            if (k >= a->npos) rfail(c, "Replacement index %d out of range for positional args tuple", k);
            v = a->pos[k];
        } else {
            bool found = false;
            for (int k = 0; k < a->nkw; k++)
                if (strlen(a->kwn[k]) == fn && !memcmp(a->kwn[k], f, fn)) v = a->kwv[k], found = true;
            if (!found) rfail(c, "KeyError: '%.*s'", (int)fn, f);
        }
        to_str(c, &o, &v, false);
        i = j;
    }
    return o.p ? v_sb(&o) : v_str("");
}

/* ---- tests ---- */

static val arith(ctx *c, int op, val x, val y);

static bool run_test(ctx *c, const char *name, val x, const args *a) {
    static const char *const one_arg[] = {
        "sameas", "eq",          "equalto", "==", "ne", "!=",          "lt", "lessthan", "<",    "le", "<=",
        "gt",     "greaterthan", ">",       "ge", ">=", "divisibleby", "in", "filter",   "test", NULL};
    int want = in_names(one_arg, name) ? 1 : 0;
    if (a->npos + a->nkw != want)
        rfail(c, "test_%s() takes %d positional argument%s but %d were given", name, want + 1,
              want ? "s" : "", a->npos + a->nkw + 1);
    val y = a->npos ? a->pos[0] : v_undef();
    if (!strcmp(name, "defined")) return x.t != V_UNDEF;
    if (!strcmp(name, "undefined")) return x.t == V_UNDEF;
    if (!strcmp(name, "none")) return x.t == V_NONE;
    if (!strcmp(name, "boolean")) return x.t == V_BOOL;
    if (!strcmp(name, "false")) return x.t == V_BOOL && !x.u.b;
    if (!strcmp(name, "true")) return x.t == V_BOOL && x.u.b;
    if (!strcmp(name, "integer")) return x.t == V_INT;
    if (!strcmp(name, "float")) return x.t == V_FLOAT;
    if (!strcmp(name, "number")) return x.t == V_INT || x.t == V_FLOAT || x.t == V_BOOL;
    if (!strcmp(name, "string")) return x.t == V_STR;
    if (!strcmp(name, "mapping")) return x.t == V_DICT;
    if (!strcmp(name, "iterable")) return x.t == V_LIST || x.t == V_DICT || x.t == V_STR || x.t == V_UNDEF;
    if (!strcmp(name, "sequence"))
        return (x.t == V_LIST && x.u.l->kind != L_GEN && x.u.l->kind != L_VIEW) || x.t == V_DICT ||
               x.t == V_STR || x.t == V_UNDEF;
    if (!strcmp(name, "callable")) /* Undefined has a __call__ (that raises) */
        return x.t == V_MACRO || x.t == V_FUNC || x.t == V_METHOD || x.t == V_UNDEF;
    if (!strcmp(name, "escaped")) return false;
    if (!strcmp(name, "filter")) return y.t == V_STR && in_names(known_filters, zstr(c, y));
    if (!strcmp(name, "test")) return y.t == V_STR && in_names(known_tests, zstr(c, y));
    if (!strcmp(name, "sameas")) {
        if (x.t != y.t) return false;
        switch (x.t) {
        case V_NONE:
        case V_UNDEF:
            return true;
        case V_BOOL:
            return x.u.b == y.u.b;
        case V_INT:
            return x.u.i == y.u.i && x.u.i >= -5 && x.u.i <= 256;
        case V_STR:
            return x.u.s.p == y.u.s.p && x.u.s.n == y.u.s.n;
        case V_LIST:
            return x.u.l == y.u.l;
        case V_DICT:
        case V_NS:
            return x.u.d == y.u.d;
        default:
            return false;
        }
    }
    if (!strcmp(name, "eq") || !strcmp(name, "equalto") || !strcmp(name, "==")) return veq(&x, &y);
    if (!strcmp(name, "ne") || !strcmp(name, "!=")) return !veq(&x, &y);
    if (!strcmp(name, "lt") || !strcmp(name, "lessthan") || !strcmp(name, "<"))
        return vcmp(c, &x, &y, "<") < 0;
    if (!strcmp(name, "le") || !strcmp(name, "<=")) return vcmp(c, &x, &y, "<=") <= 0;
    if (!strcmp(name, "gt") || !strcmp(name, "greaterthan") || !strcmp(name, ">"))
        return vcmp(c, &x, &y, ">") > 0;
    if (!strcmp(name, "ge") || !strcmp(name, ">=")) return vcmp(c, &x, &y, ">=") >= 0;
    if (!strcmp(name, "odd") || !strcmp(name, "even") || !strcmp(name, "divisibleby")) {
        /* value % 2 == 1, value % 2 == 0, value % num == 0 */
        val m = arith(c, OP_MOD, x, name[0] == 'd' ? y : v_int(2)), one = v_int(name[0] == 'o');
        return veq(&m, &one);
    }
    if (!strcmp(name, "lower") || !strcmp(name, "upper")) { /* str(value).islower() / .isupper() */
        val s = vstr(c, &x);
        bool cased = false;
        for (size_t i = 0; i < s.u.s.n;) {
            size_t len;
            uint32_t cp = u8_decode(s.u.s.p, s.u.s.n, i, &len);
            bool cs;
            uint32_t lo = cp_case(cp, false, &cs), up = cp_case(cp, true, &cs);
            if (lo == UINT32_MAX || up == UINT32_MAX)
                rfail(c, "the case of U+%04X is not known here", (unsigned)cp);
            i += len;
            if (!cs) continue;
            cased = true;
            if (name[0] == 'l' ? lo != cp : up != cp) return false;
        }
        return cased;
    }
    if (!strcmp(name, "in")) {
        if (y.t == V_STR) {
            if (x.t != V_STR)
                rfail(c, "'in <string>' requires string as left operand, not %s", type_name(&x));
            return memmem_(y.u.s.p, y.u.s.n, x.u.s.p, x.u.s.n) != NULL;
        }
        if (y.t == V_DICT) return dict_find(y.u.d, &x) != NULL;
        list *l = iter_list(c, y);
        for (size_t i = 0; i < l->n; i++)
            if (veq(&x, &l->v[i])) return true;
        return false;
    }
    if (!in_names(known_tests, name)) rfail(c, "No test named '%s'.", name);
    rfail(c, "test '%s' is not supported", name);
}

/* ---- filters ---- */

static val html_escape(ctx *c, val s) {
    sbuf o = {0};
    for (size_t i = 0; i < s.u.s.n; i++) {
        char ch = s.u.s.p[i];
        switch (ch) {
        case '&':
            sb_puts(c, &o, "&amp;");
            break;
        case '<':
            sb_puts(c, &o, "&lt;");
            break;
        case '>':
            sb_puts(c, &o, "&gt;");
            break;
        case '"':
            sb_puts(c, &o, "&#34;");
            break;
        case '\'':
            sb_puts(c, &o, "&#39;");
            break;
        default:
            sb_putc(c, &o, ch);
        }
    }
    return o.p ? v_sb(&o) : v_str("");
}

static val attr_path(ctx *c, val x, val path) {
    /* jinja2's make_attrgetter: "a.b.0" (item access, then attribute) */
    if (path.t == V_INT) return getitem_v(c, x, path);
    path = need_str(c, path, "the attribute");
    const char *p = path.u.s.p;
    size_t n = path.u.s.n, i = 0;
    while (i <= n) {
        size_t j = i;
        while (j < n && p[j] != '.')
            j++;
        bool digits = j > i;
        for (size_t k = i; k < j; k++)
            digits &= isdigit((unsigned char)p[k]) != 0;
        val key = digits ? v_int(strtoll(p + i, NULL, 10)) : v_strn(p + i, j - i);
        if (x.t == V_UNDEF)
            rfail(c, "cannot read attribute '%.*s' of an undefined value", (int)(j - i), p + i);
        if (key.t == V_STR) {
            val v = getitem_v(c, x, key);
            if (v.t == V_UNDEF || v.t == V_METHOD) {
                char *nm = ralloc(c, j - i + 1);
                memcpy(nm, p + i, j - i);
                nm[j - i] = 0;
                val w = getattr_v(c, x, nm);
                if (v.t == V_UNDEF) v = w;
            }
            x = v;
        } else {
            x = getitem_v(c, x, key);
        }
        i = j + 1;
    }
    return x;
}

static val lower_if_str(ctx *c, val v, bool case_sensitive) {
    if (!case_sensitive && v.t == V_STR) return str_case(c, v, 1);
    return v;
}

typedef struct sortkey {
    bool case_sensitive;
    val attribute; /* V_UNDEF or V_NONE: the item itself */
    int by;        /* dictsort: 0 key, 1 value */
} sortkey;

static val sort_key(ctx *c, const val *v, const sortkey *k) {
    val x = *v;
    if (k->by >= 0 && x.t == V_LIST && x.u.l->n == 2) x = x.u.l->v[k->by];
    if (k->attribute.t != V_UNDEF && k->attribute.t != V_NONE) x = attr_path(c, x, k->attribute);
    return lower_if_str(c, x, k->case_sensitive);
}

static int cmp_by_key(ctx *c, const val *a, const val *b, void *arg) {
    const sortkey *k = arg;
    val x = sort_key(c, a, k), y = sort_key(c, b, k);
    return vcmp(c, &x, &y, "<");
}

static void reverse_vals(val *v, size_t n) {
    for (size_t i = 0; i < n / 2; i++) {
        val t = v[i];
        v[i] = v[n - 1 - i];
        v[n - 1 - i] = t;
    }
}

static list *copy_list(ctx *c, list *l) {
    list *o = list_new(c, l->n + 1);
    memcpy(o->v, l->v, l->n * sizeof *o->v);
    o->n = l->n;
    return o;
}

static val mk_pair(ctx *c, val a, val b) {
    list *l = list_new(c, 2);
    l->kind = L_TUPLE;
    list_push(c, l, a);
    list_push(c, l, b);
    return v_list(l);
}

static int64_t py_int_of(ctx *c, val v, bool *ok) {
    *ok = true;
    switch (v.t) {
    case V_INT:
        return v.u.i;
    case V_BOOL:
        return v.u.b;
    case V_FLOAT:
        if (!isfinite(v.u.f) || fabs(v.u.f) > 9.2e18) break;
        return (int64_t)v.u.f;
    case V_STR: {
        char buf[64];
        size_t a = 0, b = v.u.s.n;
        while (a < b && py_space((unsigned char)v.u.s.p[a]))
            a++;
        while (b > a && py_space((unsigned char)v.u.s.p[b - 1]))
            b--;
        if (b - a == 0 || b - a >= sizeof buf) break;
        size_t k = 0;
        for (size_t i = a; i < b; i++)
            if (v.u.s.p[i] != '_') buf[k++] = v.u.s.p[i];
        buf[k] = 0;
        char *end;
        long long x = strtoll(buf, &end, 10);
        if (*end == 0 && end != buf) return x;
        double d = strtod(buf, &end);
        if (*end == 0 && end != buf && isfinite(d)) return (int64_t)d;
        break;
    }
    default:
        break;
    }
    *ok = false;
    return 0;
}

static val apply_filter(ctx *c, const char *name, val x, const args *a);

static bool select_item(ctx *c, val item, const args *a, int first, bool attr) {
    /* select / reject / selectattr / rejectattr: args[first] is the test name */
    if (attr) item = attr_path(c, item, arg(c, a, 0, NULL, v_undef()));
    if (a->npos <= first) return vtrue(&item);
    val tn = need_str(c, a->pos[first], "the test name");
    const char *tname = zstr(c, tn);
    if (!in_names(known_tests, tname)) rfail(c, "no test named '%s'", tname);
    args ta = {.pos = a->pos + first + 1, .npos = a->npos - first - 1, .what = tname};
    return run_test(c, tname, item, &ta);
}

static val apply_filter(ctx *c, const char *name, val x, const args *a) {
    char what[64];
    snprintf(what, sizeof what, "filter '%s'", name);
    args A = *a;
    A.what = what;
    a = &A;
    if (!strcmp(name, "default") || !strcmp(name, "d")) {
        static const char *const nm[] = {"default_value", "boolean", NULL};
        check_args(c, a, 2, nm);
        val def = arg(c, a, 0, "default_value", v_str(""));
        val bo = arg(c, a, 1, "boolean", v_bool(false));
        bool boolean = vtrue(&bo);
        if (x.t == V_UNDEF || (boolean && !vtrue(&x))) return def;
        return x;
    }
    if (!strcmp(name, "length") || !strcmp(name, "count")) {
        check_args(c, a, 0, NULL);
        switch (x.t) {
        case V_UNDEF:
            return v_int(0);
        case V_STR:
            return v_int((int64_t)u8_count(x.u.s.p, x.u.s.n));
        case V_LIST:
            if (x.u.l->kind == L_GEN) rfail(c, "object of type 'generator' has no len()");
            return v_int((int64_t)x.u.l->n);
        case V_DICT:
            return v_int((int64_t)x.u.d->n);
        default:
            rfail(c, "object of type '%s' has no len()", type_name(&x));
        }
    }
    if (!strcmp(name, "string")) {
        check_args(c, a, 0, NULL);
        return vstr(c, &x);
    }
    if (!strcmp(name, "safe") || !strcmp(name, "e") || !strcmp(name, "escape") ||
        !strcmp(name, "forceescape")) {
        check_args(c, a, 0, NULL);
        val s = vstr(c, &x);
        if (name[0] != 's' && !(s.safe && name[0] != 'f')) s = html_escape(c, s);
        s.safe = 1;
        return s;
    }
    if (!strcmp(name, "trim")) {
        static const char *const nm[] = {"chars", NULL};
        check_args(c, a, 1, nm);
        val s = vstr(c, &x), r = str_strip(c, s, arg(c, a, 0, "chars", v_none()), 3);
        r.safe = s.safe;
        return r;
    }
    if (!strcmp(name, "upper") || !strcmp(name, "lower") || !strcmp(name, "title") ||
        !strcmp(name, "capitalize")) {
        check_args(c, a, 0, NULL);
        int mode = name[0] == 'u' ? 0 : name[0] == 'l' ? 1 : name[0] == 't' ? 5 : 3;
        val s = vstr(c, &x), r = str_case(c, s, mode);
        r.safe = s.safe;
        return r;
    }
    if (!strcmp(name, "replace")) {
        static const char *const nm[] = {"old", "new", "count", NULL};
        check_args(c, a, 3, nm);
        val cnt = arg(c, a, 2, "count", v_none());
        return str_replace(c, vstr(c, &x), vstr(c, (val[]){arg(c, a, 0, "old", v_undef())}),
                           vstr(c, (val[]){arg(c, a, 1, "new", v_undef())}),
                           cnt.t == V_NONE ? -1 : num_i(&cnt));
    }
    if (!strcmp(name, "tojson") && c->jinja2_tojson) {
        /* jinja2's own: htmlsafe_json_dumps(x, sort_keys=True, indent=indent), Markup */
        static const char *const nm[] = {"indent", NULL};
        check_args(c, a, 1, nm);
        val ind = arg(c, a, 0, "indent", v_none());
        jsonopt o = {
            .indent = -1, .item_sep = ", ", .key_sep = ": ", .sort_keys = true, .ensure_ascii = true};
        if (ind.t != V_NONE) {
            if (ind.t != V_INT || ind.u.i < 0 || ind.u.i > 64)
                rfail(c, "tojson's indent must be a small integer");
            o.indent = (int)ind.u.i;
            o.item_sep = ",";
        }
        sbuf b = {0}, h = {0};
        to_json(c, &b, &x, &o, 0);
        for (size_t i = 0; i < b.n; i++) {
            char ch = b.p[i];
            if (ch == '<')
                sb_puts(c, &h, "\\u003c");
            else if (ch == '>')
                sb_puts(c, &h, "\\u003e");
            else if (ch == '&')
                sb_puts(c, &h, "\\u0026");
            else if (ch == '\'')
                sb_puts(c, &h, "\\u0027");
            else
                sb_putc(c, &h, ch);
        }
        val r = v_sb(&h);
        r.safe = 1;
        return r;
    }
    if (!strcmp(name, "tojson")) {
        /* transformers: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) */
        static const char *const nm[] = {"ensure_ascii", "indent", "separators", "sort_keys", NULL};
        check_args(c, a, 4, nm);
        val ea = arg(c, a, 0, "ensure_ascii", v_bool(false)), ind = arg(c, a, 1, "indent", v_none()),
            sep = arg(c, a, 2, "separators", v_none()), sk = arg(c, a, 3, "sort_keys", v_bool(false));
        jsonopt o = {.indent = -1,
                     .item_sep = ", ",
                     .key_sep = ": ",
                     .sort_keys = vtrue(&sk),
                     .ensure_ascii = vtrue(&ea)};
        if (ind.t != V_NONE) {
            if (ind.t != V_INT || ind.u.i < 0 || ind.u.i > 64)
                rfail(c, "tojson's indent must be a small integer");
            o.indent = (int)ind.u.i;
            o.item_sep = ",";
        }
        if (sep.t != V_NONE) {
            if (sep.t != V_LIST || sep.u.l->n != 2 || sep.u.l->v[0].t != V_STR || sep.u.l->v[1].t != V_STR)
                rfail(c, "tojson's separators must be two strings");
            o.item_sep = zstr(c, sep.u.l->v[0]);
            o.key_sep = zstr(c, sep.u.l->v[1]);
        }
        sbuf b = {0};
        to_json(c, &b, &x, &o, 0);
        return v_sb(&b);
    }
    if (!strcmp(name, "join")) {
        static const char *const nm[] = {"d", "attribute", NULL};
        check_args(c, a, 2, nm);
        val sep = vstr(c, (val[]){arg(c, a, 0, "d", v_str(""))}), at = arg(c, a, 1, "attribute", v_none());
        list *l = iter_list(c, x);
        sbuf o = {0};
        for (size_t i = 0; i < l->n; i++) {
            if (i) sb_add(c, &o, sep.u.s.p, sep.u.s.n);
            val it = at.t == V_NONE ? l->v[i] : attr_path(c, l->v[i], at);
            to_str(c, &o, &it, false);
        }
        return o.p ? v_sb(&o) : v_str("");
    }
    if (!strcmp(name, "first") || !strcmp(name, "last")) {
        check_args(c, a, 0, NULL);
        if (x.t == V_UNDEF) return v_undef();
        list *l = iter_list(c, x);
        if (name[0] == 'l' && x.t == V_LIST && x.u.l->kind == L_GEN)
            rfail(c, "'generator' object is not reversible");
        if (!l->n) return v_undef();
        return name[0] == 'f' ? l->v[0] : l->v[l->n - 1];
    }
    if (!strcmp(name, "list")) {
        check_args(c, a, 0, NULL);
        return v_list(copy_list(c, iter_list(c, x)));
    }
    if (!strcmp(name, "items")) {
        check_args(c, a, 0, NULL);
        if (x.t == V_UNDEF) {
            list *e = list_new(c, 1);
            e->kind = L_GEN;
            return v_list(e);
        }
        if (x.t != V_DICT) rfail(c, "Can only get item pairs from a mapping.");
        list *l = list_new(c, x.u.d->n + 1);
        for (size_t i = 0; i < x.u.d->n; i++)
            list_push(c, l, mk_pair(c, x.u.d->k[i], x.u.d->v[i]));
        l->kind = L_GEN;
        return v_list(l);
    }
    if (!strcmp(name, "dictsort")) {
        static const char *const nm[] = {"case_sensitive", "by", "reverse", NULL};
        check_args(c, a, 3, nm);
        val cs = arg(c, a, 0, "case_sensitive", v_bool(false)), by = arg(c, a, 1, "by", v_str("key")),
            rev = arg(c, a, 2, "reverse", v_bool(false));
        if (x.t != V_DICT) rfail(c, "dictsort needs a mapping, not %s", type_name(&x));
        list *l = list_new(c, x.u.d->n + 1);
        for (size_t i = 0; i < x.u.d->n; i++)
            list_push(c, l, mk_pair(c, x.u.d->k[i], x.u.d->v[i]));
        sortkey k = {.case_sensitive = vtrue(&cs), .attribute = v_undef(), .by = 0};
        if (by.t == V_STR && !strcmp(zstr(c, by), "value"))
            k.by = 1;
        else if (!(by.t == V_STR && !strcmp(zstr(c, by), "key")))
            rfail(c, "You can only sort by either \"key\" or \"value\"");
        sort_vals(c, l->v, l->n, cmp_by_key, &k);
        if (vtrue(&rev)) reverse_vals(l->v, l->n);
        return v_list(l);
    }
    if (!strcmp(name, "sort")) {
        static const char *const nm[] = {"reverse", "case_sensitive", "attribute", NULL};
        check_args(c, a, 3, nm);
        val rev = arg(c, a, 0, "reverse", v_bool(false)), cs = arg(c, a, 1, "case_sensitive", v_bool(false));
        list *l = copy_list(c, iter_list(c, x));
        sortkey k = {
            .case_sensitive = vtrue(&cs), .attribute = arg(c, a, 2, "attribute", v_none()), .by = -1};
        if (vtrue(&rev)) { /* Python's reverse sort keeps equal items in order */
            reverse_vals(l->v, l->n);
            sort_vals(c, l->v, l->n, cmp_by_key, &k);
            reverse_vals(l->v, l->n);
        } else {
            sort_vals(c, l->v, l->n, cmp_by_key, &k);
        }
        return v_list(l);
    }
    if (!strcmp(name, "unique")) {
        static const char *const nm[] = {"case_sensitive", "attribute", NULL};
        check_args(c, a, 2, nm);
        val cs = arg(c, a, 0, "case_sensitive", v_bool(false));
        sortkey k = {
            .case_sensitive = vtrue(&cs), .attribute = arg(c, a, 1, "attribute", v_none()), .by = -1};
        list *l = iter_list(c, x), *o = list_new(c, l->n + 1), *seen = list_new(c, l->n + 1);
        for (size_t i = 0; i < l->n; i++) {
            val key = sort_key(c, &l->v[i], &k);
            bool dup = false;
            for (size_t j = 0; j < seen->n && !dup; j++)
                dup = veq(&seen->v[j], &key);
            if (dup) continue;
            list_push(c, seen, key);
            list_push(c, o, l->v[i]);
        }
        o->kind = L_GEN;
        return v_list(o);
    }
    if (!strcmp(name, "min") || !strcmp(name, "max")) {
        static const char *const nm[] = {"case_sensitive", "attribute", NULL};
        check_args(c, a, 2, nm);
        val cs = arg(c, a, 0, "case_sensitive", v_bool(false));
        sortkey k = {
            .case_sensitive = vtrue(&cs), .attribute = arg(c, a, 1, "attribute", v_none()), .by = -1};
        list *l = iter_list(c, x);
        if (!l->n) return v_undef();
        size_t best = 0;
        for (size_t i = 1; i < l->n; i++) {
            int r = cmp_by_key(c, &l->v[i], &l->v[best], &k);
            if (name[1] == 'i' ? r < 0 : r > 0) best = i;
        }
        return l->v[best];
    }
    if (!strcmp(name, "reverse")) {
        check_args(c, a, 0, NULL);
        if (x.t == V_STR) {
            list *ch = iter_list(c, x);
            sbuf o = {0};
            for (size_t i = ch->n; i-- > 0;)
                sb_add(c, &o, ch->v[i].u.s.p, ch->v[i].u.s.n);
            return o.p ? v_sb(&o) : v_str("");
        }
        list *l = copy_list(c, iter_list(c, x));
        reverse_vals(l->v, l->n);
        return v_list(l);
    }
    if (!strcmp(name, "map")) {
        list *l = vtrue(&x) ? iter_list(c, x) : list_new(c, 1), *o = list_new(c, l->n + 1);
        val at = arg(c, a, -1, "attribute", v_undef());
        if (at.t != V_UNDEF) {
            static const char *const nm[] = {"attribute", "default", NULL};
            check_args(c, a, 0, nm);
            val def = arg(c, a, -1, "default", v_undef());
            for (size_t i = 0; i < l->n; i++) {
                val v = attr_path(c, l->v[i], at);
                list_push(c, o, v.t == V_UNDEF && def.t != V_UNDEF ? def : v);
            }
            o->kind = L_GEN;
            return v_list(o);
        }
        if (!a->npos) rfail(c, "map needs a filter name or attribute=");
        val fname = need_str(c, a->pos[0], "map's filter name");
        const char *fn = zstr(c, fname);
        if (!in_names(known_filters, fn)) rfail(c, "no filter named '%s'", fn);
        args fa = {.pos = a->pos + 1, .npos = a->npos - 1, .kwn = a->kwn, .kwv = a->kwv, .nkw = a->nkw};
        for (size_t i = 0; i < l->n; i++)
            list_push(c, o, apply_filter(c, fn, l->v[i], &fa));
        o->kind = L_GEN;
        return v_list(o);
    }
    if (!strcmp(name, "select") || !strcmp(name, "reject") || !strcmp(name, "selectattr") ||
        !strcmp(name, "rejectattr")) {
        bool attr = strstr(name, "attr") != NULL, keep = name[0] == 's';
        if (a->nkw) rfail(c, "%s takes no keyword arguments", what);
        if (attr && !a->npos) rfail(c, "%s needs an attribute name", what);
        list *l = vtrue(&x) ? iter_list(c, x) : list_new(c, 1), *o = list_new(c, l->n + 1);
        for (size_t i = 0; i < l->n; i++)
            if (select_item(c, l->v[i], a, attr ? 1 : 0, attr) == keep) list_push(c, o, l->v[i]);
        o->kind = L_GEN;
        return v_list(o);
    }
    if (!strcmp(name, "attribute")) {
        check_args(c, a, 1, NULL);
        return attr_path(c, x, arg(c, a, 0, NULL, v_undef()));
    }
    if (!strcmp(name, "int")) {
        static const char *const nm[] = {"default", "base", NULL};
        check_args(c, a, 2, nm);
        val def = arg(c, a, 0, "default", v_int(0));
        if (arg(c, a, 1, "base", v_int(10)).u.i != 10) rfail(c, "int's base is not supported");
        if (x.t == V_UNDEF) rfail(c, "int of an undefined value");
        bool ok;
        int64_t v = py_int_of(c, x, &ok);
        return ok ? v_int(v) : def;
    }
    if (!strcmp(name, "float")) {
        static const char *const nm[] = {"default", NULL};
        check_args(c, a, 1, nm);
        val def = arg(c, a, 0, "default", v_float(0));
        if (x.t == V_UNDEF) rfail(c, "float of an undefined value");
        if (is_num(&x)) return v_float(num_f(&x));
        if (x.t == V_STR) {
            char *end;
            char *tmp = ralloc(c, x.u.s.n + 1);
            memcpy(tmp, x.u.s.p, x.u.s.n);
            tmp[x.u.s.n] = 0;
            double d = strtod(tmp, &end);
            while (*end && py_space((unsigned char)*end))
                end++;
            if (end != tmp && !*end) return v_float(d);
        }
        return def;
    }
    if (!strcmp(name, "abs")) {
        check_args(c, a, 0, NULL);
        if (x.t == V_INT) return v_int(x.u.i < 0 ? -x.u.i : x.u.i);
        if (x.t == V_FLOAT) return v_float(fabs(x.u.f));
        if (x.t == V_BOOL) return v_int(x.u.b);
        rfail(c, "bad operand type for abs(): '%s'", type_name(&x));
    }
    if (!strcmp(name, "round")) {
        static const char *const nm[] = {"precision", "method", NULL};
        check_args(c, a, 2, nm);
        val pr = arg(c, a, 0, "precision", v_int(0)), me = arg(c, a, 1, "method", v_str("common"));
        if (!is_num(&x)) rfail(c, "round needs a number");
        if (!is_num(&pr) || pr.t == V_FLOAT) rfail(c, "round's precision must be an integer");
        int64_t p = num_i(&pr);
        if (p > 300 || p < -300) rfail(c, "round's precision is out of range");
        const char *method = me.t == V_STR ? zstr(c, me) : "";
        if (!strcmp(method, "floor") || !strcmp(method, "ceil")) { /* math.floor(value * 10**p) / 10**p */
            double m = pow(10, (double)p), v = num_f(&x) * m;
            return v_float((method[0] == 'f' ? floor(v) : ceil(v)) / m);
        }
        if (strcmp(method, "common")) rfail(c, "method must be common, ceil or floor");
        /* Python's round(): an int stays an int; a float rounds its exact
         * value half to even, as printf does */
        if (x.t != V_FLOAT && p >= 0) return v_int(num_i(&x));
        if (p < 0) {
            double m = pow(10, (double)-p), v = nearbyint(num_f(&x) / m) * m;
            return x.t == V_FLOAT ? v_float(v) : v_int((int64_t)v);
        }
        char buf[400];
        snprintf(buf, sizeof buf, "%.*f", (int)p, x.u.f);
        return v_float(strtod(buf, NULL));
    }
    if (!strcmp(name, "sum")) {
        static const char *const nm[] = {"attribute", "start", NULL};
        check_args(c, a, 2, nm);
        val at = arg(c, a, 0, "attribute", v_none()), acc = arg(c, a, 1, "start", v_int(0));
        list *l = iter_list(c, x);
        for (size_t i = 0; i < l->n; i++) {
            val v = at.t == V_NONE ? l->v[i] : attr_path(c, l->v[i], at);
            if (!is_num(&v) || !is_num(&acc)) rfail(c, "sum needs numbers");
            if (acc.t == V_FLOAT || v.t == V_FLOAT)
                acc = v_float(num_f(&acc) + num_f(&v));
            else
                acc = v_int(num_i(&acc) + num_i(&v));
        }
        return acc;
    }
    if (!strcmp(name, "indent")) {
        static const char *const nm[] = {"width", "first", "blank", NULL};
        check_args(c, a, 3, nm);
        val w = arg(c, a, 0, "width", v_int(4)), first = arg(c, a, 1, "first", v_bool(false)),
            blank = arg(c, a, 2, "blank", v_bool(false));
        sbuf ind = {0};
        if (w.t == V_STR)
            sb_add(c, &ind, w.u.s.p, w.u.s.n);
        else
            for (int64_t i = 0; i < num_i(&w) && i < 256; i++)
                sb_putc(c, &ind, ' ');
        if (!ind.p) sb_add(c, &ind, "", 0);
        if (x.t != V_STR)
            rfail(c, "indent needs a string, not %s", type_name(&x)); /* jinja2 appends "\n" to it */
        val s = x;
        /* s + "\n", split into lines (\n, \r\n, \r) */
        list *lines = list_new(c, 8);
        {
            const char *p = s.u.s.p;
            size_t n = s.u.s.n, i = 0, st = 0;
            while (i < n) {
                if (p[i] == '\n' || p[i] == '\r') {
                    list_push(c, lines, v_strn(p + st, i - st));
                    if (p[i] == '\r' && i + 1 < n && p[i + 1] == '\n') i++;
                    st = ++i;
                } else {
                    i++;
                }
            }
            list_push(c, lines, v_strn(p + st, n - st)); /* the line the added "\n" ends */
        }
        sbuf o = {0};
        for (size_t i = 0; i < lines->n; i++) {
            const val *ln = &lines->v[i];
            if (i) {
                sb_putc(c, &o, '\n');
                if (vtrue(&blank) || ln->u.s.n) sb_add(c, &o, ind.p, ind.n);
            }
            sb_add(c, &o, ln->u.s.p, ln->u.s.n);
        }
        val r = o.p ? v_sb(&o) : v_str("");
        r.safe = s.safe;
        if (vtrue(&first)) {
            sbuf f = {0};
            sb_add(c, &f, ind.p, ind.n);
            sb_add(c, &f, r.u.s.p, r.u.s.n);
            r = v_sb(&f);
            r.safe = s.safe;
        }
        return r;
    }
    if (!in_names(known_filters, name)) rfail(c, "No filter named '%s'.", name);
    rfail(c, "filter '%s' is not supported", name);
}

/* ---- methods ---- */

static val call_method(ctx *c, val obj, const char *name, const args *a) {
    char what[64];
    snprintf(what, sizeof what, "%s.%s()", type_name(&obj), name);
    args A = *a;
    A.what = what;
    a = &A;
    if (obj.t == V_STR && obj.safe) {
        /* Markup's methods: most escape their string arguments and return Markup */
        static const char *const escaping[] = {"capitalize", "title",    "lower", "upper",  "replace",
                                               "lstrip",     "rstrip",   "strip", "center", "ljust",
                                               "rjust",      "swapcase", "zfill", NULL};
        static const char *const splitting[] = {"split",     "rsplit",     "splitlines",
                                                "partition", "rpartition", NULL};
        if (!strcmp(name, "format") || !strcmp(name, "join") || !strcmp(name, "format_map"))
            rfail(c, "Markup.%s() is not supported", name);
        val plain = obj;
        plain.safe = 0;
        args B = *a;
        bool esc = in_names(escaping, name);
        if (esc) {
            B.pos = ralloc(c, (size_t)(a->npos + 1) * sizeof *B.pos);
            for (int i = 0; i < a->npos; i++)
                B.pos[i] = a->pos[i].t == V_STR ? html_escape(c, a->pos[i]) : a->pos[i];
        }
        val r = call_method(c, plain, name, &B);
        if (esc && r.t == V_STR) r.safe = 1;
        if (in_names(splitting, name) && r.t == V_LIST)
            for (size_t i = 0; i < r.u.l->n; i++)
                r.u.l->v[i].safe = 1;
        return r;
    }
    if (obj.t == V_LOOP) {
        if (!a->npos) rfail(c, "no items for cycling given");
        return a->pos[obj.u.lp->index0 % (size_t)a->npos];
    }
    if ((obj.t == V_LIST || obj.t == V_DICT) && in_names(unsafe_methods, name))
        rfail(c, "access to attribute '%s' of '%s' object is unsafe.", name, type_name(&obj));
    if (obj.t == V_DICT) {
        dict *d = obj.u.d;
        if (!strcmp(name, "items") || !strcmp(name, "keys") || !strcmp(name, "values")) {
            check_args(c, a, 0, NULL);
            list *l = list_new(c, d->n + 1);
            for (size_t i = 0; i < d->n; i++)
                list_push(c, l,
                          name[0] == 'i'   ? mk_pair(c, d->k[i], d->v[i])
                          : name[0] == 'k' ? d->k[i]
                                           : d->v[i]);
            l->kind = L_VIEW;
            return v_list(l);
        }
        if (!strcmp(name, "get")) {
            check_args(c, a, 2, NULL);
            if (!a->npos) rfail(c, "get expected at least 1 argument, got 0");
            val *v = dict_find(d, &a->pos[0]);
            return v ? *v : a->npos > 1 ? a->pos[1] : v_none();
        }
        if (!strcmp(name, "copy")) {
            dict *o = dict_new(c);
            for (size_t i = 0; i < d->n; i++)
                dict_set(c, o, d->k[i], d->v[i]);
            return v_dict(o);
        }
    } else if (obj.t == V_LIST) {
        list *l = obj.u.l;
        if (!strcmp(name, "index") || !strcmp(name, "count")) {
            check_args(c, a, 1, NULL);
            if (!a->npos) rfail(c, "%s takes exactly one argument", what);
            int64_t k = 0;
            for (size_t i = 0; i < l->n; i++) {
                if (!veq(&l->v[i], &a->pos[0])) continue;
                if (name[0] == 'i') return v_int((int64_t)i);
                k++;
            }
            if (name[0] == 'i') rfail(c, "ValueError: value is not in list");
            return v_int(k);
        }
        if (!strcmp(name, "copy")) return v_list(copy_list(c, l));
    } else if (obj.t == V_STR) {
        if (!strcmp(name, "strip") || !strcmp(name, "lstrip") || !strcmp(name, "rstrip")) {
            check_args(c, a, 1, NULL);
            return str_strip(c, obj, arg(c, a, 0, NULL, v_none()),
                             name[0] == 'l'   ? 1
                             : name[0] == 'r' ? 2
                                              : 3);
        }
        if (!strcmp(name, "split")) {
            static const char *const nm[] = {"sep", "maxsplit", NULL};
            check_args(c, a, 2, nm);
            val ms = arg(c, a, 1, "maxsplit", v_int(-1));
            return str_split(c, obj, arg(c, a, 0, "sep", v_none()), num_i(&ms));
        }
        if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
            check_args(c, a, 1, NULL);
            if (!a->npos) rfail(c, "%s takes at least 1 argument", what);
            return v_bool(str_has_affix(c, obj, a->pos[0], name[0] == 'e'));
        }
        if (!strcmp(name, "upper") || !strcmp(name, "lower") || !strcmp(name, "title") ||
            !strcmp(name, "capitalize") || !strcmp(name, "swapcase")) {
            check_args(c, a, 0, NULL);
            int mode = name[0] == 'u' ? 0 : name[0] == 'l' ? 1 : name[0] == 't' ? 2 : name[0] == 'c' ? 3 : 4;
            return str_case(c, obj, mode);
        }
        if (!strcmp(name, "replace")) {
            check_args(c, a, 3, NULL);
            if (a->npos < 2) rfail(c, "replace expected at least 2 arguments");
            val cnt = arg(c, a, 2, NULL, v_int(-1));
            return str_replace(c, obj, a->pos[0], a->pos[1], num_i(&cnt));
        }
        if (!strcmp(name, "find") || !strcmp(name, "rfind") || !strcmp(name, "index") ||
            !strcmp(name, "rindex") || !strcmp(name, "count")) {
            check_args(c, a, 1, NULL);
            if (!a->npos) rfail(c, "%s takes at least 1 argument", what);
            val sub = need_str(c, a->pos[0], "the substring");
            const char *p = obj.u.s.p;
            size_t n = obj.u.s.n;
            if (!strcmp(name, "count")) {
                if (!sub.u.s.n) return v_int((int64_t)u8_count(p, n) + 1);
                int64_t k = 0;
                for (const char *q = p; (q = memmem_(q, n - (size_t)(q - p), sub.u.s.p, sub.u.s.n));
                     q += sub.u.s.n)
                    k++;
                return v_int(k);
            }
            const char *hit = NULL;
            if (name[0] == 'r') {
                for (size_t i = n + 1; i-- > 0;)
                    if (i + sub.u.s.n <= n && !memcmp(p + i, sub.u.s.p, sub.u.s.n)) {
                        hit = p + i;
                        break;
                    }
            } else {
                hit = memmem_(p, n, sub.u.s.p, sub.u.s.n);
            }
            if (!hit && strstr(name, "index")) rfail(c, "ValueError: substring not found");
            return v_int(hit ? (int64_t)u8_count(p, (size_t)(hit - p)) : -1);
        }
        if (!strcmp(name, "format")) return str_format(c, obj, a);
        if (!strcmp(name, "join")) {
            check_args(c, a, 1, NULL);
            if (a->npos != 1) rfail(c, "join takes exactly one argument");
            list *l = iter_list(c, a->pos[0]);
            sbuf o = {0};
            for (size_t i = 0; i < l->n; i++) {
                if (i) sb_add(c, &o, obj.u.s.p, obj.u.s.n);
                val it = need_str(c, l->v[i], "join's items");
                sb_add(c, &o, it.u.s.p, it.u.s.n);
            }
            return o.p ? v_sb(&o) : v_str("");
        }
        if (!strcmp(name, "splitlines")) {
            check_args(c, a, 0, NULL);
            list *l = list_new(c, 4);
            const char *p = obj.u.s.p;
            size_t n = obj.u.s.n, st = 0, i = 0;
            while (i < n) {
                if (p[i] == '\n' || p[i] == '\r') {
                    list_push(c, l, v_strn(p + st, i - st));
                    if (p[i] == '\r' && i + 1 < n && p[i + 1] == '\n') i++;
                    st = ++i;
                } else {
                    i++;
                }
            }
            if (st < n) list_push(c, l, v_strn(p + st, n - st));
            return v_list(l);
        }
        if (!strncmp(name, "is", 2) &&
            (!strcmp(name, "isdigit") || !strcmp(name, "isalpha") || !strcmp(name, "isspace") ||
             !strcmp(name, "isalnum") || !strcmp(name, "isupper") || !strcmp(name, "islower"))) {
            check_args(c, a, 0, NULL);
            if (!strcmp(name, "isupper") || !strcmp(name, "islower")) {
                args none = {.what = name};
                return v_bool(run_test(c, name + 2, obj, &none));
            }
            if (!obj.u.s.n) return v_bool(false);
            for (size_t i = 0; i < obj.u.s.n; i++) {
                unsigned char ch = (unsigned char)obj.u.s.p[i];
                bool ok = name[2] == 'd'   ? isdigit(ch) != 0
                          : name[2] == 's' ? py_space(ch)
                          : name[4] == 'h' ? isalpha(ch) != 0
                                           : isalnum(ch) != 0;
                if (ch >= 0x80 || !ok) return v_bool(false);
            }
            return v_bool(true);
        }
        if (!strcmp(name, "removeprefix") || !strcmp(name, "removesuffix")) {
            check_args(c, a, 1, NULL);
            if (a->npos != 1) rfail(c, "%s takes exactly one argument", what);
            val af = need_str(c, a->pos[0], "the affix");
            bool end = name[6] == 's';
            if (!str_has_affix(c, obj, af, end)) return obj;
            return v_strn(obj.u.s.p + (end ? 0 : af.u.s.n), obj.u.s.n - af.u.s.n);
        }
    }
    rfail(c, "the method %s is not supported", what);
}

/* ---- calls ---- */

static void exec_body(ctx *c, frame *f, const nlist *body);

static val call_macro(ctx *c, const macro *m, const args *a) {
    const node *def = m->def;
    if (a->npos > def->nkw) rfail(c, "macro '%s' takes not more than %d argument(s)", def->name, def->nkw);
    if (++c->depth > 100) fail_at(&c->e, DUET__JINJA_LIMIT, c->line, "macro calls nested more than 100 deep");
    step(c);
    frame *f = frame_new(c, m->closure);
    for (int k = 0; k < a->nkw; k++) {
        bool ok = false;
        for (int i = 0; i < def->nkw; i++)
            ok |= !strcmp(def->kwn[i], a->kwn[k]);
        if (!ok) rfail(c, "macro '%s' takes no keyword argument '%s'", def->name, a->kwn[k]);
    }
    for (int i = 0; i < def->nkw; i++) {
        val v = v_undef();
        bool given = false;
        if (i < a->npos) v = a->pos[i], given = true;
        for (int k = 0; k < a->nkw; k++)
            if (!strcmp(def->kwn[i], a->kwn[k])) v = a->kwv[k], given = true;
        if (!given && def->kwv.v[i]) v = eval(c, f, def->kwv.v[i]);
        dict_sets(c, f->vars, def->kwn[i], v);
    }
    sbuf *saved = c->out;
    int saved_line = c->line, saved_ctl = c->loop_ctl;
    sbuf out = {0};
    c->out = &out;
    c->loop_ctl = 0;
    exec_body(c, f, &def->body);
    c->out = saved;
    c->line = saved_line;
    c->loop_ctl = saved_ctl;
    c->depth--;
    return out.p ? v_sb(&out) : v_str("");
}

static val call_func(ctx *c, int fn, const args *a) {
    switch (fn) {
    case FN_RANGE: {
        args A = *a;
        A.what = "range()";
        check_args(c, &A, 3, NULL);
        int64_t lo = 0, hi, st = 1;
        for (int i = 0; i < a->npos; i++)
            if (a->pos[i].t != V_INT && a->pos[i].t != V_BOOL)
                rfail(c, "range() needs integers, not %s", type_name(&a->pos[i]));
        if (a->npos == 0) rfail(c, "range expected at least 1 argument, got 0");
        if (a->npos == 1)
            hi = num_i(&a->pos[0]);
        else
            lo = num_i(&a->pos[0]), hi = num_i(&a->pos[1]);
        if (a->npos == 3) st = num_i(&a->pos[2]);
        if (st == 0) rfail(c, "range() arg 3 must not be zero");
        int64_t n =
            st > 0 ? (hi > lo ? (hi - lo + st - 1) / st : 0) : (lo > hi ? (lo - hi - st - 1) / -st : 0);
        if (n > 100000) rfail(c, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        list *l = list_new(c, (size_t)n + 1);
        for (int64_t i = 0; i < n; i++)
            list_push(c, l, v_int(lo + i * st));
        l->kind = L_RANGE;
        l->start = lo;
        l->stop = hi;
        l->step = st;
        return v_list(l);
    }
    case FN_NAMESPACE:
    case FN_DICT: {
        dict *d = dict_new(c);
        if (a->npos > 1)
            rfail(c, "%s takes at most one positional argument", fn == FN_DICT ? "dict()" : "namespace()");
        if (a->npos == 1) {
            val src = a->pos[0];
            if (src.t != V_DICT && src.t != V_NS)
                rfail(c, "%s needs a mapping", fn == FN_DICT ? "dict()" : "namespace()");
            for (size_t i = 0; i < src.u.d->n; i++)
                dict_set(c, d, src.u.d->k[i], src.u.d->v[i]);
        }
        for (int k = 0; k < a->nkw; k++)
            dict_sets(c, d, a->kwn[k], a->kwv[k]);
        return (val){.t = fn == FN_DICT ? V_DICT : V_NS, .u.d = d};
    }
    case FN_RAISE: {
        sbuf m = {0};
        if (a->npos) to_str(c, &m, &a->pos[0], false);
        fail_at(&c->e, DUET__JINJA_RAISED, 0, "%s", m.p ? m.p : "");
    }
    case FN_STRFTIME: {
        if (a->npos != 1 || a->pos[0].t != V_STR) rfail(c, "strftime_now() takes one format string");
        time_t t = c->now < 0 ? time(NULL) : (time_t)c->now;
        struct tm tm;
        if (c->now < 0)
            localtime_r(&t, &tm);
        else
            gmtime_r(&t, &tm);
        char buf[512];
        size_t n = strftime(buf, sizeof buf, zstr(c, a->pos[0]), &tm);
        char *p = ralloc(c, n + 1);
        memcpy(p, buf, n);
        p[n] = 0;
        return v_strn(p, n);
    }
    default:
        rfail(c, "this global function is not supported");
    }
}

static val eval_call(ctx *c, frame *f, const node *n) {
    val fn;
    if (n->a->kind == E_ATTR) { /* obj.name(...): the object is evaluated once */
        val obj = eval(c, f, n->a->a);
        const char *name = n->a->name;
        if (obj.t == V_STR || obj.t == V_LIST || obj.t == V_DICT) {
            bool is_method = obj.t == V_STR    ? in_names(str_methods, name)
                             : obj.t == V_LIST ? in_names(list_methods, name)
                                               : in_names(dict_methods, name);
            if (is_method) {
                args a = eval_args(c, f, n, name);
                c->line = n->line;
                return call_method(c, obj, name, &a);
            }
        }
        c->line = n->line;
        if (obj.t == V_UNDEF && n->a->a->kind == E_NAME) rfail(c, "'%s' is undefined", n->a->a->name);
        fn = getattr_v(c, obj, name);
        if (fn.t == V_UNDEF) rfail(c, "'%s' object has no attribute '%s'", type_name(&obj), name);
    } else {
        fn = eval(c, f, n->a);
    }
    args a = eval_args(c, f, n, "call");
    c->line = n->line;
    switch (fn.t) {
    case V_MACRO:
        return call_macro(c, fn.u.m, &a);
    case V_FUNC:
        return call_func(c, fn.u.fn, &a);
    case V_METHOD:
        return call_method(c, fn.u.me->obj, fn.u.me->name, &a);
    case V_UNDEF:
        if (n->a->kind == E_NAME) rfail(c, "'%s' is undefined", n->a->name);
        rfail(c, "cannot call an undefined value");
    default:
        rfail(c, "'%s' object is not callable", type_name(&fn));
    }
}

/* ---- operators ---- */

static val arith(ctx *c, int op, val x, val y) {
    static const char *const opname[] = {"+", "-", "*", "/", "//", "%", "**"};
    if (x.t == V_UNDEF || y.t == V_UNDEF)
        rfail(c, "an undefined value in an arithmetic expression ('%s')", opname[op]);
    if (is_num(&x) && is_num(&y)) {
        bool fl = x.t == V_FLOAT || y.t == V_FLOAT;
        if (op == OP_DIV) {
            if (num_f(&y) == 0) rfail(c, "division by zero");
            return v_float(num_f(&x) / num_f(&y));
        }
        if (fl) {
            double a = num_f(&x), b = num_f(&y);
            switch (op) {
            case OP_ADD:
                return v_float(a + b);
            case OP_SUB:
                return v_float(a - b);
            case OP_MUL:
                return v_float(a * b);
            case OP_FLOORDIV:
                if (b == 0) rfail(c, "float floor division by zero");
                return v_float(floor(a / b));
            case OP_MOD: {
                if (b == 0) rfail(c, "float modulo");
                double m = fmod(a, b);
                if (m != 0 && ((m < 0) != (b < 0))) m += b;
                return v_float(m);
            }
            case OP_POW:
                return v_float(pow(a, b));
            }
        }
        int64_t a = num_i(&x), b = num_i(&y), r;
        switch (op) {
        case OP_ADD:
            if (__builtin_add_overflow(a, b, &r)) break;
            return v_int(r);
        case OP_SUB:
            if (__builtin_sub_overflow(a, b, &r)) break;
            return v_int(r);
        case OP_MUL:
            if (__builtin_mul_overflow(a, b, &r)) break;
            return v_int(r);
        case OP_FLOORDIV:
        case OP_MOD: {
            if (b == 0) rfail(c, "integer division or modulo by zero");
            if (a == INT64_MIN && b == -1) break;
            int64_t q = a / b, m = a % b;
            if (m != 0 && ((m < 0) != (b < 0))) q--, m += b;
            return v_int(op == OP_MOD ? m : q);
        }
        case OP_POW: {
            if (b < 0) return v_float(pow((double)a, (double)b));
            r = 1;
            for (int64_t i = 0; i < b; i++)
                if (__builtin_mul_overflow(r, a, &r)) rfail(c, "integer overflow");
            return v_int(r);
        }
        }
        rfail(c, "integer overflow");
    }
    if (op == OP_ADD && x.t == V_STR && y.t == V_STR) {
        /* Markup + str escapes the str (markupsafe) */
        if (x.safe != y.safe) {
            if (x.safe)
                y = html_escape(c, y);
            else
                x = html_escape(c, x);
        }
        sbuf o = {0};
        sb_add(c, &o, x.u.s.p, x.u.s.n);
        sb_add(c, &o, y.u.s.p, y.u.s.n);
        val r = v_sb(&o);
        r.safe = x.safe;
        return r;
    }
    if (op == OP_ADD && x.t == V_LIST && y.t == V_LIST && x.u.l->kind == y.u.l->kind &&
        (x.u.l->kind == L_LIST || x.u.l->kind == L_TUPLE)) {
        list *l = list_new(c, x.u.l->n + y.u.l->n + 1);
        for (size_t i = 0; i < x.u.l->n; i++)
            list_push(c, l, x.u.l->v[i]);
        for (size_t i = 0; i < y.u.l->n; i++)
            list_push(c, l, y.u.l->v[i]);
        l->kind = x.u.l->kind;
        return v_list(l);
    }
    if (op == OP_MUL && ((x.t == V_STR || x.t == V_LIST) && (y.t == V_INT || y.t == V_BOOL))) {
        int64_t k = num_i(&y);
        if (x.t == V_STR) {
            sbuf o = {0};
            for (int64_t i = 0; i < k; i++)
                sb_add(c, &o, x.u.s.p, x.u.s.n);
            return o.p ? v_sb(&o) : v_str("");
        }
        list *l = list_new(c, 4);
        for (int64_t i = 0; i < k; i++) {
            step(c);
            for (size_t j = 0; j < x.u.l->n; j++)
                list_push(c, l, x.u.l->v[j]);
        }
        return v_list(l);
    }
    if (op == OP_MUL && (y.t == V_STR || y.t == V_LIST) && (x.t == V_INT || x.t == V_BOOL))
        return arith(c, op, y, x);
    if (op == OP_MOD && x.t == V_STR) rfail(c, "printf-style string formatting ('%%') is not supported");
    rfail(c, "unsupported operand type(s) for %s: '%s' and '%s'", opname[op], type_name(&x), type_name(&y));
}

static bool contains(ctx *c, val item, val seq) {
    args a = {.pos = &seq, .npos = 1};
    if (seq.t == V_UNDEF) return false;
    if (seq.t != V_STR && seq.t != V_DICT && seq.t != V_LIST && seq.t != V_NS)
        rfail(c, "argument of type '%s' is not iterable", type_name(&seq));
    if (seq.t == V_NS) return dict_find(seq.u.d, &item) != NULL;
    return run_test(c, "in", item, &a);
}

static val eval(ctx *c, frame *f, const node *n) {
    c->line = n->line;
    switch (n->kind) {
    case E_LIT:
        return n->lit;
    case E_NAME:
        return lookup(c, f, n->name);
    case E_ATTR: {
        val o = eval(c, f, n->a);
        c->line = n->line;
        if (o.t == V_UNDEF && n->a->kind == E_NAME) rfail(c, "'%s' is undefined", n->a->name);
        return getattr_v(c, o, n->name);
    }
    case E_INDEX: {
        val o = eval(c, f, n->a), k = eval(c, f, n->b);
        c->line = n->line;
        if (o.t == V_UNDEF && n->a->kind == E_NAME) rfail(c, "'%s' is undefined", n->a->name);
        val v = getitem_v(c, o, k);
        if (v.t == V_UNDEF && k.t == V_STR && o.t != V_DICT && o.t != V_NS) {
            char *nm = ralloc(c, k.u.s.n + 1);
            memcpy(nm, k.u.s.p, k.u.s.n);
            nm[k.u.s.n] = 0;
            return getattr_v(c, o, nm);
        }
        return v;
    }
    case E_SLICE: {
        val o = eval(c, f, n->filters);
        val a = n->a ? eval(c, f, n->a) : v_none(), b = n->b ? eval(c, f, n->b) : v_none(),
            s = n->c ? eval(c, f, n->c) : v_none();
        c->line = n->line;
        return do_slice(c, o, &a, &b, &s);
    }
    case E_CALL:
        return eval_call(c, f, n);
    case E_FILTER: {
        val x = eval(c, f, n->a);
        args a = eval_args(c, f, n, n->name);
        c->line = n->line;
        return apply_filter(c, n->name, x, &a);
    }
    case E_TEST: {
        val x = eval(c, f, n->a);
        args a = eval_args(c, f, n, n->name);
        c->line = n->line;
        bool r = run_test(c, n->name, x, &a);
        return v_bool(n->op ? !r : r);
    }
    case E_NEG:
    case E_POS: {
        val x = eval(c, f, n->a);
        c->line = n->line;
        if (x.t == V_INT || x.t == V_BOOL) {
            int64_t v = num_i(&x);
            if (n->kind == E_NEG && v == INT64_MIN) rfail(c, "integer overflow");
            return v_int(n->kind == E_NEG ? -v : v);
        }
        if (x.t == V_FLOAT) return v_float(n->kind == E_NEG ? -x.u.f : x.u.f);
        rfail(c, "bad operand type for unary %c: '%s'", n->kind == E_NEG ? '-' : '+', type_name(&x));
    }
    case E_NOT: {
        val x = eval(c, f, n->a);
        return v_bool(!vtrue(&x));
    }
    case E_AND: {
        val x = eval(c, f, n->a);
        return vtrue(&x) ? eval(c, f, n->b) : x;
    }
    case E_OR: {
        val x = eval(c, f, n->a);
        return vtrue(&x) ? x : eval(c, f, n->b);
    }
    case E_BIN: {
        val x = eval(c, f, n->a), y = eval(c, f, n->b);
        c->line = n->line;
        if (n->op == OP_CONCAT) {
            sbuf o = {0};
            to_str(c, &o, &x, false);
            to_str(c, &o, &y, false);
            return o.p ? v_sb(&o) : v_str("");
        }
        return arith(c, n->op, x, y);
    }
    case E_CMP: {
        val x = eval(c, f, n->args.v[0]);
        for (int i = 1; i < n->args.n; i++) {
            val y = eval(c, f, n->args.v[i]);
            c->line = n->line;
            bool r;
            switch (n->ops[i - 1]) {
            case OP_EQ:
                r = veq(&x, &y);
                break;
            case OP_NE:
                r = !veq(&x, &y);
                break;
            case OP_LT:
                r = vcmp(c, &x, &y, "<") < 0;
                break;
            case OP_LE:
                r = vcmp(c, &x, &y, "<=") <= 0;
                break;
            case OP_GT:
                r = vcmp(c, &x, &y, ">") > 0;
                break;
            case OP_GE:
                r = vcmp(c, &x, &y, ">=") >= 0;
                break;
            case OP_IN:
                r = contains(c, x, y);
                break;
            default:
                r = !contains(c, x, y);
                break;
            }
            if (!r) return v_bool(false);
            x = y;
        }
        return v_bool(true);
    }
    case E_COND: {
        val cond = eval(c, f, n->a);
        if (vtrue(&cond)) return eval(c, f, n->b);
        return n->c ? eval(c, f, n->c) : v_undef();
    }
    case E_LIST: {
        list *l = list_new(c, (size_t)n->args.n + 1);
        l->kind = n->op ? L_TUPLE : L_LIST;
        for (int i = 0; i < n->args.n; i++)
            list_push(c, l, eval(c, f, n->args.v[i]));
        return v_list(l);
    }
    case E_DICT: {
        dict *d = dict_new(c);
        for (int i = 0; i < n->args.n; i++) {
            val k = eval(c, f, n->args.v[i]);
            if (k.t == V_LIST || k.t == V_DICT || k.t == V_UNDEF) rfail(c, "unhashable dict key");
            dict_set(c, d, k, eval(c, f, n->kwv.v[i]));
        }
        return v_dict(d);
    }
    default:
        rfail(c, "internal error: not an expression");
    }
}

/* ---- statements ---- */

static val eval_filter_chain(ctx *c, frame *f, const node *chain, const node *ph, val input) {
    if (chain == ph) return input;
    val x = eval_filter_chain(c, f, chain->a, ph, input);
    args a = eval_args(c, f, chain, chain->name);
    c->line = chain->line;
    return apply_filter(c, chain->name, x, &a);
}

static void assign(ctx *c, frame *f, const node *n, val v) {
    if (n->attr) {
        val ns = lookup(c, f, n->name);
        if (ns.t != V_NS) rfail(c, "cannot assign attribute on non-namespace object");
        dict_sets(c, ns.u.d, n->attr, v);
        return;
    }
    if (n->nkw) {
        list *l = iter_list(c, v);
        if ((int)l->n != n->nkw)
            rfail(c,
                  l->n > (size_t)n->nkw ? "too many values to unpack (expected %d)"
                                        : "not enough values to unpack (expected %d)",
                  n->nkw);
        for (int i = 0; i < n->nkw; i++)
            dict_sets(c, f->vars, n->kwn[i], l->v[i]);
        return;
    }
    dict_sets(c, f->vars, n->name, v);
}

static void exec_for(ctx *c, frame *f, const node *n) {
    val it = eval(c, f, n->a);
    c->line = n->line;
    list *src = iter_list(c, it);
    frame *lf = frame_new(c, f);
    list *items = src;
    if (n->b) { /* for x in y if cond: filter first, loop.* counts what is left */
        items = list_new(c, src->n + 1);
        for (size_t i = 0; i < src->n; i++) {
            step(c);
            node tgt = {.name = n->kwn[0], .nkw = n->nkw > 1 ? n->nkw : 0, .kwn = n->kwn};
            assign(c, lf, &tgt, src->v[i]);
            val cond = eval(c, lf, n->b);
            if (vtrue(&cond)) list_push(c, items, src->v[i]);
        }
    } else {
        items = copy_list(c, src); /* the body may not change what it iterates */
    }
    if (!items->n) {
        exec_body(c, f, &n->orelse);
        return;
    }
    loopstate *lp = ralloc(c, sizeof *lp);
    lp->items = items;
    dict_sets(c, lf->vars, "loop", (val){.t = V_LOOP, .u.lp = lp});
    node tgt = {.name = n->kwn[0], .nkw = n->nkw > 1 ? n->nkw : 0, .kwn = n->kwn};
    for (size_t i = 0; i < items->n; i++) {
        step(c);
        lp->index0 = i;
        c->line = n->line;
        assign(c, lf, &tgt, items->v[i]);
        exec_body(c, lf, &n->body);
        if (c->loop_ctl == 1) {
            c->loop_ctl = 0;
            break;
        }
        c->loop_ctl = 0;
    }
}

static void exec_body(ctx *c, frame *f, const nlist *body) {
    for (int i = 0; i < body->n && !c->loop_ctl; i++) {
        const node *n = body->v[i];
        c->line = n->line;
        switch (n->kind) {
        case S_TEXT:
            sb_add(c, c->out, n->lit.u.s.p, n->lit.u.s.n);
            break;
        case S_OUT: {
            val v = eval(c, f, n->a);
            to_str(c, c->out, &v, false);
            break;
        }
        case S_IF: {
            val cond = eval(c, f, n->a);
            exec_body(c, f, vtrue(&cond) ? &n->body : &n->orelse);
            break;
        }
        case S_FOR:
            exec_for(c, f, n);
            break;
        case S_SET:
            assign(c, f, n, eval(c, f, n->a));
            break;
        case S_SETBLOCK:
        case S_FILTERBLOCK: {
            sbuf *saved = c->out;
            sbuf cap = {0};
            c->out = &cap;
            exec_body(c, f, &n->body);
            c->out = saved;
            val v = cap.p ? v_sb(&cap) : v_str("");
            if (n->filters) v = eval_filter_chain(c, f, n->filters, n->c, v);
            if (n->kind == S_SETBLOCK)
                assign(c, f, n, v);
            else
                to_str(c, c->out, &v, false);
            break;
        }
        case S_MACRO: {
            macro *m = ralloc(c, sizeof *m);
            m->def = n;
            m->closure = f;
            dict_sets(c, f->vars, n->name, (val){.t = V_MACRO, .u.m = m});
            break;
        }
        case S_BREAK:
            c->loop_ctl = 1;
            break;
        case S_CONTINUE:
            c->loop_ctl = 2;
            break;
        case S_BLOCK:
            exec_body(c, f, &n->body);
            break;
        default:
            rfail(c, "internal error: not a statement");
        }
    }
}

duet__jinja_result duet__jinja_render(const duet__jinja_template *t, const cJSON *vars,
                                      const duet__jinja_options *opt, char **out, size_t *out_len, char *err,
                                      size_t errlen) {
    *out = NULL;
    if (out_len) *out_len = 0;
    if (err && errlen) err[0] = 0;
    ctx *c = calloc(1, sizeof *c);
    if (!c) return DUET__JINJA_NOMEM;
    c->e.msg = err;
    c->e.msglen = errlen;
    c->max_output = opt && opt->max_output ? opt->max_output : (size_t)16 << 20;
    c->max_steps = opt && opt->max_steps ? opt->max_steps : 10000000;
    c->ar.limit = opt && opt->max_memory ? opt->max_memory : (size_t)256 << 20;
    c->now = opt ? opt->now : -1;
    c->jinja2_tojson = opt && opt->jinja2_tojson;
    if (setjmp(c->e.jb)) {
        duet__jinja_result r = c->e.code;
        arena_free(&c->ar);
        free(c);
        return r;
    }
    frame *globals = frame_new(c, NULL);
    if (vars && cJSON_IsObject(vars))
        for (const cJSON *x = vars->child; x; x = x->next)
            dict_sets(c, globals->vars, x->string, from_cjson(c, x, 0));
    frame *root = frame_new(c, globals);
    sbuf main_out = {0};
    c->out = &main_out;
    exec_body(c, root, &t->body);
    char *r = malloc(main_out.n + 1);
    if (!r) fail_at(&c->e, DUET__JINJA_NOMEM, 0, "out of memory");
    if (main_out.n) memcpy(r, main_out.p, main_out.n);
    r[main_out.n] = 0;
    *out = r;
    if (out_len) *out_len = main_out.n;
    arena_free(&c->ar);
    free(c);
    return DUET__JINJA_OK;
}
