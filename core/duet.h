/* duet.h — the public C API of libduet.
 *
 * Ownership: every object returned through an `out` pointer is owned by the
 * caller and released with its matching `_close`/`_free`. Strings passed in
 * are copied when kept. Strings returned (`duet_status_str`, `duet_last_error`,
 * token pieces) stay owned by the library.
 *
 * Thread safety: distinct `duet_model` handles may be used from different
 * threads at once. The synchronous API (duet_eval, duet_generate,
 * duet_quality_eval) uses one handle from one thread at a time (and not from
 * inside a duet_generate callback); engines
 * serving a handle (duet_engine_start_model) share its weights safely with
 * each other and with that thread, and tokenizing is safe from any thread.
 * `duet_last_error` is per thread: it describes the last failure on the
 * calling thread.
 *
 * Errors: fallible functions return a `duet_status` (0 ok, negative on
 * failure) and leave a message for `duet_last_error()`. The library never
 * exits or aborts on bad input or device errors. If a function that takes a
 * callback fails before starting, the callback is never called.
 */
#ifndef DUET_H
#define DUET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this header; duet_version() gives the library's. The
 * shared library's soname follows the major version (libduet.so.0). */
#define DUET_VERSION_MAJOR 0
#define DUET_VERSION_MINOR 1
#define DUET_VERSION_PATCH 0

/* libduet.so exports the functions declared between this push and the pop
 * at the end of the file and nothing else: the library is built with
 * -fvisibility=hidden, and a function takes the visibility of its first
 * declaration. Internal functions (`duet__*`, and those of the internal
 * headers) stay hidden; tests/test_install.py checks the exported list
 * against this header. */
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC visibility push(default)
#endif

/* One table of status codes: name, value, description. */
#define DUET_STATUS_MAP(X)                                                                                   \
    X(OK, 0, "ok")                                                                                           \
    X(INVALID_ARGUMENT, -1, "invalid argument")                                                              \
    X(OUT_OF_MEMORY, -2, "out of memory")                                                                    \
    X(IO, -3, "i/o error")                                                                                   \
    X(BAD_MODEL, -4, "malformed or unsupported model file")                                                  \
    X(UNSUPPORTED, -5, "unsupported")                                                                        \
    X(NO_DEVICE, -6, "no such backend or device")                                                            \
    X(DEVICE, -7, "device or driver error")                                                                  \
    X(COMPILE, -8, "kernel compilation failed")                                                              \
    X(CONTEXT_FULL, -9, "context length exceeded")                                                           \
    X(CANCELLED, -10, "cancelled")                                                                           \
    X(BAD_REQUEST, -11, "bad request")                                                                       \
    X(QUEUE_FULL, -12, "queue full")                                                                         \
    X(DEVICE_LOST, -13, "device lost")

typedef enum duet_status {
#define DUET__STATUS_ENUM(name, value, desc) DUET_##name = value,
    DUET_STATUS_MAP(DUET__STATUS_ENUM)
#undef DUET__STATUS_ENUM
} duet_status;

/* The library's version, "MAJOR.MINOR.PATCH", and when `backends` is not
 * NULL the backends compiled in, space-separated ("cpu vulkan opencl"):
 * built in, not necessarily usable on this machine (duet_devices_describe
 * says which are). Both strings are static. */
const char *duet_version(const char **backends);

/* Short description of a status code ("invalid argument"). Never NULL. */
const char *duet_status_str(duet_status status);
/* Name of a status code ("DUET_INVALID_ARGUMENT"). Never NULL. */
const char *duet_status_name(duet_status status);
/* The message of the last failure on this thread ("" if none). */
const char *duet_last_error(void);

/* ---- devices ---------------------------------------------------------- */

/* Prints every backend and device with its features, or the reason a
 * backend is unavailable, into `buf` as text or (json=true) a JSON array.
 * Returns the length that was needed (like snprintf). */
size_t duet_devices_describe(char *buf, size_t size, bool json);

/* ---- models ----------------------------------------------------------- */

typedef struct duet_model duet_model;

typedef struct duet_open_params {
    const char *backend; /* "auto" (NULL), "cpu", "vulkan", "opencl" */
    int device;          /* device index within the backend; -1 = best */
    int n_threads;       /* cpu backend threads; 0 = all cores */
    int n_ctx;           /* context length per sequence; 0 = model's, capped at 4096 */
    int n_seqs;          /* concurrent sequences the KV cache holds; 0 = 1 */
    const char *kv_type; /* "f32", "f16", "q8_0"; NULL = f32 for f32 models, else f16 */
    bool vocab_only;     /* load metadata and tokenizer only (no backend, no weights) */
    /* Kept for compatibility; it changes nothing: duet_model_open loads the
     * weights only, and the handle's run states (duet_eval's KV cache and
     * activations for n_seqs sequences; duet_generate's instance) are made
     * at their first call. */
    bool weights_only;
    /* Speculative decoding (duet_generate and the engine): NULL or "off",
     * or "ngram" (prompt lookup: drafts continue the latest earlier
     * occurrence of the last 3 or 2 tokens in the prompt and output). Lossless:
     * greedy output is the target's own, sampled output has the target's
     * distribution (rejection sampling). Sequences with a grammar are not
     * speculated. Helps where the output repeats its input (editing,
     * summarising, code); costs a little where it does not. */
    const char *spec;
    int spec_k; /* most draft tokens per step and sequence, 1..16; 0 = 8 (adapted per sequence) */
    /* A draft model (GGUF path) for speculative decoding (duet_generate and
     * the engine): its weights on the target's backend and device, with its
     * own KV cache (in the engine, per sequence slot, following the
     * target's blocks); its vocabulary must be the target's (checked at
     * open: DUET_BAD_MODEL otherwise). Implies spec "draft"; NULL = none. */
    const char *draft;
} duet_open_params;

/* Defaults for every field (auto backend, best device, all cores). */
duet_open_params duet_open_params_default(void);

