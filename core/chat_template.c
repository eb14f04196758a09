/* chat_template.c — a conversation to prompt text.
 *
 * GGUF files carry their chat template as Jinja text
 * (`tokenizer.chat_template`). A template is one of:
 *
 * - the model's own Jinja (or a .jinja file), run by duet's interpreter
 *   (core/jinja.c) the way transformers runs it with jinja2: variables
 *   messages (as the conversation has them, tool calls included), tools
 *   (when the conversation has them), add_generation_prompt, bos_token and
 *   eos_token. Named "jinja". A template that does not parse, or fails on a
 *   probe conversation, falls back to the family its marker strings name,
 *   and the template says why.
 * - a named family, rendered here in C the way each family's reference
 *   template renders plain text messages: plain, chatml, llama3, llama2,
 *   mistral, zephyr, phi3, gemma. Forced by name, or chosen for a model's
 *   Jinja by its marker strings.
 * - plain, with no template at all:
 *
 *       <system text>\n\n           (each system message, if any)
 *       User: <text>\n
 *       Assistant: <text>\n
 *       ...
 *       Assistant:
 *
 *   where "\nUser:" stops generation, so the model does not write the
 *   user's next turn.
 *
 * Conversations arrive as OpenAI-shaped JSON: {"messages": [{"role",
 * "content"}...], "tools": [...]}; content is a string or a list of
 * {"type": "text", "text"} parts. The families leave the BOS token out of
 * their text because tokenizing with add_special adds it.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "duet.h"
#include "duet_internal.h"
#include "jinja.h"
#include "tool_calls.h"

typedef enum family {
    FAM_PLAIN,   /* no template: "User: ...\nAssistant: ..." */
    FAM_CHATML,  /* <|im_start|>role ... <|im_end|> (Qwen, SmolLM, many fine-tunes) */
    FAM_LLAMA3,  /* <|start_header_id|>role<|end_header_id|> ... <|eot_id|> */
    FAM_LLAMA2,  /* [INST] <<SYS>> ... <</SYS>> ... [/INST] */
    FAM_MISTRAL, /* [INST] ... [/INST] without a system block */
    FAM_ZEPHYR,  /* <|user|> ... </s> */
    FAM_PHI3,    /* <|user|> ... <|end|> */
    FAM_GEMMA,   /* <start_of_turn>user ... <end_of_turn> */
    FAM_COUNT
} family;

static const char *const family_names[FAM_COUNT] = {"plain",   "chatml", "llama3", "llama2",
                                                    "mistral", "zephyr", "phi3",   "gemma"};

struct duet_chat_template {
    family fam;                  /* the family rendered; for Jinja, the one its markers name (for stops) */
    bool fam_known;              /* for Jinja: whether the markers named a family */
    duet__jinja_template *jinja; /* the template's own source, when it runs; NULL: the family renders */
    char *bos, *eos;             /* what bos_token and eos_token stand for */
    bool strip_bos;              /* leave a leading BOS text out: tokenizing with add_special adds it */
    char reason[512];            /* why the model's template fell back to a family ("" when it did not) */
    duet_tool_syntax tools;      /* how the Jinja writes tool calls (NONE: it renders no tools) */
};

/* ---- families ----------------------------------------------------------- */

/* The family of a Jinja template by its marker strings; *known says
 * whether any matched (NULL or unrecognised text gives plain). */
static family detect_family(const char *t, bool *known) {
    *known = true;
    if (!t || !*t) return *known = false, FAM_PLAIN;
    if (strstr(t, "<|im_start|>")) return FAM_CHATML;
    if (strstr(t, "<|start_header_id|>")) return FAM_LLAMA3;
    if (strstr(t, "<start_of_turn>")) return FAM_GEMMA;
    if (strstr(t, "[INST]")) return strstr(t, "<<SYS>>") ? FAM_LLAMA2 : FAM_MISTRAL;
    if (strstr(t, "<|user|>")) return strstr(t, "<|end|>") ? FAM_PHI3 : FAM_ZEPHYR;
    *known = false;
    return FAM_PLAIN;
}

static bool family_from_name(const char *name, family *out) {
    for (int i = 0; i < FAM_COUNT; i++)
        if (!strcmp(name, family_names[i])) return *out = (family)i, true;
    return false;
}

