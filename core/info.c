/* info.c — a human (or JSON) description of a GGUF file. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "duet_internal.h"
#include "model.h"
#include "tokenizer.h"

/* Whether device 0 of iface runs matmuls of weight type t (the loader asks
 * the same of the device it opens). */
static bool runs_type(const duet_backend_iface *iface, duet_dtype t) {
    duet_op op = {.kind = DUET_OP_MATMUL};
    op.matmul.dtype = t;
    return duet_device_supports_op(iface, 0, &op);
}

/* Per compiled-in backend: unavailable (and why), or the weight types of
 * the file (has[t]) it does not run. One line each for the text form. */
static void describe_backends(const bool *has, int n_types, cJSON *o, char *buf, size_t size) {
    cJSON *bs = cJSON_AddObjectToObject(o, "backends");
    size_t n = 0;
    buf[0] = '\0';
    for (int b = 0; b < duet_backend_count(); b++) {
        const duet_backend_iface *iface = duet_backend_get(b);
        cJSON *e = cJSON_AddObjectToObject(bs, iface->name);
        char why[256] = "";
        const bool ok = iface->available(why, sizeof why) && iface->device_count() > 0;
        cJSON_AddBoolToObject(e, "available", ok);
        if (!ok) {
            cJSON_AddStringToObject(e, "why", why[0] ? why : "no device");
            n += (size_t)snprintf(buf + n, n < size ? size - n : 0, "  %s: unavailable here (%s)\n",
                                  iface->name, why[0] ? why : "no device");
            continue;
        }
        cJSON *miss = cJSON_AddArrayToObject(e, "unsupported_types");
        char list[256] = "";
        size_t m = 0;
        for (int t = 0; t < n_types; t++)
            if (has[t] && !runs_type(iface, (duet_dtype)t)) {
                cJSON_AddItemToArray(miss, cJSON_CreateString(duet_dtype_name((duet_dtype)t)));
                m += (size_t)snprintf(list + m, m < sizeof list ? sizeof list - m : 0, "%s%s", m ? ", " : "",
                                      duet_dtype_name((duet_dtype)t));
            }
        if (m)
            n += (size_t)snprintf(buf + n, n < size ? size - n : 0,
                                  "  %s: cannot run it: no kernels for %s weights yet\n", iface->name, list);
        else
            n += (size_t)snprintf(buf + n, n < size ? size - n : 0, "  %s: runs every tensor type of it\n",
                                  iface->name);
    }
}

