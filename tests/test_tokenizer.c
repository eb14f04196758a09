/* test_tokenizer.c — SPM and byte-level BPE tokenizers against reference ids
 * (llama2.c for stories260K; llama.cpp's / Hugging Face's vocab test vectors),
 * decoding round trips, the streaming detokenizer, special tokens, invalid
 * input, long inputs and the loader's validation.
 */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <time.h>

#include "gguf.h"
#include "test_util.h"
#include "tokenizer.h"

/* ---- helpers ------------------------------------------------------------- */

static duet_tokenizer *load_tok(const char *rel) {
    duet_gguf *g = NULL;
    duet_status st = duet_gguf_open(test_shared_path(rel), &g);
    ck_assert_msg(st == DUET_OK, "opening %s: %s", rel, duet_last_error());
    duet_tokenizer *t = NULL;
    st = duet_tokenizer_load(g, &t);
    ck_assert_msg(st == DUET_OK, "loading the tokenizer of %s: %s", rel, duet_last_error());
    /* The tokenizer must not keep pointers into the file. */
    duet_gguf_close(g);
    return t;
}

/* Encodes into a malloc'd array; *n gets the count. */
static int32_t *encode(const duet_tokenizer *t, const char *s, size_t len, bool add_special,
                       bool parse_special, int *n) {
    int need = duet_tokenizer_encode(t, s, len, add_special, parse_special, NULL, 0);
    ck_assert_msg(need >= 0, "encode failed (%d): %s", need, duet_last_error());
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(need + 1));
    int got = duet_tokenizer_encode(t, s, len, add_special, parse_special, ids, need);
    ck_assert_msg(got == need, "encode returned %d with room, %d without", got, need);
    *n = need;
    return ids;
}

typedef struct buf {
    char *p;
    size_t len, cap;
} buf;

static void buf_add(buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        b->cap = (b->len + n + 1) * 2;
        b->p = realloc(b->p, b->cap);
        ck_assert_ptr_nonnull(b->p);
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

/* Checks that s[0..n) is complete, valid UTF-8. */
static bool valid_utf8(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        unsigned c = p[i];
        size_t need;
        unsigned lo = 0x80, hi = 0xBF;
        if (c < 0x80)
            need = 0;
        else if (c >= 0xC2 && c <= 0xDF)
            need = 1;
        else if (c == 0xE0)
            need = 2, lo = 0xA0;
        else if (c == 0xED)
            need = 2, hi = 0x9F;
        else if (c >= 0xE1 && c <= 0xEF)
            need = 2;
        else if (c == 0xF0)
            need = 3, lo = 0x90;
        else if (c >= 0xF1 && c <= 0xF3)
            need = 3;
        else if (c == 0xF4)
            need = 3, hi = 0x8F;
        else
            return false;
        if (need && i + need >= n) return false;
        for (size_t k = 1; k <= need; k++) {
            if (p[i + k] < lo || p[i + k] > hi) return false;
            lo = 0x80, hi = 0xBF;
        }
        i += need + 1;
    }
    return true;
}

/* Streams ids through the detokenizer; every chunk must be valid UTF-8. */
static buf detok_all(const duet_tokenizer *t, const int32_t *ids, int n, bool strip) {
    duet_detok d;
    duet_detok_init(&d, t, strip);
    buf b = {0};
    buf_add(&b, "", 0);
    char out[256];
    for (int i = 0; i < n; i++) {
        int k = duet_detok_push(&d, ids[i], out, sizeof out);
        ck_assert_msg(k >= 0 && k < (int)sizeof out, "detok_push(%d) returned %d", ids[i], k);
        ck_assert_msg(out[k] == 0, "detok_push output is not NUL-terminated at its length");
        ck_assert_msg(valid_utf8(out, (size_t)k), "detok_push(%d) emitted invalid or partial UTF-8", ids[i]);
        buf_add(&b, out, (size_t)k);
    }
    int k = duet_detok_flush(&d, out, sizeof out);
    ck_assert_int_ge(k, 0);
    buf_add(&b, out, (size_t)k);
    return b;
}

/* Raw bytes of the tokens (token_bytes, no specials). */
static buf raw_bytes(const duet_tokenizer *t, const int32_t *ids, int n) {
    buf b = {0};
    buf_add(&b, "", 0);
    for (int i = 0; i < n; i++) {
        char tmp[1024];
        int k = duet_tokenizer_token_bytes(t, ids[i], false, tmp, sizeof tmp);
        ck_assert_msg(k >= 0 && k <= (int)sizeof tmp, "token_bytes(%d) = %d", ids[i], k);
        buf_add(&b, tmp, (size_t)k);
    }
    return b;
}

static char *ids_str(const int32_t *ids, int n) {
    static char s[8192];
    size_t o = 0;
    s[0] = 0;
    for (int i = 0; i < n && o + 16 < sizeof s; i++)
        o += (size_t)snprintf(s + o, sizeof s - o, " %d", ids[i]);
    return s;
}

/* ---- stories260K vs llama2.c --------------------------------------------- */

START_TEST(test_stories_reference) {
    duet_tokenizer *t = load_tok("models/stories260K.gguf");
    ck_assert_str_eq(duet_tokenizer_model(t), "llama");
    ck_assert_int_eq(duet_tokenizer_n_vocab(t), 512);
    ck_assert_int_eq(duet_tokenizer_bos(t), 1);
    ck_assert_int_eq(duet_tokenizer_eos(t), 2);
    ck_assert_msg(duet_tokenizer_add_bos(t), "llama without add_bos_token must default to adding BOS");
    ck_assert_msg(!duet_tokenizer_add_eos(t), "add_eos must default to false");

    size_t len;
    char *json = test_read_file(test_shared_path("models/reference/stories260K-tokenize.json"), &len);
    ck_assert_msg(json != NULL, "cannot read stories260K-tokenize.json");
    cJSON *root = cJSON_Parse(json);
    ck_assert_msg(cJSON_IsArray(root), "stories260K-tokenize.json is not a JSON array");
    int cases = 0;
    cJSON *e;
    cJSON_ArrayForEach(e, root) {
        const char *text = cJSON_GetStringValue(cJSON_GetObjectItem(e, "text"));
        cJSON *want = cJSON_GetObjectItem(e, "token_ids");
        ck_assert_msg(text && cJSON_IsArray(want), "malformed reference entry");
        int n;
        int32_t *ids = encode(t, text, strlen(text), true, false, &n);
        char got[8192];
        snprintf(got, sizeof got, "%s", ids_str(ids, n));
        int nw = cJSON_GetArraySize(want);
        int32_t w[512];
        ck_assert_int_le(nw, 512);
        for (int i = 0; i < nw; i++)
            w[i] = (int32_t)cJSON_GetArrayItem(want, i)->valuedouble;
        ck_assert_msg(n == nw && memcmp(ids, w, sizeof(int32_t) * (size_t)n) == 0,
                      "stories260K %s:\n  got  %s\n  want %s", text, got, ids_str(w, nw));
        /* Decoding after BOS drops the dummy-prefix space: the text comes back. */
        buf b = detok_all(t, ids, n, true);
        ck_assert_msg(strcmp(b.p, text) == 0, "stories260K detok of '%s' gave '%s'", text, b.p);
        free(b.p);
        free(ids);
        cases++;
    }
    ck_assert_int_eq(cases, 15);
    cJSON_Delete(root);
    free(json);

    /* Empty text: just BOS with specials, nothing without. */
    int n;
    int32_t *ids = encode(t, "", 0, true, false, &n);
    ck_assert_msg(n == 1 && ids[0] == 1, "empty prompt must give [1], got%s", ids_str(ids, n));
    free(ids);
    ids = encode(t, "", 0, false, false, &n);
    ck_assert_int_eq(n, 0);
    free(ids);
    duet_tokenizer_free(t);
}
END_TEST