static const char *const no_stops[] = {NULL};
static const char *const plain_stops[] = {"\nUser:", NULL};
static const char *const chatml_stops[] = {"<|im_end|>", NULL};
static const char *const llama3_stops[] = {"<|eot_id|>", NULL};
static const char *const phi3_stops[] = {"<|end|>", NULL};
static const char *const gemma_stops[] = {"<end_of_turn>", NULL};

static const char *const *family_stops(family f) {
    switch (f) {
    case FAM_PLAIN:
        return plain_stops;
    case FAM_CHATML:
        return chatml_stops;
    case FAM_LLAMA3:
        return llama3_stops;
    case FAM_PHI3:
        return phi3_stops;
    case FAM_GEMMA:
        return gemma_stops;
    default:
        return no_stops; /* the model's EOS token ends the turn */
    }
}

typedef enum role { ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT } role;

typedef struct message {
    role role;
    char *content; /* owned */
} message;

/* A growing NUL-terminated string; ok turns false on the first failed
 * allocation and every later append is a no-op. */
typedef struct text {
    char *p;
    size_t len, cap;
    bool ok;
} text;

static void put_n(text *t, const char *s, size_t n) {
    if (!t->ok) return;
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 256;
        while (cap < t->len + n + 1)
            cap *= 2;
        char *p = realloc(t->p, cap);
        if (!p) {
            t->ok = false;
            return;
        }
        t->p = p;
        t->cap = cap;
    }
    memcpy(t->p + t->len, s, n);
    t->len += n;
    t->p[t->len] = '\0';
}

static void put(text *t, const char *s) {
    put_n(t, s, strlen(s));
}

static const char *role_name(role r) {
    return r == ROLE_SYSTEM ? "system" : r == ROLE_USER ? "user" : "assistant";
}

/* The content with leading and trailing whitespace removed (Llama and
 * Mistral templates strip it), as a pointer and a length. */
