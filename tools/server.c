/* server.c — the HTTP side of `duet serve` (libmicrohttpd).
 *
 * Threads: libmicrohttpd runs one thread per connection, so a connection
 * may block while its request generates: a non-streamed request waits in
 * the access handler, a streamed one in the response's content reader. The
 * engine thread only appends to a job under the job's mutex and signals its
 * condition variable; it never waits for a connection.
 *
 * A job is one HTTP request: it fans out into one engine request ("slot")
 * per prompt and choice (n). It is reference counted: one reference for the
 * connection, one for a streaming response, one per engine request until
 * its DONE event. Whoever drops the last one frees it.
 *
 * Client disconnects: every WAIT_SLICE_MS a waiting connection peeks at its
 * socket (recv MSG_PEEK); an orderly close or a reset cancels the job's
 * engine requests, whose KV blocks the engine frees at once. A stream whose
 * write fails is cancelled the same way from the request-completed callback.
 *
 * Connections: poll(), not select(), so sockets past FD_SETSIZE (1024) are
 * served (epoll would need suspend/resume around every blocking wait, which
 * thread-per-connection does not have); an idle connection is closed after
 * idle_timeout_s; past max_connections open connections a request gets 503
 * with Connection: close (libmicrohttpd itself drops connections only
 * beyond a margin above that, when even a 503 would cost too much).
 *
 * Locks: the job mutex is never held while calling into the engine
 * (duet_engine_cancel is called after unlocking), so the engine may hold its
 * own lock while delivering events without risking a lock-order deadlock.
 *
 * Instances: requests go through a fleet (duet_fleet_*): one engine, or
 * several (--instance) behind the router, which picks the instance of each
 * engine request and retries it elsewhere when its instance fails first.
 * Events carry the instance that served them; a non-streamed response
 * names them in its X-Duet-Instance header. A request may name one itself
 * in the same header (GET /v1/models lists the instances): it is pinned
 * there (duet_fleet_submit_to), whatever the router would choose.
 */
#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <malloc.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "server.h"

#define MAX_BODY (8u << 20)     /* request bodies beyond this get 413 */
#define WAIT_SLICE_MS 50        /* how often a waiting connection checks its client */
#define STREAM_BLOCK (16 << 10) /* libmicrohttpd's buffer for a streamed response */
#define CONN_STACK (2u << 20)   /* per connection thread: cJSON recursion up to its nesting limit fits */
#define CONN_MARGIN 64          /* connections past max_connections that still get their 503 */

enum {
    R_COMPLETIONS,
    R_CHAT,
    R_MODELS,
    R_HEALTH,
    R_METRICS,
    R_TOKENIZE,
    R_DETOKENIZE,
    R_READY,
    R_OPENAPI,
    R_OTHER
};
#define N_ROUTES (R_OTHER + 1)
static const char *const route_paths[N_ROUTES] = {
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/health",       "/metrics",
    "/tokenize",       "/detokenize",          "/ready",     "/openapi.json", "other"};

/* tools/openapi.json, embedded by the build (tools/embed_file.cmake). */
extern const char srv_openapi_json[];
extern const unsigned long srv_openapi_json_len;

/* Status codes counted per endpoint; the last column counts every other one. */
static const int tracked_codes[] = {200, 204, 400, 401, 403, 404, 405, 408, 413, 415, 429, 499, 500, 503};
#define N_CODES ((int)(sizeof tracked_codes / sizeof *tracked_codes) + 1)

/* How a generation request ended: each one the server receives is counted
 * once, by one of these, when its connection is done with it. */
enum { OUT_STOP, OUT_LENGTH, OUT_CANCELLED, OUT_FAILED, OUT_REJECTED, OUT_INVALID, N_OUTCOMES };
static const char *const outcome_names[N_OUTCOMES] = {"stop",   "length",   "cancelled",
                                                      "failed", "rejected", "invalid"};

/* One open TCP connection, for the request-read deadline: `reading` while a
 * request is on its way in (from the connection's start, or from the last
 * response), so a client that trickles its request is cut off. */
typedef struct conn_rec {
    struct conn_rec *prev, *next;
    int fd;
    struct sockaddr_storage peer; /* to recognise the socket before shutting it */
    socklen_t peer_len;
    double read_since;
    bool reading;
} conn_rec;

struct srv {
    struct MHD_Daemon *d;
    unsigned idle_s; /* --idle-timeout: connections without a request in work */
    duet_fleet *f;
    const duet_model *model;
    char *name, *path, *name_label;
    srv_limits lim;
    int n_ctx, port;
    size_t fit_bytes; /* prompts longer than this may be refused early (prompt_may_fit) */
    duet_chat_template *chat;
    duet_tool_syntax tool_syntax; /* how the chat template writes tool calls */
    int32_t bos;                  /* -1 when the model has none */
    bool verbose;
    long started;
    uint64_t salt;
    atomic_uint_fast64_t counter;
    atomic_bool draining, cancel_all, stopping;
    atomic_bool ready;     /* srv_set_ready was called (the model is warm); /ready says so until draining */
    atomic_int open_conns; /* TCP connections libmicrohttpd holds open */
    int max_conns;
    double read_timeout_s, request_timeout_s;
    char *api_key;       /* NULL: no authentication */
    bool metrics_public; /* /metrics without the key */
    char **origins;      /* allowed CORS origins (NULL-terminated), or NULL */
    bool any_origin;     /* --allowed-origins '*' */

    pthread_mutex_t mu; /* in_flight, stats, outcomes */
    pthread_cond_t idle;
    int in_flight;
    uint64_t stats[N_ROUTES][N_CODES]; /* the last code column counts "other" codes */
    uint64_t received, outcomes[N_OUTCOMES], read_timeouts;

    /* Open connections, for the request-read deadline (the sweeper thread). */
    pthread_mutex_t conns_mu;
    pthread_cond_t sweep_cv;
    conn_rec *conns;
    pthread_t sweeper;
    bool sweeper_started, sweeper_stop;
};

typedef struct job job;

typedef struct slot {
    job *j;
    int index;  /* the choice index in the response */
    int prompt; /* which prompt it answers */
    uint64_t id;
    int instance; /* the fleet instance that served it (set at DONE) */
    bool submitted, done, failed;
    srv_text text; /* the generated text (the engine cuts it at a stop string); echo: the prompt's first */
    int tokens, prompt_tokens;
    srv_lp *lp; /* logprob records (echo: the prompt's tokens first) */
    int n_lp, cap_lp;
    duet_finish finish;
    char error[256];
    /* Chat with tools (the connection's thread only): each call's id, and
     * what the stream has sent of the content and of each call. */
    srv_call_id call_ids[DUET_MAX_TOOL_CALLS];
    int calls_opened;
    size_t content_sent, args_sent[DUET_MAX_TOOL_CALLS];
} slot;

/* A stream event: slot's text grew to `end` bytes, or (finish) it ended. */
typedef struct sse_ev {
    int slot;
    size_t end;
    int lp_end; /* the slot's logprob records then */
    bool finish;
} sse_ev;

struct job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    srv *s;
    srv_request req;
    int pin;                       /* the instance of its X-Duet-Instance header; -1: the router picks */
    duet_tool_syntax tools;        /* the syntax the replies' tool calls are parsed in; NONE: not parsed */
    char *stops[SRV_MAX_STOP + 4]; /* request's and the chat template's (not owned) */
    int n_stops;
    char id[48];
    long created;
    slot *slots;
    int n_slots, n_done;
    int prompt_tokens; /* the prompts' tokens, each prompt once */
    bool cancelled;
    bool timed_out; /* cancelled by its deadline */
    bool peer_eof;  /* the client half-closed (or closed: writes will tell) */
    sse_ev *ev;     /* appended by the engine thread */
    int n_ev, cap_ev;

    /* The connection's side (its own thread only). */
    int fd;
    int ev_sent;
    size_t *sent_end;
    int *sent_lp;
    bool role_sent, stream_done;
    srv_text out;
    size_t out_off;
    double t0, deadline; /* deadline: monotonic seconds, 0 = none */
    bool timeout_sent;   /* the stream's timeout error event went out */
};

typedef struct conn {
    srv_text body;
    bool too_big, counted;
    int route, code;
    bool generation; /* a POST to a generation endpoint: counted in received/outcomes */
    bool received;   /* ... and it arrived whole */
    int outcome;     /* -1 until an error response decides it; else from the job */
    job *j;
    char instances[256]; /* X-Duet-Instance of the answer: its choices' instances */
} conn;

static double mono_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static uint64_t fresh_u64(srv *s) {
    return splitmix64(s->salt ^ atomic_fetch_add(&s->counter, 1));
}

/* ---- jobs --------------------------------------------------------------- */

static void job_free(job *j) {
    for (int i = 0; i < j->n_slots; i++) {
        srv_text_free(&j->slots[i].text);
        free(j->slots[i].lp);
    }
    free(j->slots);
    free(j->sent_lp);
    free(j->ev);
    free(j->sent_end);
    srv_text_free(&j->out);
    srv_request_free(&j->req);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

static void job_release(job *j) {
    pthread_mutex_lock(&j->mu);
    bool last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) job_free(j);
}

/* Under j->mu. A failed allocation drops the event: the final one is
 * retried by the reader, which sees `done` and the text either way. */
static void push_event(job *j, int slot_i, size_t end, bool finish) {
    if (j->n_ev == j->cap_ev) {
        int cap = j->cap_ev ? j->cap_ev * 2 : 64;
        sse_ev *ev = realloc(j->ev, (size_t)cap * sizeof *ev);
        if (!ev) return;
        j->ev = ev;
        j->cap_ev = cap;
    }
    j->ev[j->n_ev++] = (sse_ev){slot_i, end, j->slots[slot_i].n_lp, finish};
}

/* The engine's event callback: runs on the engine thread, so it only
 * appends and signals. Stop strings are the engine's: the text it sends
 * never holds one, and a request cut by one ends as STOP. */
/* Under j->mu: appends a logprob record; false when out of memory. */
static bool add_lp(slot *sl, int32_t token, const duet_event *ev) {
    if (sl->n_lp == sl->cap_lp) {
        int cap = sl->cap_lp ? sl->cap_lp * 2 : 32;
        srv_lp *lp = realloc(sl->lp, (size_t)cap * sizeof *lp);
        if (!lp) return false;
        sl->lp = lp;
        sl->cap_lp = cap;
    }
    srv_lp *l = &sl->lp[sl->n_lp++];
    l->token = token;
    l->has = ev && ev->has_logprob;
    l->logprob = l->has ? ev->logprob : 0;
    l->n_top = l->has ? ev->n_top : 0;
    if (l->n_top) memcpy(l->top, ev->top, (size_t)l->n_top * sizeof *l->top);
    return true;
}

