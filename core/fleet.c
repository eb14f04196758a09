/* fleet.c — several engines behind the router (router.h): routing, speed
 * measurement, retries after an instance fails, and the metrics of all.
 *
 * Threads and locks: duet_fleet_submit and duet_fleet_cancel run on the
 * callers' threads, fleet_event on the engines' threads. One mutex (f->mu)
 * guards the router and the request table. It may be held while calling
 * duet_engine_healthy (which takes that engine's lock briefly), never while
 * submitting or cancelling: engines deliver events without their own lock,
 * so the order f->mu -> engine lock is the only one there is.
 *
 * A request's record lives from submit to the DONE the client gets. A
 * retry keeps the record (the client's id stays) and moves it to another
 * engine; the DONE(ERROR) of the failed attempt is swallowed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "duet_internal.h"
#include "metrics.h"
#include "router.h"
#include "step_cost.h"

#define FLEET_ID_BITS 20
#define FLEET_CAP (1 << 14)
#define FLEET_NAME 64

typedef struct fleet_req {
    uint64_t id; /* 0: free */
    duet_fleet *f;
    int inst;
    uint64_t eid; /* the engine's id; 0 while a submit is on its way */
    bool cancelled;
    duet_event_fn fn;
    void *user;
    /* A copy of the request, for a retry: prompt, stop strings, grammar. */
    duet_request q;
    int32_t *prompt;
    char **stops;
    char *grammar;
} fleet_req;

typedef struct fleet_inst {
    duet_engine *e;
    duet_priority tier;
    char name[FLEET_NAME], backend[FLEET_NAME], device[128];
    double seen_tokens, seen_busy; /* the engine's step totals at the last speed measurement */
} fleet_inst;

struct duet_fleet {
    pthread_mutex_t mu;
    duet_router *router;
    int n;
    fleet_inst inst[DUET_ROUTER_MAX_INSTANCES];
    fleet_req *reqs; /* [FLEET_CAP] */
    uint64_t next_seq;
};

duet_fleet_params duet_fleet_params_default(void) {
    return (duet_fleet_params){.spill_interactive = true};
}

/* Label values: no quote, backslash or newline (replaced). */
static void label_copy(char *dst, size_t size, const char *src) {
    snprintf(dst, size, "%s", src);
    for (char *p = dst; *p; p++)
        if (*p == '"' || *p == '\\' || *p == '\n') *p = '_';
}

duet_status duet_fleet_new(const duet_fleet_instance *in, int n, const duet_fleet_params *params,
                           duet_fleet **out) {
    if (!out) return duet__error(DUET_INVALID_ARGUMENT, "fleet: out is NULL");
    *out = NULL;
    if (!in || n < 1 || n > DUET_ROUTER_MAX_INSTANCES)
        return duet__error(DUET_INVALID_ARGUMENT, "fleet: %d instances (1..%d)", n,
                           DUET_ROUTER_MAX_INSTANCES);
    duet_fleet_params p = params ? *params : duet_fleet_params_default();
    duet_router_instance_config rc[DUET_ROUTER_MAX_INSTANCES];
    for (int i = 0; i < n; i++) {
        if (!in[i].engine) return duet__error(DUET_INVALID_ARGUMENT, "fleet: instance %d has no engine", i);
        /* Every instance starts with the same guess; measurements take over. */
        rc[i] = (duet_router_instance_config){
            .tier = in[i].tier, .speed = 1000, .max_outstanding = in[i].max_outstanding};
    }
    duet_router_config c = duet__router_config_default();
    c.n_instances = n;
    c.instances = rc;
    c.max_requests = FLEET_CAP;
    c.tier_blind = p.tier_blind;
    c.spill_interactive = p.spill_interactive;
    c.spill_batch = p.spill_batch;
    duet_fleet *f = calloc(1, sizeof *f);
    if (!f) return duet__error(DUET_OUT_OF_MEMORY, "fleet: out of memory");
    duet_status st = duet__router_new(&c, &f->router);
    if (!st && !(f->reqs = calloc(FLEET_CAP, sizeof *f->reqs)))
        st = duet__error(DUET_OUT_OF_MEMORY, "fleet: out of memory");
    if (st) {
        duet__router_free(f->router);
        free(f);
        return st;
    }
    pthread_mutex_init(&f->mu, NULL);
    f->n = n;
    for (int i = 0; i < n; i++) {
        fleet_inst *fi = &f->inst[i];
        fi->e = in[i].engine;
        fi->tier = in[i].tier;
        duet_model_desc d;
        duet_model_describe(duet_engine_model(fi->e), &d);
        char idx[16];
        snprintf(idx, sizeof idx, "%d", i);
        label_copy(fi->name, sizeof fi->name, in[i].name ? in[i].name : idx);
        label_copy(fi->backend, sizeof fi->backend, d.backend);
        label_copy(fi->device, sizeof fi->device, d.device);
    }
    *out = f;
    return DUET_OK;
}