/* Loads a GGUF model and uploads its weights to the chosen device. The
 * handle is reference-counted: each engine serving it holds a reference,
 * and duet_model_close drops the caller's; the weights are freed when the
 * last is gone (the caller may close its handle while engines serve on). */
duet_status duet_model_open(const char *path, const duet_open_params *params, duet_model **out);
void duet_model_close(duet_model *model);

typedef struct duet_model_desc {
    const char *arch;    /* "llama", "qwen2", "mistral" */
    const char *backend; /* backend that runs it */
    const char *device;  /* device name */
    int n_vocab, n_embd, n_layer, n_head, n_head_kv, n_ff, n_ctx_train, n_ctx;
    int bos, eos; /* -1 when the model has none */
    bool add_bos;
    uint64_t weight_bytes; /* bytes of weights read per token */
} duet_model_desc;

void duet_model_describe(const duet_model *model, duet_model_desc *out);

/* Copies a string metadata value (e.g. "tokenizer.chat_template",
 * "general.name") NUL-terminated into buf; returns its full length, or -1
 * when the key is absent or not a string. */
int duet_model_meta(const duet_model *model, const char *key, char *buf, size_t size);

/* ---- files: inspect, convert, synthesise ----------------------------- */

/* Describes a GGUF file (architecture, shapes, tensor types, tokenizer,
 * size) as text or JSON into a malloc'd string the caller frees with free(). */
duet_status duet_file_info(const char *path, bool json, char **out);

/* How `duet quantize` rewrites a model (core/quantize.c). */
typedef struct duet_quantize_params {
    /* A weight type: "f16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k",
     * "q6_k", "iq4_nl", "iq4_xs"; or one of llama.cpp's per-tensor mixes:
     * "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m",
     * with "q3_k", "q4_k", "q5_k" meaning the _m mixes, as in llama-quantize.
     * Every quantized type also gets llama.cpp's per-tensor rules (the
     * output matrix, or a tied embedding table, in q6_k; the mixes' extra
     * bits for attn_v/ffn_down/attn_output). */
    const char *type;
    bool allow_requantize; /* accept matrices that are already quantized (costs quality) */
    bool pure;             /* every matrix in `type`: no per-tensor rules */
} duet_quantize_params;

/* Rewrites `in` with its weight matrices quantized as `p` says; norms and
 * other 1-D tensors are copied. A matrix whose rows do not fit the chosen
 * type's block falls back as llama.cpp does (q4_k -> q5_0, q5_k -> q5_1,
 * q6_k -> q8_0, q2_k/q3_k/iq4_xs -> iq4_nl, then f16), and `report`
 * (malloc'd, may be NULL) names each such tensor. */
duet_status duet_quantize_model(const char *in, const char *out, const duet_quantize_params *p,
                                char **report);

/* duet_quantize_model with only a type (no requantizing, not pure). */
duet_status duet_quantize_file(const char *in, const char *out, const char *type, char **report);

typedef struct duet_mkmodel_params {
    const char *shape; /* "tiny", "small", "125m", "1b" (TinyLlama-1.1B), "7b" (Llama-2-7B) */
    const char *type;  /* "f32", "f16", "q8_0" */
    uint64_t seed;
    int n_ctx; /* 0 = the shape's default */
} duet_mkmodel_params;

/* Writes a Llama-shaped GGUF with deterministic random weights and a
 * working SentencePiece-style tokenizer (same params, same bytes). */
duet_status duet_mkmodel(const duet_mkmodel_params *params, const char *path);

/* Bumped whenever duet_mkmodel writes different bytes for the same params. */
#define DUET_MKMODEL_VERSION 1

/* The model of these params in duet's cache ($XDG_CACHE_HOME/duet/models or
 * ~/.cache/duet/models), generated there first when missing (written under
 * a private name, then renamed). Its path goes to `path`; *generated (may be
 * NULL) says whether this call made it. */
duet_status duet_mkmodel_cached(const duet_mkmodel_params *params, char *path, size_t size, bool *generated);

/* ---- tokens ----------------------------------------------------------- */

/* Tokenizes `len` bytes of `text`. add_special adds BOS (and EOS) as the
 * model's metadata asks; parse_special turns "<s>"-style text into control
 * tokens. Writes at most `max` ids and returns the number of ids the text
 * needs (may exceed max: call again with a larger array), or a negative
 * duet_status on failure. */
int duet_tokenize(const duet_model *model, const char *text, size_t len, bool add_special, bool parse_special,
                  int32_t *ids, int max);

/* The bytes of one token as the detokenizer prints it (byte tokens become
 * their byte, "▁" a space). Returns the byte count, or negative on a bad id. */
int duet_token_piece(const duet_model *model, int32_t id, char *buf, size_t size);

/* ---- chat templates --------------------------------------------------- */

/* A conversation to prompt text, the way the model's own template writes it.
 * "auto" runs the model's `tokenizer.chat_template` (Jinja) the way
 * transformers runs it with jinja2; a template duet's Jinja cannot run falls
 * back to the named family its marker strings suggest, and says why. Named
 * families (plain, chatml, llama3, llama2, mistral, zephyr, phi3, gemma) are
 * rendered in C and may be forced by name. */
typedef struct duet_chat_template duet_chat_template;

/* name: NULL or "auto" (the model's template), a family name, or the path
 * of a Jinja file. model may be NULL for a family name or a file. */
duet_status duet_chat_template_load(const duet_model *model, const char *name, duet_chat_template **out);
/* A template from Jinja source, with the texts of the BOS and EOS tokens
 * it may write. */
duet_status duet_chat_template_parse(const char *source, const char *bos_token, const char *eos_token,
                                     duet_chat_template **out);
void duet_chat_template_free(duet_chat_template *t);
/* "jinja" when the template's own source runs, else the family's name. */
const char *duet_chat_template_name(const duet_chat_template *t);
/* Why the model's template was not run as written ("" when it was, or when
 * a family was asked for by name). */