static void on_event(const duet_event *ev, void *user) {
    slot *sl = user;
    job *j = sl->j;
    bool cancel = false, last = false;
    pthread_mutex_lock(&j->mu);
    if (ev->kind == DUET_EVENT_PROMPT_TOKEN) {
        if (!sl->failed && !add_lp(sl, ev->token, ev)) {
            snprintf(sl->error, sizeof sl->error, "out of memory for the logprobs");
            sl->failed = cancel = true;
        }
    } else if (ev->kind == DUET_EVENT_TOKEN) {
        if (!sl->failed && !sl->done) {
            if (ev->token >= 0) sl->tokens++;
            if (ev->token >= 0 && j->req.logprobs && !add_lp(sl, ev->token, ev)) {
                snprintf(sl->error, sizeof sl->error, "out of memory for the logprobs");
                sl->failed = cancel = true;
            } else if (ev->text_len && !srv_text_append(&sl->text, ev->text, ev->text_len)) {
                snprintf(sl->error, sizeof sl->error, "out of memory for the generated text");
                sl->failed = cancel = true; /* end here and free the sequence */
            } else if (ev->text_len) {
                push_event(j, sl->index, sl->text.len, false);
            }
        }
    } else {
        sl->done = true;
        sl->instance = ev->instance;
        j->n_done++;
        sl->finish = sl->error[0] ? DUET_FINISH_ERROR : ev->finish;
        sl->tokens = ev->generated_tokens;
        sl->prompt_tokens = ev->prompt_tokens;
        if (ev->finish == DUET_FINISH_ERROR && !sl->error[0])
            snprintf(sl->error, sizeof sl->error, "%s",
                     ev->message && ev->message[0] ? ev->message : "engine error");
        push_event(j, sl->index, sl->text.len, true);
        last = --j->refs == 0;
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (cancel) duet_fleet_cancel(j->s->f, ev->request_id);
    if (last) job_free(j);
}

/* Cancels the job's engine requests that have not finished. */
static void job_cancel(job *j) {
    uint64_t ids[SRV_MAX_N * 4];
    int n = 0;
    pthread_mutex_lock(&j->mu);
    j->cancelled = true;
    for (int i = 0; i < j->n_slots; i++)
        if (j->slots[i].submitted && !j->slots[i].done) ids[n++] = j->slots[i].id;
    pthread_mutex_unlock(&j->mu);
    for (int i = 0; i < n; i++)
        duet_fleet_cancel(j->s->f, ids[i]);
}

/* What the client's side of the socket says. An orderly close (EOF) may be
 * a half-close by a client still waiting for its answer, so only a reset or
 * an error means it is gone; a closed client is found by the next write
 * (its kernel answers with a reset), which the waits below provoke with
 * keepalive bytes once they have seen the EOF. */
typedef enum { PEER_OK, PEER_EOF, PEER_GONE } peer_state;

static peer_state peer_check(int fd) {
    if (fd < 0) return PEER_OK;
    char b;
    ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return PEER_EOF;
    return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR ? PEER_GONE : PEER_OK;
}

/* Waits on j->cv (held) for one slice. */
static void wait_slice(job *j) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += WAIT_SLICE_MS * 1000000L;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(&j->cv, &j->mu, &ts);
}

/* Cancels the job once its deadline has passed. */
static void check_deadline(job *j) {
    if (j->deadline > 0 && !j->cancelled && mono_now() > j->deadline) {
        j->timed_out = true;
        job_cancel(j);
    }
}

/* Between slices (j->mu not held): cancels on a vanished client, a server
 * shutting down, srv_cancel_all or the deadline. Returns true when the
 * client is gone; notes a half-close in j->peer_eof. */
static bool check_client(job *j) {
    srv *s = j->s;
    peer_state p = peer_check(j->fd);
    if (p == PEER_EOF) j->peer_eof = true;
    bool gone = p == PEER_GONE || atomic_load(&s->stopping);
    if ((gone || atomic_load(&s->cancel_all)) && !j->cancelled) job_cancel(j);
    check_deadline(j);
    return gone;
}

static const char *finish_name(duet_finish f) {
    switch (f) {
    case DUET_FINISH_LENGTH:
        return "length";
    case DUET_FINISH_CANCELLED:
        return "abort";
    case DUET_FINISH_ERROR:
        return "error";
    default:
        return "stop";
    }
}

static srv_usage job_usage(job *j) {
    srv_usage u = {j->prompt_tokens, 0};
    for (int i = 0; i < j->n_slots; i++)
        u.completion_tokens += j->slots[i].tokens;
    return u;
}

/* ---- responses ------------------------------------------------------ */

static void count_response(srv *s, conn *cn, int code) {
    int k = N_CODES - 1;
    for (int i = 0; i < N_CODES - 2; i++)
        if (tracked_codes[i] == code) k = i;
    pthread_mutex_lock(&s->mu);
    s->stats[cn->route][k]++;
    pthread_mutex_unlock(&s->mu);
    cn->code = code;
}

/* CORS: only for an allowed Origin, and only when --allowed-origins asks. */
static bool origin_allowed(const srv *s, const char *origin) {
    if (s->any_origin) return true;
    for (char **o = s->origins; o && *o; o++)
        if (!strcmp(*o, origin)) return true;
    return false;
}

static void add_cors(srv *s, struct MHD_Connection *c, struct MHD_Response *r) {
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    if (!origin || !origin_allowed(s, origin)) return;
    MHD_add_response_header(r, "Access-Control-Allow-Origin", s->any_origin ? "*" : origin);
    if (!s->any_origin) MHD_add_response_header(r, MHD_HTTP_HEADER_VARY, "Origin");
}

static enum MHD_Result send_body(srv *s, conn *cn, struct MHD_Connection *c, int code, const char *ctype,
                                 char *body, const char *retry_after) {
    if (!body) {
        body = strdup("{\"error\":{\"message\":\"out of "
                      "memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}");
        code = 500;
        if (!body) return MHD_NO;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (retry_after) MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, retry_after);
    if (atomic_load(&s->draining)) MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    if (code == 401) MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (cn && cn->instances[0]) MHD_add_response_header(r, "X-Duet-Instance", cn->instances);
    add_cors(s, c, r);
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)code, r);
    MHD_destroy_response(r);
    count_response(s, cn, code);
    /* A refused generation request: its outcome is the refusal's. */
    if (cn->generation && cn->outcome < 0 && code >= 300)
        cn->outcome = code == 429 || code == 503 ? OUT_REJECTED : code >= 500 ? OUT_FAILED : OUT_INVALID;
    return ret;
}

static enum MHD_Result send_json(srv *s, conn *cn, struct MHD_Connection *c, int code, char *body) {
    return send_body(s, cn, c, code, "application/json", body, NULL);
}

static enum MHD_Result send_error(srv *s, conn *cn, struct MHD_Connection *c, const srv_error *err) {
    return send_body(s, cn, c, err->http ? err->http : 400, "application/json", srv_error_json(err),
                     err->http == 429 ? "1" : NULL);
}

static srv_error server_error(int http, const char *type, const char *code, const char *msg) {
    srv_error e = {.http = http, .type = type, .code = code};
    snprintf(e.message, sizeof e.message, "%s", msg);
    return e;
}

/* The error of a request cut by its deadline (408, request_timeout). */
static srv_error timeout_error(job *j) {
    srv_error e = server_error(408, "invalid_request_error", "request_timeout", "");
    pthread_mutex_lock(&j->mu);
    int generated = job_usage(j).completion_tokens;
    pthread_mutex_unlock(&j->mu);
    snprintf(
        e.message, sizeof e.message,
        "the request did not finish within its timeout of %.3g s (%d tokens generated); it was cancelled",
        j->deadline - j->t0, generated);
    return e;
}

/* ---- GET endpoints -------------------------------------------------- */

static enum MHD_Result get_models(srv *s, conn *cn, struct MHD_Connection *c) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", s->name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)s->started);
    cJSON_AddStringToObject(m, "owned_by", "duet");
    cJSON_AddNumberToObject(m, "max_model_len", s->n_ctx);
    /* duet's own: the instances serving it (an X-Duet-Instance header pins a request to one). */
    cJSON *insts = cJSON_AddArrayToObject(m, "instances");
    for (int i = 0; i < duet_fleet_size(s->f); i++) {
        duet_fleet_instance_desc d;
        if (duet_fleet_describe(s->f, i, &d)) continue;
        cJSON *it = cJSON_CreateObject();
        cJSON_AddStringToObject(it, "name", d.name);
        cJSON_AddStringToObject(it, "backend", d.backend);
        cJSON_AddStringToObject(it, "device", d.device);
        cJSON_AddStringToObject(it, "tier", d.tier == DUET_PRIORITY_BATCH ? "batch" : "interactive");
        cJSON_AddNumberToObject(it, "max_batch_seqs", d.max_batch_seqs);
        cJSON_AddBoolToObject(it, "healthy", d.healthy);
        cJSON_AddItemToArray(insts, it);
    }
    cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "data"), m);
    char *t = cJSON_PrintUnformatted(o);
    char *body = t ? strdup(t) : NULL;
    cJSON_free(t);
    cJSON_Delete(o);
    return send_json(s, cn, c, 200, body);
}