/* ---- vocab test vectors (.inp / .out) ------------------------------------ */

typedef struct vectors {
    char *inp, *out;
    char *str[64];
    size_t len[64];
    char *line[64];
    int n;
} vectors;

/* .inp: each string ends with "\n__ggml_vocab_test__\n" (llama.cpp's
 * test-tokenizer-0 convention: the newline before the separator line is not
 * part of the string). .out: one line of ids per string. */
static void load_vectors(const char *rel, vectors *v) {
    char path[512];
    snprintf(path, sizeof path, "%s.inp", test_shared_path(rel));
    v->inp = test_read_file(path, NULL);
    snprintf(path, sizeof path, "%s.out", test_shared_path(rel));
    v->out = test_read_file(path, NULL);
    ck_assert_msg(v->inp && v->out, "cannot read the test vectors of %s", rel);
    static const char sep[] = "\n__ggml_vocab_test__\n";
    v->n = 0;
    char *p = v->inp;
    char *q;
    while ((q = strstr(p, sep)) != NULL) {
        ck_assert_int_lt(v->n, 64);
        *q = 0;
        v->str[v->n] = p;
        v->len[v->n] = (size_t)(q - p);
        v->n++;
        p = q + strlen(sep);
    }
    ck_assert_msg(*p == 0, "trailing text after the last separator in %s.inp", rel);
    int lines = 0;
    p = v->out;
    while (*p) {
        q = strchr(p, '\n');
        ck_assert_msg(q != NULL, "unterminated line in %s.out", rel);
        *q = 0;
        ck_assert_int_lt(lines, 64);
        v->line[lines++] = p;
        p = q + 1;
    }
    ck_assert_msg(lines == v->n, "%s: %d strings but %d id lines", rel, v->n, lines);
}

static int parse_ids(const char *line, int32_t *ids, int max) {
    int n = 0;
    char *end;
    for (;;) {
        long v = strtol(line, &end, 10);
        if (end == line) break;
        ck_assert_int_lt(n, max);
        ids[n++] = (int32_t)v;
        line = end;
    }
    return n;
}

/* Encodes every vector of one vocabulary; prints "name: k/n exact" (the
 * listing the test log keeps) and fails if any vector differs. */
static void check_vectors(const char *rel, int expect_n, bool spm) {
    duet_tokenizer *t = load_tok(rel);
    vectors v;
    load_vectors(rel, &v);
    ck_assert_int_eq(v.n, expect_n);
    int failures = 0;
    for (int i = 0; i < v.n; i++) {
        int32_t want[1024];
        int nw = parse_ids(v.line[i], want, 1024);
        int n;
        int32_t *ids = encode(t, v.str[i], v.len[i], false, false, &n);
        if (n != nw || memcmp(ids, want, sizeof(int32_t) * (size_t)n) != 0) {
            char got[8192];
            snprintf(got, sizeof got, "%s", ids_str(ids, n));
            fprintf(stderr, "%s vector %d '%s':\n  got  %s\n  want %s\n", rel, i, v.str[i], got,
                    ids_str(want, nw));
            failures++;
        }
        /* Round trip: byte-level BPE is lossless; SPM without BOS loses only
         * the dummy-prefix space, which strip_leading_space removes. */
        buf b = detok_all(t, ids, n, spm);
        ck_assert_msg(b.len == v.len[i] && memcmp(b.p, v.str[i], b.len) == 0,
                      "%s vector %d: detokenized '%s' != input '%s'", rel, i, b.p, v.str[i]);
        free(b.p);
        buf r = raw_bytes(t, ids, n);
        size_t skip = spm && n > 0 ? 1 : 0;
        ck_assert_msg(r.len == v.len[i] + skip && memcmp(r.p + skip, v.str[i], v.len[i]) == 0 &&
                          (!skip || r.p[0] == ' '),
                      "%s vector %d: token_bytes concatenation differs from the input", rel, i);
        free(r.p);
        free(ids);
    }
    printf("vocab %-40s %2d/%2d vectors exact\n", rel, v.n - failures, v.n);
    fflush(stdout);
    ck_assert_msg(failures == 0, "%s: %d of %d vectors differ (see stderr)", rel, failures, v.n);
    free(v.inp);
    free(v.out);
    duet_tokenizer_free(t);
}

START_TEST(test_vectors_llama_spm) {
    check_vectors("models/ggml-vocab-llama-spm.gguf", 46, true);
}
END_TEST

START_TEST(test_vectors_gpt2) {
    check_vectors("models/ggml-vocab-gpt-2.gguf", 46, false);
}
END_TEST

START_TEST(test_vectors_command_r) {
    check_vectors("models/ggml-vocab-command-r.gguf", 46, false);
}
END_TEST

START_TEST(test_vectors_deepseek_coder) {
    check_vectors("models/ggml-vocab-deepseek-coder.gguf", 46, false);
}
END_TEST

START_TEST(test_vectors_deepseek_llm) {
    check_vectors("models/ggml-vocab-deepseek-llm.gguf", 46, false);
}
END_TEST

START_TEST(test_vectors_llama_bpe) {
    check_vectors("models/ggml-vocab-llama-bpe.gguf", 46, false);
}
END_TEST

START_TEST(test_vectors_qwen2) {
    check_vectors("models/ggml-vocab-qwen2.gguf", 46, false);
}
END_TEST

START_TEST(test_vectors_qwen35) {
    check_vectors("models/ggml-vocab-qwen35.gguf", 50, false);
}
END_TEST

/* ---- metadata, decoding of single tokens ---------------------------------- */