const char *duet_chat_template_fallback_reason(const duet_chat_template *t);
/* Renders conversation_json, OpenAI-shaped: {"messages": [{"role": ...,
 * "content": ...}, ...], "tools": [...]}; with add_generation_prompt, the
 * opening of the assistant's reply follows. A Jinja template sees messages
 * and tools as given (tool_calls, tool results and content parts included);
 * a BOS text it writes first is left out when the model's tokenizer adds
 * BOS itself, as the families leave it out: tokenize the result with
 * add_special and parse_special. The template's raise_exception() is a
 * DUET_BAD_REQUEST with its message. *out is malloc'd for the caller to
 * free. */
duet_status duet_chat_template_apply(const duet_chat_template *t, const char *conversation_json,
                                     bool add_generation_prompt, char **out);
/* Texts that end the assistant's turn when the model writes them as text
 * (NULL-terminated; may be empty: the model's end-of-generation tokens
 * always end it). */
const char *const *duet_chat_template_stops(const duet_chat_template *t);

/* ---- tool calls ------------------------------------------------------- */

/* How a chat template writes an assistant's tool calls, found by rendering
 * a probe conversation with the template (what it writes, not the model's
 * name): */
typedef enum duet_tool_syntax {
    DUET_TOOL_SYNTAX_NONE = 0, /* no tools rendered, or calls in a syntax duet does not parse */
    DUET_TOOL_SYNTAX_HERMES,   /* <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen) */
    DUET_TOOL_SYNTAX_LLAMA3, /* {"name": ..., "parameters": {...}}, maybe after <|python_tag|> (Llama 3.1+) */
    DUET_TOOL_SYNTAX_MISTRAL /* [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (Mistral) */
} duet_tool_syntax;

/* The template's tool-call syntax: NONE when it renders no tool
 * definitions (the families never do) or writes calls in another syntax. */
duet_tool_syntax duet_chat_template_tool_syntax(const duet_chat_template *t);
/* "none", "hermes", "llama3", "mistral". */
const char *duet_tool_syntax_name(duet_tool_syntax s);

#define DUET_MAX_TOOL_CALLS 16

typedef struct duet_tool_call {
    char *name;      /* NULL until the model has written the whole name */
    char *arguments; /* the arguments' JSON text so far (NUL-terminated); whole once complete */
    size_t arguments_len;
    bool complete; /* the call's JSON is closed */
} duet_tool_call;

typedef struct duet_tool_calls {
    size_t content_len; /* text[0..content_len) is the reply's text outside the calls */
    int n;              /* calls found, in order */
    duet_tool_call call[DUET_MAX_TOOL_CALLS];
} duet_tool_calls;

/* Parses a model's reply (text[0..len)) written in `syntax`. With final
 * false the text may still grow: content_len stops before anything that may
 * begin a call, a call's name appears once whole, and its arguments grow as
 * a prefix of their final text (arguments written as a JSON object are kept
 * as the model wrote them; as a JSON string, decoded once whole), so a
 * stream can send the differences. With final true the text is all there
 * is. Text after the calls is dropped. *out is filled (free it with
 * duet_tool_calls_free) even when the text holds no call. */
duet_status duet_tool_calls_parse(duet_tool_syntax syntax, const char *text, size_t len, bool final,
                                  duet_tool_calls *out);
void duet_tool_calls_free(duet_tool_calls *c);
/* A GBNF grammar (for duet_request.grammar) whose sentences are exactly one
 * call, in `syntax`, of one of the functions of tools_json (an OpenAI
 * "tools" array), or of the function `name` only when not NULL, with
 * arguments that satisfy the function's "parameters" JSON Schema (the
 * subset of duet_json_schema_to_gbnf). The Mistral and Llama forms start
 * at the JSON: their marker is a control token no grammar can write.
 * DUET_BAD_REQUEST for an unknown name or a schema outside the subset. */
duet_status duet_tool_call_grammar(duet_tool_syntax syntax, const char *tools_json, const char *name,
                                   char **out);

/* ---- generation ------------------------------------------------------- */

typedef struct duet_sampling {
    float temperature;        /* 0 = greedy (argmax) */
    int top_k;                /* 0 = off */
    float top_p;              /* 1 = off */
    float min_p;              /* 0 = off */
    float repetition_penalty; /* 1 = off; divides positive logits, multiplies negative */
    float presence_penalty;   /* 0 = off */
    float frequency_penalty;  /* 0 = off */
    int penalty_last_n;       /* window for penalties; 0 = whole context */
    uint64_t seed;            /* same seed + settings = same output */
} duet_sampling;

duet_sampling duet_sampling_default(void);

/* Called once per generated token with its id and the UTF-8 text it
 * completes (possibly empty: a split character waits for its last byte).
 * Return false to stop: no further call follows. Otherwise, after the last
 * token, one more call with id -1 delivers an unfinished character (as
 * U+FFFD) if one is pending. */
typedef bool (*duet_token_fn)(int32_t id, const char *text, size_t len, void *user);

typedef struct duet_generate_stats {
    int prompt_tokens, generated_tokens;
    double prefill_seconds, decode_seconds;
    double decode_cpu_seconds; /* the process's CPU time during decode (all threads) */
    bool stopped_by_eos;
    /* Speculative decoding: verification steps with drafts, draft tokens
     * proposed, and how many of them the target kept. */
    int spec_drafts, spec_draft_tokens, spec_accepted_tokens;
} duet_generate_stats;

/* Runs the prompt ids through the model, then samples up to max_tokens new
 * tokens, calling `fn` after each; stops at EOS (unless ignore_eos) or when
 * fn returns false. It is a synchronous client of the handle's own instance:
 * an engine (one sequence at a time, batch 1, the open params' speculation)
 * started at the first call and kept until duet_model_close, so `fn` runs on
 * that engine's thread while the caller waits, and its prefix cache lets a
 * prompt that starts with an earlier call's prompt and output (a chat's next
 * turn) reuse their KV blocks. A failed step returns its status (DUET_DEVICE,
 * DUET_DEVICE_LOST: the handle then serves no more). */