static enum MHD_Result get_metrics(srv *s, conn *cn, struct MHD_Connection *c) {
    char *engine = duet_fleet_metrics(s->f);
    if (!engine) {
        srv_error e = server_error(500, "server_error", NULL, "could not render the metrics");
        return send_error(s, cn, c, &e);
    }
    srv_text t = {0};
    bool ok = srv_text_append(&t, engine, strlen(engine));
    free(engine);
    /* The server's own numbers: responses by endpoint and status code. */
    ok = ok &&
         srv_text_printf(&t, "# HELP duet_http_requests_total HTTP responses by endpoint and status code.\n"
                             "# TYPE duet_http_requests_total counter\n");
    pthread_mutex_lock(&s->mu);
    for (int r = 0; r < N_ROUTES; r++)
        for (int k = 0; k < N_CODES; k++) {
            char code[8];
            if (k == N_CODES - 1)
                snprintf(code, sizeof code, "other");
            else
                snprintf(code, sizeof code, "%d", tracked_codes[k]);
            ok = ok && srv_text_printf(
                           &t, "duet_http_requests_total{model_name=\"%s\",path=\"%s\",code=\"%s\"} %llu\n",
                           s->name_label, route_paths[r], code, (unsigned long long)s->stats[r][k]);
        }
    /* The accounting identity: once idle, received = the sum of finished. */
    ok = ok && srv_text_printf(
                   &t,
                   "# HELP duet_server_requests_received_total Generation requests (POST /v1/completions, "
                   "/v1/chat/completions) taken up: read whole, or refused on their headers.\n"
                   "# TYPE duet_server_requests_received_total counter\n"
                   "duet_server_requests_received_total{model_name=\"%s\"} %llu\n"
                   "# HELP duet_server_requests_finished_total Generation requests by outcome (rejected: "
                   "429/503; invalid: refused 4xx); each received request is counted once when it ends.\n"
                   "# TYPE duet_server_requests_finished_total counter\n",
                   s->name_label, (unsigned long long)s->received);
    for (int o = 0; o < N_OUTCOMES; o++)
        ok = ok && srv_text_printf(
                       &t, "duet_server_requests_finished_total{model_name=\"%s\",outcome=\"%s\"} %llu\n",
                       s->name_label, outcome_names[o], (unsigned long long)s->outcomes[o]);
    ok = ok && srv_text_printf(
                   &t,
                   "# HELP duet_server_read_timeouts_total Connections shut because no whole request "
                   "arrived within --read-timeout (slow clients; keep-alive connections idle that long).\n"
                   "# TYPE duet_server_read_timeouts_total counter\n"
                   "duet_server_read_timeouts_total{model_name=\"%s\"} %llu\n",
                   s->name_label, (unsigned long long)s->read_timeouts);
    pthread_mutex_unlock(&s->mu);
    if (!ok) {
        srv_text_free(&t);
        t.p = NULL;
    }
    return send_body(s, cn, c, 200, "text/plain; version=0.0.4; charset=utf-8", t.p, NULL);
}

/* 200 {"status":"ok"}; 503 when draining, or when the engine cannot serve
 * (its device was lost): {"status":"unhealthy","error":"..."}. */
static enum MHD_Result get_health(srv *s, conn *cn, struct MHD_Connection *c) {
    char why[512];
    if (!duet_fleet_healthy(s->f, why, sizeof why)) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "status", "unhealthy");
        cJSON_AddStringToObject(o, "error", why);
        char *t = cJSON_PrintUnformatted(o);
        char *body = t ? strdup(t) : NULL;
        cJSON_free(t);
        cJSON_Delete(o);
        return send_json(s, cn, c, 503, body);
    }
    bool draining = atomic_load(&s->draining);
    return send_json(s, cn, c, draining ? 503 : 200,
                     strdup(draining ? "{\"status\":\"draining\"}" : "{\"status\":\"ok\"}"));
}

/* /ready, for a readiness probe: 200 {"status":"ready"} once srv_set_ready
 * was called (the model is loaded and warm) and until draining starts; 503
 * {"status":"starting"|"draining"|"unhealthy"} otherwise. */
static enum MHD_Result get_ready(srv *s, conn *cn, struct MHD_Connection *c) {
    const char *why = atomic_load(&s->draining)            ? "draining"
                      : !atomic_load(&s->ready)            ? "starting"
                      : !duet_fleet_healthy(s->f, NULL, 0) ? "unhealthy"
                                                           : NULL;
    char body[64];
    snprintf(body, sizeof body, "{\"status\":\"%s\"}", why ? why : "ready");
    return send_json(s, cn, c, why ? 503 : 200, strdup(body));
}

/* ---- /tokenize and /detokenize, as llama.cpp's server has them ------------ */

static int tokenize(const duet_model *m, const char *text, size_t len, int32_t **out);

static cJSON *body_json(conn *cn) {
    return cn->body.p ? cJSON_ParseWithLength(cn->body.p, cn->body.len) : NULL;
}

static enum MHD_Result send_cjson(srv *s, conn *cn, struct MHD_Connection *c, cJSON *o) {
    char *t = o ? cJSON_PrintUnformatted(o) : NULL;
    char *body = t ? strdup(t) : NULL;
    cJSON_free(t);
    cJSON_Delete(o);
    return send_json(s, cn, c, 200, body);
}

/* {"content": "...", "add_special": false, "with_pieces": false} ->
 * {"tokens": [ids]} or, with_pieces, {"tokens": [{"id", "piece"}]}. */
static enum MHD_Result post_tokenize(srv *s, conn *cn, struct MHD_Connection *c) {
    cJSON *in = body_json(cn);
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(in, "content");
    const cJSON *as = cJSON_GetObjectItemCaseSensitive(in, "add_special");
    const cJSON *wp = cJSON_GetObjectItemCaseSensitive(in, "with_pieces");
    srv_error err;
    if (!cJSON_IsObject(in) || !cJSON_IsString(content) || (as && !cJSON_IsBool(as)) ||
        (wp && !cJSON_IsBool(wp))) {
        cJSON_Delete(in);
        srv_bad(&err, "content", "invalid_value",
                "the body must be {\"content\": string, \"add_special\": bool, \"with_pieces\": bool}");
        return send_error(s, cn, c, &err);
    }
    const char *text = content->valuestring;
    size_t len = strlen(text);
    int32_t *ids = NULL;
    int n = len ? tokenize(s->model, text, len, &ids) : 0;
    if (n >= 0 && !cJSON_IsTrue(as) && n > 0 && ids[0] == s->bos) /* tokenize() adds BOS as the model asks */
        memmove(ids, ids + 1, (size_t)--n * sizeof *ids);
    if (n < 0) {
        cJSON_Delete(in);
        free(ids);
        srv_bad(&err, "content", NULL, "cannot tokenize: %s", duet_last_error());
        return send_error(s, cn, c, &err);
    }
    cJSON *o = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(o, "tokens");
    for (int i = 0; i < n; i++) {
        if (cJSON_IsTrue(wp)) {
            cJSON *t = cJSON_CreateObject();
            cJSON_AddNumberToObject(t, "id", ids[i]);
            cJSON_AddItemToObject(t, "piece", srv_token_json(s->model, ids[i], NULL, NULL));
            cJSON_AddItemToArray(arr, t);
        } else {
            cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
        }
    }
    free(ids);
    cJSON_Delete(in);
    return send_cjson(s, cn, c, o);
}

/* {"tokens": [ids]} -> {"content": "..."} (the pieces joined; bytes that
 * are not UTF-8 become U+FFFD). */
static enum MHD_Result post_detokenize(srv *s, conn *cn, struct MHD_Connection *c) {
    cJSON *in = body_json(cn);
    const cJSON *toks = cJSON_GetObjectItemCaseSensitive(in, "tokens");
    srv_error err;
    duet_model_desc d;
    duet_model_describe(s->model, &d);
    bool ok = cJSON_IsObject(in) && cJSON_IsArray(toks);
    for (const cJSON *t = ok ? toks->child : NULL; t; t = t->next)
        if (!cJSON_IsNumber(t) || t->valuedouble != (double)(int)t->valuedouble || t->valueint < 0 ||
            t->valueint >= d.n_vocab)
            ok = false;
    if (!ok) {
        cJSON_Delete(in);
        srv_bad(&err, "tokens", "invalid_value", "the body must be {\"tokens\": [token ids in [0, %d)]}",
                d.n_vocab);
        return send_error(s, cn, c, &err);
    }
    srv_text t = {0};
    char piece[256];
    for (const cJSON *it = toks->child; it; it = it->next) {
        int n = duet_token_piece(s->model, it->valueint, piece, sizeof piece);
        if (n > 0) srv_text_append(&t, piece, (size_t)(n < (int)sizeof piece ? n : (int)sizeof piece));
    }
    cJSON_Delete(in);
    srv_utf8_sanitize(&t);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "content", t.p ? t.p : "");
    srv_text_free(&t);
    return send_cjson(s, cn, c, o);
}

/* ---- generation ------------------------------------------------------ */

/* Tokenizes text into a malloc'd array; returns the count or a negative status. */
static int tokenize(const duet_model *m, const char *text, size_t len, int32_t **out) {
    int cap = (int)(len < (1u << 24) ? len : (1u << 24)) + 16;
    for (;;) {
        int32_t *ids = malloc((size_t)cap * sizeof *ids);
        if (!ids) return DUET_OUT_OF_MEMORY;
        int n = duet_tokenize(m, text, len, true, true, ids, cap);
        if (n >= 0 && n <= cap) {
            *out = ids;
            return n;
        }
        free(ids);
        if (n < 0) return n;
        cap = n;
    }
}

/* A prompt far longer in bytes than a context can hold is refused without
 * tokenizing all of it (megabytes cost seconds of a core): its first
 * `fit_bytes` bytes, which are enough for a context's worth of tokens, are
 * tokenized instead, and if they alone fill the context it cannot fit. */
static bool prompt_may_fit(srv *s, const char *text) {
    size_t len = strlen(text);
    if (len <= s->fit_bytes) return true;
    size_t cut = s->fit_bytes;
    while (cut > 0 && ((unsigned char)text[cut] & 0xC0) == 0x80)
        cut--; /* at a character boundary */
    int32_t *ids = NULL;
    int n = tokenize(s->model, text, cut, &ids);
    free(ids);
    return n < s->n_ctx; /* a tokenizer error is left to the full tokenization to report */
}

/* A call id as OpenAI writes them, or Mistral's 9 letters and digits
 * (its template refuses others when the call comes back). */
