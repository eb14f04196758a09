/* duet_bench_http.c — the HTTP client: streaming POSTs to an
 * OpenAI-compatible /v1/completions with libcurl's multi interface, all
 * from one thread, and GETs of /metrics and /v1/models.
 *
 * Timing follows `vllm bench serve`: a request's clock starts when it is
 * handed to curl; TTFT is the first SSE chunk that carries a choice; every
 * later such chunk adds one inter-token gap. A final chunk with an empty
 * text and a finish_reason carries no token, so it adds no gap (vLLM counts
 * it; on servers that send it separately that would add a ~0 gap).
 * Token counts come from the usage chunk (stream_options.include_usage),
 * or from the chunks counted when a server sends no usage.
 */
#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "duet_bench.h"

/* curl_global_init is not thread-safe; duet-bench calls it from main
 * before any thread exists, through this once-flag. */
static void http_global_init(void) {
    static bool done;
    if (!done) {
        curl_global_init(CURL_GLOBAL_DEFAULT);
        done = true;
    }
}

/* ---- simple GETs ------------------------------------------------------------ */

typedef struct membuf {
    char *p;
    size_t len, cap, limit;
} membuf;

static bool membuf_add(membuf *b, const char *data, size_t n) {
    if (b->limit && b->len + n > b->limit) n = b->len < b->limit ? b->limit - b->len : 0;
    if (b->len + n + 1 > b->cap) {
        size_t cap = (b->len + n + 1) * 2;
        char *p = realloc(b->p, cap);
        if (!p) return false;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = 0;
    return true;
}

static size_t membuf_write(char *data, size_t size, size_t nmemb, void *user) {
    return membuf_add(user, data, size * nmemb) ? size * nmemb : 0;
}

char *db_http_get(const char *base_url, const char *path, double timeout_s, long *status) {
    http_global_init();
    if (status) *status = 0;
    CURL *c = curl_easy_init();
    if (!c) return NULL;
    char url[1024];
    snprintf(url, sizeof url, "%s%s", base_url, path);
    membuf b = {0};
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, membuf_write);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000));
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    CURLcode rc = curl_easy_perform(c);
    long code = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(c);
    if (status) *status = code;
    if (rc != CURLE_OK || code != 200) {
        free(b.p);
        return NULL;
    }
    if (!b.p) b.p = calloc(1, 1);
    return b.p;
}

bool db_http_model_id(const char *base_url, char *buf, size_t size) {
    char *body = db_http_get(base_url, "/v1/models", 10, NULL);
    if (!body) return false;
    cJSON *o = cJSON_Parse(body);
    free(body);
    const cJSON *data = o ? cJSON_GetObjectItemCaseSensitive(o, "data") : NULL;
    const cJSON *first = cJSON_IsArray(data) ? data->child : NULL;
    const cJSON *id = first ? cJSON_GetObjectItemCaseSensitive(first, "id") : NULL;
    bool ok = cJSON_IsString(id);
    if (ok) snprintf(buf, size, "%s", id->valuestring);
    cJSON_Delete(o);
    return ok;
}

int db_http_instances(const char *base_url, db_instance *out, int max, char *err, size_t esize) {
    long status = 0;
    char *body = db_http_get(base_url, "/v1/models", 10, &status);
    if (!body) {
        snprintf(err, esize, "GET %s/v1/models failed (HTTP %ld)", base_url, status);
        return -1;
    }
    cJSON *o = cJSON_Parse(body);
    free(body);
    const cJSON *data = o ? cJSON_GetObjectItemCaseSensitive(o, "data") : NULL;
    const cJSON *first = cJSON_IsArray(data) ? data->child : NULL;
    const cJSON *arr = first ? cJSON_GetObjectItemCaseSensitive(first, "instances") : NULL;
    if (!cJSON_IsArray(arr) || !arr->child) {
        snprintf(err, esize, "%s/v1/models lists no instances (not a duet server, or an older one)",
                 base_url);
        cJSON_Delete(o);
        return -1;
    }
    int n = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, arr) {
        if (n == max) {
            snprintf(err, esize, "the server has more than %d instances", max);
            cJSON_Delete(o);
            return -1;
        }
        db_instance *d = &out[n++];
        memset(d, 0, sizeof *d);
        static const char *const keys[4] = {"name", "backend", "device", "tier"};
        char *dst[4] = {d->name, d->backend, d->device, d->tier};
        size_t sz[4] = {sizeof d->name, sizeof d->backend, sizeof d->device, sizeof d->tier};
        for (int k = 0; k < 4; k++) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(it, keys[k]);
            snprintf(dst[k], sz[k], "%s", cJSON_IsString(v) ? v->valuestring : "?");
        }
        const cJSON *mbs = cJSON_GetObjectItemCaseSensitive(it, "max_batch_seqs");
        d->max_batch_seqs = cJSON_IsNumber(mbs) ? mbs->valueint : 0;
        d->healthy = !cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(it, "healthy"));
    }
    cJSON_Delete(o);
    return n;
}