duet_status duet_generate(duet_model *model, const int32_t *prompt, int n_prompt, int max_tokens,
                          const duet_sampling *sampling, bool ignore_eos, duet_token_fn fn, void *user,
                          duet_generate_stats *stats);

/* Low-level: evaluates `n` tokens at positions pos0.. of sequence 0 and
 * copies the logits of the last one into `logits` (n_vocab floats) when not
 * NULL. Lets tests and tools compare logits step by step. */
duet_status duet_eval(duet_model *model, const int32_t *tokens, int n, int pos0, float *logits);

/* ---- structured output ------------------------------------------------ */

/* A JSON Schema (JSON text; the common subset: types, properties and
 * required, enum, const, items with minItems/maxItems, string lengths,
 * anyOf/oneOf, $ref to $defs, integer bounds; formats and patterns left free) as a GBNF
 * grammar for duet_request.grammar whose sentences satisfy the schema.
 * NULL: any JSON object. *out is malloc'd for the caller to free.
 * DUET_BAD_REQUEST with a message for what the subset cannot express. */
duet_status duet_json_schema_to_gbnf(const char *schema_json, char **out);

/* ---- serving engine -------------------------------------------------- */

/* An engine is one model instance on one device with its own thread, KV
 * cache and continuous-batching scheduler. Several engines may serve one
 * loaded model (duet_engine_start_model): they share its weights on its
 * device, each with its own KV pool, scheduler and knobs, and take turns on
 * the device step by step. Requests are submitted from any thread; events
 * are delivered on the engine thread, so callbacks must be quick and must
 * not call back into the engine except duet_engine_cancel. */
typedef struct duet_engine duet_engine;

typedef enum duet_priority { DUET_PRIORITY_INTERACTIVE = 0, DUET_PRIORITY_BATCH = 1 } duet_priority;

typedef struct duet_engine_params {
    duet_open_params open;   /* backend, device, threads, n_ctx, kv_type */
    int max_batch_seqs;      /* sequences decoded together; 0 = 16 */
    int max_batch_tokens;    /* tokens per step (decodes + prefill chunks); 0 = 256 */
    double batch_timeout_ms; /* an idle engine waits this long for more arrivals; <0 = default 2 ms */
    int prefill_chunk;       /* prompt tokens per sequence per step; 0 = 128 */
    int max_waiting;         /* queued requests beyond which submit says DUET_QUEUE_FULL; 0 = 256 */
    int kv_block_size;       /* tokens per KV block; 0 = 16 */
    int kv_blocks;           /* KV blocks in the pool; 0 = enough for every slot at full context */
    const char *served_name; /* the metrics' model_name label; NULL = the model's general.name (copied) */
    /* A CSV file (created or truncated) with a line for every step the
     * engine completes: its start and the idle time before it, its shape,
     * its measured time, the online model's prediction (what sized it) and
     * the seeding profile's; NULL = none. Written out whenever the engine
     * goes idle, so a reader between bursts of work sees every step. */
    const char *step_log;
    bool no_prefix_cache; /* turns automatic prefix caching off (it is on by default: full KV blocks of
                             prompts are kept and reused by later requests that start the same way) */
    /* Speculation (open.spec, open.draft) is decided per step and per
     * sequence: drafts are verified only where the step-cost models (the
     * target's and the draft model's, fitted online from the steps run) and
     * each sequence's measured acceptance predict more tokens per second
     * for the whole step, so it backs off as a compute-bound batch fills.
     * This is a hard cap on top: a step with more decodes than this verifies
     * no drafts. 0 = no cap; -1 = no cap and no decision (as spec_always). */
    int spec_max_batch;
    /* Verify every draft offered (up to spec_max_batch's cap): no measured
     * decision. For tests and A/B measurements. */
    bool spec_always;
    /* Latency targets per duet_priority, in ms (0 = none): p99 time to first
     * token and p99 inter-token latency. With any target set, the adaptive
     * controller (core/controller.h) retunes batch_timeout, max_batch_seqs
     * and max_batch_tokens once per controller window (the configured
     * values are the ceilings of the last two). */
    double slo_ttft_ms[2], slo_itl_ms[2];
    double controller_window_ms; /* 0 = 2000 */
    /* Keep the configured knobs: the controller does not run (the latency
     * targets still size stall-free steps, at step_budget_share). For
     * comparing the controller against the best fixed setting. */
    bool static_knobs;
    /* The share of each class's ITL target a step with its decodes may take,
     * predicted (0 = 0.8: headroom for a p99 over the predicted mean); the
     * controller starts here and retunes it within [0.25, 1]. */
    double step_budget_share;
    /* Seeds the engine's step-cost model (duet_step_cost_load of a file
     * `duet profile` wrote; copied), which the engine refits online from its
     * steps; NULL = learn it from the warm-up and the steps. Under an ITL
     * target the scheduler sizes each step with decodes from it: prompt
     * chunks fill what the predicted decode time leaves of the target. */
    const struct duet_step_cost *step_cost;
} duet_engine_params;

duet_engine_params duet_engine_params_default(void);

/* Loads the model at model_path (params->open: backend, device, threads,
 * n_ctx, kv_type) and starts an engine serving it alone. */
duet_status duet_engine_start(const char *model_path, const duet_engine_params *params, duet_engine **out);
/* Starts an engine serving an already loaded model (not vocab-only; the
 * engine takes a reference: the caller may close its handle afterwards).
 * params->open's backend, device and n_threads are the model's and ignored
 * here; n_ctx (0 = the model's) and kv_type (NULL = the model's) apply to
 * this engine's KV cache. */
duet_status duet_engine_start_model(duet_model *model, const duet_engine_params *params, duet_engine **out);
/* Stops accepting; with drain, finishes in-flight requests first, otherwise
 * cancels them (each gets its final event). Then joins the thread and frees. */