duet_status duet_file_info(const char *path, bool json, char **out) {
    *out = NULL;
    duet_gguf *g;
    duet_status st = duet_gguf_open(path, &g);
    if (st) return st;
    duet_hparams hp;
    bool have_hp = duet__hparams_load(g, &hp) == DUET_OK;
    char hp_error[256] = "";
    if (!have_hp) snprintf(hp_error, sizeof hp_error, "%s", duet_last_error());
    char arch[64] = "?", tok_model[32] = "none", name[128] = "";
    duet_gguf_get_str(g, "general.architecture", arch, sizeof arch);
    duet_gguf_get_str(g, "tokenizer.ggml.model", tok_model, sizeof tok_model);
    duet_gguf_get_str(g, "general.name", name, sizeof name);
    const duet_gguf_kv *toks = duet_gguf_find(g, "tokenizer.ggml.tokens");
    uint64_t n_tokens = toks && toks->value.type == DUET_GGUF_ARRAY ? toks->value.arr.n : 0;

    /* Parameters and bytes per tensor type, indexed by GGUF type id (the
     * reader accepts only ids the type table names, all below N_TYPE_IDS). */
    enum { N_TYPE_IDS = 64 };
    uint64_t count[N_TYPE_IDS] = {0}, bytes[N_TYPE_IDS] = {0}, params = 0;
    bool matrix_type[N_TYPE_IDS] = {false}; /* types of 2-D weights: what a matmul reads */
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const duet_gguf_tensor *t = &g->tensors[i];
        uint64_t n = 1;
        for (int d = 0; d < t->n_dims; d++) n *= (uint64_t)t->ne[d];
        params += n;
        if ((unsigned)t->type < N_TYPE_IDS) {
            count[t->type]++, bytes[t->type] += t->size;
            if (t->n_dims == 2) matrix_type[t->type] = true;
        }
    }
    char template_head[64] = "";
    const bool has_template =
        duet_gguf_get_str(g, "tokenizer.chat_template", template_head, sizeof template_head);

    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "path", path);
    cJSON_AddStringToObject(o, "name", name);
    cJSON_AddNumberToObject(o, "gguf_version", g->version);
    cJSON_AddNumberToObject(o, "file_bytes", (double)g->size);
    cJSON_AddStringToObject(o, "architecture", arch);
    if (have_hp) {
        cJSON_AddNumberToObject(o, "n_vocab", hp.n_vocab);
        cJSON_AddNumberToObject(o, "n_embd", hp.n_embd);
        cJSON_AddNumberToObject(o, "n_layer", hp.n_layer);
        cJSON_AddNumberToObject(o, "n_head", hp.n_head);
        cJSON_AddNumberToObject(o, "n_head_kv", hp.n_head_kv);
        cJSON_AddNumberToObject(o, "head_dim", hp.head_dim);
        cJSON_AddNumberToObject(o, "n_ff", hp.n_ff);
        cJSON_AddNumberToObject(o, "n_ctx_train", hp.n_ctx_train);
        cJSON_AddNumberToObject(o, "rope_base", hp.rope_base);
        cJSON_AddNumberToObject(o, "norm_eps", hp.norm_eps);
        static const char *const scalings[] = {"none", "linear", "yarn"};
        cJSON_AddStringToObject(o, "rope_scaling",
                                hp.rope_factor != 1.0f ? scalings[hp.rope_scaling] : "none");
        cJSON_AddNumberToObject(o, "rope_factor", hp.rope_factor);
        cJSON_AddBoolToObject(o, "rope_freqs", duet_gguf_find_tensor(g, "rope_freqs.weight") != NULL);
        cJSON_AddNumberToObject(o, "sliding_window", hp.sliding_window);
    }
    cJSON_AddNumberToObject(o, "n_tensors", (double)g->n_tensors);
    cJSON_AddNumberToObject(o, "n_params", (double)params);
    cJSON *tt = cJSON_AddObjectToObject(o, "tensor_types");
    for (int k = 0; k < N_TYPE_IDS; k++)
        if (count[k]) {
            cJSON *e = cJSON_AddObjectToObject(tt, duet_dtype_name((duet_dtype)k));
            cJSON_AddNumberToObject(e, "tensors", (double)count[k]);
            cJSON_AddNumberToObject(e, "bytes", (double)bytes[k]);
        }
    if (!have_hp)
        cJSON_AddStringToObject(o, "cannot_run", hp_error);
    else if (g->n_tensors == 0)
        cJSON_AddStringToObject(o, "cannot_run", "no weights (a vocabulary-only file)");
    char backends[1024];
    describe_backends(matrix_type, N_TYPE_IDS, o, backends, sizeof backends);
    cJSON *tk = cJSON_AddObjectToObject(o, "tokenizer");
    cJSON_AddStringToObject(tk, "model", tok_model);
    cJSON_AddNumberToObject(tk, "n_tokens", (double)n_tokens);
    duet_tokenizer *tok = NULL;
    if (n_tokens && duet_tokenizer_load(g, &tok) == DUET_OK) {
        cJSON_AddNumberToObject(tk, "bos", duet_tokenizer_bos(tok));
        cJSON_AddNumberToObject(tk, "eos", duet_tokenizer_eos(tok));
        cJSON_AddBoolToObject(tk, "add_bos", duet_tokenizer_add_bos(tok));
        duet_tokenizer_free(tok);
    }
    cJSON_AddBoolToObject(tk, "chat_template", has_template);

    if (json) {
        *out = cJSON_PrintUnformatted(o);
    } else {
        char buf[4096];
        int n = snprintf(buf, sizeof buf, "%s: GGUF v%u, %.1f MiB, %s%s%s\n", path, g->version,
                         (double)g->size / (1 << 20), arch, name[0] ? ", " : "", name);
        if (have_hp)
            n += snprintf(buf + n, sizeof buf - n,
                          "  shape: vocab %d, embd %d, layers %d, heads %d (kv %d, dim %d), ff %d, ctx %d, "
                          "rope base %g, eps %g\n",
                          hp.n_vocab, hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff,
                          hp.n_ctx_train, hp.rope_base, hp.norm_eps);
        if (have_hp &&
            (hp.rope_factor != 1.0f || hp.sliding_window || duet_gguf_find_tensor(g, "rope_freqs.weight")))
            n += snprintf(buf + n, sizeof buf - n, "  rope: %s x%g%s; sliding window %d\n",
                          hp.rope_scaling == DUET_ROPE_SCALING_YARN ? "yarn" : "linear", hp.rope_factor,
                          duet_gguf_find_tensor(g, "rope_freqs.weight") ? ", per-pair factors (rope_freqs)"
                                                                        : "",
                          hp.sliding_window);
        n += snprintf(buf + n, sizeof buf - n, "  tensors: %llu, %.2fM parameters:", (unsigned long long)g->n_tensors,
                      (double)params / 1e6);
        for (int k = 0; k < N_TYPE_IDS; k++)
            if (count[k])
                n += snprintf(buf + n, sizeof buf - n, " %s x%llu (%.1f MiB)", duet_dtype_name((duet_dtype)k),
                              (unsigned long long)count[k], (double)bytes[k] / (1 << 20));
        n += snprintf(buf + n, sizeof buf - n, "\n  tokenizer: %s, %llu tokens; chat template: %s\n",
                      tok_model, (unsigned long long)n_tokens, has_template ? "yes" : "none");
        if (!have_hp)
            n += snprintf(buf + n, sizeof buf - n, "  cannot run: %s\n", hp_error);
        else if (g->n_tensors == 0)
            n += snprintf(buf + n, sizeof buf - n, "  cannot run: no weights (a vocabulary-only file)\n");
        else
            n += snprintf(buf + n, sizeof buf - n, "%s", backends);
        *out = strdup(buf);
    }
    cJSON_Delete(o);
    duet_gguf_close(g);
    return *out ? DUET_OK : duet__error(DUET_OUT_OF_MEMORY, "info: out of memory");
}