/* ---- streaming requests ----------------------------------------------------- */

typedef struct hc_req {
    CURL *easy;
    struct curl_slist *hdrs;
    char *body;
    db_result *res;
    double t_sent_abs, t_last;
    bool first, saw_done, saw_usage, bad_chunk;
    int chunks;
    membuf line;  /* the SSE text not yet split into lines */
    membuf ebody; /* the body of a non-200 answer (capped) */
    char stream_error[120];
} hc_req;

/* One SSE "data:" payload. */
static void hc_payload(hc_req *q, const char *data, double now) {
    if (!strcmp(data, "[DONE]")) {
        q->saw_done = true;
        return;
    }
    cJSON *o = cJSON_Parse(data);
    if (!o) {
        q->bad_chunk = true;
        return;
    }
    const cJSON *choices = cJSON_GetObjectItemCaseSensitive(o, "choices");
    const cJSON *usage = cJSON_GetObjectItemCaseSensitive(o, "usage");
    const cJSON *error = cJSON_GetObjectItemCaseSensitive(o, "error");
    if (cJSON_IsArray(choices) && choices->child) {
        const cJSON *c0 = choices->child;
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(c0, "text");
        const cJSON *fin = cJSON_GetObjectItemCaseSensitive(c0, "finish_reason");
        bool has_text = cJSON_IsString(text) && text->valuestring[0];
        bool finished = fin && !cJSON_IsNull(fin);
        if (has_text || !finished) {
            q->chunks++;
            if (!q->first) {
                q->res->ttft = now - q->t_sent_abs;
                q->first = true;
            } else if (!db_result_add_itl(q->res, now - q->t_last)) {
                q->bad_chunk = true;
            }
            q->t_last = now;
        }
    }
    if (cJSON_IsObject(usage)) {
        const cJSON *pt = cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens");
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(usage, "completion_tokens");
        if (cJSON_IsNumber(pt)) q->res->prompt_tokens = pt->valueint;
        if (cJSON_IsNumber(ct)) q->res->output_tokens = ct->valueint, q->saw_usage = true;
    }
    if (cJSON_IsObject(error)) {
        const cJSON *msg = cJSON_GetObjectItemCaseSensitive(error, "message");
        snprintf(q->stream_error, sizeof q->stream_error, "stream error: %s",
                 cJSON_IsString(msg) ? msg->valuestring : "(no message)");
    }
    cJSON_Delete(o);
}

static size_t hc_write(char *data, size_t size, size_t nmemb, void *user) {
    hc_req *q = user;
    size_t n = size * nmemb;
    long code = 0;
    curl_easy_getinfo(q->easy, CURLINFO_RESPONSE_CODE, &code);
    if (code != 200) {
        q->ebody.limit = 1024;
        membuf_add(&q->ebody, data, n);
        return n;
    }
    double now = db_now();
    if (!membuf_add(&q->line, data, n)) return 0;
    /* Split off whole lines; keep a partial one for the next call. */
    char *start = q->line.p, *nl;
    while ((nl = memchr(start, '\n', q->line.len - (size_t)(start - q->line.p)))) {
        *nl = 0;
        if (nl > start && nl[-1] == '\r') nl[-1] = 0;
        if (!strncmp(start, "data:", 5)) {
            const char *payload = start + 5;
            if (*payload == ' ') payload++;
            hc_payload(q, payload, now);
        }
        start = nl + 1;
    }
    size_t rest = q->line.len - (size_t)(start - q->line.p);
    memmove(q->line.p, start, rest);
    q->line.len = rest;
    q->line.p[rest] = 0;
    return n;
}

static char *request_body(const db_http *h, const db_prompt *p, const db_req_opts *ro, uint64_t seed) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    if (h->model_name[0]) cJSON_AddStringToObject(o, "model", h->model_name);
    if (p->text) {
        cJSON_AddStringToObject(o, "prompt", p->text);
    } else {
        cJSON *ids = cJSON_AddArrayToObject(o, "prompt");
        for (int i = 0; ids && i < p->n_ids; i++)
            cJSON_AddItemToArray(ids, cJSON_CreateNumber(p->ids[i]));
    }
    cJSON_AddNumberToObject(o, "max_tokens", p->output_len);
    cJSON_AddBoolToObject(o, "stream", true);
    cJSON *so = cJSON_AddObjectToObject(o, "stream_options");
    if (so) cJSON_AddBoolToObject(so, "include_usage", true);
    cJSON_AddNumberToObject(o, "temperature", ro->temperature);
    cJSON_AddNumberToObject(o, "seed", (double)(seed & 0xFFFFFFFFu));
    if (ro->ignore_eos) cJSON_AddBoolToObject(o, "ignore_eos", true);
    if (p->priority_set)
        cJSON_AddStringToObject(o, "priority", p->priority == DUET_PRIORITY_BATCH ? "batch" : "interactive");
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