void duet_engine_stop(duet_engine *e, bool drain);
/* Tokens (prompt + generated) one request can ever hold: the context, or
 * less when the KV pool (kv_blocks) is smaller than one full context. */
int duet_engine_max_sequence_tokens(const duet_engine *e);
/* The engine's model, for tokenizing and describing (read-only use). */
const duet_model *duet_engine_model(const duet_engine *e);

typedef struct duet_request {
    const int32_t *prompt; /* copied at submit */
    int n_prompt;
    int max_tokens;
    duet_sampling sampling;
    duet_priority priority;
    bool ignore_eos;
    /* Stop strings (copied at submit; at most DUET_MAX_STOP, none empty):
     * generation ends before the first one the text contains, with finish
     * STOP, and none of its text is delivered. */
    const char *const *stop;
    int n_stop;
    /* Log-probabilities under the model's raw next-token distribution (the
     * log-softmax of the logits, before penalties, temperature and top-k/p):
     * with `logprobs`, every TOKEN event carries its token's and those of
     * the top_logprobs (0..DUET_MAX_TOP_LOGPROBS) most likely tokens. With
     * prompt_logprobs too, PROMPT_TOKEN events first give each prompt
     * token's (the logits of every prompt position are then computed). */
    bool logprobs, prompt_logprobs;
    int top_logprobs;
    /* A GBNF grammar (llama.cpp's notation, start rule `root`; copied at
     * submit) that the generated text must follow: tokens it refuses are
     * never drawn, end-of-generation comes only where its sentence is
     * whole, and generation stops (finish STOP) once nothing may follow.
     * NULL: none. A grammar that does not parse is DUET_BAD_REQUEST. */
    const char *grammar;
} duet_request;
#define DUET_MAX_STOP 32
#define DUET_MAX_TOP_LOGPROBS 20

/* One token and its log-probability. */
typedef struct duet_token_logprob {
    int32_t token;
    float logprob;
} duet_token_logprob;

/* PROMPT_TOKEN (only with prompt_logprobs): prompt token `token` at stream
 * position `position` (1 .. n_prompt-1, in order, each once, all before
 * the first TOKEN) and its logprob given the tokens before it. */
typedef enum duet_event_kind { DUET_EVENT_TOKEN, DUET_EVENT_DONE, DUET_EVENT_PROMPT_TOKEN } duet_event_kind;

typedef enum duet_finish {
    DUET_FINISH_NONE = 0,
    DUET_FINISH_STOP,      /* end-of-generation token or a stop string */
    DUET_FINISH_LENGTH,    /* max_tokens or context reached */
    DUET_FINISH_CANCELLED, /* duet_engine_cancel or engine stop without drain */
    DUET_FINISH_ERROR,     /* see message */
} duet_finish;

typedef struct duet_event {
    duet_event_kind kind;
    uint64_t request_id;
    int32_t token; /* TOKEN: the sampled id (-1: text flushed at the end); PROMPT_TOKEN: the prompt's */
    int position;  /* PROMPT_TOKEN: its index in the prompt */
    /* TOKEN (token >= 0) and PROMPT_TOKEN of a request with logprobs: */
    bool has_logprob;
    float logprob;                 /* log p(token) */
    int n_top;                     /* entries in top (the request's top_logprobs) */
    const duet_token_logprob *top; /* the most likely tokens, best first */
    const char *text;              /* TOKEN: UTF-8 text it completes (may be empty) */
    size_t text_len;
    duet_finish finish;  /* DONE */
    const char *message; /* DONE with ERROR */
    duet_status status;  /* DONE with ERROR: the failure's code (DUET_DEVICE_LOST, ...); else DUET_OK */
    int instance;        /* from a fleet: the instance that served it (its index); 0 from an engine */
    int prompt_tokens, generated_tokens;
    double queue_seconds, ttft_seconds, total_seconds; /* DONE: timings */
    int spec_drafts;                                   /* DONE: steps that verified drafts */
    int spec_draft_tokens, spec_accepted_tokens;       /* DONE: speculative drafts proposed and kept */
} duet_event;

/* Called for every event of a request; DONE is always the last, exactly once. */
typedef void (*duet_event_fn)(const duet_event *ev, void *user);

/* Queues a request. Refusals: DUET_CONTEXT_FULL when the request can never fit, and DUET_BAD_REQUEST for
 * invalid settings; when the queue is full it returns DUET_QUEUE_FULL; after the device was lost,
 * DUET_DEVICE_LOST (see duet_engine_healthy). On failure fn is never called. */
duet_status duet_engine_submit(duet_engine *e, const duet_request *req, duet_event_fn fn, void *user,
                               uint64_t *id);
/* Cancels a request in any state; its DONE event (CANCELLED) follows soon. */
duet_status duet_engine_cancel(duet_engine *e, uint64_t id);

/* Whether the engine can serve. A failed step (a device error, out of
 * memory) fails only that step's requests and the engine stays healthy. When
 * the device is lost, every request in flight gets DONE(ERROR), submit
 * refuses new ones with DUET_DEVICE_LOST, and the engine stays unhealthy
 * until it is stopped (there is no recovery: start a new engine). Returns
 * true when healthy (`why` then ""); false with the reason in `why` (e.g.
 * "device lost: <the driver's message>"). `why` may be NULL. */
bool duet_engine_healthy(duet_engine *e, char *why, size_t why_size);

/* Runs the model once (a short prompt chunk, then one decode step) outside
 * any request and the metrics, so that the first request does not pay for
 * first-use costs (pipeline and kernel builds, first touch of memory). For
 * servers before they report ready: call it before submitting; it does
 * nothing when requests are already in flight. */
duet_status duet_engine_warmup(duet_engine *e);

/* Prometheus text exposition of the engine's metrics (malloc'd; free()). */
char *duet_engine_metrics(duet_engine *e);