START_TEST(test_metadata_and_pieces) {
    duet_tokenizer *t = load_tok("models/ggml-vocab-gpt-2.gguf");
    ck_assert_str_eq(duet_tokenizer_model(t), "gpt2");
    ck_assert_int_eq(duet_tokenizer_n_vocab(t), 50257);
    ck_assert_msg(!duet_tokenizer_add_bos(t) && !duet_tokenizer_add_eos(t), "gpt2 defaults to no BOS/EOS");
    ck_assert_int_eq(duet_tokenizer_eos(t), 50256);
    ck_assert_msg(duet_tokenizer_is_eog(t, 50256), "<|endoftext|> ends generation");
    ck_assert_msg(!duet_tokenizer_is_eog(t, 0) && !duet_tokenizer_is_eog(t, -1) &&
                      !duet_tokenizer_is_eog(t, 50257),
                  "is_eog of ordinary or bad ids must be false");
    ck_assert_int_eq(duet_tokenizer_token_type(t, 50256), DUET_TOKEN_CONTROL);
    ck_assert_str_eq(duet_tokenizer_piece(t, 50256), "<|endoftext|>");
    ck_assert_ptr_null(duet_tokenizer_piece(t, 50257));
    ck_assert_ptr_null(duet_tokenizer_piece(t, -5));
    char b[64];
    /* 11751 is "Ġhello" -> " hello"? find it by encoding instead. */
    int n;
    int32_t *ids = encode(t, " hello", 6, false, false, &n);
    ck_assert_int_eq(n, 1);
    ck_assert_str_eq(duet_tokenizer_piece(t, ids[0]), "\xc4\xa0hello");
    ck_assert_int_eq(duet_tokenizer_token_bytes(t, ids[0], false, b, sizeof b), 6);
    ck_assert_str_eq(b, " hello");
    free(ids);
    /* Control tokens render only on request; a short buffer is never overrun. */
    ck_assert_int_eq(duet_tokenizer_token_bytes(t, 50256, false, b, sizeof b), 0);
    ck_assert_int_eq(duet_tokenizer_token_bytes(t, 50256, true, b, sizeof b), 13);
    ck_assert_str_eq(b, "<|endoftext|>");
    memset(b, 'x', sizeof b);
    ck_assert_int_eq(duet_tokenizer_token_bytes(t, 50256, true, b, 4), 13);
    ck_assert_msg(memcmp(b, "<|en", 4) == 0 && b[4] == 'x', "token_bytes wrote past size");
    ck_assert_int_lt(duet_tokenizer_token_bytes(t, 50257, true, b, sizeof b), 0);
    duet_tokenizer_free(t);

    t = load_tok("models/stories260K.gguf");
    ck_assert_int_eq(duet_tokenizer_token_type(t, 0), DUET_TOKEN_UNKNOWN);
    ck_assert_int_eq(duet_tokenizer_token_type(t, 1), DUET_TOKEN_CONTROL);
    ck_assert_int_eq(duet_tokenizer_token_type(t, 3 + 0x41), DUET_TOKEN_BYTE);
    ck_assert_int_eq(duet_tokenizer_token_bytes(t, 3 + 0x41, false, b, sizeof b), 1);
    ck_assert_int_eq(b[0], 'A');
    ck_assert_int_eq(duet_tokenizer_token_bytes(t, 410, false, b, sizeof b), 1); /* "▁" */
    ck_assert_str_eq(b, " ");
    ck_assert_int_eq(duet_tokenizer_token_bytes(t, 1, false, b, sizeof b), 0);
    ck_assert_int_eq(duet_tokenizer_token_bytes(t, 1, true, b, sizeof b), 3);
    ck_assert_str_eq(b, "<s>");
    ck_assert_msg(duet_tokenizer_is_eog(t, 2) && !duet_tokenizer_is_eog(t, 1),
                  "EOS (and not BOS) ends generation");
    duet_tokenizer_free(t);

    t = load_tok("models/ggml-vocab-deepseek-coder.gguf");
    ck_assert_msg(duet_tokenizer_add_bos(t), "deepseek-coder's metadata sets add_bos");
    ck_assert_int_eq(duet_tokenizer_bos(t), 32013);
    ck_assert_msg(duet_tokenizer_is_eog(t, 32014), "deepseek EOS ends generation");
    ck_assert_msg(duet_tokenizer_is_eog(t, 32021), "<|EOT|> ends generation");
    ck_assert_msg(!duet_tokenizer_is_eog(t, 32019), "<|User|> does not end generation");
    ids = encode(t, "hi", 2, true, false, &n);
    ck_assert_msg(n == 2 && ids[0] == 32013, "add_special puts deepseek's BOS first, got%s", ids_str(ids, n));
    free(ids);
    duet_tokenizer_free(t);
}
END_TEST

/* Every single token fits the 256-byte buffer the header promises. */
START_TEST(test_detok_every_token_fits) {
    static const char *const files[] = {"models/stories260K.gguf", "models/ggml-vocab-llama-spm.gguf",
                                        "models/ggml-vocab-gpt-2.gguf",
                                        "models/ggml-vocab-deepseek-coder.gguf"};
    for (size_t f = 0; f < 4; f++) {
        duet_tokenizer *t = load_tok(files[f]);
        for (int32_t id = 0; id < duet_tokenizer_n_vocab(t); id++) {
            duet_detok d;
            duet_detok_init(&d, t, false);
            char out[256];
            int k = duet_detok_push(&d, id, out, sizeof out);
            ck_assert_msg(k >= 0 && k < 256, "%s token %d needs %d bytes", files[f], id, k);
            ck_assert_msg(valid_utf8(out, (size_t)k), "%s token %d: invalid UTF-8 out", files[f], id);
            k = duet_detok_flush(&d, out, sizeof out);
            ck_assert_msg(k == 0 || (k == 3 && memcmp(out, "\xef\xbf\xbd", 3) == 0),
                          "%s token %d: flush gave %d bytes", files[f], id, k);
        }
        duet_tokenizer_free(t);
    }
}
END_TEST

/* ---- streaming detokenizer ------------------------------------------------ */

START_TEST(test_detok_streaming_emoji) {
    duet_tokenizer *t = load_tok("models/stories260K.gguf");
    const char *text = "emoji \xf0\x9f\xa6\x99!";
    int n;
    int32_t *ids = encode(t, text, strlen(text), true, false, &n);
    /* llama2.c: [1, 344, 423, 414, 449, 417, 410, 243, 162, 169, 156, 443]. */
    ck_assert_int_eq(n, 12);
    duet_detok d;
    duet_detok_init(&d, t, true);
    char out[256];
    buf b = {0};
    buf_add(&b, "", 0);
    for (int i = 0; i < n; i++) {
        int k = duet_detok_push(&d, ids[i], out, sizeof out);
        ck_assert_int_ge(k, 0);
        if (i >= 7 && i <= 9)
            ck_assert_msg(k == 0,
                          "byte token %d of the emoji emitted %d bytes before the character completed", i, k);
        if (i == 10)
            ck_assert_msg(k == 4 && memcmp(out, "\xf0\x9f\xa6\x99", 4) == 0,
                          "the emoji's last byte must emit it");
        ck_assert_msg(valid_utf8(out, (size_t)k), "partial UTF-8 emitted at token %d", i);
        buf_add(&b, out, (size_t)k);
    }
    ck_assert_int_eq(duet_detok_flush(&d, out, sizeof out), 0);
    ck_assert_str_eq(b.p, text);
    free(b.p);

    /* Without stripping, the dummy-prefix space stays. */
    b = detok_all(t, ids, n, false);
    ck_assert_str_eq(b.p, " emoji \xf0\x9f\xa6\x99!");
    free(b.p);
    free(ids);

    /* Invalid sequences become U+FFFD instead of being held. Byte token of
     * byte x is id x + 3 in this vocabulary. */
    int32_t seq[] = {3 + 0xE2, 3 + 0x82, 3 + 'a', 3 + 0xFF, 3 + 0xF0, 3 + 0x9F};
    duet_detok_init(&d, t, false);
    b = (buf){0};
    buf_add(&b, "", 0);
    for (int i = 0; i < 6; i++) {
        int k = duet_detok_push(&d, seq[i], out, sizeof out);
        ck_assert_msg(valid_utf8(out, (size_t)k), "partial UTF-8 emitted");
        buf_add(&b, out, (size_t)k);
    }
    ck_assert_str_eq(b.p, "\xef\xbf\xbd"
                          "a"
                          "\xef\xbf\xbd");
    /* The incomplete F0 9F is flushed as one replacement character. */
    int k = duet_detok_flush(&d, out, sizeof out);
    ck_assert_int_eq(k, 3);
    ck_assert_str_eq(out, "\xef\xbf\xbd");
    ck_assert_int_eq(duet_detok_flush(&d, out, sizeof out), 0);
    free(b.p);

    /* A bad id is an error, not a crash. */
    ck_assert_int_lt(duet_detok_push(&d, 512, out, sizeof out), 0);
    ck_assert_int_lt(duet_detok_push(&d, -1, out, sizeof out), 0);
    duet_tokenizer_free(t);
}
END_TEST