static void hc_free(hc_req *q) {
    if (q->easy) curl_easy_cleanup(q->easy);
    curl_slist_free_all(q->hdrs);
    cJSON_free(q->body);
    free(q->line.p);
    free(q->ebody.p);
    memset(q, 0, sizeof *q);
}

/* The outcome of a finished transfer. */
static void hc_finish(hc_req *q, CURLcode rc, double now) {
    db_result *r = q->res;
    long code = 0;
    curl_easy_getinfo(q->easy, CURLINFO_RESPONSE_CODE, &code);
    r->e2el = now - q->t_sent_abs;
    if (!q->saw_usage) r->output_tokens = q->chunks;
    if (rc != CURLE_OK) {
        snprintf(r->error, sizeof r->error, "transfer: %s", curl_easy_strerror(rc));
    } else if (code != 200) {
        /* Keep the start of the OpenAI error message. */
        char msg[120] = "";
        cJSON *o = q->ebody.p ? cJSON_Parse(q->ebody.p) : NULL;
        const cJSON *e = o ? cJSON_GetObjectItemCaseSensitive(o, "error") : NULL;
        const cJSON *m = e ? cJSON_GetObjectItemCaseSensitive(e, "message") : NULL;
        if (cJSON_IsString(m)) snprintf(msg, sizeof msg, "%s", m->valuestring);
        cJSON_Delete(o);
        snprintf(r->error, sizeof r->error, "HTTP %ld%s%s", code, msg[0] ? ": " : "", msg);
    } else if (q->stream_error[0]) {
        snprintf(r->error, sizeof r->error, "%s", q->stream_error);
    } else if (q->bad_chunk) {
        snprintf(r->error, sizeof r->error, "malformed SSE chunk");
    } else if (!q->saw_done) {
        snprintf(r->error, sizeof r->error, "stream ended without [DONE]");
    } else if (!q->first && r->output_tokens > 0) {
        snprintf(r->error, sizeof r->error, "usage says %d tokens but none was streamed", r->output_tokens);
    } else {
        r->ok = true;
    }
}