static void make_call_id(srv *s, duet_tool_syntax syn, srv_call_id out) {
    static const char digits[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    uint64_t x = fresh_u64(s);
    if (syn != DUET_TOOL_SYNTAX_MISTRAL) {
        snprintf(out, sizeof(srv_call_id), "call_%016llx", (unsigned long long)x);
        return;
    }
    for (int i = 0; i < 9; i++, x /= 62)
        out[i] = digits[x % 62];
    out[9] = '\0';
}

/* A chat request with tools: the template must render them and write calls
 * duet parses; a required call becomes the request's grammar. */
static bool prepare_tools(srv *s, job *j, srv_error *err) {
    srv_request *r = &j->req;
    j->tools = s->tool_syntax;
    if (j->tools == DUET_TOOL_SYNTAX_NONE)
        return srv_bad(
            err, "tools", "unsupported",
            "this server's chat template (%s) renders no tools, or writes tool calls in a syntax duet "
            "does not parse (Hermes <tool_call>, Llama 3.1 JSON, Mistral [TOOL_CALLS]); start it with "
            "--chat-template FILE naming a template that does (e.g. Qwen2.5's), or send tool_choice \"none\"",
            duet_chat_template_name(s->chat));
    if (r->tool_choice != SRV_TOOLS_REQUIRED && r->tool_choice != SRV_TOOLS_NAMED) return true;
    duet_status st = duet_tool_call_grammar(
        j->tools, r->tools_json, r->tool_choice == SRV_TOOLS_NAMED ? r->tool_name : NULL, &r->grammar);
    if (st == DUET_OUT_OF_MEMORY)
        return *err = server_error(500, "server_error", NULL, "out of memory"), false;
    if (st) return srv_bad(err, "tools", "invalid_value", "%s", duet_last_error());
    return true;
}

/* Builds the job's slots and prompts; on failure fills err. */
static bool job_prepare(srv *s, job *j, int32_t **ids, int *n_ids, srv_error *err) {
    srv_request *r = &j->req;
    int n_prompts = r->kind == SRV_CHAT ? 1 : r->n_prompts;
    if (r->kind == SRV_CHAT && r->tools_json && !prepare_tools(s, j, err)) return false;
    for (int p = 0; p < n_prompts; p++) {
        const char *text = NULL;
        srv_text chat = {0};
        if (r->kind == SRV_CHAT) {
            char *conv = srv_conversation_json(r);
            duet_status st =
                conv ? duet_chat_template_apply(s->chat, conv, true, &chat.p) : DUET_OUT_OF_MEMORY;
            free(conv);
            if (st == DUET_OUT_OF_MEMORY)
                return *err = server_error(500, "server_error", NULL, "out of memory"), false;
            if (st) return srv_bad(err, "messages", "invalid_value", "%s", duet_last_error());
            text = chat.p;
        } else {
            text = r->prompts[p].text;
        }
        if (text && !prompt_may_fit(s, text)) {
            srv_text_free(&chat);
            return srv_bad(
                err, r->kind == SRV_CHAT ? "messages" : "prompt", "context_length_exceeded",
                "This model's maximum context length is %d tokens; the prompt has more (%zu bytes)", s->n_ctx,
                strlen(text));
        }
        if (text) {
            int n = tokenize(s->model, text, strlen(text), &ids[p]);
            srv_text_free(&chat);
            if (n < 0)
                return srv_bad(err, r->kind == SRV_CHAT ? "messages" : "prompt", NULL, "cannot tokenize: %s",
                               duet_last_error()[0] ? duet_last_error() : duet_status_str((duet_status)n));
            /* A template that writes the BOS text itself gets it once. */
            if (r->kind == SRV_CHAT && n >= 2 && ids[p][0] == s->bos && ids[p][1] == s->bos)
                memmove(ids[p], ids[p] + 1, (size_t)--n * sizeof **ids);
            n_ids[p] = n;
        } else {
            n_ids[p] = r->prompts[p].n_ids;
            if (!(ids[p] = malloc((size_t)n_ids[p] * sizeof **ids)))
                return *err = server_error(500, "server_error", NULL, "out of memory"), false;
            memcpy(ids[p], r->prompts[p].ids, (size_t)n_ids[p] * sizeof **ids);
        }
        const char *param = r->kind == SRV_CHAT ? "messages" : "prompt";
        if (n_ids[p] == 0)
            return srv_bad(err, param, "invalid_value", "the prompt is empty (and the model adds no BOS)");
        if (n_ids[p] >= s->n_ctx)
            return srv_bad(err, param, "context_length_exceeded",
                           "This model's maximum context length is %d tokens; the prompt has %d tokens",
                           s->n_ctx, n_ids[p]);
        if (r->max_tokens > 0 && n_ids[p] + r->max_tokens > s->n_ctx)
            return srv_bad(
                err, "max_tokens", "context_length_exceeded",
                "This model's maximum context length is %d tokens. However, you requested %d tokens (%d in "
                "the prompt, %d for the completion). Reduce the prompt or max_tokens.",
                s->n_ctx, n_ids[p] + r->max_tokens, n_ids[p], r->max_tokens);
        j->prompt_tokens += n_ids[p];
    }
    j->n_slots = n_prompts * r->n;
    j->slots = calloc((size_t)j->n_slots, sizeof *j->slots);
    j->sent_end = calloc((size_t)j->n_slots, sizeof *j->sent_end);
    j->sent_lp = calloc((size_t)j->n_slots, sizeof *j->sent_lp);
    if (!j->slots || !j->sent_end || !j->sent_lp)
        return *err = server_error(500, "server_error", NULL, "out of memory"), false;
    for (int i = 0; i < j->n_slots; i++) {
        slot *sl = &j->slots[i];
        sl->j = j;
        sl->index = i;
        sl->prompt = i / r->n;
        /* echo: the choice starts with its prompt (its text, or the ids'
         * pieces) and, with logprobs, the prompt's tokens (the first has
         * none; the engine's PROMPT_TOKEN events give the rest). */
        if (!r->echo) continue;
        const char *pt = r->prompts[sl->prompt].text;
        bool ok = true;
        if (pt)
            ok = srv_text_append(&sl->text, pt, strlen(pt));
        else
            for (int k = 0; ok && k < n_ids[sl->prompt]; k++) {
                char piece[256];
                int len = duet_token_piece(s->model, ids[sl->prompt][k], piece, sizeof piece);
                if (len > 0) ok = srv_text_append(&sl->text, piece, (size_t)(len < 256 ? len : 256));
            }
        if (ok && !pt) srv_utf8_sanitize(&sl->text);
        if (ok && r->logprobs) ok = add_lp(sl, ids[sl->prompt][0], NULL);
        if (!ok) return *err = server_error(500, "server_error", NULL, "out of memory"), false;
    }
    /* Stop strings: the request's, then the template's end-of-turn markers. */
    for (int i = 0; i < r->n_stop; i++)
        j->stops[j->n_stops++] = r->stop[i];
    if (r->kind == SRV_CHAT)
        for (const char *const *t = duet_chat_template_stops(s->chat); *t; t++)
            j->stops[j->n_stops++] = (char *)*t;
    return true;
}

/* Submits every slot; on a refusal cancels the ones already queued. */
static bool job_submit(srv *s, job *j, int32_t **ids, const int *n_ids, srv_error *err) {
    srv_request *r = &j->req;
    for (int i = 0; i < j->n_slots; i++) {
        slot *sl = &j->slots[i];
        int p = sl->prompt;
        duet_request q = {.prompt = ids[p],
                          .n_prompt = n_ids[p],
                          .sampling = r->sampling,
                          .priority = r->priority,
                          .ignore_eos = r->ignore_eos,
                          .stop = (const char *const *)j->stops,
                          .n_stop = j->n_stops,
                          .logprobs = r->logprobs,
                          .prompt_logprobs = r->echo,
                          .top_logprobs = r->top_logprobs,
                          .grammar = r->grammar};
        /* Default length: OpenAI's 16 for completions, the rest of the
         * context for chat. */
        int room = s->n_ctx - n_ids[p];
        q.max_tokens = r->max_tokens > 0           ? r->max_tokens
                       : r->kind == SRV_COMPLETION ? (room < 16 ? room : 16)
                                                   : room;
        /* n choices with one seed must still differ: seed + choice. */
        q.sampling.seed = r->seed_set ? r->sampling.seed + (uint64_t)(i % r->n) : fresh_u64(s);
        pthread_mutex_lock(&j->mu);
        j->refs++;
        pthread_mutex_unlock(&j->mu);
        uint64_t id = 0;
        duet_status st = duet_fleet_submit_to(s->f, j->pin, &q, on_event, sl, &id);
        if (st) {
            job_release(j); /* the reference the engine did not take */
            const char *msg = duet_last_error()[0] ? duet_last_error() : duet_status_str(st);
            if (st == DUET_QUEUE_FULL)
                *err = server_error(429, "rate_limit_error", "queue_full", msg);
            else if (st == DUET_CONTEXT_FULL)
                srv_bad(err, "max_tokens", "context_length_exceeded", "%s", msg);
            else if (st == DUET_BAD_REQUEST || st == DUET_INVALID_ARGUMENT)
                srv_bad(err, NULL, "invalid_value", "%s", msg);
            else
                *err = server_error(503, "server_error", NULL, msg);
            job_cancel(j);
            return false;
        }
        pthread_mutex_lock(&j->mu);
        sl->id = id;
        sl->submitted = true;
        pthread_mutex_unlock(&j->mu);
    }
    return true;
}

static bool is_space(char c) {
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

/* A chat reply with tools, streamed: sends what text[0..len) adds to what
 * the client of slot si has: content (whole UTF-8 characters, and not the
 * whitespace that may lead into a call), then each call's opening once its
 * name is whole and its arguments as they grow, as OpenAI streams them.
 * Returns the calls found. */
static int tool_stream(job *j, int si, const char *text, size_t len, bool final) {
    srv *s = j->s;
    slot *sl = &j->slots[si];
    bool null_usage = j->req.include_usage;
    duet_tool_calls tc;
    if (!text) text = "", len = 0;
    if (duet_tool_calls_parse(j->tools, text, len, final, &tc)) return 0;
    size_t cl = tc.content_len;
    if (!final || tc.n)
        while (cl > sl->content_sent && is_space(text[cl - 1]))
            cl--;
    if (cl > sl->content_sent) {
        size_t n = cl - sl->content_sent;
        if (!final) n = srv_utf8_valid_prefix(text + sl->content_sent, n);
        if (n)
            srv_chunk_sse(&j->out, SRV_CHAT, j->id, j->created, s->name, si, text + sl->content_sent, n, NULL,
                          false, null_usage);
        sl->content_sent += n;
    }
    int named = 0;
    for (; named < tc.n && tc.call[named].name; named++) {
        const duet_tool_call *c = &tc.call[named];
        int k = named;
        if (k >= sl->calls_opened) {
            make_call_id(s, j->tools, sl->call_ids[k]);
            srv_tool_chunk_sse(&j->out, j->id, j->created, s->name, si, k, sl->call_ids[k], c->name, "", 0,
                               null_usage);
            sl->calls_opened = k + 1;
        }
        if (c->arguments_len > sl->args_sent[k]) {
            size_t n = c->arguments_len - sl->args_sent[k];
            if (!final && !c->complete) n = srv_utf8_valid_prefix(c->arguments + sl->args_sent[k], n);
            if (n)
                srv_tool_chunk_sse(&j->out, j->id, j->created, s->name, si, k, NULL, NULL,
                                   c->arguments + sl->args_sent[k], n, null_usage);
            sl->args_sent[k] += n;
        }
    }
    duet_tool_calls_free(&tc);
    return named;
}

/* Formats what the engine produced since the last call into j->out. */
static void stream_fill(job *j) {
    srv *s = j->s;
    srv_request *r = &j->req;
    bool usage_null = r->include_usage;
    /* A stream whose tokens keep coming never waits a whole slice, so it
     * would never reach check_client: look at srv_cancel_all here too. */
    if (atomic_load(&s->cancel_all) && !j->cancelled) job_cancel(j);
    check_deadline(j);
    if (!j->role_sent) {
        j->role_sent = true;
        if (r->kind == SRV_CHAT)
            for (int i = 0; i < j->n_slots; i++)
                srv_chunk_sse(&j->out, r->kind, j->id, j->created, s->name, i, NULL, 0, NULL, true,
                              usage_null);
        if (j->out.len) return;
    }
    pthread_mutex_lock(&j->mu);
    while (j->ev_sent == j->n_ev && j->n_done < j->n_slots) {
        wait_slice(j);
        if (j->ev_sent == j->n_ev && j->n_done < j->n_slots) {
            pthread_mutex_unlock(&j->mu);
            bool gone = check_client(j);
            pthread_mutex_lock(&j->mu);
            if (gone) {
                pthread_mutex_unlock(&j->mu);
                j->stream_done = true; /* the reader ends the response with an error */
                j->out.len = j->out_off = 0;
                return;
            }
            if (j->peer_eof && j->ev_sent == j->n_ev) {
                /* An SSE comment, which clients ignore: a closed client's
                 * socket fails the write and the stream ends. */
                pthread_mutex_unlock(&j->mu);
                srv_text_printf(&j->out, ": keepalive\n\n");
                return;
            }
        }
    }
    /* Copy the new text out under the lock, format after it. */
    int n = j->n_ev - j->ev_sent;
    sse_ev *evs = n ? malloc((size_t)n * sizeof *evs) : NULL;
    srv_text *texts = n ? calloc((size_t)n, sizeof *texts) : NULL;
    duet_finish *fin = n ? calloc((size_t)n, sizeof *fin) : NULL;
    char(*errs)[256] = n ? calloc((size_t)n, sizeof *errs) : NULL;
    srv_choice_result *lps = n ? calloc((size_t)n, sizeof *lps) : NULL;
    size_t *offs = n ? calloc((size_t)n, sizeof *offs) : NULL;
    if (n && (!evs || !texts || !fin || !errs || !lps || !offs)) n = 0; /* retried on the next call */
    for (int k = 0; k < n; k++) {
        evs[k] = j->ev[j->ev_sent + k];
        slot *sl = &j->slots[evs[k].slot];
        size_t from = j->sent_end[evs[k].slot];
        if (j->tools) /* the whole reply so far: the tool-call parser rescans it */
            srv_text_append(&texts[k], sl->text.p ? sl->text.p : "",
                            evs[k].finish ? sl->text.len : evs[k].end);
        else if (!evs[k].finish && evs[k].end > from)
            srv_text_append(&texts[k], sl->text.p + from, evs[k].end - from);
        if (!evs[k].finish) j->sent_end[evs[k].slot] = evs[k].end;
        offs[k] = from;
        /* The logprobs of the tokens since the last chunk (at the end, all the rest). */
        int lp_from = j->sent_lp[evs[k].slot], lp_to = evs[k].finish ? sl->n_lp : evs[k].lp_end;
        if (j->tools && !evs[k].finish) lp_to = lp_from; /* with tools, logprobs come with the last chunk */
        if (r->logprobs && lp_to > lp_from) {
            srv_lp *copy = malloc((size_t)(lp_to - lp_from) * sizeof *copy);
            if (copy) {
                memcpy(copy, sl->lp + lp_from, (size_t)(lp_to - lp_from) * sizeof *copy);
                lps[k] = (srv_choice_result){
                    .logprobs = true, .lp = copy, .n_lp = lp_to - lp_from, .model = s->model};
                j->sent_lp[evs[k].slot] = lp_to;
            }
        } else if (r->logprobs) {
            lps[k] = (srv_choice_result){.logprobs = true, .model = s->model};
        }
        fin[k] = sl->finish;
        memcpy(errs[k], sl->error, sizeof errs[k]);
    }
    j->ev_sent += n;
    bool all_done = j->n_done == j->n_slots && j->ev_sent == j->n_ev;
    srv_usage u = job_usage(j);
    pthread_mutex_unlock(&j->mu);

    for (int k = 0; k < n; k++) {
        bool failed = evs[k].finish &&
                      (fin[k] == DUET_FINISH_ERROR || (j->timed_out && fin[k] == DUET_FINISH_CANCELLED));
        int calls =
            j->tools && !failed ? tool_stream(j, evs[k].slot, texts[k].p, texts[k].len, evs[k].finish) : 0;
        if (!evs[k].finish) {
            if (texts[k].len && !j->tools)
                srv_chunk_sse_lp(&j->out, r->kind, j->id, j->created, s->name, evs[k].slot, texts[k].p,
                                 texts[k].len, NULL, false, usage_null, &lps[k], offs[k]);
        } else if (failed) {
            if (fin[k] != DUET_FINISH_ERROR && j->timeout_sent) continue; /* one timeout event per stream */
            srv_error e = fin[k] == DUET_FINISH_ERROR ? server_error(500, "server_error", NULL, errs[k])
                                                      : timeout_error(j);
            j->timeout_sent |= fin[k] != DUET_FINISH_ERROR;
            char *ej = srv_error_json(&e);
            if (ej) srv_text_printf(&j->out, "data: %s\n\n", ej);
            free(ej);
        } else {
            const char *why = calls && fin[k] == DUET_FINISH_STOP ? "tool_calls" : finish_name(fin[k]);
            srv_chunk_sse_lp(&j->out, r->kind, j->id, j->created, s->name, evs[k].slot, "", 0, why, false,
                             usage_null, lps[k].n_lp ? &lps[k] : NULL, offs[k]);
        }
        srv_text_free(&texts[k]);
        free((void *)lps[k].lp);
    }
    free(lps);
    free(offs);
    free(evs);
    free(texts);
    free(fin);
    free(errs);
    if (all_done) {
        if (r->include_usage) srv_usage_sse(&j->out, r->kind, j->id, j->created, s->name, u);
        srv_text_printf(&j->out, "data: [DONE]\n\n");
        j->stream_done = true;
    }
}

/* Hands libmicrohttpd the next bytes of j->out (formatted, not yet sent). */
static ssize_t copy_out(job *j, char *buf, size_t max) {
    size_t n = j->out.len - j->out_off < max ? j->out.len - j->out_off : max;
    memcpy(buf, j->out.p + j->out_off, n);
    j->out_off += n;
    if (j->out_off == j->out.len) j->out.len = j->out_off = 0;
    return (ssize_t)n;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    job *j = cls;
    for (;;) {
        if (j->out_off < j->out.len) return copy_out(j, buf, max);
        if (j->stream_done) {
            pthread_mutex_lock(&j->mu);
            bool finished = j->n_done == j->n_slots;
            pthread_mutex_unlock(&j->mu);
            return finished ? MHD_CONTENT_READER_END_OF_STREAM : MHD_CONTENT_READER_END_WITH_ERROR;
        }
        stream_fill(j);
    }
}

static void stream_free(void *cls) {
    job_release(cls);
}

/* The finished job's answer: *code and a malloc'd JSON body. Call when
 * every slot is done (the engine is done with them: no lock needed). */
static char *plain_answer(srv *s, job *j, int *code) {
    const char *error = NULL;
    for (int i = 0; i < j->n_slots; i++)
        if (j->slots[i].finish == DUET_FINISH_ERROR) error = j->slots[i].error;
    srv_error e;
    if (error)
        e = server_error(500, "server_error", NULL, error);
    else if (j->timed_out)
        e = timeout_error(j);
    if (error || j->timed_out) {
        *code = e.http;
        return srv_error_json(&e);
    }
    srv_choice_result *res = calloc((size_t)(j->n_slots > 0 ? j->n_slots : 1), sizeof *res);
    duet_tool_calls *tcs = j->tools ? calloc((size_t)j->n_slots, sizeof *tcs) : NULL;
    bool ok = res && (!j->tools || tcs);
    for (int i = 0; ok && i < j->n_slots; i++) {
        slot *sl = &j->slots[i];
        res[i] = (srv_choice_result){.text = sl->text.p,
                                     .len = sl->text.len,
                                     .finish = finish_name(sl->finish),
                                     .logprobs = j->req.logprobs,
                                     .lp = sl->lp,
                                     .n_lp = sl->n_lp,
                                     .model = s->model};
        if (!j->tools) continue;
        /* The calls apart from the content (whose trailing whitespace led into them). */
        if (duet_tool_calls_parse(j->tools, sl->text.p ? sl->text.p : "", sl->text.len, true, &tcs[i])) {
            ok = false;
            break;
        }
        res[i].len = tcs[i].content_len;
        while (tcs[i].n && res[i].len && is_space(res[i].text[res[i].len - 1]))
            res[i].len--;
        for (int k = 0; k < tcs[i].n; k++)
            make_call_id(s, j->tools, sl->call_ids[k]);
        res[i].calls = &tcs[i];
        res[i].call_ids = sl->call_ids;
        if (tcs[i].n && sl->finish == DUET_FINISH_STOP) res[i].finish = "tool_calls";
    }
    char *body =
        ok ? srv_response_json(j->req.kind, j->id, j->created, s->name, res, j->n_slots, job_usage(j)) : NULL;
    for (int i = 0; tcs && i < j->n_slots; i++)
        duet_tool_calls_free(&tcs[i]);
    free(tcs);
    free(res);
    *code = 200;
    return body;
}

/* The reader of a non-streamed answer whose client half-closed: status 200
 * is sent at once, then a space (JSON allows leading whitespace) every
 * slice until the answer is ready, so that a client that really closed is
 * found by a failed write and its request cancelled (from `completed`). */
static ssize_t plain_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    job *j = cls;
    for (;;) {
        if (j->out_off < j->out.len) return copy_out(j, buf, max);
        if (j->stream_done) return MHD_CONTENT_READER_END_OF_STREAM;
        pthread_mutex_lock(&j->mu);
        if (j->n_done < j->n_slots) wait_slice(j);
        bool done = j->n_done == j->n_slots;
        pthread_mutex_unlock(&j->mu);
        if (!done) {
            if (check_client(j)) return MHD_CONTENT_READER_END_WITH_ERROR;
            buf[0] = ' ';
            return 1;
        }
        int code;
        char *body = plain_answer(j->s, j, &code);
        if (!body || !srv_text_append(&j->out, body, strlen(body))) {
            free(body);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        free(body);
        j->stream_done = true;
    }
}

static enum MHD_Result finish_plain(srv *s, conn *cn, struct MHD_Connection *c, job *j) {
    pthread_mutex_lock(&j->mu);
    while (j->n_done < j->n_slots) {
        wait_slice(j);
        if (j->n_done == j->n_slots) break;
        pthread_mutex_unlock(&j->mu);
        bool gone = check_client(j);
        if (gone) {
            count_response(s, cn, 499); /* nginx's "client closed request" */
            return MHD_NO;
        }
        if (j->peer_eof && !j->cancelled) {
            /* Half-closed, or closed: answer through plain_read. */
            pthread_mutex_lock(&j->mu);
            j->refs++; /* the response's */
            pthread_mutex_unlock(&j->mu);
            struct MHD_Response *r =
                MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, STREAM_BLOCK, plain_read, j, stream_free);
            if (!r) {
                job_release(j);
                return MHD_NO;
            }
            MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
            add_cors(s, c, r);
            enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, r);
            MHD_destroy_response(r);
            count_response(s, cn, 200);
            return ret;
        }
        pthread_mutex_lock(&j->mu);
    }
    int served[SRV_MAX_N * SRV_MAX_PROMPTS];
    int n_served = j->n_slots < (int)(sizeof served / sizeof *served) ? j->n_slots
                                                                      : (int)(sizeof served / sizeof *served);
    for (int i = 0; i < n_served; i++)
        served[i] = j->slots[i].instance;
    pthread_mutex_unlock(&j->mu);
    size_t at = 0;
    for (int i = 0; i < n_served; i++) {
        duet_fleet_instance_desc d;
        if (duet_fleet_describe(s->f, served[i], &d)) continue;
        int w = snprintf(cn->instances + at, sizeof cn->instances - at, "%s%s", i ? "," : "", d.name);
        if (w < 0 || (size_t)w >= sizeof cn->instances - at) {
            cn->instances[at] = 0; /* whole names only */
            break;
        }
        at += (size_t)w;
    }
    int code;
    char *body = plain_answer(s, j, &code);
    if (j->timed_out && cn->generation) cn->outcome = OUT_CANCELLED;
    return send_json(s, cn, c, code, body);
}

