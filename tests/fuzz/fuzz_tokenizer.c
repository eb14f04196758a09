/* fuzz_tokenizer.c — libFuzzer target for the tokenizers.
 *
 * Loads the stories260K (SentencePiece) and the GPT-2, Llama 3 (whole
 * pre-tokens as tokens) and DeepSeek-LLM (regexes over UTF-8 text) byte-level
 * BPE tokenizers once, from $DUET_SHARED/models (default ../shared, then
 * <executable>/../../shared). Each input is tokenized by both, with and
 * without special-token parsing, and streamed back through the detokenizer.
 * Aborts when an id is out of range, when the streamed text is not valid
 * UTF-8, or when a lossless round trip fails: byte-level BPE must give the
 * input back exactly; SPM (byte fallback) must give " " + input, with any
 * literal U+2581 read as a space.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "tokenizer.h"

#define N_BPE 3
static duet_tokenizer *spm, *bpe[N_BPE];
static const char *const BPE_FILES[N_BPE] = {"ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-bpe.gguf",
                                             "ggml-vocab-deepseek-llm.gguf"};
/* DeepSeek-LLM's vocabulary has the characters of the bytes that never occur
 * in UTF-8 (0xC0, 0xC1, 0xF5-0xFF) as user-defined tokens, which decode as
 * their text (as in llama.cpp): lossless on valid UTF-8 only. */
static const bool BPE_LOSSY_ON_INVALID[N_BPE] = {false, false, true};

static duet_tokenizer *load(const char *root, const char *name) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/models/%s", root, name);
    duet_gguf *g = NULL;
    duet_tokenizer *t = NULL;
    if (duet_gguf_open(path, &g) != DUET_OK) return NULL;
    if (duet_tokenizer_load(g, &t) != DUET_OK) t = NULL;
    duet_gguf_close(g);
    return t;
}

static bool load_all(const char *root) {
    spm = load(root, "stories260K.gguf");
    bool ok = spm != NULL;
    for (int i = 0; i < N_BPE; i++) {
        bpe[i] = load(root, BPE_FILES[i]);
        ok = ok && bpe[i];
    }
    if (ok) return true;
    duet_tokenizer_free(spm);
    spm = NULL;
    for (int i = 0; i < N_BPE; i++) {
        duet_tokenizer_free(bpe[i]);
        bpe[i] = NULL;
    }
    return false;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *env = getenv("DUET_SHARED");
    if (env) {
        if (load_all(env)) return 0;
    } else {
        if (load_all("../shared")) return 0;
        char exe[PATH_MAX];
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 32);
        if (n > 0) {
            exe[n] = 0;
            char *slash = strrchr(exe, '/');
            if (slash) {
                strcpy(slash, "/../../shared");
                if (load_all(exe)) return 0;
            }
        }
    }
    fprintf(stderr,
            "fuzz_tokenizer: cannot load the tokenizers (%s); set DUET_SHARED to the shared/ folder\n",
            duet_last_error());
    abort();
}

static bool valid_utf8(const unsigned char *p, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = p[i], lo = 0x80, hi = 0xBF;
        size_t need;
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

static void check(bool ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", what);
        abort();
    }
}

static void run(const duet_tokenizer *t, bool is_spm, bool lossy_on_invalid, const char *text, size_t len,
                bool parse_special) {
    int n = duet_tokenizer_encode(t, text, len, true, parse_special, NULL, 0);
    check(n >= 0, "encode failed");
    int32_t *ids = malloc(sizeof(int32_t) * ((size_t)n + 1));
    check(ids != NULL, "out of memory");
    check(duet_tokenizer_encode(t, text, len, true, parse_special, ids, n) == n, "encode count changed");
    int nv = duet_tokenizer_n_vocab(t);

    /* Raw bytes (specials rendered) and the streamed text. */
    size_t cap = 4 * len + 64, raw_len = 0;
    char *raw = malloc(cap);
    check(raw != NULL, "out of memory");
    duet_detok d;
    duet_detok_init(&d, t, is_spm);
    char out[256];
    for (int i = 0; i < n; i++) {
        check(ids[i] >= 0 && ids[i] < nv, "id out of range");
        char tmp[512];
        int k = duet_tokenizer_token_bytes(t, ids[i], true, tmp, sizeof tmp);
        check(k >= 0 && k <= (int)sizeof tmp, "token_bytes failed");
        check(raw_len + (size_t)k <= cap, "decoded text longer than possible");
        memcpy(raw + raw_len, tmp, (size_t)k);
        raw_len += (size_t)k;
        k = duet_detok_push(&d, ids[i], out, sizeof out);
        check(k >= 0 && k < (int)sizeof out && out[k] == 0, "detok_push length");
        check(valid_utf8((const unsigned char *)out, (size_t)k), "detok_push emitted invalid UTF-8");
    }
    int k = duet_detok_flush(&d, out, sizeof out);
    check(k == 0 || (k == 3 && memcmp(out, "\xef\xbf\xbd", 3) == 0), "detok_flush output");

    /* Round trips. BOS (when added) renders as its text first. */
    const char *p = raw;
    size_t m = raw_len;
    int32_t bos = duet_tokenizer_bos(t);
    if (duet_tokenizer_add_bos(t) && n > 0 && ids[0] == bos) {
        size_t bl = strlen(duet_tokenizer_piece(t, bos));
        check(m >= bl, "BOS missing");
        p += bl, m -= bl;
    }
    if (!is_spm) {
        if (!lossy_on_invalid || valid_utf8((const unsigned char *)text, len))
            check(m == len && memcmp(p, text, len) == 0, "byte-level BPE round trip failed");
    } else if (!parse_special && len > 0) {
        /* SentencePiece reads a literal U+2581 as a space: expect one back. */
        char *want = malloc(len + 1);
        check(want != NULL, "out of memory");
        size_t w = 0;
        want[w++] = ' ';
        for (size_t i = 0; i < len;) {
            if (i + 3 <= len && memcmp(text + i, "\xe2\x96\x81", 3) == 0) {
                want[w++] = ' ';
                i += 3;
            } else {
                want[w++] = text[i++];
            }
        }
        check(m == w && memcmp(p, want, w) == 0, "SPM byte-fallback round trip failed");
        free(want);
    }
    free(raw);
    free(ids);
}

/* Longer inputs only slow the instrumented build down (the seed corpus
 * holds whole GGUF files); long prompts are covered by test_tokenizer. */
#define MAX_FUZZ_INPUT 8192

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *text = (const char *)data;
    if (size > MAX_FUZZ_INPUT) size = MAX_FUZZ_INPUT;
    for (int ps = 0; ps < 2; ps++) {
        run(spm, true, false, text, size, ps);
        run(bpe[0], false, BPE_LOSSY_ON_INVALID[0], text, size, ps);
    }
    /* The other BPE vocabularies take one input in two each (by its size,
     * so a crash reproduces), in one mode: the test command's fixed number
     * of runs stays about as long as with two tokenizers. */
    int extra = 1 + (int)(size & 1);
    run(bpe[extra], false, BPE_LOSSY_ON_INVALID[extra], text, size, (size >> 1) & 1);
    return 0;
}
