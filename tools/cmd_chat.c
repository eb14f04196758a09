/* cmd_chat.c — `duet chat`: a conversation in the terminal through the
 * model's own chat template.
 *
 * Each turn renders the whole history with the template, generates the
 * reply while streaming it, and appends it to the history. Ctrl-C during a
 * reply stops that reply (what was written stays in the history); Ctrl-C
 * or end of input at the prompt ends the program. With -p the one question
 * is answered and the program ends (the README's demo).
 *
 * Text stop strings of the template ("<|im_end|>" written as text, "\nUser:"
 * of the plain format) end the reply; the streamed text holds back any tail
 * that could still become one, so a stop string is never printed.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: duet chat [-m MODEL] [-p QUESTION] [options]\n"
        "  -m, --model FILE        GGUF model (default: SmolLM2-135M-Instruct, fetched by "
        "tools/fetch_smollm2.sh)\n"
        "  -p, --prompt TEXT       answer this one question and exit (default: interactive)\n"
        "  -s, --system TEXT       system prompt\n"
        "      --chat-template T   auto, a family (plain|chatml|llama3|llama2|mistral|zephyr|phi3|gemma) or "
        "a\n"
        "                          Jinja file (default auto: the model's own)\n"
        "  -n, --n-predict N       most tokens per reply (default 512)\n"
        "      --backend NAME      auto|cpu|vulkan|opencl (default auto)\n"
        "      --device I          device index within the backend (default: best)\n"
        "  -t, --threads N         cpu threads (default: all cores)\n"
        "  -c, --ctx N             context length (default: the model's, at most 4096)\n"
        "      --temp T            temperature; 0 = greedy (default 0.7)\n"
        "      --top-p P           (default 0.95)\n"
        "      --seed S            sampling seed (default: from the clock)\n"
        "  -v, --verbose           print speed after every reply\n"
        "Interactive: an empty line or /exit ends, /reset forgets the conversation; Ctrl-C stops a reply.\n");
}

static volatile sig_atomic_t interrupted;

static void on_sigint(int sig) {
    (void)sig;
    interrupted = 1;
}

/* One reply being streamed: its text so far, how much of it is printed,
 * and the template's text stop strings. */
typedef struct reply {
    char *text;
    size_t len, cap, printed;
    const char *const *stops;
    bool stopped; /* a stop string or Ctrl-C ended it */
} reply;

/* The length of the longest tail of s[0, n) that is a proper prefix of a
 * stop string: text that must wait for the next token. */
static size_t held_back(const char *s, size_t n, const char *const *stops) {
    size_t hold = 0;
    for (const char *const *t = stops; *t; t++) {
        size_t k = strlen(*t);
        for (size_t m = k - 1 < n ? k - 1 : n; m > hold; m--)
            if (!memcmp(s + n - m, *t, m)) {
                hold = m;
                break;
            }
    }
    return hold;
}

static bool on_token(int32_t id, const char *text, size_t len, void *user) {
    (void)id;
    reply *r = user;
    if (r->len + len + 1 > r->cap) {
        size_t cap = (r->cap + len + 1) * 2;
        char *t = realloc(r->text, cap);
        if (!t) return false;
        r->text = t;
        r->cap = cap;
    }
    memcpy(r->text + r->len, text, len);
    r->len += len;
    r->text[r->len] = '\0';
    /* Cut at the first stop string, searching only where a new one can be. */
    size_t from = r->printed;
    for (const char *const *t = r->stops; *t; t++) {
        char *hit = strstr(r->text + from, *t);
        if (hit) {
            r->len = (size_t)(hit - r->text);
            r->text[r->len] = '\0';
            r->stopped = true;
        }
    }
    size_t upto = r->stopped ? r->len : r->len - held_back(r->text, r->len, r->stops);
    if (upto > r->printed) {
        fwrite(r->text + r->printed, 1, upto - r->printed, stdout);
        fflush(stdout);
        r->printed = upto;
    }
    if (interrupted) r->stopped = true;
    return !r->stopped;
}

/* Appends {"role", "content"} to the conversation's messages. */
static bool add_message(cJSON *msgs, const char *role, const char *content) {
    cJSON *m = cJSON_CreateObject();
    if (!m || !cJSON_AddItemToArray(msgs, m)) return cJSON_Delete(m), false;
    return cJSON_AddStringToObject(m, "role", role) && cJSON_AddStringToObject(m, "content", content);
}

