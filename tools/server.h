/* server.h — the OpenAI-compatible HTTP server behind `duet serve`.
 *
 * server.c         the HTTP side (libmicrohttpd, one thread per connection):
 *                  routing, jobs that fan a request out to engine requests,
 *                  streaming, client disconnects, draining on SIGTERM.
 * server_openai.c  the OpenAI dialect: request parsing and validation,
 *                  stop strings, response and stream-chunk JSON, errors.
 *
 * The pure parts (parsing, stop strings, JSON) take no locks
 * and touch no engine, so tests/test_server.c tests them directly.
 */
#ifndef DUET_SERVER_H
#define DUET_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "duet.h"

/* ---- growable text -------------------------------------------------- */

typedef struct srv_text {
    char *p; /* NUL-terminated when not NULL */
    size_t len, cap;
} srv_text;

bool srv_text_append(srv_text *t, const char *s, size_t n);
bool srv_text_printf(srv_text *t, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void srv_text_free(srv_text *t);

/* ---- errors (OpenAI's error object) ---------------------------------- */

typedef struct srv_error {
    int http;          /* 400, 404, 405, 413, 429, 500, 503 */
    const char *type;  /* "invalid_request_error", "rate_limit_error", "server_error" */
    const char *code;  /* NULL, or e.g. "context_length_exceeded", "model_not_found" */
    char param[64];    /* the offending field; "" when none */
    char message[512];
} srv_error;

/* Fills err (http 400, invalid_request_error) and returns false, so a
 * validator can `return srv_bad(err, "temperature", NULL, "...")`. */
bool srv_bad(srv_error *err, const char *param, const char *code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
/* {"error": {"message", "type", "param", "code"}} (malloc'd; free()). */
char *srv_error_json(const srv_error *err);

/* ---- chat messages --------------------------------------------------- */

typedef enum srv_role { SRV_ROLE_SYSTEM, SRV_ROLE_USER, SRV_ROLE_ASSISTANT, SRV_ROLE_TOOL } srv_role;

typedef struct srv_message {
    srv_role role;
    char *content; /* the text ("" for none) */
} srv_message;

/* tool_choice: what the model may or must do with the request's tools. */
typedef enum srv_tool_choice {
    SRV_TOOLS_NONE,     /* no tools, or "none": tools are not shown to the model, no calls parsed */
    SRV_TOOLS_AUTO,     /* the model may call them (the default with tools) */
    SRV_TOOLS_REQUIRED, /* it must call one: decoding is constrained to one call */
    SRV_TOOLS_NAMED     /* it must call tool_name */
} srv_tool_choice;

#define SRV_MAX_TOOLS 128

/* ---- requests -------------------------------------------------------- */

typedef enum srv_kind { SRV_COMPLETION, SRV_CHAT } srv_kind;

#define SRV_MAX_N 16       /* choices per prompt */
#define SRV_MAX_PROMPTS 16 /* prompts in one completion request */
#define SRV_MAX_STOP 16    /* stop strings */
#define SRV_MAX_STOP_LEN 256

typedef struct srv_prompt {
    char *text;   /* a text prompt, or NULL */
    int32_t *ids; /* a token-id prompt (when text is NULL) */
    int n_ids;
} srv_prompt;

typedef struct srv_request {
    srv_kind kind;
    srv_prompt prompts[SRV_MAX_PROMPTS]; /* completions */
    int n_prompts;
    srv_message *messages; /* chat */
    int n_messages;
    int max_tokens;       /* -1 when not given */
    duet_sampling sampling;
    bool seed_set;
    int n;
    bool stream, include_usage, ignore_eos;
    char *stop[SRV_MAX_STOP];
    int n_stop;
    duet_priority priority;
    double timeout_s; /* "timeout": seconds until it is cancelled and answered (0: the server's) */
    /* Logprobs: completions' "logprobs": N (then top_logprobs = N) and
     * "echo"; chat's "logprobs": true and "top_logprobs": N. */
    bool logprobs, echo;
    int top_logprobs;
    /* GBNF the output must follow: the request's "grammar" (llama.cpp), or
     * from "response_format" json_object / json_schema. NULL: none. */
    char *grammar;
    /* Chat: the messages as the chat template reads them (JSON array:
     * roles, content as text, assistant tool_calls with their arguments as
     * objects where they parse, tool results), and the "tools" array
     * (NULL: none, or tool_choice "none"). */
    char *messages_json;
    char *tools_json;
    srv_tool_choice tool_choice;
    char tool_name[72]; /* SRV_TOOLS_NAMED */
} srv_request;

/* What validation needs to know about the served model. */
typedef struct srv_limits {
    const char *model_name;  /* the served name */
    const char *model_alias; /* also accepted (the -m path); may be NULL */
    int n_vocab;
} srv_limits;

/* Parses and validates a request body. Unknown fields are ignored; known
 * fields of the wrong type or with absurd values are errors. On failure
 * *err says why (http 400) and *out holds nothing to free. */
bool srv_request_parse(srv_kind kind, const char *body, size_t len, const srv_limits *lim, srv_request *out,
                       srv_error *err);
void srv_request_free(srv_request *r);
/* A chat request's messages (and tools) as the conversation JSON
 * duet_chat_template_apply reads (malloc'd; NULL when out of memory). */
char *srv_conversation_json(const srv_request *r);

/* ---- responses ------------------------------------------------------- */

/* One token's logprob record (the response's "logprobs"). */
typedef struct srv_lp {
    int32_t token;
    bool has; /* false: no logprob (an echoed prompt's first token: null) */
    float logprob;
    int n_top;
    duet_token_logprob top[DUET_MAX_TOP_LOGPROBS];
} srv_lp;

/* The "logprobs" object of a choice or chunk for records lp[0..n): chat's
 * {"content": [...]} or completions' {"tokens", "token_logprobs",
 * "top_logprobs", "text_offset"} with offsets from text_offset0. Returns a
 * cJSON * (void * keeps cJSON out of this header). */
void *srv_logprobs_json(srv_kind kind, const duet_model *m, const srv_lp *lp, int n, size_t text_offset0);

typedef char srv_call_id[32];

typedef struct srv_choice_result {
    const char *text;
    size_t len;
    const char *finish; /* "stop", "length", ... */
    /* With logprobs asked for (logprobs true): the records and the model
     * that names their tokens. */
    bool logprobs;
    const srv_lp *lp;
    int n_lp;
    const duet_model *model;
    /* Chat with tools: the calls parsed from the text (text and len are
     * then the content outside them; with calls and no content, content
     * is null) and their ids. */
    const duet_tool_calls *calls;
    const srv_call_id *call_ids;
} srv_choice_result;

typedef struct srv_usage {
    int prompt_tokens, completion_tokens;
} srv_usage;

/* The whole (non-streamed) response body (malloc'd; free()). */
char *srv_response_json(srv_kind kind, const char *id, long created, const char *model,
                        const srv_choice_result *choices, int n, srv_usage usage);
/* One SSE event "data: {...}\n\n" appended to out: a text delta of choice
 * `index` (finish NULL), its final chunk (finish set, text empty), or with
 * role=true the chat opening delta {"role":"assistant","content":""}.
 * null_usage adds "usage": null (stream_options.include_usage). */
bool srv_chunk_sse(srv_text *out, srv_kind kind, const char *id, long created, const char *model, int index,
                   const char *text, size_t len, const char *finish, bool role, bool null_usage);
/* srv_chunk_sse with the logprobs of the chunk's tokens (lp->logprobs set). */
bool srv_chunk_sse_lp(srv_text *out, srv_kind kind, const char *id, long created, const char *model,
                      int index, const char *text, size_t len, const char *finish, bool role, bool null_usage,
                      const srv_choice_result *lp, size_t text_offset0);
/* A chat chunk with one tool call's delta: its opening (call_id and name
 * set: id, type and name, arguments "") or a piece of its arguments. */
bool srv_tool_chunk_sse(srv_text *out, const char *id, long created, const char *model, int index, int call,
                        const char *call_id, const char *name, const char *args, size_t args_len,
                        bool null_usage);
/* The usage chunk (empty choices) that ends a stream with include_usage. */
bool srv_usage_sse(srv_text *out, srv_kind kind, const char *id, long created, const char *model, srv_usage u);

/* ---- token text ------------------------------------------------------ */

/* Length of the longest prefix of s[0..n) that is whole, valid UTF-8. */
size_t srv_utf8_valid_prefix(const char *s, size_t n);
/* Replaces every byte that is not part of valid UTF-8 with U+FFFD. */
void srv_utf8_sanitize(srv_text *t);
/* A token's bytes as a JSON string (a cJSON *, declared void * here so this
 * header needs no cJSON): the text when its bytes are whole UTF-8, else
 * OpenAI's "bytes:\\xe2\\x80" spelling. *bytes_out (may be NULL) gets the raw
 * bytes and *n_bytes their count (at most 255). */
void *srv_token_json(const duet_model *m, int32_t id, unsigned char *bytes_out, int *n_bytes);

/* ---- the server ------------------------------------------------------ */

#define SRV_DEFAULT_MAX_CONNECTIONS 4096
#define SRV_DEFAULT_IDLE_TIMEOUT_S 30
#define SRV_DEFAULT_READ_TIMEOUT_S 30

typedef struct srv_config {
    const char *host;          /* address to bind; "0.0.0.0" or "::" for all */
    int port;                  /* 0 = any free port (see srv_port) */
    const char *model_name;    /* served name (the `model` field) */
    const char *model_path;    /* also accepted as the model name */
    const char *chat_template; /* NULL or "auto": from the model; or a family name */
    int max_connections; /* open connections; past it requests get 503 (0 = SRV_DEFAULT_MAX_CONNECTIONS) */
    int idle_timeout_s;  /* an idle connection is closed after this (0 = SRV_DEFAULT_IDLE_TIMEOUT_S) */
    int read_timeout_s;  /* a request must arrive whole within this (0 = SRV_DEFAULT_READ_TIMEOUT_S) */
    double request_timeout_s;    /* generation deadline per request; 0 = none */
    const char *api_key;         /* NULL or "": no authentication */
    bool metrics_public;         /* /metrics without the API key */
    const char *allowed_origins; /* NULL: no CORS; "*" or a comma-separated list of origins */
    bool verbose;                /* log one line per request */
} srv_config;

typedef struct srv srv;

/* Starts listening, serving through fleet f (one instance or several, all
 * of one model). Returns 0, or -1 after printing why. */
int srv_start(duet_fleet *f, const srv_config *cfg, srv **out);
int srv_port(const srv *s);
const char *srv_chat_template_in_use(const srv *s);
/* From now on GET /ready answers 200 (until srv_drain): call it once the
 * model is warm (duet_engine_warmup). Before, /ready answers 503. */
void srv_set_ready(srv *s);
/* Stops accepting connections; requests arriving on open connections get
 * 503 (and /ready too). Requests in flight carry on. */
void srv_drain(srv *s);
/* Waits until no request is in flight (true) or the timeout passes. */
bool srv_wait_idle(srv *s, double timeout_s);
/* Cancels every request in flight (their clients get what was generated). */
void srv_cancel_all(srv *s);
/* Closes every connection and frees the server (the fleet and its engines stay). */
void srv_stop(srv *s);

#endif /* DUET_SERVER_H */