static const char *trimmed(const char *s, size_t *n) {
    while (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r')
        s++;
    size_t k = strlen(s);
    while (k && (s[k - 1] == ' ' || s[k - 1] == '\n' || s[k - 1] == '\t' || s[k - 1] == '\r'))
        k--;
    *n = k;
    return s;
}

static void put_trimmed(text *t, const char *s) {
    size_t n;
    const char *c = trimmed(s, &n);
    put_n(t, c, n);
}

/* Families without a system role fold the system messages into the first
 * user turn: "<system>\n\n<user>". This joins them. */
static void system_prefix(const message *m, int n, text *sys) {
    for (int i = 0; i < n; i++)
        if (m[i].role == ROLE_SYSTEM) {
            if (sys->len) put(sys, "\n\n");
            put(sys, m[i].content);
        }
}

static bool has_user(const message *m, int n) {
    for (int i = 0; i < n; i++)
        if (m[i].role == ROLE_USER) return true;
    return false;
}

static void render_inst(bool llama2, const message *m, int n, text *out) {
    text sys = {.ok = true};
    bool first_user = true;
    system_prefix(m, n, &sys);
    /* A system prompt with no user turn still needs a turn to live in. */
    if (sys.len && !has_user(m, n)) {
        put(out, llama2 ? "[INST] <<SYS>>\n" : "[INST] ");
        put_n(out, sys.p, sys.len);
        put(out, llama2 ? "\n<</SYS>>\n\n [/INST]" : " [/INST]");
        first_user = false;
    }
    for (int i = 0; i < n; i++) {
        if (m[i].role == ROLE_USER) {
            /* Every user turn after the first opens with its own BOS. */
            if (!first_user) put(out, "<s>");
            put(out, "[INST] ");
            if (first_user && sys.len) {
                put(out, llama2 ? "<<SYS>>\n" : "");
                put_n(out, sys.p, sys.len);
                put(out, llama2 ? "\n<</SYS>>\n\n" : "\n\n");
            }
            put_trimmed(out, m[i].content);
            put(out, " [/INST]");
            first_user = false;
        } else if (m[i].role == ROLE_ASSISTANT) {
            put(out, " ");
            put_trimmed(out, m[i].content);
            put(out, llama2 ? " </s>" : "</s>");
        }
    }
    out->ok &= sys.ok;
    free(sys.p);
}

static void render_gemma(const message *m, int n, bool gen, text *out) {
    /* Gemma has no system role: it goes in front of the first user turn. */
    text sys = {.ok = true};
    bool first_user = true;
    system_prefix(m, n, &sys);
    if (sys.len && !has_user(m, n)) {
        put(out, "<start_of_turn>user\n");
        put_n(out, sys.p, sys.len);
        put(out, "<end_of_turn>\n");
    }
    for (int i = 0; i < n; i++) {
        if (m[i].role == ROLE_SYSTEM) continue;
        put(out, m[i].role == ROLE_USER ? "<start_of_turn>user\n" : "<start_of_turn>model\n");
        if (m[i].role == ROLE_USER && first_user && sys.len) {
            put_n(out, sys.p, sys.len);
            put(out, "\n\n");
        }
        if (m[i].role == ROLE_USER) first_user = false;
        put_trimmed(out, m[i].content);
        put(out, "<end_of_turn>\n");
    }
    if (gen) put(out, "<start_of_turn>model\n");
    out->ok &= sys.ok;
    free(sys.p);
}

static void render_family(family f, const message *m, int n, bool gen, text *out) {
    switch (f) {
    case FAM_CHATML:
        for (int i = 0; i < n; i++) {
            put(out, "<|im_start|>");
            put(out, role_name(m[i].role));
            put(out, "\n");
            put(out, m[i].content);
            put(out, "<|im_end|>\n");
        }
        if (gen) put(out, "<|im_start|>assistant\n");
        break;
    case FAM_LLAMA3:
        for (int i = 0; i < n; i++) {
            put(out, "<|start_header_id|>");
            put(out, role_name(m[i].role));
            put(out, "<|end_header_id|>\n\n");
            put_trimmed(out, m[i].content);
            put(out, "<|eot_id|>");
        }
        if (gen) put(out, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case FAM_LLAMA2:
    case FAM_MISTRAL:
        render_inst(f == FAM_LLAMA2, m, n, out);
        break;
    case FAM_ZEPHYR:
    case FAM_PHI3:
        for (int i = 0; i < n; i++) {
            put(out, "<|");
            put(out, role_name(m[i].role));
            put(out, "|>\n");
            put(out, m[i].content);
            put(out, f == FAM_PHI3 ? "<|end|>\n" : "</s>\n");
        }
        if (gen) put(out, "<|assistant|>\n");
        break;
    case FAM_GEMMA:
        render_gemma(m, n, gen, out);
        break;
    default: /* plain */
        for (int i = 0; i < n; i++) {
            if (m[i].role == ROLE_SYSTEM) {
                put(out, m[i].content);
                put(out, "\n\n");
            } else {
                put(out, m[i].role == ROLE_USER ? "User: " : "Assistant: ");
                put(out, m[i].content);
                put(out, "\n");
            }
        }
        if (gen) put(out, "Assistant:");
        break;
    }
}

/* ---- conversations -------------------------------------------------------- */

/* A message's content as text: a string, null (""), or the text parts of a
 * list joined with newlines (as vLLM joins them). Returns NULL (with the error set) for anything else. */
static char *content_text(const cJSON *c, int i) {
    if (!c || cJSON_IsNull(c)) return strdup("");
    if (cJSON_IsString(c)) return strdup(c->valuestring);
    if (!cJSON_IsArray(c)) {
        duet__error(DUET_BAD_REQUEST, "chat: messages[%d].content must be a string or a list of parts", i);
        return NULL;
    }
    text t = {.ok = true};
    put(&t, "");
    const cJSON *part;
    cJSON_ArrayForEach(part, c) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *tx = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") || !cJSON_IsString(tx)) {
            free(t.p);
            duet__error(DUET_BAD_REQUEST, "chat: messages[%d].content: only text parts are supported", i);
            return NULL;
        }
        if (t.len) put(&t, "\n");
        put(&t, tx->valuestring);
    }
    if (!t.ok) free(t.p), duet__error(DUET_OUT_OF_MEMORY, "chat: out of memory");
    return t.ok ? t.p : NULL;
}