START_TEST(test_detok_bpe_split_character) {
    /* GPT-2 has no token for "🦙": it comes out as partial-character byte
     * tokens that the detokenizer must join. */
    duet_tokenizer *t = load_tok("models/ggml-vocab-gpt-2.gguf");
    const char *text = "llama \xf0\x9f\xa6\x99\xf0\x9f\xa6\x99 \xe6\x97\xa5\xe6\x9c\xac";
    int n;
    int32_t *ids = encode(t, text, strlen(text), false, false, &n);
    buf b = detok_all(t, ids, n, false);
    ck_assert_str_eq(b.p, text);
    free(b.p);
    free(ids);
    duet_tokenizer_free(t);
}
END_TEST

/* ---- special tokens ------------------------------------------------------- */

static bool contains(const int32_t *ids, int n, int32_t id) {
    for (int i = 0; i < n; i++)
        if (ids[i] == id) return true;
    return false;
}

START_TEST(test_special_tokens) {
    duet_tokenizer *t = load_tok("models/stories260K.gguf");
    int n, nh;
    int32_t *hello = encode(t, "Hello", 5, false, false, &nh);
    const char *s = "<s>Hello</s>";
    int32_t *ids = encode(t, s, strlen(s), false, true, &n);
    /* [BOS] + "▁Hello" (the fragment after a special gets the dummy prefix) + [EOS]. */
    ck_assert_msg(n == nh + 2 && ids[0] == 1 && ids[n - 1] == 2 &&
                      memcmp(ids + 1, hello, sizeof(int32_t) * (size_t)nh) == 0,
                  "parse_special '<s>Hello</s>' gave%s", ids_str(ids, n));
    free(ids);
    ids = encode(t, s, strlen(s), false, false, &n);
    ck_assert_msg(!contains(ids, n, 1) && !contains(ids, n, 2), "without parse_special, '<s>' is text:%s",
                  ids_str(ids, n));
    buf b = detok_all(t, ids, n, true);
    ck_assert_str_eq(b.p, s);
    free(b.p);
    free(ids);
    free(hello);
    /* With add_special and an explicit <s>, both BOS are kept. */
    ids = encode(t, "<s>", 3, true, true, &n);
    ck_assert_msg(n == 2 && ids[0] == 1 && ids[1] == 1, "'<s>' with add_special+parse_special:%s",
                  ids_str(ids, n));
    free(ids);
    duet_tokenizer_free(t);

    t = load_tok("models/ggml-vocab-gpt-2.gguf");
    s = "a<|endoftext|>b<|endoftext|";
    ids = encode(t, s, strlen(s), false, true, &n);
    ck_assert_msg(n >= 3 && ids[1] == 50256 && !contains(ids + 2, n - 2, 50256), "gpt2 parse_special: got%s",
                  ids_str(ids, n));
    free(ids);
    ids = encode(t, s, strlen(s), false, false, &n);
    ck_assert_msg(!contains(ids, n, 50256), "gpt2 without parse_special must not emit <|endoftext|>");
    b = detok_all(t, ids, n, false);
    ck_assert_str_eq(b.p, s);
    free(b.p);
    free(ids);
    duet_tokenizer_free(t);

    /* deepseek-coder: user-defined tokens match even without parse_special,
     * control tokens only with it; the longest match wins. */
    t = load_tok("models/ggml-vocab-deepseek-coder.gguf");
    s = "x<|EOT|>y<\xef\xbd\x9c"
        "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
    ids = encode(t, s, strlen(s), false, false, &n);
    ck_assert_msg(contains(ids, n, 32021) && !contains(ids, n, 32014), "deepseek without parse_special:%s",
                  ids_str(ids, n));
    free(ids);
    ids = encode(t, s, strlen(s), false, true, &n);
    ck_assert_msg(contains(ids, n, 32021) && ids[n - 1] == 32014, "deepseek with parse_special:%s",
                  ids_str(ids, n));
    free(ids);
    duet_tokenizer_free(t);
}
END_TEST

/* ---- invalid input, NULs, output-size semantics --------------------------- */

START_TEST(test_invalid_utf8_and_nul) {
    /* Truncated and overlong sequences, surrogates, stray continuations, NULs. */
    static const char junk[] = "\x00"
                               "abc\xc3(\xe2\x82\xf0\x9f\x98 \x80\x80\xed\xa0\x80 \xf4\x90\x80\x80 z\x00\xc3";
    /* Also bytes that never occur in UTF-8 (C0, C1, F5..FF). DeepSeek-Coder has
     * no normal token for them: only user-defined tokens whose text is their
     * byte-level character, which decode as that text (as in llama.cpp), so
     * they cannot round-trip there. */
    static const char junk2[] = "\xff\xfe\xc0\xc1\xf5 x\xf8";
    static const char *const files[] = {
        "models/stories260K.gguf",          "models/ggml-vocab-llama-spm.gguf",
        "models/ggml-vocab-gpt-2.gguf",     "models/ggml-vocab-deepseek-coder.gguf",
        "models/ggml-vocab-llama-bpe.gguf", "models/ggml-vocab-deepseek-llm.gguf"};
    for (int f = 0; f < 6; f++) {
        bool spm = f < 2;
        /* DeepSeek-LLM's vocabulary has the same user-defined tokens. */
        bool lossy_junk2 = f == 3 || f == 5;
        duet_tokenizer *t = load_tok(files[f]);
        for (int c = 0; c < 4; c++) {
            const char *in = c & 1 ? junk2 : junk;
            size_t len = c & 1 ? sizeof junk2 - 1 : sizeof junk - 1;
            bool ps = c >= 2;
            int n;
            int32_t *ids = encode(t, in, len, false, ps, &n);
            ck_assert_int_gt(n, 0);
            for (int i = 0; i < n; i++)
                ck_assert_msg(ids[i] >= 0 && ids[i] < duet_tokenizer_n_vocab(t), "%s: id %d out of range",
                              files[f], ids[i]);
            /* Byte fallback / byte-level BPE keep every byte. */
            buf r = raw_bytes(t, ids, n);
            size_t skip = spm ? 1 : 0;
            if (!lossy_junk2 || in == junk)
                ck_assert_msg(r.len == len + skip && memcmp(r.p + skip, in, len) == 0,
                              "%s: invalid UTF-8 input %d did not survive encode+decode", files[f], c);
            free(r.p);
            /* Streaming never emits invalid UTF-8. */
            buf b = detok_all(t, ids, n, spm);
            ck_assert_msg(valid_utf8(b.p, b.len), "%s: detok emitted invalid UTF-8", files[f]);
            free(b.p);
            free(ids);
        }
        duet_tokenizer_free(t);
    }
}
END_TEST