static enum MHD_Result generate(srv *s, conn *cn, struct MHD_Connection *c) {
    srv_error err;
    if (atomic_load(&s->draining)) {
        err = server_error(503, "server_error", "shutting_down", "the server is shutting down");
        return send_error(s, cn, c, &err);
    }
    if (cn->too_big) {
        err =
            server_error(413, "invalid_request_error", "request_too_large", "the request body is too large");
        return send_error(s, cn, c, &err);
    }
    /* X-Duet-Instance: NAME pins the request to that instance. */
    const char *pin_name = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Duet-Instance");
    int pin = pin_name ? duet_fleet_find(s->f, pin_name) : -1;
    if (pin_name && pin < 0) {
        srv_bad(&err, NULL, "invalid_value",
                "X-Duet-Instance: no instance is named '%.64s'; this server has ", pin_name);
        size_t at = strlen(err.message);
        for (int i = 0; i < duet_fleet_size(s->f) && at < sizeof err.message; i++) {
            duet_fleet_instance_desc d;
            if (duet_fleet_describe(s->f, i, &d)) continue;
            at +=
                (size_t)snprintf(err.message + at, sizeof err.message - at, "%s%s (%s, %s)", i ? ", " : "",
                                 d.name, d.backend, d.tier == DUET_PRIORITY_BATCH ? "batch" : "interactive");
        }
        return send_error(s, cn, c, &err);
    }
    job *j = calloc(1, sizeof *j);
    if (!j) return MHD_NO;
    j->pin = pin;
    srv_kind kind = cn->route == R_CHAT ? SRV_CHAT : SRV_COMPLETION;
    if (!srv_request_parse(kind, cn->body.p ? cn->body.p : "", cn->body.len, &s->lim, &j->req, &err)) {
        free(j);
        return send_error(s, cn, c, &err);
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->refs = 1; /* the connection's */
    j->s = s;
    j->fd = -1;
    j->t0 = mono_now();
    /* The deadline: the request's "timeout", at most the server's. */
    double timeout = j->req.timeout_s;
    if (s->request_timeout_s > 0 && (timeout <= 0 || timeout > s->request_timeout_s))
        timeout = s->request_timeout_s;
    j->deadline = timeout > 0 ? j->t0 + timeout : 0;
    j->created = (long)time(NULL);
    snprintf(j->id, sizeof j->id, "%s%016llx", kind == SRV_CHAT ? "chatcmpl-" : "cmpl-",
             (unsigned long long)fresh_u64(s));
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) j->fd = ci->connect_fd;
    cn->j = j;
    pthread_mutex_lock(&s->mu);
    s->in_flight++;
    pthread_mutex_unlock(&s->mu);
    cn->counted = true;