/* Reads the messages of a conversation for the families. */
static duet_status read_messages(const cJSON *conv, message **out, int *n_out) {
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(conv, "messages");
    if (!cJSON_IsArray(msgs)) return duet__error(DUET_BAD_REQUEST, "chat: 'messages' must be an array");
    int n = cJSON_GetArraySize(msgs);
    message *m = calloc((size_t)n + 1, sizeof *m);
    if (!m) return duet__error(DUET_OUT_OF_MEMORY, "chat: out of memory");
    int i = 0;
    const cJSON *msg;
    duet_status st = DUET_OK;
    cJSON_ArrayForEach(msg, msgs) {
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(msg, "role");
        const char *rs = cJSON_IsString(r) ? r->valuestring : "";
        if (!strcmp(rs, "system") || !strcmp(rs, "developer"))
            m[i].role = ROLE_SYSTEM;
        else if (!strcmp(rs, "user"))
            m[i].role = ROLE_USER;
        else if (!strcmp(rs, "assistant"))
            m[i].role = ROLE_ASSISTANT;
        else {
            st = duet__error(
                DUET_UNSUPPORTED,
                "chat: messages[%d].role '%s': this chat template knows system, user and assistant", i, rs);
            break;
        }
        if (!(m[i].content = content_text(cJSON_GetObjectItemCaseSensitive(msg, "content"), i))) {
            st = duet_last_error()[0] ? DUET_BAD_REQUEST : DUET_OUT_OF_MEMORY;
            break;
        }
        i++;
    }
    if (st) {
        for (int k = 0; k < i; k++)
            free(m[k].content);
        free(m);
        return st;
    }
    *out = m;
    *n_out = n;
    return DUET_OK;
}

/* ---- the public API ------------------------------------------------------- */

static duet_status template_new(family f, const char *reason, duet_chat_template **out) {
    duet_chat_template *t = calloc(1, sizeof *t);
    if (!t) return duet__error(DUET_OUT_OF_MEMORY, "chat template: out of memory");
    t->fam = f;
    snprintf(t->reason, sizeof t->reason, "%s", reason ? reason : "");
    *out = t;
    return DUET_OK;
}

static duet_status render_jinja(const duet_chat_template *t, cJSON *conv, bool add_generation_prompt,
                                char **out);

/* Every template that runs as Jinja must render this conversation. */
static const char probe_conversation[] =
    "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}, {\"role\": \"assistant\", \"content\": "
    "\"Hi! How can I help?\"}, {\"role\": \"user\", \"content\": \"Tell me a joke.\"}]}";

/* A tool, and an assistant turn that calls it (the id has Mistral's 9
 * characters; the arguments are an object, as transformers passes them). */
#define PROBE_TOOL                                                                                           \
    "[{\"type\": \"function\", \"function\": {\"name\": \"" DUET__TOOL_PROBE_NAME                            \
    "\", \"description\": \"Probe.\", \"parameters\": {\"type\": \"object\", \"properties\": "               \
    "{\"x\": {\"type\": \"integer\"}}, \"required\": [\"x\"]}}}]"
static const char probe_tools[] =
    "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"tools\": " PROBE_TOOL "}";
static const char probe_call[] =
    "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}, {\"role\": \"assistant\", "
    "\"content\": \"\", \"tool_calls\": [{\"id\": \"abcDEF123\", \"type\": \"function\", \"function\": "
    "{\"name\": \"" DUET__TOOL_PROBE_NAME "\", \"arguments\": {\"x\": 7}}}]}], \"tools\": " PROBE_TOOL "}";

/* Renders a probe conversation; NULL when the template refuses it. */
static char *render_probe(const duet_chat_template *t, const char *conv_json, bool gen) {
    cJSON *conv = cJSON_Parse(conv_json);
    char *text = NULL;
    if (conv && render_jinja(t, conv, gen, &text) != DUET_OK) text = NULL;
    cJSON_Delete(conv);
    return text;
}

/* The tool-call syntax a Jinja template writes: it must render the tool
 * definitions, then a call in a syntax duet parses. */
static duet_tool_syntax probe_tool_syntax(const duet_chat_template *t) {
    char *text = render_probe(t, probe_tools, true);
    bool renders = text && strstr(text, DUET__TOOL_PROBE_NAME);
    free(text);
    if (!renders) return DUET_TOOL_SYNTAX_NONE;
    text = render_probe(t, probe_call, false);
    duet_tool_syntax s = duet__tool_syntax_detect(text);
    free(text);
    return s;
}