/* ---- step-cost model, profiling, fleet simulation ----------------------- */

/* The time one engine step takes, as a linear function of what is in it:
 *
 *   seconds = coef[0]                      fixed cost of a step
 *           + coef[1] * n_decode           per decode token (a running sequence's next token)
 *           + coef[2] * n_prefill          per prompt token in a chunk
 *           + coef[3] * decode_ctx         per position a decode token attends to
 *           + coef[4] * prefill_ctx        per position a prompt token attends to
 *
 * Fitted by least squares (non-negative coefficients) from measured steps:
 * offline by `duet profile` (duet_profile_run), which writes it to a small
 * JSON file, and online by the engine from its own steps. The scheduler
 * sizes a step's prefill share with it and `duet-bench --simulate` costs
 * its virtual steps with it: one model for both. */
#define DUET_STEP_COST_TERMS 5

typedef struct duet_step_shape {
    int n_decode;       /* decode tokens: one per running sequence past its prompt */
    int n_prefill;      /* prompt (or re-prefill) tokens, in chunks */
    double decode_ctx;  /* sum over decode tokens of (position + 1) */
    double prefill_ctx; /* sum over prompt-chunk tokens of (position + 1) */
} duet_step_shape;

typedef struct duet_step_sample {
    duet_step_shape shape;
    double seconds; /* measured */
} duet_step_sample;

#define DUET_STEP_COST_KNOTS 32
#define DUET_STEP_COST_NOISE_Q 16

typedef struct duet_step_cost {
    double coef[DUET_STEP_COST_TERMS]; /* seconds per unit of each term, >= 0 */
    /* A correction by the step's token count (n_decode + n_prefill): the
     * matrix multiplies' time is not linear in the batch (kernels change
     * path with its size: on the cpu a 4-token step can cost what an
     * 8-token one does). knot_s[k] seconds are added at knot_tokens[k]
     * (ascending), interpolated linearly between knots and held past the
     * ends; negative where the linear terms overshoot. n_knots 0: none.
     * duet profile fits it from the medians of the linear fit's residuals
     * at each token count of its grid; the scheduler's time budget uses
     * the linear terms only. */
    int n_knots;
    int knot_tokens[DUET_STEP_COST_KNOTS];
    double knot_s[DUET_STEP_COST_KNOTS];
    /* The dispersion of a step's time around the model: quantiles of
     * measured / predicted over every timed repeat of the profile
     * (noise_level[k] ascending in [0, 1], noise_ratio[k] the ratio at that
     * level). A server's step times vary (clock, cache, the OS), and
     * queueing near capacity grows with that variance (Pollaczek-Khinchine:
     * waiting ~ 1 + CV^2); duet_simulate can draw each step's cost from it.
     * (Measured so far it is narrow, CV about 4% on cpu and PoCL, since the
     * profile times settled steps: bench/results/sim-validation.md.)
     * n_noise 0: unknown (older profiles). */
    int n_noise;
    double noise_level[DUET_STEP_COST_NOISE_Q], noise_ratio[DUET_STEP_COST_NOISE_Q];
    /* Fit quality over the samples it came from (0 when unknown). */
    int n_samples;
    double rmse_s;       /* root mean square error, seconds */
    double mean_rel_err; /* mean |predicted - measured| / measured */
    double r2;           /* coefficient of determination */
    /* Where it was measured ("" when unknown), and the profiled context. */
    char model[256], backend[32], device[256];
    int n_ctx;
} duet_step_cost;

/* Adds one step entry to a shape: n_tokens tokens at positions pos.., a
 * decode (one token) or a prompt chunk. */
void duet_step_shape_add(duet_step_shape *s, int pos, int n_tokens, bool decode);
/* Predicted seconds of a step (the linear terms plus the token-count
 * correction; never negative). */
double duet_step_cost_predict(const duet_step_cost *m, const duet_step_shape *s);
/* Multiplies every cost m predicts by f (> 0 and finite, else m is left
 * as it is): its terms and token-count correction; the dispersion is a
 * ratio and stays. For a server that runs slower or faster than its
 * profile measured (duet_step_cost_served_seconds_total over
 * duet_step_cost_profiled_seconds_total at /metrics). */
void duet_step_cost_scale(duet_step_cost *m, double f);
/* The JSON name of term i ("intercept", "per_decode_token", ...); NULL past the last. */
const char *duet_step_cost_term(int i);
/* Least squares of the relative error over n samples, every coefficient
 * >= 0; fills coef, then the token-count correction (the median residual
 * at each distinct token count, when there are at least two), and the fit
 * quality of both (the where-fields are cleared). DUET_INVALID_ARGUMENT when
 * n < 1 or a sample is not finite or negative. Terms no sample exercises
 * get 0. */
duet_status duet_step_cost_fit(const duet_step_sample *samples, int n, duet_step_cost *out);
/* Sets m's dispersion (n_noise, noise_level, noise_ratio) from n timed
 * steps: the quantiles of seconds / duet_step_cost_predict over them. */
void duet_step_cost_fit_noise(duet_step_cost *m, const duet_step_sample *steps, int n);
/* The inverse of m's dispersion at u in [0, 1) (piecewise linear between
 * its quantiles): a step-cost multiplier; 1 when m has none. */
double duet_step_cost_noise_at(const duet_step_cost *m, double u);
/* Writes the model as JSON (with the samples, when given, for refitting);
 * DUET_IO with the path and reason on failure. */
duet_status duet_step_cost_save(const duet_step_cost *m, const duet_step_sample *samples, int n_samples,
                                const char *path);
/* Reads a file duet_step_cost_save wrote. DUET_IO when it cannot be read,
 * DUET_INVALID_ARGUMENT when it is not such a file (the message names the
 * file and what is wrong: not JSON, wrong format or version, a term missing,
 * negative or not a number). */
duet_status duet_step_cost_load(const char *path, duet_step_cost *out);

