/* info.c — a human (or JSON) description of a GGUF file. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "tokenizer.h"

duet_status duet_file_info(const char *path, bool json, char **out) {
    *out = NULL;
    duet_gguf *g;
    duet_status st = duet_gguf_open(path, &g);
    if (st) return st;
    duet_hparams hp;
    bool have_hp = duet__hparams_load(g, &hp) == DUET_OK;
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
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const duet_gguf_tensor *t = &g->tensors[i];
        uint64_t n = 1;
        for (int d = 0; d < t->n_dims; d++) n *= (uint64_t)t->ne[d];
        params += n;
        if ((unsigned)t->type < N_TYPE_IDS) count[t->type]++, bytes[t->type] += t->size;
    }

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
        n += snprintf(buf + n, sizeof buf - n, "  tensors: %llu, %.2fM parameters:", (unsigned long long)g->n_tensors,
                      (double)params / 1e6);
        for (int k = 0; k < N_TYPE_IDS; k++)
            if (count[k])
                n += snprintf(buf + n, sizeof buf - n, " %s x%llu (%.1f MiB)", duet_dtype_name((duet_dtype)k),
                              (unsigned long long)count[k], (double)bytes[k] / (1 << 20));
        n += snprintf(buf + n, sizeof buf - n, "\n  tokenizer: %s, %llu tokens\n", tok_model,
                      (unsigned long long)n_tokens);
        *out = strdup(buf);
    }
    cJSON_Delete(o);
    duet_gguf_close(g);
    return *out ? DUET_OK : duet__error(DUET_OUT_OF_MEMORY, "info: out of memory");
}