static void req_release(fleet_req *r) {
    free(r->prompt);
    free(r->stops);
    free(r->grammar);
    memset(r, 0, sizeof *r);
}

void duet_fleet_free(duet_fleet *f) {
    if (!f) return;
    for (int i = 0; i < FLEET_CAP; i++)
        if (f->reqs[i].id) req_release(&f->reqs[i]);
    free(f->reqs);
    duet__router_free(f->router);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

static fleet_req *find(duet_fleet *f, uint64_t id) {
    fleet_req *r = &f->reqs[id & (FLEET_CAP - 1)];
    return id && r->id == id ? r : NULL;
}

/* Under f->mu: instances whose engines report a lost device are taken out
 * of the router; every live one's speed estimate follows its step totals. */
static void sync_instances(duet_fleet *f) {
    for (int i = 0; i < f->n; i++) {
        duet_router_instance_stats is;
        duet__router_instance_stats(f->router, i, &is);
        if (is.failed) continue;
        if (!duet_engine_healthy(f->inst[i].e, NULL, 0)) {
            duet__router_fail_instance(f->router, i, NULL, 0);
            continue;
        }
        duet_metrics_summary s;
        duet__metrics_summary(duet__engine_metrics(f->inst[i].e), &s);
        fleet_inst *fi = &f->inst[i];
        double dt = s.busy_s - fi->seen_busy, dn = s.step_tokens - fi->seen_tokens;
        if (dt >= 0.05 && dn >= 1) {
            duet__router_observe(f->router, i, (int64_t)dn, dt);
            fi->seen_busy = s.busy_s, fi->seen_tokens = s.step_tokens;
        }
    }
}

static void fleet_event(const duet_event *ev, void *user);

/* Submits r to instance `to` (not under f->mu). The record points there
 * before the submit: its first events may arrive before the submit returns. */
static duet_status submit_to(duet_fleet *f, fleet_req *r, int to) {
    pthread_mutex_lock(&f->mu);
    r->inst = to;
    r->eid = 0;
    pthread_mutex_unlock(&f->mu);
    uint64_t eid = 0;
    duet_status st = duet_engine_submit(f->inst[to].e, &r->q, fleet_event, r, &eid);
    if (st) return st;
    pthread_mutex_lock(&f->mu);
    bool cancel = r->cancelled && r->inst == to;
    if (r->inst == to) r->eid = eid;
    pthread_mutex_unlock(&f->mu);
    if (cancel) duet_engine_cancel(f->inst[to].e, eid);
    return DUET_OK;
}

/* Copies q into r for a retry: every pointer it holds is the record's own. */
static bool req_copy(fleet_req *r, const duet_request *q) {
    r->q = *q;
    r->prompt = malloc((size_t)q->n_prompt * sizeof *r->prompt);
    size_t bytes = 0;
    for (int i = 0; i < q->n_stop; i++)
        bytes += q->stop[i] ? strlen(q->stop[i]) + 1 : 1;
    r->stops = q->n_stop ? malloc((size_t)q->n_stop * sizeof(char *) + bytes) : NULL;
    r->grammar = q->grammar ? strdup(q->grammar) : NULL;
    if (!r->prompt || (q->n_stop && !r->stops) || (q->grammar && !r->grammar)) return false;
    memcpy(r->prompt, q->prompt, (size_t)q->n_prompt * sizeof *r->prompt);
    char *at = (char *)(r->stops + q->n_stop);
    for (int i = 0; i < q->n_stop; i++) {
        size_t n = q->stop[i] ? strlen(q->stop[i]) : 0;
        memcpy(at, q->stop[i] ? q->stop[i] : "", n + 1);
        r->stops[i] = at;
        at += n + 1;
    }
    r->q.prompt = r->prompt;
    r->q.stop = (const char *const *)r->stops;
    r->q.grammar = r->grammar;
    return true;
}

/* Routes record fid: to `pin` when >= 0, else where the router says. */
static duet_status route(duet_fleet *f, uint64_t fid, const duet_request *q, int pin, int *inst) {
    duet_status st = pin >= 0
                         ? duet__router_route_to(f->router, fid, q->priority, q->n_prompt, q->max_tokens, pin)
                         : duet__router_route(f->router, fid, q->priority, q->n_prompt, q->max_tokens, inst);
    if (pin >= 0 && !st) *inst = pin;
    if (st == DUET_NO_DEVICE && pin >= 0)
        return duet__error(DUET_DEVICE_LOST, "instance %s cannot serve: its device was lost",
                           f->inst[pin].name);
    if (st == DUET_NO_DEVICE)
        return duet__error(DUET_DEVICE_LOST, "no instance can serve: every device was lost");
    return st;
}

duet_status duet_fleet_submit_to(duet_fleet *f, int pin, const duet_request *q, duet_event_fn fn, void *user,
                                 uint64_t *id) {
    if (!f || !q || !fn) return duet__error(DUET_INVALID_ARGUMENT, "fleet submit: NULL argument");
    if (pin < -1 || pin >= f->n)
        return duet__error(DUET_INVALID_ARGUMENT, "fleet submit: no instance %d (0..%d, or -1)", pin,
                           f->n - 1);
    if (q->n_prompt < 1 || !q->prompt) return duet__error(DUET_BAD_REQUEST, "the prompt is empty");
    if (q->max_tokens < 1) return duet__error(DUET_BAD_REQUEST, "max_tokens %d must be >= 1", q->max_tokens);
    if (q->n_stop < 0 || q->n_stop > DUET_MAX_STOP || (q->n_stop && !q->stop))
        return duet__error(DUET_BAD_REQUEST, "n_stop %d: 0 to %d stop strings", q->n_stop, DUET_MAX_STOP);
    if (q->priority != DUET_PRIORITY_INTERACTIVE && q->priority != DUET_PRIORITY_BATCH)
        return duet__error(DUET_BAD_REQUEST, "priority %d is not interactive (0) or batch (1)",
                           (int)q->priority);
    pthread_mutex_lock(&f->mu);
    fleet_req *r = NULL;
    for (int k = 0; k < FLEET_CAP && !r; k++) {
        int i = (int)((f->next_seq + (uint64_t)k) & (FLEET_CAP - 1));
        if (!f->reqs[i].id) r = &f->reqs[i];
    }
    if (!r) {
        pthread_mutex_unlock(&f->mu);
        return duet__error(DUET_QUEUE_FULL, "the queue is full; retry later");
    }
    uint64_t fid = ((++f->next_seq) << FLEET_ID_BITS) | (uint64_t)(r - f->reqs);
    r->id = fid; /* claimed */
    r->f = f;
    r->fn = fn;
    r->user = user;
    sync_instances(f);
    int inst = -1;
    duet_status st = route(f, fid, q, pin, &inst);
    pthread_mutex_unlock(&f->mu);
    if (!st && !req_copy(r, q)) st = duet__error(DUET_OUT_OF_MEMORY, "fleet submit: out of memory");
    while (!st) {
        st = submit_to(f, r, inst);
        if (st != DUET_DEVICE_LOST) break;
        /* The instance lost its device since the last look: take it out,
         * and try the router's next pick (this is no retry: nothing ran);
         * a pinned request has no other pick. */
        pthread_mutex_lock(&f->mu);
        duet__router_fail_instance(f->router, inst, NULL, 0);
        duet__router_done(f->router, fid);
        st = route(f, fid, q, pin, &inst);
        pthread_mutex_unlock(&f->mu);
    }
    if (st) {
        pthread_mutex_lock(&f->mu);
        duet__router_done(f->router, fid);
        req_release(r);
        pthread_mutex_unlock(&f->mu);
        return st;
    }
    if (id) *id = fid;
    return DUET_OK;
}

duet_status duet_fleet_submit(duet_fleet *f, const duet_request *q, duet_event_fn fn, void *user,
                              uint64_t *id) {
    return duet_fleet_submit_to(f, -1, q, fn, user, id);
}

duet_status duet_fleet_cancel(duet_fleet *f, uint64_t id) {
    pthread_mutex_lock(&f->mu);
    fleet_req *r = find(f, id);
    if (!r || r->cancelled) {
        pthread_mutex_unlock(&f->mu);
        return duet__error(DUET_INVALID_ARGUMENT, "request %llu is not in flight", (unsigned long long)id);
    }
    r->cancelled = true;
    duet_engine *e = f->inst[r->inst].e;
    uint64_t eid = r->eid; /* 0: its submit is on its way and cancels it */
    pthread_mutex_unlock(&f->mu);
    if (eid) duet_engine_cancel(e, eid);
    return DUET_OK;
}

/* An engine's event for record r: forwarded with the fleet's id; a failed
 * instance's DONE(ERROR) may turn into a retry instead. */
static void fleet_event(const duet_event *ev, void *user) {
    fleet_req *r = user;
    duet_fleet *f = r->f;
    duet_event out = *ev;
    out.request_id = r->id;
    out.instance = r->inst;
    if (ev->kind != DUET_EVENT_DONE) {
        pthread_mutex_lock(&f->mu);
        duet__router_token(f->router, r->id);
        pthread_mutex_unlock(&f->mu);
        r->fn(&out, r->user);
        return;
    }
    char why[512] = "";
    if (ev->finish == DUET_FINISH_ERROR && !duet_engine_healthy(f->inst[r->inst].e, NULL, 0)) {
        int to = -1;
        pthread_mutex_lock(&f->mu);
        duet__router_fail_instance(f->router, r->inst, NULL, 0);
        sync_instances(f);
        bool retry = !r->cancelled && duet__router_failed(f->router, r->id, &to) == DUET_OK;
        if (!retry) duet__router_done(f->router, r->id); /* no-op when failed() removed it */
        pthread_mutex_unlock(&f->mu);
        if (retry) {
            duet_status st = submit_to(f, r, to);
            if (st == DUET_OK) return; /* the client sees the retry's events and DONE */
            snprintf(why, sizeof why, "%s; its retry was refused: %s",
                     ev->message ? ev->message : "instance failed", duet_last_error());
            out.message = why;
            pthread_mutex_lock(&f->mu);
            duet__router_done(f->router, r->id);
            pthread_mutex_unlock(&f->mu);
        }
    } else {
        pthread_mutex_lock(&f->mu);
        duet__router_done(f->router, r->id);
        pthread_mutex_unlock(&f->mu);
    }
    r->fn(&out, r->user);
    pthread_mutex_lock(&f->mu);
    req_release(r);
    pthread_mutex_unlock(&f->mu);
}

bool duet_fleet_healthy(duet_fleet *f, char *why, size_t why_size) {
    if (why && why_size) why[0] = 0;
    int healthy = 0;
    size_t len = 0;
    for (int i = 0; i < f->n; i++) {
        char one[256];
        if (duet_engine_healthy(f->inst[i].e, one, sizeof one)) {
            healthy++;
        } else if (why && why_size > len) {
            len += (size_t)snprintf(why + len, why_size - len, "%sinstance %s: %s", len ? "; " : "",
                                    f->inst[i].name, one);
        }
    }
    return healthy > 0;
}

duet_status duet_fleet_warmup(duet_fleet *f) {
    for (int i = 0; i < f->n; i++) {
        duet_status st = duet_engine_warmup(f->inst[i].e);
        if (st) return st;
    }
    return DUET_OK;
}

int duet_fleet_find(const duet_fleet *f, const char *name) {
    for (int i = 0; name && i < f->n; i++)
        if (!strcmp(f->inst[i].name, name)) return i;
    return -1;
}

duet_status duet_fleet_describe(duet_fleet *f, int i, duet_fleet_instance_desc *out) {
    if (!f || !out || i < 0 || i >= f->n)
        return duet__error(DUET_INVALID_ARGUMENT, "fleet describe: no instance %d", i);
    fleet_inst *fi = &f->inst[i];
    duet_metrics_summary s;
    duet__metrics_summary(duet__engine_metrics(fi->e), &s);
    duet_router_instance_stats rs;
    pthread_mutex_lock(&f->mu);
    duet__router_instance_stats(f->router, i, &rs);
    pthread_mutex_unlock(&f->mu);
    *out = (duet_fleet_instance_desc){.name = fi->name,
                                      .backend = fi->backend,
                                      .device = fi->device,
                                      .tier = fi->tier,
                                      .max_batch_seqs = (int)s.gauges.max_batch_seqs,
                                      .healthy = s.healthy && !rs.failed};
    return DUET_OK;
}

int duet_fleet_size(const duet_fleet *f) {
    return f->n;
}

duet_engine *duet_fleet_engine(duet_fleet *f, int i) {
    return i >= 0 && i < f->n ? f->inst[i].e : NULL;
}

const duet_model *duet_fleet_model(const duet_fleet *f) {
    return duet_engine_model(f->inst[0].e);
}

int duet_fleet_max_sequence_tokens(const duet_fleet *f) {
    int n = duet_engine_max_sequence_tokens(f->inst[0].e);
    for (int i = 1; i < f->n; i++) {
        int k = duet_engine_max_sequence_tokens(f->inst[i].e);
        if (k < n) n = k;
    }
    return n;
}

/* ---- metrics ---------------------------------------------------------------- */

static const char *const tier_names[2] = {"interactive", "batch"};

char *duet_fleet_metrics(duet_fleet *f) {
    duet_metrics *ms[DUET_ROUTER_MAX_INSTANCES];
    for (int i = 0; i < f->n; i++)
        ms[i] = duet__engine_metrics(f->inst[i].e);
    char *agg = duet__metrics_render_sum(ms, f->n);
    if (!agg) return NULL;
    duet_text t = {0};
    duet__text_printf(&t, "%s", agg);
    free(agg);
    const char *model = duet__metrics_model_name(ms[0]); /* the aggregate families' label */
    duet_metrics_summary sum[DUET_ROUTER_MAX_INSTANCES];
    duet_router_instance_stats rs[DUET_ROUTER_MAX_INSTANCES];
    duet_router_stats st;
    pthread_mutex_lock(&f->mu);
    for (int i = 0; i < f->n; i++) {
        duet__metrics_summary(ms[i], &sum[i]);
        duet__router_instance_stats(f->router, i, &rs[i]);
    }
    duet__router_stats(f->router, &st);
    pthread_mutex_unlock(&f->mu);
    /* One family per quantity, one sample per instance, each with the
     * instance's identity as labels. */
    static const struct {
        const char *name, *type, *help;
    } fam[] = {
        {"duet_instance_info", "gauge",
         "Each instance of this server: its backend, device and tier (value 1)."},
        {"duet_instance_healthy", "gauge", "1 while the instance serves; 0 once its device is lost."},
        {"duet_instance_requests_running", "gauge", "Requests holding a batch slot on the instance."},
        {"duet_instance_requests_waiting", "gauge", "Requests queued on the instance."},
        {"duet_instance_kv_cache_usage_ratio", "gauge", "Fraction of the instance's KV cache blocks in use."},
        {"duet_instance_max_batch_seqs", "gauge", "The instance's max_batch_seqs knob."},
        {"duet_instance_generation_tokens_total", "counter",
         "Tokens generated by the instance's finished requests."},
        {"duet_instance_requests_finished_total", "counter", "Requests the instance finished (any outcome)."},
        {"duet_instance_device_busy_seconds_total", "counter", "Device time of the instance's steps."},
        {"duet_router_requests_routed_total", "counter",
         "Requests the router sent to the instance (retries and pinned requests included)."},
        {"duet_router_requests_pinned_total", "counter",
         "Requests pinned to the instance by their client (duet_fleet_submit_to; the server's "
         "X-Duet-Instance "
         "request header)."},
        {"duet_router_outstanding_tokens", "gauge",
         "Tokens still to compute for the requests routed to the instance."},
        {"duet_router_speed_tokens_per_second", "gauge", "The router's estimate of the instance's speed."},
    };
    for (size_t k = 0; k < sizeof fam / sizeof *fam; k++) {
        duet__text_printf(&t, "# HELP %s %s\n# TYPE %s %s\n", fam[k].name, fam[k].help, fam[k].name,
                          fam[k].type);
        for (int i = 0; i < f->n; i++) {
            const duet_metrics_summary *s = &sum[i];
            const duet_metrics_gauges *g = &s->gauges;
            double v = 0;
            switch (k) {
            case 0:
                v = 1;
                break;
            case 1:
                v = s->healthy && !rs[i].failed;
                break;
            case 2:
                v = g->running[0] + g->running[1];
                break;
            case 3:
                v = g->waiting[0] + g->waiting[1];
                break;
            case 4:
                v = g->kv_usage;
                break;
            case 5:
                v = g->max_batch_seqs;
                break;
            case 6:
                v = (double)s->generated_tokens;
                break;
            case 7:
                v = (double)s->finished;
                break;
            case 8:
                v = s->busy_s;
                break;
            case 9:
                v = (double)rs[i].routed;
                break;
            case 10:
                v = (double)rs[i].pinned;
                break;
            case 11:
                v = (double)rs[i].outstanding;
                break;
            default:
                v = rs[i].speed;
                break;
            }
            duet__text_printf(
                &t, "%s{model_name=\"%s\",instance=\"%s\",backend=\"%s\",device=\"%s\",tier=\"%s\"} %.17g\n",
                fam[k].name, model, f->inst[i].name, f->inst[i].backend, f->inst[i].device,
                tier_names[f->inst[i].tier], v);
        }
    }
    /* The step-cost model each instance fits online from its steps. */
    duet_step_cost_report cost[DUET_ROUTER_MAX_INSTANCES];
    char labels[DUET_ROUTER_MAX_INSTANCES][1024];
    const char *lp[DUET_ROUTER_MAX_INSTANCES];
    for (int i = 0; i < f->n; i++) {
        duet__engine_step_cost(f->inst[i].e, &cost[i]);
        snprintf(labels[i], sizeof labels[i],
                 "model_name=\"%s\",instance=\"%s\",backend=\"%s\",device=\"%s\",tier=\"%s\"", model,
                 f->inst[i].name, f->inst[i].backend, f->inst[i].device, tier_names[f->inst[i].tier]);
        lp[i] = labels[i];
    }
    duet__step_cost_prom_families(&t, cost, lp, f->n);
    duet__text_printf(
        &t,
        "# HELP duet_router_spills_total Requests routed to an instance of the other tier (theirs was "
        "saturated or had none live).\n# TYPE duet_router_spills_total counter\n"
        "duet_router_spills_total{model_name=\"%s\"} %llu\n"
        "# HELP duet_router_retries_total Requests routed again after their instance failed before they "
        "streamed a token.\n# TYPE duet_router_retries_total counter\n"
        "duet_router_retries_total{model_name=\"%s\"} %llu\n"
        "# HELP duet_router_failed_total Requests ended by an instance failure (they had streamed, were "
        "retried once already, or had nowhere to go).\n# TYPE duet_router_failed_total counter\n"
        "duet_router_failed_total{model_name=\"%s\"} %llu\n"
        "# HELP duet_router_instances_live Instances the router sends requests to.\n"
        "# TYPE duet_router_instances_live gauge\nduet_router_instances_live{model_name=\"%s\"} %d\n",
        model, (unsigned long long)st.spills, model, (unsigned long long)st.retries, model,
        (unsigned long long)st.failed, model, st.live);
    if (t.oom) {
        free(t.p);
        return NULL;
    }
    return t.p;
}