typedef struct chat {
    duet_model *m;
    duet_chat_template *tmpl;
    duet_sampling smp;
    int n_predict, bos;
    bool verbose;
} chat;

/* Answers the conversation's last user message, streaming the reply, and
 * appends the reply to the conversation. Returns false on an error. */
static bool answer(chat *c, cJSON *conv) {
    char *js = cJSON_PrintUnformatted(conv), *prompt = NULL;
    duet_status st = js ? duet_chat_template_apply(c->tmpl, js, true, &prompt) : DUET_OUT_OF_MEMORY;
    cJSON_free(js);
    if (st) return cli_fail("chat template", st), false;
    int32_t *ids = NULL;
    int n = cli_tokenize(c->m, prompt, true, true, &ids);
    free(prompt);
    if (n < 0) return false;
    /* A template that writes the BOS text itself gets it once. */
    if (n >= 2 && ids[0] == c->bos && ids[1] == c->bos) memmove(ids, ids + 1, (size_t)--n * sizeof *ids);
    reply r = {.stops = duet_chat_template_stops(c->tmpl)};
    duet_generate_stats gs;
    interrupted = 0;
    st = duet_generate(c->m, ids, n, c->n_predict, &c->smp, false, on_token, &r, &gs);
    free(ids);
    if (r.printed < r.len && !r.stopped) fwrite(r.text + r.printed, 1, r.len - r.printed, stdout);
    printf("\n");
    fflush(stdout);
    bool ok = st == DUET_OK || (st == DUET_CANCELLED && r.stopped);
    if (!ok) cli_fail("generate", st);
    if (ok && interrupted) fprintf(stderr, "duet: (reply stopped)\n");
    interrupted = 0; /* that Ctrl-C was the reply's */
    if (ok && c->verbose) {
        duet_model_desc d;
        duet_model_describe(c->m, &d);
        double pf = gs.prefill_seconds > 0 ? gs.prompt_tokens / gs.prefill_seconds : 0;
        double dc = gs.generated_tokens > 1 && gs.decode_seconds > 0
                        ? (gs.generated_tokens - 1) / gs.decode_seconds
                        : 0;
        fprintf(stderr,
                "duet: %s on %s (%s): %d prompt tokens at %.1f tokens/s, %d generated at %.1f tokens/s\n",
                d.arch, d.backend, d.device, gs.prompt_tokens, pf, gs.generated_tokens, dc);
    }
    ok = ok && add_message(cJSON_GetObjectItem(conv, "messages"), "assistant", r.text ? r.text : "");
    free(r.text);
    c->smp.seed++; /* the next reply samples afresh */
    return ok;
}

/* Reads one line from stdin without its newline (malloc'd), or NULL at the
 * end of input or on Ctrl-C. */
static char *read_line(void) {
    size_t cap = 0;
    char *line = NULL;
    ssize_t n = getline(&line, &cap, stdin);
    if (n < 0 || interrupted) return free(line), NULL;
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
        line[--n] = '\0';
    return line;
}

static cJSON *new_conversation(const char *system) {
    cJSON *conv = cJSON_CreateObject();
    cJSON *msgs = conv ? cJSON_AddArrayToObject(conv, "messages") : NULL;
    if (!msgs || (system && !add_message(msgs, "system", system))) return cJSON_Delete(conv), NULL;
    return conv;
}