static duet_status template_from_source(const char *source, const char *bos_token, const char *eos_token,
                                        bool strip_bos, duet_chat_template **out) {
    *out = NULL;
    bool known;
    family f = detect_family(source, &known);
    if (!source || !*source) return template_new(f, "the model has no chat template", out);
    char err[400];
    duet__jinja_template *j = NULL;
    duet__jinja_result r = duet__jinja_parse(source, strlen(source), &j, err, sizeof err);
    if (r == DUET__JINJA_NOMEM) return duet__error(DUET_OUT_OF_MEMORY, "chat template: out of memory");
    duet_chat_template *t = calloc(1, sizeof *t);
    if (!t || !(t->bos = strdup(bos_token ? bos_token : "")) ||
        !(t->eos = strdup(eos_token ? eos_token : ""))) {
        duet_chat_template_free(t);
        duet__jinja_free(j);
        return duet__error(DUET_OUT_OF_MEMORY, "chat template: out of memory");
    }
    t->fam = f;
    t->fam_known = known;
    t->strip_bos = strip_bos;
    if (r == DUET__JINJA_OK) {
        t->jinja = j;
        cJSON *probe = cJSON_Parse(probe_conversation);
        char *text = NULL;
        duet_status st = probe ? render_jinja(t, probe, true, &text) : DUET_OUT_OF_MEMORY;
        cJSON_Delete(probe);
        free(text);
        if (st == DUET_OK) {
            t->tools = probe_tool_syntax(t);
            *out = t;
            return DUET_OK;
        }
        if (st == DUET_OUT_OF_MEMORY) {
            duet_chat_template_free(t);
            return st;
        }
        snprintf(err, sizeof err, "%s", duet_last_error());
        duet__jinja_free(t->jinja);
        t->jinja = NULL;
    }
    /* The families render without the Jinja: the fallback. */
    snprintf(t->reason, sizeof t->reason,
             "the model's Jinja template does not run in duet (%s); using the %s family%s", err,
             family_names[f], known ? "" : ", as no family's markers matched");
    *out = t;
    return DUET_OK;
}

duet_status duet_chat_template_parse(const char *source, const char *bos_token, const char *eos_token,
                                     duet_chat_template **out) {
    if (!out) return duet__error(DUET_INVALID_ARGUMENT, "duet_chat_template_parse: out is NULL");
    return template_from_source(source, bos_token, eos_token, true, out);
}

duet_status duet_chat_template_load(const duet_model *model, const char *name, duet_chat_template **out) {
    if (!out) return duet__error(DUET_INVALID_ARGUMENT, "duet_chat_template_load: out is NULL");
    *out = NULL;
    family f;
    if (name && strcmp(name, "auto") && family_from_name(name, &f)) return template_new(f, "", out);
    char *source = NULL;
    if (name && strcmp(name, "auto")) {
        /* A path to a Jinja file. */
        FILE *fp = fopen(name, "rb");
        if (!fp)
            return duet__error(
                DUET_INVALID_ARGUMENT,
                "chat template '%s': neither a family (plain, chatml, llama3, llama2, mistral, zephyr, "
                "phi3, gemma) nor a readable file",
                name);
        long n = fseek(fp, 0, SEEK_END) == 0 ? ftell(fp) : -1;
        if (n < 0 || n > (1 << 20) || fseek(fp, 0, SEEK_SET) != 0 || !(source = malloc((size_t)n + 1)) ||
            fread(source, 1, (size_t)n, fp) != (size_t)n) {
            fclose(fp);
            free(source);
            return duet__error(DUET_IO, "chat template '%s': cannot read it (at most 1 MiB)", name);
        }
        fclose(fp);
        source[n] = '\0';
    } else if (model) {
        int n = duet_model_meta(model, "tokenizer.chat_template", NULL, 0);
        if (n >= 0 && (source = malloc((size_t)n + 1)))
            duet_model_meta(model, "tokenizer.chat_template", source, (size_t)n + 1);
    }
    const char *bos = NULL, *eos = NULL;
    bool strip_bos = true;
    if (model && model->tok) {
        bos = duet_tokenizer_piece(model->tok, duet_tokenizer_bos(model->tok));
        eos = duet_tokenizer_piece(model->tok, duet_tokenizer_eos(model->tok));
        strip_bos = duet_tokenizer_add_bos(model->tok);
    }
    duet_status st = template_from_source(source, bos ? bos : "", eos ? eos : "", strip_bos, out);
    free(source);
    return st;
}

