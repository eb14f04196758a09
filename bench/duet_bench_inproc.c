/* duet_bench_inproc.c — the in-process client: requests go straight to a
 * duet_engine in this process, and tokens are timed in the engine's event
 * callback. No HTTP, JSON or detokenizing cost is measured, so this is the
 * engine's own latency; the HTTP client adds the server's on top.
 *
 * Threads: this (main) thread sends on schedule; the engine thread delivers
 * events. Each request's result is written only by the engine thread until
 * its DONE event, which hands it over under the mutex.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "duet_bench.h"

typedef struct ip_run ip_run;

typedef struct ip_req {
    ip_run *run;
    db_result *res;
    double t_sent_abs, t_last;
    bool first;
} ip_req;

struct ip_run {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int in_flight, done;
    double t_last_done;
    bool oom;
};

static void on_event(const duet_event *ev, void *user) {
    ip_req *q = user;
    double now = db_now();
    db_result *r = q->res;
    if (ev->kind == DUET_EVENT_TOKEN) {
        /* id -1 is the detokenizer's flush of a split character, not a token. */
        if (ev->token < 0) return;
        if (!q->first) {
            r->ttft = now - q->t_sent_abs;
            q->first = true;
        } else if (!db_result_add_itl(r, now - q->t_last)) {
            q->run->oom = true;
        }
        q->t_last = now;
        return;
    }
    r->e2el = now - q->t_sent_abs;
    r->prompt_tokens = ev->prompt_tokens;
    r->output_tokens = ev->generated_tokens;
    r->ok = ev->finish == DUET_FINISH_STOP || ev->finish == DUET_FINISH_LENGTH;
    if (!r->ok)
        snprintf(r->error, sizeof r->error, "%s%s%s",
                 ev->finish == DUET_FINISH_CANCELLED ? "cancelled" : "error", ev->message ? ": " : "",
                 ev->message ? ev->message : "");
    ip_run *run = q->run;
    pthread_mutex_lock(&run->mu);
    run->in_flight--;
    run->done++;
    run->t_last_done = now;
    pthread_cond_broadcast(&run->cv);
    pthread_mutex_unlock(&run->mu);
}

static void abs_deadline(double t, struct timespec *ts) {
    ts->tv_sec = (time_t)floor(t);
    ts->tv_nsec = (long)((t - floor(t)) * 1e9);
    if (ts->tv_nsec >= 1000000000L) ts->tv_sec++, ts->tv_nsec -= 1000000000L;
}

bool db_inproc_run(duet_engine *e, const db_prompt *prompts, int n, const db_load *load,
                   const db_req_opts *ro, db_progress *prog, db_result *results, int *n_sent,
                   double *duration, char **metrics_before, char **metrics_after, char *err, size_t esize) {
    *n_sent = 0;
    *duration = 0;
    ip_req *reqs = calloc((size_t)n, sizeof *reqs);
    if (!reqs) {
        snprintf(err, esize, "out of memory");
        return false;
    }
    ip_run run = {0};
    pthread_mutex_init(&run.mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&run.cv, &ca);
    pthread_condattr_destroy(&ca);

    if (metrics_before) *metrics_before = duet_engine_metrics(e);
    db_arrivals arr;
    db_arrivals_init(&arr, load);
    double t0 = db_now(), arrival = 0, next_scrape = 0;
    int sent = 0;
    pthread_mutex_lock(&run.mu);
    for (int i = 0; i < n; i++) {
        arrival = db_arrivals_next(&arr);
        if (isinf(arrival) || (load->duration_s > 0 && arrival >= load->duration_s)) break;
        /* Wait for the arrival time and for a free concurrency slot. */
        bool out_of_time = false;
        for (;;) {
            double now = db_now();
            if (load->duration_s > 0 && now - t0 >= load->duration_s) {
                out_of_time = true;
                break;
            }
            bool slot = load->max_concurrency <= 0 || run.in_flight < load->max_concurrency;
            if (slot && now >= t0 + arrival) break;
            if (prog) db_progress_update(prog, run.done, n, run.in_flight, now - t0, false);
            if (load->scrapes && now - t0 >= next_scrape) {
                /* Not under run.mu: the engine's callbacks take it. */
                pthread_mutex_unlock(&run.mu);
                char *text = duet_engine_metrics(e);
                pthread_mutex_lock(&run.mu);
                db_scrapes_add(load->scrapes, now - t0, text);
                free(text);
                next_scrape += load->scrapes->every_s;
            }
            /* Wake at the arrival, a completion, a sample or a progress tick. */
            double wake = now + 0.25;
            if (load->scrapes && t0 + next_scrape < wake) wake = t0 + next_scrape;
            if (slot && t0 + arrival < wake) wake = t0 + arrival;
            struct timespec ts;
            abs_deadline(wake, &ts);
            pthread_cond_timedwait(&run.cv, &run.mu, &ts);
        }
        if (out_of_time) break;
        run.in_flight++;
        pthread_mutex_unlock(&run.mu);

        const db_prompt *p = &prompts[i];
        db_result *r = &results[i];
        memset(r, 0, sizeof *r);
        r->ttft = NAN;
        r->priority = p->priority;
        /* Room for every gap up front: no allocation on the engine thread. */
        r->cap_itl = p->output_len + 1;
        r->itl = malloc((size_t)r->cap_itl * sizeof *r->itl);
        if (!r->itl) r->cap_itl = 0;
        double now = db_now();
        r->t_arrival = arrival;
        r->t_sent = now - t0;
        reqs[i] = (ip_req){.run = &run, .res = r, .t_sent_abs = now};
        duet_request q = {.prompt = p->ids,
                          .n_prompt = p->n_ids,
                          .max_tokens = p->output_len,
                          .sampling = duet_sampling_default(),
                          .priority = p->priority,
                          .ignore_eos = ro->ignore_eos};
        q.sampling.temperature = (float)ro->temperature;
        q.sampling.seed = load->seed + (uint64_t)i;
        duet_status st = p->ids ? duet_engine_submit(e, &q, on_event, &reqs[i], NULL) : DUET_BAD_REQUEST;
        pthread_mutex_lock(&run.mu);
        sent++;
        if (st != DUET_OK) {
            /* Refused at the door (queue full, too long): a failed request. */
            snprintf(r->error, sizeof r->error, "%s: %s", duet_status_name(st),
                     p->ids ? duet_last_error() : "no token ids (a text prompt needs -m to tokenize)");
            r->e2el = db_now() - now;
            run.in_flight--;
            run.done++;
            run.t_last_done = db_now();
        }
    }
    while (run.done < sent) {
        double now = db_now();
        if (prog) db_progress_update(prog, run.done, sent, run.in_flight, now - t0, false);
        struct timespec ts;
        abs_deadline(now + 0.25, &ts);
        pthread_cond_timedwait(&run.cv, &run.mu, &ts);
    }
    double t_end = run.t_last_done > 0 ? run.t_last_done : db_now();
    bool oom = run.oom;
    pthread_mutex_unlock(&run.mu);
    if (prog) db_progress_update(prog, sent, sent, 0, t_end - t0, true);
    if (metrics_after) *metrics_after = duet_engine_metrics(e);

    pthread_cond_destroy(&run.cv);
    pthread_mutex_destroy(&run.mu);
    free(reqs);
    *n_sent = sent;
    *duration = t_end - t0;
    if (oom) {
        snprintf(err, esize, "out of memory recording inter-token gaps");
        return false;
    }
    return true;
}