    int32_t *ids[SRV_MAX_PROMPTS] = {0};
    int n_ids[SRV_MAX_PROMPTS] = {0};
    bool ok = job_prepare(s, j, ids, n_ids, &err) && job_submit(s, j, ids, n_ids, &err);
    for (int p = 0; p < SRV_MAX_PROMPTS; p++)
        free(ids[p]);
    if (!ok) return send_error(s, cn, c, &err);
    /* A request in work is not idle: one queued behind a long backlog can
     * wait past --idle-timeout before its first byte, and libmicrohttpd
     * would then close it mid-response ("partial file", no error event).
     * Its client is watched instead (check_client: a vanished client
     * cancels it), and --request-timeout bounds it; `completed` restores
     * the idle timeout for the connection's next request. */
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, 0u);

    if (!j->req.stream) return finish_plain(s, cn, c, j);
    pthread_mutex_lock(&j->mu);
    j->refs++; /* the response's */
    pthread_mutex_unlock(&j->mu);
    struct MHD_Response *r =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, STREAM_BLOCK, stream_read, j, stream_free);
    if (!r) {
        job_release(j);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(r, "X-Accel-Buffering", "no"); /* proxies must not buffer the stream */
    if (pin_name) MHD_add_response_header(r, "X-Duet-Instance", pin_name); /* known before it starts */
    enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    count_response(s, cn, 200);
    return ret;
}

/* ---- routing --------------------------------------------------------- */

static int route_of(const char *url) {
    for (int r = 0; r < R_OTHER; r++)
        if (!strcmp(url, route_paths[r])) return r;
    /* Without the /v1 prefix too, as some clients send. */
    if (!strcmp(url, "/completions")) return R_COMPLETIONS;
    if (!strcmp(url, "/chat/completions")) return R_CHAT;
    if (!strcmp(url, "/models")) return R_MODELS;
    return R_OTHER;
}

/* Keeps the list of open connections for the sweeper. libmicrohttpd says
 * CLOSED before it closes the socket, so a listed fd is still this one. */
static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    srv *s = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        atomic_fetch_add(&s->open_conns, 1);
        conn_rec *rec = calloc(1, sizeof *rec);
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (!rec || !ci) {
            free(rec);
            return; /* no read deadline for this one */
        }
        rec->fd = ci->connect_fd;
        rec->peer_len = sizeof rec->peer;
        if (getpeername(rec->fd, (struct sockaddr *)&rec->peer, &rec->peer_len) != 0) rec->peer_len = 0;
        rec->read_since = mono_now();
        rec->reading = true;
        pthread_mutex_lock(&s->conns_mu);
        rec->next = s->conns;
        if (s->conns) s->conns->prev = rec;
        s->conns = rec;
        pthread_mutex_unlock(&s->conns_mu);
        *socket_context = rec;
    } else if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
        atomic_fetch_sub(&s->open_conns, 1);
        conn_rec *rec = *socket_context;
        if (!rec) return;
        pthread_mutex_lock(&s->conns_mu);
        if (rec->prev)
            rec->prev->next = rec->next;
        else
            s->conns = rec->next;
        if (rec->next) rec->next->prev = rec->prev;
        pthread_mutex_unlock(&s->conns_mu);
        free(rec);
        *socket_context = NULL;
    }
}

/* The request-read deadline: a connection whose request has been arriving
 * for longer than read_timeout_s (headers or body, however slowly it
 * trickles: the idle timeout alone restarts at every byte) is shut down,
 * which ends its libmicrohttpd thread. */
static void *sweep_main(void *arg) {
    srv *s = arg;
    pthread_mutex_lock(&s->conns_mu);
    while (!s->sweeper_stop) {
        double now = mono_now();
        for (conn_rec *r = s->conns; r; r = r->next) {
            if (!r->reading || now - r->read_since < s->read_timeout_s) continue;
            struct sockaddr_storage peer;
            socklen_t len = sizeof peer;
            if (getpeername(r->fd, (struct sockaddr *)&peer, &len) == 0 && len == r->peer_len &&
                !memcmp(&peer, &r->peer, len))
                shutdown(r->fd, SHUT_RDWR);
            r->reading = false;
            pthread_mutex_lock(&s->mu);
            s->read_timeouts++;
            pthread_mutex_unlock(&s->mu);
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 250000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&s->sweep_cv, &s->conns_mu, &ts);
    }
    pthread_mutex_unlock(&s->conns_mu);
    return NULL;
}

/* Counts Content-Length headers whose value differs from the first. */
static enum MHD_Result content_length_seen(void *cls, enum MHD_ValueKind kind, const char *key,
                                           const char *value) {
    (void)kind;
    const char **first = ((const char **)cls);
    if (strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH) != 0) return MHD_YES;
    if (!first[0])
        first[0] = value ? value : "";
    else if (strcmp(first[0], value ? value : "") != 0)
        first[1] = value ? value : "";
    return MHD_YES;
}