int cmd_chat(int argc, char **argv) {
    enum { O_BACKEND = 256, O_DEVICE, O_TEMP, O_TOPP, O_SEED, O_TEMPLATE };
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"prompt", required_argument, 0, 'p'},
                                         {"system", required_argument, 0, 's'},
                                         {"n-predict", required_argument, 0, 'n'},
                                         {"threads", required_argument, 0, 't'},
                                         {"ctx", required_argument, 0, 'c'},
                                         {"backend", required_argument, 0, O_BACKEND},
                                         {"device", required_argument, 0, O_DEVICE},
                                         {"temp", required_argument, 0, O_TEMP},
                                         {"top-p", required_argument, 0, O_TOPP},
                                         {"seed", required_argument, 0, O_SEED},
                                         {"chat-template", required_argument, 0, O_TEMPLATE},
                                         {"verbose", no_argument, 0, 'v'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *model = NULL, *question = NULL, *system = NULL, *template_name = NULL;
    chat c = {.n_predict = 512, .smp = duet_sampling_default()};
    c.smp.temperature = 0.7f;
    duet_open_params op = duet_open_params_default();
    unsigned long long seed = 0;
    bool seed_set = false;
    optind = 1;
    int ch;
    while ((ch = getopt_long(argc, argv, "m:p:s:n:t:c:vh", opts, NULL)) != -1) {
        bool ok = true;
        switch (ch) {
        case 'm':
            model = optarg;
            break;
        case 'p':
            question = optarg;
            break;
        case 's':
            system = optarg;
            break;
        case 'n':
            ok = cli_int("-n", optarg, 1, 1 << 20, &c.n_predict);
            break;
        case 't':
            ok = cli_int("--threads", optarg, 0, 1024, &op.n_threads);
            break;
        case 'c':
            ok = cli_int("--ctx", optarg, 1, 1 << 20, &op.n_ctx);
            break;
        case O_BACKEND:
            op.backend = optarg;
            break;
        case O_DEVICE:
            ok = cli_int("--device", optarg, 0, 1024, &op.device);
            break;
        case O_TEMP:
            ok = cli_float("--temp", optarg, 0, 100, &c.smp.temperature);
            break;
        case O_TOPP:
            ok = cli_float("--top-p", optarg, 1e-6, 1, &c.smp.top_p);
            break;
        case O_SEED:
            ok = cli_u64("--seed", optarg, &seed), seed_set = true;
            break;
        case O_TEMPLATE:
            template_name = optarg;
            break;
        case 'v':
            c.verbose = true;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
        if (!ok) return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "duet: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }
    if (!model && !(model = cli_default_model())) return 1;
    c.smp.seed = seed_set ? seed : (unsigned long long)time(NULL);
    c.verbose |= question != NULL; /* the one-shot answer reports its speed */

    duet_status st = duet_model_open(model, &op, &c.m);
    if (st) return cli_fail(model, st);
    if ((st = duet_chat_template_load(c.m, template_name, &c.tmpl))) {
        duet_model_close(c.m);
        return cli_fail("chat template", st);
    }
    if (duet_chat_template_fallback_reason(c.tmpl)[0])
        fprintf(stderr, "duet: chat template '%s' (%s)\n", duet_chat_template_name(c.tmpl),
                duet_chat_template_fallback_reason(c.tmpl));
    duet_model_desc d;
    duet_model_describe(c.m, &d);
    c.bos = d.bos;

    struct sigaction sa = {.sa_handler = on_sigint};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL); /* no SA_RESTART: Ctrl-C at the prompt ends getline */

    int rc = 0;
    cJSON *conv = new_conversation(system);
    if (!conv) rc = cli_fail("chat", DUET_OUT_OF_MEMORY);
    if (!rc && question) {
        printf("> %s\n", question);
        if (!add_message(cJSON_GetObjectItem(conv, "messages"), "user", question) || !answer(&c, conv))
            rc = 1;
    } else if (!rc) {
        fprintf(stderr, "duet: chatting with %s (%s on %s, template %s); an empty line ends\n", model,
                d.backend, d.device, duet_chat_template_name(c.tmpl));
        for (;;) {
            printf("> ");
            fflush(stdout);
            char *line = read_line();
            if (!line || !*line || !strcmp(line, "/exit")) {
                free(line);
                break;
            }
            if (!strcmp(line, "/reset")) {
                cJSON_Delete(conv);
                conv = new_conversation(system);
                free(line);
                if (!conv) {
                    rc = cli_fail("chat", DUET_OUT_OF_MEMORY);
                    break;
                }
                continue;
            }
            bool ok = add_message(cJSON_GetObjectItem(conv, "messages"), "user", line);
            free(line);
            if (!ok || !answer(&c, conv)) {
                rc = 1;
                break;
            }
        }
    }
    cJSON_Delete(conv);
    duet_chat_template_free(c.tmpl);
    duet_model_close(c.m);
    return rc;
}
