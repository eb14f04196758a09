/* server_chat.c — chat templates.
 *
 * GGUF files carry their chat template as Jinja text
 * (`tokenizer.chat_template`). duet does not run Jinja: it recognises the
 * common families by their marker strings and renders them in C, the way
 * each family's reference template does for plain text messages. The BOS
 * token is left out of the text because tokenizing with add_special adds
 * it (templates that write it would get it twice).
 *
 * With no template, or one that is not recognised, the "plain" format is
 * used:
 *
 *     <system text>\n\n           (each system message, if any)
 *     User: <text>\n
 *     Assistant: <text>\n
 *     ...
 *     Assistant:
 *
 * and "\nUser:" stops generation, so the model does not write the user's
 * next turn. `duet serve --chat-template NAME` forces a family.
 */
#include <string.h>

#include "server.h"

static const char *const family_names[SRV_CHAT_COUNT] = {"plain",  "chatml", "llama3", "llama2",
                                                         "mistral", "zephyr", "phi3",   "gemma"};

const char *srv_chat_name(srv_chat_family f) {
    return (unsigned)f < SRV_CHAT_COUNT ? family_names[f] : "plain";
}

bool srv_chat_from_name(const char *name, srv_chat_family *out) {
    for (int i = 0; i < SRV_CHAT_COUNT; i++)
        if (!strcmp(name, family_names[i])) {
            *out = (srv_chat_family)i;
            return true;
        }
    return false;
}

srv_chat_family srv_chat_detect(const char *t, bool *recognised) {
    srv_chat_family f = SRV_CHAT_PLAIN;
    bool known = true;
    if (!t || !*t) f = SRV_CHAT_PLAIN;
    else if (strstr(t, "<|im_start|>")) f = SRV_CHAT_CHATML;
    else if (strstr(t, "<|start_header_id|>")) f = SRV_CHAT_LLAMA3;
    else if (strstr(t, "<start_of_turn>")) f = SRV_CHAT_GEMMA;
    else if (strstr(t, "[INST]")) f = strstr(t, "<<SYS>>") ? SRV_CHAT_LLAMA2 : SRV_CHAT_MISTRAL;
    else if (strstr(t, "<|user|>")) f = strstr(t, "<|end|>") ? SRV_CHAT_PHI3 : SRV_CHAT_ZEPHYR;
    else known = false;
    if (recognised) *recognised = known && t && *t;
    return f;
}

static const char *const no_stops[] = {NULL};
static const char *const plain_stops[] = {"\nUser:", NULL};
static const char *const chatml_stops[] = {"<|im_end|>", NULL};
static const char *const llama3_stops[] = {"<|eot_id|>", NULL};
static const char *const phi3_stops[] = {"<|end|>", NULL};
static const char *const gemma_stops[] = {"<end_of_turn>", NULL};

const char *const *srv_chat_stops(srv_chat_family f) {
    switch (f) {
    case SRV_CHAT_PLAIN: return plain_stops;
    case SRV_CHAT_CHATML: return chatml_stops;
    case SRV_CHAT_LLAMA3: return llama3_stops;
    case SRV_CHAT_PHI3: return phi3_stops;
    case SRV_CHAT_GEMMA: return gemma_stops;
    default: return no_stops; /* the model's EOS token ends the turn */
    }
}

static const char *role_name(srv_role r) {
    return r == SRV_ROLE_SYSTEM ? "system" : r == SRV_ROLE_USER ? "user" : "assistant";
}

/* The content with leading and trailing whitespace removed (Llama and
 * Mistral templates strip it), as a pointer and a length. */