static bool hc_start(CURLM *multi, hc_req *q, const db_http *h, const db_prompt *p, const db_req_opts *ro,
                     uint64_t seed) {
    if (!(q->easy = curl_easy_init()) || !(q->body = request_body(h, p, ro, seed))) return false;
    char url[1024];
    snprintf(url, sizeof url, "%s%s", h->base_url, h->endpoint);
    q->hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    q->hdrs = curl_slist_append(q->hdrs, "Accept: text/event-stream");
    if (h->instance[0]) {
        char pin[128];
        snprintf(pin, sizeof pin, "X-Duet-Instance: %s", h->instance);
        q->hdrs = curl_slist_append(q->hdrs, pin);
    }
    /* A server started with --api-key: the key from the environment, as
     * OpenAI's clients take OPENAI_API_KEY. */
    const char *key = getenv("DUET_API_KEY");
    if (key && *key) {
        char auth[512];
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", key);
        q->hdrs = curl_slist_append(q->hdrs, auth);
    }
    curl_easy_setopt(q->easy, CURLOPT_URL, url);
    curl_easy_setopt(q->easy, CURLOPT_HTTPHEADER, q->hdrs);
    curl_easy_setopt(q->easy, CURLOPT_POSTFIELDS, q->body);
    curl_easy_setopt(q->easy, CURLOPT_WRITEFUNCTION, hc_write);
    curl_easy_setopt(q->easy, CURLOPT_WRITEDATA, q);
    curl_easy_setopt(q->easy, CURLOPT_PRIVATE, q);
    curl_easy_setopt(q->easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(q->easy, CURLOPT_TCP_NODELAY, 1L);
    /* A generous cap: a run that hangs fails its requests, not the tool. */
    curl_easy_setopt(q->easy, CURLOPT_TIMEOUT, 6L * 3600);
    return curl_multi_add_handle(multi, q->easy) == CURLM_OK;
}

bool db_http_run(const db_http *h, const db_prompt *prompts, int n, const db_load *load,
                 const db_req_opts *ro, db_progress *prog, db_result *results, int *n_sent, double *duration,
                 char **metrics_before, char **metrics_after, char *err, size_t esize) {
    http_global_init();
    *n_sent = 0;
    *duration = 0;
    CURLM *multi = curl_multi_init();
    hc_req *reqs = calloc((size_t)n, sizeof *reqs);
    if (!multi || !reqs) {
        snprintf(err, esize, "out of memory");
        free(reqs);
        if (multi) curl_multi_cleanup(multi);
        return false;
    }
    /* Many streams to one host: no pipelining limits beyond the server's. */
    curl_multi_setopt(multi, CURLMOPT_MAX_HOST_CONNECTIONS, 0L);
    curl_multi_setopt(multi, CURLMOPT_MAXCONNECTS, (long)(n > 16 ? n : 16));

    if (metrics_before) *metrics_before = db_http_get(h->base_url, "/metrics", 10, NULL);
    db_arrivals arr;
    db_arrivals_init(&arr, load);
    double t0 = db_now(), next_arrival = db_arrivals_next(&arr), t_last_done = 0, next_scrape = 0;
    int sent = 0, done = 0, in_flight = 0;
    bool stop_sending = isinf(next_arrival), ok = true;
    while (ok && ((!stop_sending && sent < n) || in_flight > 0)) {
        double now = db_now();
        if (load->duration_s > 0 && now - t0 >= load->duration_s) stop_sending = true;
        if (load->scrapes && now - t0 >= next_scrape) {
            char *text = db_http_get(h->base_url, "/metrics", 2, NULL);
            db_scrapes_add(load->scrapes, now - t0, text);
            free(text);
            next_scrape += load->scrapes->every_s;
        }
        /* Send whatever is due and allowed. */
        while (!stop_sending && sent < n && now >= t0 + next_arrival &&
               (load->max_concurrency <= 0 || in_flight < load->max_concurrency)) {
            hc_req *q = &reqs[sent];
            db_result *r = &results[sent];
            memset(r, 0, sizeof *r);
            r->ttft = NAN;
            r->priority = prompts[sent].priority;
            r->t_arrival = next_arrival;
            r->t_sent = now - t0;
            q->res = r;
            q->t_sent_abs = now;
            if (!hc_start(multi, q, h, &prompts[sent], ro, load->seed + (uint64_t)sent)) {
                snprintf(err, esize, "cannot start an HTTP request (out of memory?)");
                ok = false;
                break;
            }
            sent++;
            in_flight++;
            if (sent < n) {
                next_arrival = db_arrivals_next(&arr);
                if (isinf(next_arrival) || (load->duration_s > 0 && next_arrival >= load->duration_s))
                    stop_sending = true;
            }
        }
        int running = 0;
        curl_multi_perform(multi, &running);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(multi, &left))) {
            if (msg->msg != CURLMSG_DONE) continue;
            hc_req *q = NULL;
            curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&q);
            double t = db_now();
            hc_finish(q, msg->data.result, t);
            curl_multi_remove_handle(multi, q->easy);
            hc_free(q);
            in_flight--;
            done++;
            t_last_done = t;
        }
        now = db_now();
        if (prog) db_progress_update(prog, done, stop_sending ? sent : n, in_flight, now - t0, false);
        /* Sleep until data, the next arrival, or a progress tick. */
        double wait = 0.25;
        if (load->scrapes && t0 + next_scrape - now < wait) wait = fmax(t0 + next_scrape - now, 0);
        if (!stop_sending && sent < n && (load->max_concurrency <= 0 || in_flight < load->max_concurrency)) {
            double until = t0 + next_arrival - now;
            if (until < wait) wait = until > 0 ? until : 0;
        }
        if (wait > 0) curl_multi_poll(multi, NULL, 0, (int)ceil(wait * 1000), NULL);
    }
    /* On an early stop, abandon what is still in flight. */
    for (int i = 0; i < sent; i++)
        if (reqs[i].easy) {
            snprintf(results[i].error, sizeof results[i].error, "abandoned: the run stopped early");
            curl_multi_remove_handle(multi, reqs[i].easy);
            hc_free(&reqs[i]);
        }
    double t_end = t_last_done > 0 ? t_last_done : db_now();
    if (prog) db_progress_update(prog, done, sent, 0, t_end - t0, true);
    if (metrics_after) *metrics_after = db_http_get(h->base_url, "/metrics", 10, NULL);
    curl_multi_cleanup(multi);
    free(reqs);
    *n_sent = sent;
    *duration = t_end - t0;
    return ok;
}