START_TEST(test_output_capacity) {
    duet_tokenizer *t = load_tok("models/stories260K.gguf");
    const char *s = "Once upon a time";
    int32_t ids[8] = {-7, -7, -7, -7, -7, -7, -7, -7};
    int need = duet_tokenizer_encode(t, s, strlen(s), true, false, ids, 3);
    ck_assert_int_eq(need, 5);
    ck_assert_msg(ids[0] == 1 && ids[1] == 403 && ids[2] == 407 && ids[3] == -7,
                  "encode must write the first max ids and nothing more");
    ck_assert_int_eq(duet_tokenizer_encode(t, s, strlen(s), true, false, NULL, 0), 5);
    ck_assert_int_lt(duet_tokenizer_encode(t, NULL, 5, true, false, ids, 8), 0);
    ck_assert_int_lt(duet_tokenizer_encode(t, s, 3, true, false, ids, -1), 0);
    ck_assert_int_eq(duet_tokenizer_encode(t, NULL, 0, true, false, ids, 8), 1);
    duet_tokenizer_free(t);
}
END_TEST

/* ---- long inputs ---------------------------------------------------------- */

static char *make_text(size_t target, size_t *len) {
    static const char *const words[] = {
        "the ",         "quick ",  "brown  ",          "fox\n", "\xe6\x97\xa5\xe6\x9c\xac ",
        "caf\xc3\xa9 ", "123456 ", "\xf0\x9f\xa6\x99", "!!! ",  "\t  ",
        "don't ",       "Hello, ", "<|endoftext|>",    "x=1; ", "    "};
    char *s = malloc(target + 64);
    size_t n = 0;
    uint32_t r = 12345;
    while (n < target) {
        r = r * 1103515245u + 12345u;
        const char *w = words[(r >> 16) % (sizeof words / sizeof words[0])];
        size_t l = strlen(w);
        memcpy(s + n, w, l);
        n += l;
    }
    s[n] = 0;
    *len = n;
    return s;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

START_TEST(test_long_inputs) {
    static const char *const files[] = {"models/stories260K.gguf", "models/ggml-vocab-llama-spm.gguf",
                                        "models/ggml-vocab-gpt-2.gguf",
                                        "models/ggml-vocab-deepseek-coder.gguf"};
    size_t len;
    char *text = make_text(100000, &len);
    /* Degenerate inputs that make naive merging or backtracking quadratic. */
    size_t dl = 100000;
    char *spaces = malloc(dl + 1), *letters = malloc(dl + 1), *newlines = malloc(dl + 1);
    memset(spaces, ' ', dl), spaces[dl - 1] = 'x';
    memset(letters, 'a', dl);
    memset(newlines, '\n', dl);
    for (int f = 0; f < 4; f++) {
        bool spm = f < 2;
        duet_tokenizer *t = load_tok(files[f]);
        const char *inputs[] = {text, spaces, letters, newlines};
        size_t lens[] = {len, dl, dl, dl};
        for (int i = 0; i < 4; i++) {
            double t0 = now_s();
            int n;
            int32_t *ids = encode(t, inputs[i], lens[i], false, false, &n);
            double dt = now_s() - t0;
            ck_assert_int_gt(n, 0);
            buf r = raw_bytes(t, ids, n);
            size_t skip = spm ? 1 : 0;
            ck_assert_msg(r.len == lens[i] + skip && memcmp(r.p + skip, inputs[i], lens[i]) == 0,
                          "%s: long input %d does not round-trip", files[f], i);
            fprintf(stderr, "%s input %d: %zu bytes -> %d tokens in %.3f s\n", files[f], i, lens[i], n, dt);
            free(r.p);
            free(ids);
        }
        duet_tokenizer_free(t);
    }
    free(spaces);
    free(letters);
    free(newlines);
    free(text);
}
END_TEST

/* ---- loader validation ---------------------------------------------------- */

/* Writes a synthetic vocab-only GGUF and loads it; returns the status. */
typedef void (*setup_fn)(duet_gguf_writer *w);

static duet_status load_synthetic(setup_fn setup, duet_tokenizer **out) {
    char path[512];
    snprintf(path, sizeof path, "%s/tok_synthetic_%d.gguf", DUET_BINARY_DIR, (int)getpid());
    duet_gguf_writer *w = duet_gguf_writer_new();
    ck_assert_ptr_nonnull(w);
    setup(w);
    ck_assert_int_eq(duet_gguf_write(w, path), DUET_OK);
    duet_gguf_writer_free(w);
    duet_gguf *g = NULL;
    ck_assert_msg(duet_gguf_open(path, &g) == DUET_OK, "reopening the synthetic file: %s", duet_last_error());
    duet_tokenizer *t = NULL;
    duet_status st = duet_tokenizer_load(g, &t);
    duet_gguf_close(g);
    unlink(path);
    if (out)
        *out = t;
    else
        duet_tokenizer_free(t);
    return st;
}

/* A tiny byte-level vocabulary: the 256 byte characters, "ab", "abc". */
static const char *bpe_tokens[261];
static char bpe_store[256][4];

static void bpe_base(duet_gguf_writer *w, const char *const *merges, int n_merges) {
    int n = 0;
    for (int b = 0; b < 256; b++) {
        /* GPT-2's alphabet, computed independently of the library. */
        int cp = b;
        if (!((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) {
            int k = 0;
            for (int i = 0; i < b; i++)
                if (!((i >= 0x21 && i <= 0x7E) || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE)) k++;
            cp = 0x100 + k;
        }
        char *o = bpe_store[b];
        if (cp < 0x80) {
            o[0] = (char)cp, o[1] = 0;
        } else {
            o[0] = (char)(0xC0 | (cp >> 6)), o[1] = (char)(0x80 | (cp & 0x3F)), o[2] = 0;
        }
        bpe_tokens[n++] = o;
    }
    bpe_tokens[n++] = "ab";
    bpe_tokens[n++] = "abc";
    bpe_tokens[n++] = "<|end|>";
    bpe_tokens[n++] = "12";
    bpe_tokens[n++] = "123";
    duet_gguf_set_str(w, "tokenizer.ggml.model", "gpt2");
    duet_gguf_set_str(w, "tokenizer.ggml.pre", "gpt-2");
    duet_gguf_set_str_array(w, "tokenizer.ggml.tokens", bpe_tokens, (uint64_t)n);
    int32_t types[261];
    for (int i = 0; i < n; i++)
        types[i] = DUET_TOKEN_NORMAL;
    types[258] = DUET_TOKEN_CONTROL;
    duet_gguf_set_array(w, "tokenizer.ggml.token_type", DUET_GGUF_INT32, types, (uint64_t)n);
    if (merges) duet_gguf_set_str_array(w, "tokenizer.ggml.merges", merges, (uint64_t)n_merges);
}

static void s_bpe_ok(duet_gguf_writer *w) {
    /* "q z" names pieces that exist but whose concatenation does not; "x yy"
     * names a missing piece: both are skipped. */
    static const char *const m[] = {"q z", "x yy", "a b", "ab c"};
    bpe_base(w, m, 4);
    duet_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 258);
}
static void s_bpe_no_merges(duet_gguf_writer *w) {
    bpe_base(w, NULL, 0);
}

/* Digits: merges "1 2" -> "12" and "12 3" -> "123" (ids 259, 260); each
 * pre-tokenizer splits "12341234" differently. */
static const char *digits_pre;
static void s_bpe_digits(duet_gguf_writer *w) {
    static const char *const m[] = {"1 2", "12 3"};
    bpe_base(w, m, 2);
    duet_gguf_set_str(w, "tokenizer.ggml.pre", digits_pre);
}
static void s_bpe_bad_merge(duet_gguf_writer *w) {
    static const char *const m[] = {"a b", "abc"};
    bpe_base(w, m, 2);
}
static void s_bpe_bad_pre(duet_gguf_writer *w) {
    static const char *const m[] = {"a b"};
    bpe_base(w, m, 1);
    duet_gguf_set_str(w, "tokenizer.ggml.pre", "no-such-pre");
}
static void s_no_model(duet_gguf_writer *w) {
    static const char *const toks[] = {"a"};
    duet_gguf_set_str_array(w, "tokenizer.ggml.tokens", toks, 1);
}
static void s_bert(duet_gguf_writer *w) {
    static const char *const toks[] = {"a"};
    duet_gguf_set_str(w, "tokenizer.ggml.model", "bert");
    duet_gguf_set_str_array(w, "tokenizer.ggml.tokens", toks, 1);
}
static void s_empty(duet_gguf_writer *w) {
    duet_gguf_set_str(w, "tokenizer.ggml.model", "llama");
    duet_gguf_set_str_array(w, "tokenizer.ggml.tokens", NULL, 0);
}
static void s_no_tokens(duet_gguf_writer *w) {
    duet_gguf_set_str(w, "tokenizer.ggml.model", "llama");
}

static const char *const spm_toks[] = {"<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "ab"};
static const float spm_scores[] = {0, 0, 0, -1, -2, -3, -4, -1.5f, -6};
static const int32_t spm_types[] = {2, 3, 3, 1, 1, 1, 1, 1, 1};

static void spm_base(duet_gguf_writer *w) {
    duet_gguf_set_str(w, "tokenizer.ggml.model", "llama");
    duet_gguf_set_str_array(w, "tokenizer.ggml.tokens", spm_toks, 9);
    duet_gguf_set_array(w, "tokenizer.ggml.scores", DUET_GGUF_FLOAT32, spm_scores, 9);
    duet_gguf_set_array(w, "tokenizer.ggml.token_type", DUET_GGUF_INT32, spm_types, 9);
    duet_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    duet_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    duet_gguf_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
}
static void s_spm_ok(duet_gguf_writer *w) {
    spm_base(w);
}
static void s_spm_scores_short(duet_gguf_writer *w) {
    spm_base(w);
    duet_gguf_set_array(w, "tokenizer.ggml.scores", DUET_GGUF_FLOAT32, spm_scores, 8);
}
static void s_spm_types_bad(duet_gguf_writer *w) {
    spm_base(w);
    int32_t ty[9];
    memcpy(ty, spm_types, sizeof ty);
    ty[4] = 42;
    duet_gguf_set_array(w, "tokenizer.ggml.token_type", DUET_GGUF_INT32, ty, 9);
}
static void s_spm_bos_range(duet_gguf_writer *w) {
    spm_base(w);
    duet_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 9);
}
static void s_spm_bos_none(duet_gguf_writer *w) {
    spm_base(w);
    duet_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 0xFFFFFFFFu);
}
static void s_spm_tokens_not_strings(duet_gguf_writer *w) {
    spm_base(w);
    duet_gguf_set_array(w, "tokenizer.ggml.tokens", DUET_GGUF_INT32, spm_types, 9);
}
static void s_spm_no_prefix(duet_gguf_writer *w) {
    spm_base(w);
    duet_gguf_set_bool(w, "tokenizer.ggml.add_space_prefix", false);
    duet_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", false);
}

START_TEST(test_loader_validation) {
    duet_tokenizer *t = NULL;
    ck_assert_int_eq(load_synthetic(s_no_model, NULL), DUET_BAD_MODEL);
    ck_assert_int_eq(load_synthetic(s_bert, NULL), DUET_UNSUPPORTED);
    ck_assert_int_eq(load_synthetic(s_empty, NULL), DUET_BAD_MODEL);
    ck_assert_int_eq(load_synthetic(s_no_tokens, NULL), DUET_BAD_MODEL);
    ck_assert_int_eq(load_synthetic(s_spm_scores_short, NULL), DUET_BAD_MODEL);
    ck_assert_int_eq(load_synthetic(s_spm_types_bad, NULL), DUET_BAD_MODEL);
    ck_assert_int_eq(load_synthetic(s_spm_bos_range, NULL), DUET_BAD_MODEL);
    ck_assert_int_eq(load_synthetic(s_spm_tokens_not_strings, NULL), DUET_BAD_MODEL);
    ck_assert_int_eq(load_synthetic(s_bpe_no_merges, NULL), DUET_BAD_MODEL);
    ck_assert_int_eq(load_synthetic(s_bpe_bad_merge, NULL), DUET_BAD_MODEL);
    ck_assert_int_eq(load_synthetic(s_bpe_bad_pre, NULL), DUET_UNSUPPORTED);
    ck_assert_msg(strlen(duet_last_error()) > 0, "a failed load must leave a message");

    /* SPM: duplicate "ab" (ids 7 and 8) resolves to the first. */
    ck_assert_int_eq(load_synthetic(s_spm_ok, &t), DUET_OK);
    int n;
    int32_t *ids = encode(t, "a ab", 4, true, false, &n);
    /* "▁a▁ab": "ab" (-1.5) merges before either "▁a" (-4); then the leftmost
     * "▁a"; "▁ab" is not a piece: [BOS, ▁a, ▁, ab]. */
    ck_assert_msg(n == 4 && ids[0] == 1 && ids[1] == 6 && ids[2] == 3 && ids[3] == 7, "synthetic SPM gave%s",
                  ids_str(ids, n));
    free(ids);
    /* "c" is not in the vocabulary and there are no byte tokens: <unk>. */
    ids = encode(t, "c", 1, false, false, &n);
    ck_assert_msg(n == 2 && ids[0] == 3 && ids[1] == 0, "unknown char without byte tokens:%s",
                  ids_str(ids, n));
    free(ids);
    duet_tokenizer_free(t);

    ck_assert_int_eq(load_synthetic(s_spm_bos_none, &t), DUET_OK);
    ck_assert_int_eq(duet_tokenizer_bos(t), -1);
    ck_assert_msg(!duet_tokenizer_add_bos(t), "no BOS id: the default add_bos is dropped");
    duet_tokenizer_free(t);

    ck_assert_int_eq(load_synthetic(s_spm_no_prefix, &t), DUET_OK);
    ids = encode(t, "ab", 2, true, false, &n);
    ck_assert_msg(n == 1 && ids[0] == 7, "add_space_prefix=false, add_bos=false gave%s", ids_str(ids, n));
    free(ids);
    duet_tokenizer_free(t);

    /* BPE: the skipped merges do not apply; "a b" then "ab c" do. */
    ck_assert_int_eq(load_synthetic(s_bpe_ok, &t), DUET_OK);
    ids = encode(t, "abcab", 5, false, false, &n);
    ck_assert_msg(n == 2 && ids[0] == 257 && ids[1] == 256, "synthetic BPE gave%s", ids_str(ids, n));
    free(ids);
    ck_assert_msg(duet_tokenizer_is_eog(t, 258), "<|end|> as a control token ends generation");
    duet_tokenizer_free(t);

    /* GPT-2 keeps digit runs whole, Llama 3 cuts them in threes, Qwen2 and
     * DeepSeek-Coder into single digits. '1' is byte 0x31 = id 0x31. */
    static const struct {
        const char *pre;
        int n;
        int32_t ids[8];
    } digit_cases[] = {
        {"gpt-2", 4, {260, '4', 260, '4'}},
        /* llama.cpp's default (no tokenizer.ggml.pre) ends with [0-9]{3}. */
        {"default", 5, {260, '4', 259, '3', '4'}},
        {"kimi-k2", 5, {260, '4', 259, '3', '4'}},
        /* Groups of three from the right: 12 341 234. */
        {"superbpe", 7, {259, '3', '4', '1', '2', '3', '4'}},
        {"tiny_aya", 7, {259, '3', '4', '1', '2', '3', '4'}},
        {"afmoe", 7, {259, '3', '4', '1', '2', '3', '4'}},
        {"llama-bpe", 5, {260, '4', 259, '3', '4'}},
        {"llama3", 5, {260, '4', 259, '3', '4'}},
        {"qwen2", 8, {'1', '2', '3', '4', '1', '2', '3', '4'}},
        {"deepseek-coder", 8, {'1', '2', '3', '4', '1', '2', '3', '4'}},
    };
    for (size_t c = 0; c < sizeof digit_cases / sizeof digit_cases[0]; c++) {
        digits_pre = digit_cases[c].pre;
        ck_assert_msg(load_synthetic(s_bpe_digits, &t) == DUET_OK, "pre '%s': %s", digits_pre,
                      duet_last_error());
        ids = encode(t, "12341234", 8, false, false, &n);
        ck_assert_msg(n == digit_cases[c].n &&
                          memcmp(ids, digit_cases[c].ids, sizeof(int32_t) * (size_t)n) == 0,
                      "pre '%s' on 12341234 gave%s", digits_pre, ids_str(ids, n));
        free(ids);
        duet_tokenizer_free(t);
    }
}
END_TEST

/* Every tokenizer.ggml.pre name llama.cpp (commit 0c1e570) accepts for BPE,
 * written out here independently of the library's table. */
static const char *const LLAMA_CPP_PRE_NAMES[] = {
    "default",
    "minicpm5",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "spark2_5",
    "youtu",
    "falcon",
    "mpt",
    "starcoder",
    "gpt-2",
    "phi-2",
    "jina-es",
    "jina-de",
    "gigachat",
    "jina-v2-es",
    "jina-v2-de",
    "a.x-4.0",
    "mellum",
    "modern-bert",
    "jais-2",
    "gemma4",
    "granite-embed-multi-311m",
    "sarvam-moe",
    "jina-v1-en",
    "jina-v2-code",
    "roberta-bpe",
    "whitespace",
    "refact",
    "command-r",
    "qwen2",
    "deepseek-r1-qwen",
    "kormo",
    "f2llmv2",
    "qwen35",
    "stablelm2",
    "olmo",
    "dbrx",
    "smaug-bpe",
    "poro-chat",
    "chatglm-bpe",
    "glm4",
    "glm5",
    "viking",
    "jais",
    "tekken",
    "smollm",
    "codeshell",
    "bloom",
    "gpt3-finnish",
    "exaone",
    "exaone4",
    "exaone-moe",
    "chameleon",
    "minerva-7b",
    "megrez",
    "gpt-4o",
    "llama4",
    "kanana2",
    "talkie",
    "granite-embed-multi-97m",
    "tiny_aya",
    "cohere2moe",
    "superbpe",
    "trillion",
    "granite-docling",
    "bailingmoe",
    "bailingmoe2",
    "llada-moe",
    "seed-coder",
    "hunyuan",
    "hunyuan-dense",
    "hy_v4",
    "joyai-llm",
    "kimi-k2",
    "ufakzeka",
    "grok-2",
    "afmoe",
    "laguna",
    "minimax-m2",
    "solar-open",
    "mellum2",
};

/* Every name loads; byte-level ones tokenize a text that exercises their
 * regexes (letters, digits, marks, CJK, white space runs, invalid UTF-8)
 * losslessly. The SentencePiece-style ones (gemma4, sarvam-moe, ...) need
 * <0xNN> tokens this vocabulary lacks: they only have to load and run. */
START_TEST(test_pre_tokenizer_names) {
    static const char text[] = "Hello, World! It's 2024: 12345678 \t\n\n  na\xc3\xafve C\xe1\xbb\xad"
                               "a Vi\xe1\xbb\x87t \xe4\xb8\xad\xe6\x96\x87 \xed\x95\x9c "
                               "\xf0\x9f\xa6\x99 <sentinel:12> IMGIMGABZ \xff\xfe end   \r\n x";
    size_t len = sizeof text - 1;
    int n_names = (int)(sizeof LLAMA_CPP_PRE_NAMES / sizeof LLAMA_CPP_PRE_NAMES[0]);
    for (int i = 0; i < n_names; i++) {
        digits_pre = LLAMA_CPP_PRE_NAMES[i];
        duet_tokenizer *t = NULL;
        ck_assert_msg(load_synthetic(s_bpe_digits, &t) == DUET_OK, "pre '%s': %s", digits_pre,
                      duet_last_error());
        int n;
        int32_t *ids = encode(t, text, len, false, false, &n);
        bool spm_style = !strcmp(digits_pre, "gemma4") || !strcmp(digits_pre, "granite-embed-multi-311m") ||
                         !strcmp(digits_pre, "sarvam-moe") || !strcmp(digits_pre, "whitespace");
        if (!spm_style) {
            buf r = raw_bytes(t, ids, n);
            ck_assert_msg(r.len == len && memcmp(r.p, text, len) == 0, "pre '%s' does not round-trip",
                          digits_pre);
            free(r.p);
        }
        free(ids);
        duet_tokenizer_free(t);
    }
    printf("pre-tokenizers: all %d of llama.cpp's names load\n", n_names);
}
END_TEST

/* Vocabularies duet does not tokenize are refused, naming what they are. */
static const char *refuse_model;
static void s_other_model(duet_gguf_writer *w) {
    static const char *const toks[] = {"a"};
    duet_gguf_set_str(w, "tokenizer.ggml.model", refuse_model);
    duet_gguf_set_str_array(w, "tokenizer.ggml.tokens", toks, 1);
}

START_TEST(test_refused_vocabularies) {
    static const struct {
        const char *model, *says;
    } cases[] = {{"bert", "WPM"}, {"t5", "UGM"}, {"rwkv", "RWKV"}, {"plamo2", "plamo2"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        refuse_model = cases[i].model;
        ck_assert_int_eq(load_synthetic(s_other_model, NULL), DUET_UNSUPPORTED);
        ck_assert_msg(strstr(duet_last_error(), cases[i].says), "refusing '%s' says '%s'", cases[i].model,
                      duet_last_error());
    }
    ck_assert_int_eq(load_synthetic(s_bpe_bad_pre, NULL), DUET_UNSUPPORTED);
    ck_assert_msg(strstr(duet_last_error(), "'no-such-pre'"), "an unknown pre-tokenizer is named: '%s'",
                  duet_last_error());
}
END_TEST

/* Llama 3's vocabulary takes a pre-token that is a token whole
 * (ignore_merges); GPT-2's merges it. "abc" is a token, but the merges
 * only make "ab": [ab, c] without, [abc] with. */
static void s_bpe_ignore_merges(duet_gguf_writer *w) {
    static const char *const m[] = {"a b"};
    bpe_base(w, m, 1);
    duet_gguf_set_str(w, "tokenizer.ggml.pre", digits_pre);
}

START_TEST(test_ignore_merges) {
    duet_tokenizer *t = NULL;
    int n;
    digits_pre = "llama-bpe";
    ck_assert_int_eq(load_synthetic(s_bpe_ignore_merges, &t), DUET_OK);
    ck_assert_msg(duet_tokenizer_add_bos(t) == false, "no BOS id: add_bos drops even where llama3 wants it");
    int32_t *ids = encode(t, "abc", 3, false, false, &n);
    ck_assert_msg(n == 1 && ids[0] == 257, "llama-bpe on 'abc' gave%s", ids_str(ids, n));
    free(ids);
    duet_tokenizer_free(t);
    digits_pre = "gpt-2";
    ck_assert_int_eq(load_synthetic(s_bpe_ignore_merges, &t), DUET_OK);
    ids = encode(t, "abc", 3, false, false, &n);
    ck_assert_msg(n == 2 && ids[0] == 256 && ids[1] == 'c', "gpt-2 on 'abc' gave%s", ids_str(ids, n));
    free(ids);
    duet_tokenizer_free(t);
}
END_TEST

/* Gemma 4's SentencePiece-style BPE: spaces as U+2581, merges over UTF-8
 * characters, <0xNN> byte fallback, decoding back to the text. */
static void s_gemma4(duet_gguf_writer *w) {
    static char bytes[256][8];
    static const char *toks[256 + 5];
    int32_t types[256 + 5];
    int n = 0;
    for (int b = 0; b < 256; b++) {
        snprintf(bytes[b], sizeof bytes[b], "<0x%02X>", b);
        types[n] = DUET_TOKEN_BYTE;
        toks[n++] = bytes[b];
    }
    static const char *const extra[] = {"\xe2\x96\x81", "a", "b",
                                        "\xe2\x96\x81"
                                        "a",
                                        "\xe2\x96\x81"
                                        "ab"};
    for (int i = 0; i < 5; i++)
        types[n] = DUET_TOKEN_NORMAL, toks[n++] = extra[i];
    static const char *const m[] = {"\xe2\x96\x81 a", "\xe2\x96\x81"
                                                      "a b"};
    duet_gguf_set_str(w, "tokenizer.ggml.model", "gemma4");
    duet_gguf_set_str_array(w, "tokenizer.ggml.tokens", toks, (uint64_t)n);
    duet_gguf_set_array(w, "tokenizer.ggml.token_type", DUET_GGUF_INT32, types, (uint64_t)n);
    duet_gguf_set_str_array(w, "tokenizer.ggml.merges", m, 2);
}

START_TEST(test_spm_style_bpe) {
    duet_tokenizer *t = NULL;
    ck_assert_msg(load_synthetic(s_gemma4, &t) == DUET_OK, "gemma4: %s", duet_last_error());
    int n;
    /* " ab" -> "▁ab"; "c" is not a piece: its byte token <0x63>. */
    int32_t *ids = encode(t, " abc", 4, false, false, &n);
    ck_assert_msg(n == 2 && ids[0] == 260 && ids[1] == 0x63, "gemma4 on ' abc' gave%s", ids_str(ids, n));
    buf r = raw_bytes(t, ids, n);
    ck_assert_msg(r.len == 4 && memcmp(r.p, " abc", 4) == 0, "gemma4 decodes to '%s'", r.p);
    free(r.p);
    free(ids);
    duet_tokenizer_free(t);
}
END_TEST

int main(void) {
    Suite *s = suite_create("tokenizer");
    /* llama.cpp's vocabulary test vectors, one line per vocabulary. */
    TCase *tv = tcase_create("vectors");
    tcase_set_timeout(tv, 120);
    tcase_add_test(tv, test_vectors_llama_spm);
    tcase_add_test(tv, test_vectors_gpt2);
    tcase_add_test(tv, test_vectors_deepseek_coder);
    tcase_add_test(tv, test_vectors_command_r);
    tcase_add_test(tv, test_vectors_deepseek_llm);
    tcase_add_test(tv, test_vectors_llama_bpe);
    tcase_add_test(tv, test_vectors_qwen2);
    tcase_add_test(tv, test_vectors_qwen35);
    suite_add_tcase(s, tv);
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_stories_reference);
    tcase_add_test(tc, test_metadata_and_pieces);
    tcase_add_test(tc, test_detok_every_token_fits);
    tcase_add_test(tc, test_detok_streaming_emoji);
    tcase_add_test(tc, test_detok_bpe_split_character);
    tcase_add_test(tc, test_special_tokens);
    tcase_add_test(tc, test_invalid_utf8_and_nul);
    tcase_add_test(tc, test_output_capacity);
    tcase_add_test(tc, test_long_inputs);
    tcase_add_test(tc, test_loader_validation);
    tcase_add_test(tc, test_pre_tokenizer_names);
    tcase_add_test(tc, test_refused_vocabularies);
    tcase_add_test(tc, test_ignore_merges);
    tcase_add_test(tc, test_spm_style_bpe);
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