/* The engine's online fit of its own steps, now (coefficients, steps seen
 * as n_samples, recent mean relative error as mean_rel_err). Also exported
 * at /metrics as duet_step_cost_seconds{term=...}. */
duet_status duet_engine_step_cost(duet_engine *e, duet_step_cost *out);
/* Starts the engine's online fit again from `prior` (a profile's model),
 * which then counts as a few steps' worth of evidence. */
duet_status duet_engine_set_step_cost(duet_engine *e, const duet_step_cost *prior);

/* `duet profile`: real steps of a grid of shapes on one backend and device,
 * timed, then fitted. Decode steps of every batch size at every context,
 * prompt chunks of every size starting at every context, and mixed steps
 * (the middle decode batch with every chunk). Each shape runs once untimed
 * (first-use costs), then the grid runs `repeats` times in rounds (so a
 * slow moment of the machine touches one run of each shape, not every run
 * of one), by step size, each timed step after untimed ones of its own
 * shape (a step in the wake of a bigger one costs more than in a server's
 * run of similar steps); the fit uses each shape's median. Sizes are
 * capped by the model's context. */
typedef struct duet_profile_params {
    duet_open_params open;   /* backend, device, threads, n_ctx, kv_type */
    const int *decode_batch; /* decode batch sizes; NULL = 1, 2, 4, 8, 16 */
    int n_decode_batch;
    const int *chunk; /* prompt chunk sizes; NULL = 16, 32, 64, 128 */
    int n_chunk;
    const int *context; /* contexts (positions before the step); NULL = 16, 128, 512 */
    int n_context;
    int repeats;     /* timed runs per shape; 0 = 3 */
    double budget_s; /* stop starting new shapes (untimed) and rounds after this long; 0 = 45 */
    /* Called as the rounds progress (may be NULL): shapes done and in all. */
    void (*progress)(int done, int total, void *user);
    void *user;
} duet_profile_params;

duet_profile_params duet_profile_params_default(void);
/* Opens the model, runs the grid, fits. *samples (malloc'd, caller frees)
 * gets one median sample per shape timed, *fit the model with its
 * where-fields set. */
duet_status duet_profile_run(const char *model_path, const duet_profile_params *p, duet_step_sample **samples,
                             int *n_samples, duet_step_cost *fit);

/* A fleet of identical instances behind the server's router (least
 * outstanding work; at most 64 instances),
 * simulated on a virtual clock: each instance runs the engine's real
 * scheduler, and each planned step takes what the step-cost model says.
 * Every request generates exactly its n_output tokens (as with
 * ignore_eos), clamped to the context like duet_engine_submit does. */
typedef struct duet_sim_request {
    double arrival; /* seconds; requests in non-decreasing order */
    int n_prompt, n_output;
    duet_priority priority;
} duet_sim_request;

typedef struct duet_sim_outcome {
    duet_status status; /* DUET_OK, or the refusal: DUET_QUEUE_FULL, DUET_CONTEXT_FULL, DUET_BAD_REQUEST */
    int instance;       /* where the router sent it; -1 when refused before */
    double first_token; /* seconds (NAN when refused) */
    double done;        /* seconds: its last token (the refusal's time when refused) */
    int n_generated;
} duet_sim_outcome;

typedef struct duet_sim_params {
    int n_instances;           /* 1..64 */
    duet_engine_params engine; /* every instance's knobs, as duet_engine_start takes them (0 = default) */
    int n_ctx;                 /* context per sequence; 0 = the cost model's, else 2048 */
    duet_step_cost cost;
    /* Each step's cost times a draw from the cost model's dispersion
     * (duet_step_cost_noise_at, n_noise > 0), from a generator seeded with
     * noise_seed (the same seed, the same run); false: the predicted costs. */
    bool step_noise;
    uint64_t noise_seed;
    /* Each step's cost times prompt_scale when it runs a prompt chunk,
     * decode_scale when it only decodes (0 = 1): served speeds measured by
     * kind (a server's --step-log), which can move apart on one device
     * (compute-bound prompt chunks, memory-bound decodes). The simulated
     * schedulers keep the model unscaled. */
    double prompt_scale, decode_scale;
    /* Called for every generated token in time order (may be NULL): the
     * request's index, the token's index in its output, its time. */
    void (*on_token)(int request, int index, double t, void *user);
    /* Called for every step as it starts (may be NULL): the instance, the
     * start, its simulated duration, the sequences in it and its shape
     * (what the cost model priced). */
    void (*on_step)(int instance, double t, double seconds, int n_seqs, const duet_step_shape *shape,
                    void *user);
    void *user;
} duet_sim_params;

typedef struct duet_sim_stats {
    double end; /* the last step's end, seconds */
    uint64_t steps, preemptions;
    double busy_s;               /* summed step time of every instance */
    uint64_t controller_windows; /* adaptive controller windows run (with a latency target set) */
} duet_sim_stats;

/* Runs the requests to completion; out[i] for reqs[i]. DUET_INVALID_ARGUMENT
 * on bad parameters (a message says which) or arrivals out of order. */
duet_status duet_simulate(const duet_sim_params *p, const duet_sim_request *reqs, int n,
                          duet_sim_outcome *out, duet_sim_stats *stats);

/* ---- several instances behind a router ------------------------------- */

/* A fleet puts a router (core/router.h) in front of several engines: each
 * request goes to an instance of its tier (priority) with the least
 * outstanding work for its measured speed; when the tier is saturated it
 * may spill over to the other; an instance whose device is lost is taken
 * out, and its requests that had streamed nothing are retried once on
 * another instance (the client sees one request: its events, then one
 * DONE). The engines may be of any backends and devices, loaded from the
 * same model file (tokenize with duet_fleet_model). The caller starts the
 * engines, and stops them before duet_fleet_free (so every DONE has been
 * delivered). Thread-safe like an engine. */
typedef struct duet_fleet duet_fleet;