static const char *trimmed(const char *s, size_t *n) {
    while (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r') s++;
    size_t k = strlen(s);
    while (k && (s[k - 1] == ' ' || s[k - 1] == '\n' || s[k - 1] == '\t' || s[k - 1] == '\r')) k--;
    *n = k;
    return s;
}

#define PUT(str) ok = ok && srv_text_append(out, (str), strlen(str))
#define PUTN(str, n) ok = ok && srv_text_append(out, (str), (n))

/* Families without a system role fold the system messages into the first
 * user turn: "<system>\n\n<user>". This joins them. */
static bool system_prefix(const srv_message *msgs, int n, srv_text *sys) {
    bool ok = true;
    for (int i = 0; i < n && ok; i++)
        if (msgs[i].role == SRV_ROLE_SYSTEM) {
            if (sys->len) ok = srv_text_append(sys, "\n\n", 2);
            ok = ok && srv_text_append(sys, msgs[i].content, strlen(msgs[i].content));
        }
    return ok;
}

static bool has_user(const srv_message *msgs, int n) {
    for (int i = 0; i < n; i++)
        if (msgs[i].role == SRV_ROLE_USER) return true;
    return false;
}

static bool render_inst(bool llama2, const srv_message *msgs, int n, srv_text *out) {
    srv_text sys = {0};
    bool ok = system_prefix(msgs, n, &sys), first_user = true;
    /* A system prompt with no user turn still needs a turn to live in. */
    if (ok && sys.len && !has_user(msgs, n)) {
        PUT(llama2 ? "[INST] <<SYS>>\n" : "[INST] ");
        PUTN(sys.p, sys.len);
        PUT(llama2 ? "\n<</SYS>>\n\n [/INST]" : " [/INST]");
        first_user = false;
    }
    for (int i = 0; i < n && ok; i++) {
        size_t len;
        const char *c = trimmed(msgs[i].content, &len);
        if (msgs[i].role == SRV_ROLE_USER) {
            /* Every user turn after the first opens with its own BOS. */
            if (!first_user) PUT("<s>");
            PUT("[INST] ");
            if (first_user && sys.len) {
                if (llama2) {
                    PUT("<<SYS>>\n");
                    PUTN(sys.p, sys.len);
                    PUT("\n<</SYS>>\n\n");
                } else {
                    PUTN(sys.p, sys.len);
                    PUT("\n\n");
                }
            }
            PUTN(c, len);
            PUT(" [/INST]");
            first_user = false;
        } else if (msgs[i].role == SRV_ROLE_ASSISTANT) {
            PUT(" ");
            PUTN(c, len);
            PUT(llama2 ? " </s>" : "</s>");
        }
    }
    srv_text_free(&sys);
    return ok;
}

bool srv_chat_render(srv_chat_family f, const srv_message *msgs, int n, srv_text *out) {
    bool ok = srv_text_append(out, "", 0);
    switch (f) {
    case SRV_CHAT_CHATML:
        for (int i = 0; i < n; i++) {
            PUT("<|im_start|>");
            PUT(role_name(msgs[i].role));
            PUT("\n");
            PUT(msgs[i].content);
            PUT("<|im_end|>\n");
        }
        PUT("<|im_start|>assistant\n");
        break;
    case SRV_CHAT_LLAMA3:
        for (int i = 0; i < n; i++) {
            size_t len;
            const char *c = trimmed(msgs[i].content, &len);
            PUT("<|start_header_id|>");
            PUT(role_name(msgs[i].role));
            PUT("<|end_header_id|>\n\n");
            PUTN(c, len);
            PUT("<|eot_id|>");
        }
        PUT("<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case SRV_CHAT_LLAMA2:
    case SRV_CHAT_MISTRAL: ok = ok && render_inst(f == SRV_CHAT_LLAMA2, msgs, n, out); break;
    case SRV_CHAT_ZEPHYR:
    case SRV_CHAT_PHI3:
        for (int i = 0; i < n; i++) {
            PUT("<|");
            PUT(role_name(msgs[i].role));
            PUT("|>\n");
            PUT(msgs[i].content);
            PUT(f == SRV_CHAT_PHI3 ? "<|end|>\n" : "</s>\n");
        }
        PUT("<|assistant|>\n");
        break;
    case SRV_CHAT_GEMMA: {
        /* Gemma has no system role: it goes in front of the first user turn. */
        srv_text sys = {0};
        bool first_user = true;
        ok = ok && system_prefix(msgs, n, &sys);
        if (sys.len && !has_user(msgs, n)) {
            PUT("<start_of_turn>user\n");
            PUTN(sys.p, sys.len);
            PUT("<end_of_turn>\n");
        }
        for (int i = 0; i < n; i++) {
            if (msgs[i].role == SRV_ROLE_SYSTEM) continue;
            size_t len;
            const char *c = trimmed(msgs[i].content, &len);
            PUT(msgs[i].role == SRV_ROLE_USER ? "<start_of_turn>user\n" : "<start_of_turn>model\n");
            if (msgs[i].role == SRV_ROLE_USER && first_user && sys.len) {
                PUTN(sys.p, sys.len);
                PUT("\n\n");
            }
            if (msgs[i].role == SRV_ROLE_USER) first_user = false;
            PUTN(c, len);
            PUT("<end_of_turn>\n");
        }
        PUT("<start_of_turn>model\n");
        srv_text_free(&sys);
        break;
    }
    default: /* plain */
        for (int i = 0; i < n; i++) {
            if (msgs[i].role == SRV_ROLE_SYSTEM) {
                PUT(msgs[i].content);
                PUT("\n\n");
            } else {
                PUT(msgs[i].role == SRV_ROLE_USER ? "User: " : "Assistant: ");
                PUT(msgs[i].content);
                PUT("\n");
            }
        }
        PUT("Assistant:");
        break;
    }
    return ok;
}