/* The answer to a CORS preflight from an allowed origin. */
static enum MHD_Result send_preflight(srv *s, conn *cn, struct MHD_Connection *c) {
    struct MHD_Response *r = MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    add_cors(s, c, r);
    MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
    MHD_add_response_header(r, "Access-Control-Allow-Headers",
                            "Authorization, Content-Type, X-Duet-Instance");
    MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    enum MHD_Result ret = MHD_queue_response(c, 204, r);
    MHD_destroy_response(r);
    count_response(s, cn, 204);
    return ret;
}

/* The connection's record (its socket context). */
static conn_rec *rec_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

/* The request is in whole: the read deadline stops, and a generation
 * request is counted as received. */
static void request_read(srv *s, struct MHD_Connection *c, conn *cn) {
    conn_rec *rec = rec_of(c);
    if (rec) {
        pthread_mutex_lock(&s->conns_mu);
        rec->reading = false;
        pthread_mutex_unlock(&s->conns_mu);
    }
    if (cn->generation) {
        cn->received = true;
        pthread_mutex_lock(&s->mu);
        s->received++;
        pthread_mutex_unlock(&s->mu);
    }
}

/* Compares in time that depends on the length of what the client sent,
 * never on how much of the key it got right. */
static bool key_matches(const char *key, const char *got) {
    size_t nk = strlen(key), ng = strlen(got);
    unsigned char diff = nk != ng;
    for (size_t i = 0; i < ng; i++)
        diff |= (unsigned char)(got[i] ^ key[i % nk]);
    return diff == 0;
}

/* Is the media type of the header value application/json (any parameters)? */
static bool is_json_type(const char *v) {
    if (!v) return false;
    while (*v == ' ' || *v == '\t')
        v++;
    size_t n = strlen("application/json");
    if (strncasecmp(v, "application/json", n)) return false;
    v += n;
    while (*v == ' ' || *v == '\t')
        v++;
    return *v == 0 || *v == ';';
}

/* The checks before any endpoint: CORS preflight (err->http 204 = answer
 * it), the Origin, the API key, and JSON bodies on POST (a web page can
 * send text/plain across origins without asking first; JSON it cannot). */
static bool admit(srv *s, conn *cn, struct MHD_Connection *c, const char *method, srv_error *err) {
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    if (origin && !origin_allowed(s, origin)) {
        *err = server_error(403, "invalid_request_error", "origin_not_allowed", "");
        snprintf(err->message, sizeof err->message,
                 "requests from the web origin %.200s are not allowed (see --allowed-origins)", origin);
        return false;
    }
    if (!strcmp(method, MHD_HTTP_METHOD_OPTIONS) && origin && cn->route != R_OTHER) {
        *err = (srv_error){.http = 204};
        return false;
    }
    bool open =
        cn->route == R_HEALTH || cn->route == R_READY || (cn->route == R_METRICS && s->metrics_public);
    if (s->api_key && !open) {
        const char *auth = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
        if (!auth || strncasecmp(auth, "Bearer ", 7) || !key_matches(s->api_key, auth + 7)) {
            *err = server_error(401, "invalid_request_error", "invalid_api_key",
                                auth ? "Incorrect API key provided"
                                     : "An API key is required: Authorization: Bearer KEY");
            return false;
        }
    }
    if (!strcmp(method, MHD_HTTP_METHOD_POST) &&
        !is_json_type(MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE))) {
        *err = server_error(415, "invalid_request_error", "unsupported_media_type",
                            "the request body must be JSON, sent with Content-Type: application/json");
        return false;
    }
    return true;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    srv *s = cls;
    conn *cn = *con_cls;
    if (!cn) { /* first call: headers only */
        if (!(cn = calloc(1, sizeof *cn))) return MHD_NO;
        cn->route = route_of(url);
        cn->code = 0;
        cn->outcome = -1;
        cn->generation =
            (cn->route == R_COMPLETIONS || cn->route == R_CHAT) && !strcmp(method, MHD_HTTP_METHOD_POST);
        *con_cls = cn;
        /* A declared body past the limit is refused before it is read (the
         * connection then closes), rather than buffered and dropped. */
        const char *declared =
            MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (declared && strtoull(declared, NULL, 10) > MAX_BODY) {
            srv_error err = server_error(413, "invalid_request_error", "request_too_large", "");
            snprintf(err.message, sizeof err.message,
                     "the request body (%.30s bytes) is larger than the limit of %u", declared, MAX_BODY);
            request_read(s, c, cn);
            return send_error(s, cn, c, &err);
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (cn->body.len + *upload_size > MAX_BODY)
            cn->too_big = true;
        else if (!srv_text_append(&cn->body, upload, *upload_size))
            return MHD_NO;
        *upload_size = 0;
        return MHD_YES;
    }
    if (cn->code) return MHD_YES; /* already answered */
    request_read(s, c, cn);
    bool post = !strcmp(method, MHD_HTTP_METHOD_POST), get = !strcmp(method, MHD_HTTP_METHOD_GET);
    srv_error err;
    /* Two Content-Length headers that disagree: a proxy in front may have
     * framed the body by the other one (request smuggling). */
    const char *lengths[2] = {NULL, NULL};
    MHD_get_connection_values(c, MHD_HEADER_KIND, content_length_seen, lengths);
    if (lengths[1]) {
        err = server_error(400, "invalid_request_error", "conflicting_content_length", "");
        snprintf(err.message, sizeof err.message, "conflicting Content-Length headers (%.40s and %.40s)",
                 lengths[0], lengths[1]);
        return send_error(s, cn, c, &err);
    }
    if (atomic_load(&s->open_conns) > s->max_conns) {
        err = server_error(503, "server_error", "too_many_connections", "");
        snprintf(err.message, sizeof err.message,
                 "the server holds its limit of %d open connections (--max-connections); retry later",
                 s->max_conns);
        return send_error(s, cn, c, &err);
    }
    if (!admit(s, cn, c, method, &err))
        return err.http == 204 ? send_preflight(s, cn, c) : send_error(s, cn, c, &err);
    switch (cn->route) {
    case R_COMPLETIONS:
    case R_CHAT:
        if (post) return generate(s, cn, c);
        break;
    case R_MODELS:
        if (get) return get_models(s, cn, c);
        break;
    case R_HEALTH:
        if (get) return get_health(s, cn, c);
        break;
    case R_METRICS:
        if (get) return get_metrics(s, cn, c);
        break;
    case R_READY:
        if (get) return get_ready(s, cn, c);
        break;
    case R_TOKENIZE:
        if (post) return post_tokenize(s, cn, c);
        break;
    case R_DETOKENIZE:
        if (post) return post_detokenize(s, cn, c);
        break;
    case R_OPENAPI:
        if (get) return send_json(s, cn, c, 200, strndup(srv_openapi_json, srv_openapi_json_len));
        break;
    default:
        err = server_error(404, "invalid_request_error", "not_found", "");
        snprintf(err.message, sizeof err.message, "no such endpoint: %s %.200s", method, url);
        return send_error(s, cn, c, &err);
    }
    err = server_error(405, "invalid_request_error", "method_not_allowed", "");
    snprintf(err.message, sizeof err.message, "%s is not allowed on %.200s", method, url);
    return send_error(s, cn, c, &err);
}

/* A generation request's outcome, from its job (once its connection is
 * done with it): failed, cancelled (client gone, deadline, shutdown),
 * length, or stop. */
static int job_outcome(job *j) {
    int out = OUT_STOP;
    pthread_mutex_lock(&j->mu);
    bool unfinished = j->n_done < j->n_slots;
    for (int i = 0; i < j->n_slots; i++) {
        duet_finish f = j->slots[i].finish;
        if (f == DUET_FINISH_ERROR)
            out = OUT_FAILED;
        else if ((f == DUET_FINISH_CANCELLED || !j->slots[i].done) && out != OUT_FAILED)
            out = OUT_CANCELLED;
        else if (f == DUET_FINISH_LENGTH && out == OUT_STOP)
            out = OUT_LENGTH;
    }
    if ((unfinished || j->cancelled) && out != OUT_FAILED) out = OUT_CANCELLED;
    pthread_mutex_unlock(&j->mu);
    return out;
}

static void completed(void *cls, struct MHD_Connection *c, void **con_cls,
                      enum MHD_RequestTerminationCode toe) {
    (void)toe;
    srv *s = cls;
    conn_rec *rec = rec_of(c);
    if (rec) { /* a keep-alive connection's next request starts arriving now */
        pthread_mutex_lock(&s->conns_mu);
        rec->reading = true;
        rec->read_since = mono_now();
        pthread_mutex_unlock(&s->conns_mu);
    }
    conn *cn = *con_cls;
    if (!cn) return;
    if (cn->j) MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, s->idle_s);
    if (cn->received) { /* counted once, by how it ended */
        int out = cn->outcome >= 0 ? cn->outcome : cn->j ? job_outcome(cn->j) : OUT_FAILED;
        pthread_mutex_lock(&s->mu);
        s->outcomes[out]++;
        pthread_mutex_unlock(&s->mu);
    }
    if (cn->j) {
        /* A stream cut short (write error, client gone) leaves work behind. */
        pthread_mutex_lock(&cn->j->mu);
        bool unfinished = cn->j->n_done < cn->j->n_slots;
        pthread_mutex_unlock(&cn->j->mu);
        if (unfinished) job_cancel(cn->j);
        if (s->verbose) {
            pthread_mutex_lock(&cn->j->mu);
            srv_usage u = job_usage(cn->j);
            pthread_mutex_unlock(&cn->j->mu);
            fprintf(stderr, "duet: %s %d %s choices=%d prompt=%d generated=%d %.3fs%s\n",
                    route_paths[cn->route], cn->code, cn->j->id, cn->j->n_slots, u.prompt_tokens,
                    u.completion_tokens, mono_now() - cn->j->t0, unfinished ? " (cancelled)" : "");
        }
        job_release(cn->j);
    }
    if (cn->counted) {
        pthread_mutex_lock(&s->mu);
        if (--s->in_flight == 0) pthread_cond_broadcast(&s->idle);
        pthread_mutex_unlock(&s->mu);
    }
    srv_text_free(&cn->body);
    free(cn);
    *con_cls = NULL;
}

/* ---- lifecycle --------------------------------------------------------- */