typedef struct duet_fleet_instance {
    duet_engine *engine;
    duet_priority tier;  /* the requests it is for */
    int max_outstanding; /* requests at which it counts as saturated (spill-over); 0 = never */
    const char *name;    /* its `instance` label in the metrics (copied); NULL = its index */
} duet_fleet_instance;

typedef struct duet_fleet_params {
    bool tier_blind;        /* ignore tiers: every instance serves every request */
    bool spill_interactive; /* interactive requests may use batch instances when theirs are saturated
                               (default) */
    bool spill_batch;       /* batch requests may use interactive instances when theirs are saturated */
} duet_fleet_params;

duet_fleet_params duet_fleet_params_default(void);
/* n instances, 1..64. */
duet_status duet_fleet_new(const duet_fleet_instance *instances, int n, const duet_fleet_params *params,
                           duet_fleet **out);
void duet_fleet_free(duet_fleet *f);
/* As duet_engine_submit, on the instance the router picks; events carry
 * the fleet's id and the serving instance. DUET_DEVICE_LOST when no
 * instance can serve. */
duet_status duet_fleet_submit(duet_fleet *f, const duet_request *req, duet_event_fn fn, void *user,
                              uint64_t *id);
/* As duet_fleet_submit, on instance `inst` (0..size-1) whatever its tier
 * and load: a benchmark comparing the instances, a client placing its own
 * requests; -1 lets the router pick. A pinned request is never retried
 * elsewhere: when its instance fails it ends with DONE(ERROR). Counted in
 * the instance's routed and pinned metrics. DUET_INVALID_ARGUMENT for an
 * instance out of range, DUET_DEVICE_LOST when it has failed. */
duet_status duet_fleet_submit_to(duet_fleet *f, int inst, const duet_request *req, duet_event_fn fn,
                                 void *user, uint64_t *id);
duet_status duet_fleet_cancel(duet_fleet *f, uint64_t id);
/* True while any instance is healthy; `why` lists the ones that are not. */
bool duet_fleet_healthy(duet_fleet *f, char *why, size_t why_size);
/* duet_engine_warmup on every instance. */
duet_status duet_fleet_warmup(duet_fleet *f);
/* Prometheus text: the engines' families summed (the names and labels of a
 * single engine's), then per-instance families (duet_instance_*, with
 * instance, backend, device and tier labels) and the router's decisions
 * (duet_router_*). malloc'd; free(). */
char *duet_fleet_metrics(duet_fleet *f);
int duet_fleet_size(const duet_fleet *f);
duet_engine *duet_fleet_engine(duet_fleet *f, int i);
/* One instance as the fleet labels it (strings owned by the fleet). */
typedef struct duet_fleet_instance_desc {
    const char *name;    /* its `instance` label (duet_fleet_instance.name, or its index) */
    const char *backend; /* "cpu", "vulkan", "opencl" */
    const char *device;  /* the device's name */
    duet_priority tier;
    int max_batch_seqs; /* its current knob */
    bool healthy;       /* false once its device is lost */
} duet_fleet_instance_desc;
duet_status duet_fleet_describe(duet_fleet *f, int i, duet_fleet_instance_desc *out);
/* The index of the instance named `name`, or -1. */
int duet_fleet_find(const duet_fleet *f, const char *name);
/* The first instance's model (tokenizer, chat template, description). */
const duet_model *duet_fleet_model(const duet_fleet *f);
/* The least of the instances' duet_engine_max_sequence_tokens. */
int duet_fleet_max_sequence_tokens(const duet_fleet *f);

/* ---- quality evaluation ---------------------------------------------- */

/* How closely `model` follows a reference on one token sequence (teacher
 * forcing: both read the same tokens and predict each next one). Used to
 * check a quantised model or a backend against an f32 original on the CPU. */
typedef struct duet_quality {
    int positions;         /* next-token predictions scored */
    int windows;           /* passes from position 0 over the split text */
    double kl_mean;        /* mean KL(ref || model) of the next-token distributions, nats */
    double kl_p99, kl_max; /* 99th percentile (nearest rank) and largest per-position KL */
    double top1_agreement; /* fraction of positions where both argmaxes are the same id */
    double ppl, ppl_ref;   /* exp(mean -log p(actual next token)) under model and ref */
    double seconds;        /* wall time of the two forward passes and the scoring */
} duet_quality;

/* Scores `model` against `ref` over tokens[0..n_tokens). Both handles come
 * from duet_model_open (any backends and devices) and must have the same
 * vocabulary, else DUET_INVALID_ARGUMENT with a message naming the first
 * difference. The text is split into windows of at most `window` tokens
 * (0 = the smaller context of the two), each run from position 0; a window
 * after the first starts with BOS (or the previous token when the model has
 * no BOS) unless its first token already is BOS. Every token that follows
 * another in a window is predicted once, so positions is n_tokens - 1 less
 * the windows that start at a BOS of the text. Logits are compared in double
 * precision. A non-finite logit is an error (DUET_DEVICE) naming the model
 * and position. Sequence 0's KV cache of both handles is overwritten. */
duet_status duet_quality_eval(duet_model *model, duet_model *ref, const int32_t *tokens, int n_tokens,
                              int window, duet_quality *out);

/* Writes n_tokens of text sampled from `ref` into tokens[]: BOS, then tokens
 * drawn at temperature 1 from the full distribution (no top-k/top-p/min-p,
 * no penalties), so the text is in the model's own distribution and not the
 * repetitive loop greedy decoding falls into. Each segment holds at most
 * `window` tokens (0 = the context); at EOS or a full segment the next one
 * starts with BOS and a seed derived from `seed`. Same model, seed and window
 * give the same tokens. DUET_UNSUPPORTED when the model has no BOS token. */
duet_status duet_quality_generate(duet_model *ref, int n_tokens, int window, uint64_t seed, int32_t *tokens);

#if defined(__GNUC__) || defined(__clang__)
#pragma GCC visibility pop
#endif

#ifdef __cplusplus
}
#endif

#endif /* DUET_H */