void duet_chat_template_free(duet_chat_template *t) {
    if (!t) return;
    duet__jinja_free(t->jinja);
    free(t->bos);
    free(t->eos);
    free(t);
}

const char *duet_chat_template_name(const duet_chat_template *t) {
    return !t ? "plain" : t->jinja ? "jinja" : family_names[t->fam];
}

const char *duet_chat_template_fallback_reason(const duet_chat_template *t) {
    return t ? t->reason : "";
}

duet_tool_syntax duet_chat_template_tool_syntax(const duet_chat_template *t) {
    return t && t->jinja ? t->tools : DUET_TOOL_SYNTAX_NONE;
}

const char *const *duet_chat_template_stops(const duet_chat_template *t) {
    if (t && t->jinja && !t->fam_known) return no_stops; /* the model's end-of-generation tokens end it */
    return family_stops(t ? t->fam : FAM_PLAIN);
}

/* Renders CONV (its "messages" and "tools" as they are) through the Jinja;
 * CONV gains the other variables. */
static duet_status render_jinja(const duet_chat_template *t, cJSON *conv, bool add_generation_prompt,
                                char **out) {
    *out = NULL;
    if (!cJSON_IsObject(conv) || !cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(conv, "messages")))
        return duet__error(DUET_BAD_REQUEST, "chat: 'messages' must be an array");
    const cJSON *msg;
    int i = 0;
    cJSON_ArrayForEach(msg, cJSON_GetObjectItemCaseSensitive(conv, "messages")) {
        if (!cJSON_IsObject(msg) || !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(msg, "role")))
            return duet__error(DUET_BAD_REQUEST, "chat: messages[%d] needs a string 'role'", i);
        i++;
    }
    static const char *const vars[] = {"add_generation_prompt", "bos_token", "eos_token"};
    for (int k = 0; k < 3; k++)
        cJSON_DeleteItemFromObjectCaseSensitive(conv, vars[k]);
    if (!cJSON_AddBoolToObject(conv, "add_generation_prompt", add_generation_prompt) ||
        !cJSON_AddStringToObject(conv, "bos_token", t->bos) ||
        !cJSON_AddStringToObject(conv, "eos_token", t->eos))
        return duet__error(DUET_OUT_OF_MEMORY, "chat: out of memory");
    char err[400], *text = NULL;
    size_t len = 0;
    duet__jinja_options opt = {.now = -1};
    duet__jinja_result r = duet__jinja_render(t->jinja, conv, &opt, &text, &len, err, sizeof err);
    switch (r) {
    case DUET__JINJA_OK:
        break;
    case DUET__JINJA_RAISED:
        return duet__error(DUET_BAD_REQUEST, "chat template: %s", err);
    case DUET__JINJA_NOMEM:
        return duet__error(DUET_OUT_OF_MEMORY, "chat template: out of memory");
    default:
        return duet__error(DUET_BAD_REQUEST, "chat template: %s", err);
    }
    size_t nb = strlen(t->bos);
    if (t->strip_bos && nb && len >= nb && !memcmp(text, t->bos, nb)) memmove(text, text + nb, len - nb + 1);
    *out = text;
    return DUET_OK;
}

duet_status duet_chat_template_apply(const duet_chat_template *t, const char *conversation_json,
                                     bool add_generation_prompt, char **out) {
    if (!t || !conversation_json || !out)
        return duet__error(DUET_INVALID_ARGUMENT, "duet_chat_template_apply: NULL argument");
    *out = NULL;
    cJSON *conv = cJSON_Parse(conversation_json);
    if (!conv) return duet__error(DUET_BAD_REQUEST, "chat: the conversation is not valid JSON");
    if (t->jinja) {
        duet_status st = render_jinja(t, conv, add_generation_prompt, out);
        cJSON_Delete(conv);
        return st;
    }
    message *m = NULL;
    int n = 0;
    duet_status st = read_messages(conv, &m, &n);
    cJSON_Delete(conv);
    if (st) return st;
    text o = {.ok = true};
    put(&o, "");
    render_family(t->fam, m, n, add_generation_prompt, &o);
    for (int i = 0; i < n; i++)
        free(m[i].content);
    free(m);
    if (!o.ok) {
        free(o.p);
        return duet__error(DUET_OUT_OF_MEMORY, "chat: out of memory");
    }
    *out = o.p;
    return DUET_OK;
}