/* libmicrohttpd's messages. A stream that ends because its client left is
 * reported as an "internal error" by the library; that is routine here, so
 * it is only shown with --verbose. */
static void mhd_log(void *cls, const char *fmt, va_list ap) {
    srv *s = cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    if (!s->verbose && strstr(msg, "Application reported internal error")) return;
    fprintf(stderr, "duet: http: %s%s", msg, msg[0] && msg[strlen(msg) - 1] == '\n' ? "" : "\n");
}

static char *escape_label(const char *v) {
    srv_text t = {0};
    srv_text_append(&t, "", 0);
    for (const char *p = v; *p; p++) {
        if (*p == '\\' || *p == '"')
            srv_text_printf(&t, "\\%c", *p);
        else if (*p == '\n')
            srv_text_printf(&t, "\\n");
        else
            srv_text_append(&t, p, 1);
    }
    return t.p;
}

static uint64_t os_random(void) {
    uint64_t x = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    FILE *f = fopen("/dev/urandom", "rb");
    if (f) {
        uint64_t r;
        if (fread(&r, sizeof r, 1, f) == 1) x ^= r;
        fclose(f);
    }
    return x;
}

static void srv_free(srv *s) {
    duet_chat_template_free(s->chat);
    if (!s) return;
    free(s->name);
    free(s->path);
    free(s->name_label);
    free(s->api_key);
    for (char **o = s->origins; o && *o; o++)
        free(*o);
    free(s->origins);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->idle);
    pthread_mutex_destroy(&s->conns_mu);
    pthread_cond_destroy(&s->sweep_cv);
    free(s);
}

/* "a, b,c" -> {"a", "b", "c", NULL}; "*" sets any_origin. */
static bool parse_origins(srv *s, const char *list) {
    size_t n = 1;
    for (const char *p = list; *p; p++)
        n += *p == ',';
    if (!(s->origins = calloc(n + 1, sizeof *s->origins))) return false;
    size_t k = 0;
    for (const char *p = list; *p;) {
        while (*p == ' ' || *p == ',')
            p++;
        size_t len = strcspn(p, ", ");
        if (!len) break;
        if (len == 1 && *p == '*')
            s->any_origin = true;
        else if (!(s->origins[k++] = strndup(p, len)))
            return false;
        p += len;
    }
    return true;
}

/* Every connection holds a descriptor (and a thread): lift the soft limit
 * toward `want` (the hard limit caps it), or say what the limit allows. */
static void raise_fd_limit(rlim_t want) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= want) return;
    rlim_t target = rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= want ? want : rl.rlim_max;
    rl.rlim_cur = target;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0 || target < want)
        fprintf(stderr,
                "duet: the open-file limit (%llu) is below --max-connections + 256; raise it (ulimit -n)\n",
                (unsigned long long)target);
}

int srv_start(duet_fleet *f, const srv_config *cfg, srv **out) {
    *out = NULL;
    srv *s = calloc(1, sizeof *s);
    if (!s) return fprintf(stderr, "duet: out of memory\n"), -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->idle, NULL);
    pthread_mutex_init(&s->conns_mu, NULL);
    pthread_cond_init(&s->sweep_cv, NULL);
    s->f = f;
    s->model = duet_fleet_model(f);
    s->name = strdup(cfg->model_name ? cfg->model_name : "duet");
    s->path = strdup(cfg->model_path ? cfg->model_path : "");
    s->name_label = s->name ? escape_label(s->name) : NULL;
    if (!s->name || !s->path || !s->name_label) {
        srv_free(s);
        return fprintf(stderr, "duet: out of memory\n"), -1;
    }
    duet_model_desc d;
    duet_model_describe(s->model, &d);
    /* What one request can hold: a --kv-blocks pool smaller than a context
     * lowers it, so a default max_tokens is clamped to what fits and an
     * explicit one gets a 400 that says the real limit. */
    s->n_ctx = duet_fleet_max_sequence_tokens(f); /* at most d.n_ctx; the least of the instances' */
    s->bos = d.bos;
    /* A context's worth of the longest tokens, with room for control tokens
     * (which print nothing but match their text). */
    int longest = 1;
    for (int id = 0; id < d.n_vocab; id++) {
        char piece[256];
        int n = duet_token_piece(s->model, id, piece, sizeof piece);
        if (n > longest) longest = n;
    }
    s->fit_bytes = (size_t)s->n_ctx * ((size_t)longest + 64);
    s->lim =
        (srv_limits){.model_name = s->name, .model_alias = s->path[0] ? s->path : NULL, .n_vocab = d.n_vocab};
    s->verbose = cfg->verbose;
    s->read_timeout_s = cfg->read_timeout_s > 0 ? cfg->read_timeout_s : SRV_DEFAULT_READ_TIMEOUT_S;
    s->request_timeout_s = cfg->request_timeout_s > 0 ? cfg->request_timeout_s : 0;
    s->metrics_public = cfg->metrics_public;
    if ((cfg->api_key && cfg->api_key[0] && !(s->api_key = strdup(cfg->api_key))) ||
        (cfg->allowed_origins && !parse_origins(s, cfg->allowed_origins))) {
        srv_free(s);
        return fprintf(stderr, "duet: out of memory\n"), -1;
    }
    s->started = (long)time(NULL);
    s->salt = os_random();

    /* The chat template: the model's own, or forced by name or file. */
    if (duet_chat_template_load(s->model, cfg->chat_template, &s->chat)) {
        fprintf(stderr, "duet: %s\n", duet_last_error());
        srv_free(s);
        return -1;
    }
    s->tool_syntax = duet_chat_template_tool_syntax(s->chat);
    if (s->tool_syntax != DUET_TOOL_SYNTAX_NONE)
        fprintf(stderr, "duet: the chat template writes tool calls in the %s syntax\n",
                duet_tool_syntax_name(s->tool_syntax));
    if (duet_chat_template_fallback_reason(s->chat)[0])
        fprintf(stderr, "duet: chat template '%s' (%s; force one with --chat-template)\n",
                duet_chat_template_name(s->chat), duet_chat_template_fallback_reason(s->chat));

    /* Resolve the listen address. */
    char port[16];
    snprintf(port, sizeof port, "%d", cfg->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE},
                    *ai = NULL;
    int gai = getaddrinfo(cfg->host && *cfg->host ? cfg->host : NULL, port, &hints, &ai);
    if (gai) {
        fprintf(stderr, "duet: cannot resolve --host %s: %s\n", cfg->host ? cfg->host : "",
                gai_strerror(gai));
        srv_free(s);
        return -1;
    }
    s->max_conns = cfg->max_connections > 0 ? cfg->max_connections : SRV_DEFAULT_MAX_CONNECTIONS;
    raise_fd_limit((rlim_t)s->max_conns + 256);
    /* Request bodies of megabytes come and go: a fixed mmap threshold
     * gives their memory back when they are freed (glibc's adaptive one
     * rises past them and keeps them in its arenas for good). */
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
    const unsigned idle_s =
        (unsigned)(cfg->idle_timeout_s > 0 ? cfg->idle_timeout_s : SRV_DEFAULT_IDLE_TIMEOUT_S);
    s->idle_s = idle_s;
    unsigned flags =
        MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL_INTERNAL_THREAD | MHD_USE_ITC | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    /* No MHD_OPTION_LISTENING_ADDRESS_REUSE: it sets SO_REUSEPORT, and a
     * second server on the port would start and take part of the traffic. */
    errno = 0;
    s->d =
        MHD_start_daemon(flags, (uint16_t)cfg->port, NULL, NULL, handle, s, MHD_OPTION_NOTIFY_COMPLETED,
                         completed, s, MHD_OPTION_NOTIFY_CONNECTION, on_connection, s, MHD_OPTION_SOCK_ADDR,
                         ai->ai_addr, MHD_OPTION_CONNECTION_LIMIT, (unsigned)s->max_conns + CONN_MARGIN,
                         MHD_OPTION_CONNECTION_TIMEOUT, idle_s, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, s,
                         MHD_OPTION_THREAD_STACK_SIZE, (size_t)CONN_STACK, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->d) {
        const int e = errno;
        fprintf(stderr, "duet: cannot listen on %s:%d: %s\n", cfg->host ? cfg->host : "*", cfg->port,
                e == EADDRINUSE ? "the port is in use (another server?)"
                : e             ? strerror(e)
                                : "libmicrohttpd failed");
        srv_free(s);
        return -1;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : cfg->port;
    if (pthread_create(&s->sweeper, NULL, sweep_main, s) != 0) {
        fprintf(stderr, "duet: cannot start the connection sweeper thread\n");
        MHD_stop_daemon(s->d);
        srv_free(s);
        return -1;
    }
    s->sweeper_started = true;
    *out = s;
    return 0;
}

int srv_port(const srv *s) {
    return s->port;
}

const char *srv_chat_template_in_use(const srv *s) {
    return duet_chat_template_name(s->chat);
}

void srv_set_ready(srv *s) {
    atomic_store(&s->ready, true);
}

void srv_drain(srv *s) {
    if (atomic_exchange(&s->draining, true)) return;
    /* Stop accepting: close the listening socket; open connections live on. */
    MHD_socket fd = MHD_quiesce_daemon(s->d);
    if (fd != MHD_INVALID_SOCKET) close(fd);
}

bool srv_wait_idle(srv *s, double timeout_s) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double end = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 + timeout_s;
    ts.tv_sec = (time_t)end;
    ts.tv_nsec = (long)((end - (double)ts.tv_sec) * 1e9);
    pthread_mutex_lock(&s->mu);
    int rc = 0;
    while (s->in_flight > 0 && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&s->idle, &s->mu, &ts);
    bool idle = s->in_flight == 0;
    pthread_mutex_unlock(&s->mu);
    return idle;
}

void srv_cancel_all(srv *s) {
    atomic_store(&s->cancel_all, true);
}

void srv_stop(srv *s) {
    if (!s) return;
    /* Waiting connections give up at their next slice, so MHD's joins end. */
    atomic_store(&s->cancel_all, true);
    atomic_store(&s->stopping, true);
    if (s->sweeper_started) {
        pthread_mutex_lock(&s->conns_mu);
        s->sweeper_stop = true;
        pthread_cond_signal(&s->sweep_cv);
        pthread_mutex_unlock(&s->conns_mu);
        pthread_join(s->sweeper, NULL);
    }
    MHD_stop_daemon(s->d);
    srv_free(s);
}
