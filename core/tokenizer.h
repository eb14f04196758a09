/* tokenizer.h — tokenizers read from GGUF metadata.
 *
 * `llama`: SentencePiece-style (scores, byte fallback, dummy prefix).
 * `gpt2`:  byte-level BPE (merges; the pre-tokenizer is chosen by
 *          tokenizer.ggml.pre: every name llama.cpp accepts, with its regexes
 *          run by PCRE2 over llama.cpp's Unicode classes). `gemma4` and the
 *          gemma4/sarvam-moe pre-tokenizers: SentencePiece-style BPE.
 * WPM (bert), UGM (t5) and RWKV vocabularies are refused (DUET_UNSUPPORTED).
 * A tokenizer is immutable after load: safe to use from many threads.
 */
#ifndef DUET_TOKENIZER_H
#define DUET_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

typedef struct duet_tokenizer duet_tokenizer;

typedef enum duet_token_type {
    DUET_TOKEN_NORMAL = 1,
    DUET_TOKEN_UNKNOWN = 2,
    DUET_TOKEN_CONTROL = 3,
    DUET_TOKEN_USER_DEFINED = 4,
    DUET_TOKEN_UNUSED = 5,
    DUET_TOKEN_BYTE = 6,
} duet_token_type;

/* Builds the tokenizer from tokenizer.ggml.* keys; the result does not keep
 * pointers into `g`. DUET_BAD_MODEL (with a message) when keys are missing
 * or inconsistent, DUET_UNSUPPORTED for an unknown tokenizer model. */
duet_status duet_tokenizer_load(const duet_gguf *g, duet_tokenizer **out);
void duet_tokenizer_free(duet_tokenizer *t);

int duet_tokenizer_n_vocab(const duet_tokenizer *t);
int32_t duet_tokenizer_bos(const duet_tokenizer *t); /* -1 when none */
int32_t duet_tokenizer_eos(const duet_tokenizer *t);
bool duet_tokenizer_add_bos(const duet_tokenizer *t); /* metadata's add_bos (default: true for llama) */
bool duet_tokenizer_add_eos(const duet_tokenizer *t);
const char *duet_tokenizer_model(const duet_tokenizer *t); /* "llama", "gpt2" */
duet_token_type duet_tokenizer_token_type(const duet_tokenizer *t, int32_t id);
/* True for tokens that end generation (EOS, EOT, ...). */
bool duet_tokenizer_is_eog(const duet_tokenizer *t, int32_t id);

/* Tokenizes `len` bytes. add_special: BOS/EOS as add_bos/add_eos say.
 * parse_special: control/user-defined token texts in the input become those
 * tokens. Writes at most max ids; returns the number needed (may be > max),
 * or a negative duet_status. */
int duet_tokenizer_encode(const duet_tokenizer *t, const char *text, size_t len, bool add_special,
                          bool parse_special, int32_t *ids, int max);

/* The raw vocabulary piece of a token (NUL-terminated), or NULL for bad ids. */
const char *duet_tokenizer_piece(const duet_tokenizer *t, int32_t id);

/* The bytes a token decodes to: SPM "▁" -> ' ', <0xNN> -> that byte, BPE
 * byte-level unicode -> bytes; control tokens decode to "" unless
 * `render_special`. Returns the byte count (may exceed size: nothing is
 * written past size), or negative for a bad id. */
int duet_tokenizer_token_bytes(const duet_tokenizer *t, int32_t id, bool render_special, char *buf,
                               size_t size);

/* Streaming detokenizer: feeds tokens, emits only complete UTF-8 characters;
 * an incomplete character waits for the bytes that finish it. With
 * strip_leading_space, a SentencePiece leading space right after BOS (or at
 * the start) is dropped, as SentencePiece decoding does. */
typedef struct duet_detok {
    const duet_tokenizer *tok;
    bool strip_leading_space;
    bool at_start;
    char pending[8];
    int n_pending;
} duet_detok;

void duet_detok_init(duet_detok *d, const duet_tokenizer *t, bool strip_leading_space);
/* Appends the text completed by `id` to out (at most size bytes, NUL-terminated)
 * and returns its full length; if that is >= size, the text was cut at a
 * character boundary. Token texts have no length limit in GGUF: 3 bytes per
 * byte of the longest token, plus 13, is always enough. */
int duet_detok_push(duet_detok *d, int32_t id, char *out, size_t size);
/* Flushes an unfinished character as U+FFFD replacement bytes. */
int duet_detok_flush(duet_detok *d, char *out, size_t size);

#endif /* DUET_TOKENIZER_H */
