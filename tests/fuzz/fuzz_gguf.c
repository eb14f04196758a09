/* fuzz_gguf.c — libFuzzer target for the GGUF reader.
 *
 * Parses the input from memory; if the reader accepts it, walks every
 * key, value and tensor and calls every getter, so a structure that passed
 * validation but points outside the input shows up under ASan.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"

static volatile uint64_t sink; /* keeps the walks from being optimised out */

static uint64_t walk(const duet_gguf_value *v) {
    uint64_t h = (uint64_t)v->type;
    switch (v->type) {
    case DUET_GGUF_STRING:
        for (uint64_t i = 0; i < v->str.len; i++)
            h = h * 31 + (uint8_t)v->str.ptr[i];
        break;
    case DUET_GGUF_ARRAY:
        h += v->arr.n;
        if (v->arr.type == DUET_GGUF_STRING) {
            for (uint64_t i = 0; i < v->arr.n; i++)
                for (uint64_t j = 0; j < v->arr.strs[i].len; j++)
                    h = h * 31 + (uint8_t)v->arr.strs[i].ptr[j];
        } else if (v->arr.type == DUET_GGUF_ARRAY) {
            for (uint64_t i = 0; i < v->arr.n; i++)
                h += walk(&v->arr.arrays[i]);
        } else {
            /* Scalar elements: read them through their type, as a caller would. */
            for (uint64_t i = 0; i < v->arr.n; i++) {
                switch (v->arr.type) {
                case DUET_GGUF_UINT8:
                case DUET_GGUF_INT8:
                case DUET_GGUF_BOOL:
                    h += ((const uint8_t *)v->arr.data)[i];
                    break;
                case DUET_GGUF_UINT16:
                case DUET_GGUF_INT16:
                    h += ((const uint16_t *)v->arr.data)[i];
                    break;
                case DUET_GGUF_UINT32:
                case DUET_GGUF_INT32:
                case DUET_GGUF_FLOAT32:
                    h += ((const uint32_t *)v->arr.data)[i];
                    break;
                default:
                    h += ((const uint64_t *)v->arr.data)[i];
                    break;
                }
            }
        }
        break;
    default:
        h += v->u64;
        break;
    }
    return h;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    duet_gguf *g = NULL;
    if (duet_gguf_open_memory(data, size, &g) != DUET_OK) return 0;
    uint64_t h = 0;
    char key[256], buf[64];
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const duet_gguf_kv *kv = &g->kv[i];
        h += walk(&kv->value);
        size_t n = kv->key.len < sizeof key - 1 ? (size_t)kv->key.len : sizeof key - 1;
        memcpy(key, kv->key.ptr, n);
        key[n] = 0;
        /* A truncated key need not exist; a full one must be found. */
        const duet_gguf_kv *found = duet_gguf_find(g, key);
        if (n == kv->key.len && !memchr(key, 0, n) && found != kv) abort();
        uint32_t u;
        int64_t i64;
        float f;
        bool b;
        h += duet_gguf_get_u32(g, key, &u) + duet_gguf_get_i64(g, key, &i64) + duet_gguf_get_f32(g, key, &f) +
             duet_gguf_get_bool(g, key, &b) + duet_gguf_get_str(g, key, buf, sizeof buf);
        h += strlen(duet_gguf_type_name(kv->value.type));
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const duet_gguf_tensor *t = &g->tensors[i];
        const uint8_t *d = t->data;
        if (t->size) h += d[0] + d[t->size - 1]; /* first and last byte: in bounds */
        if (d < g->base || d + t->size > g->base + g->size) abort();
        size_t n = t->name.len < sizeof key - 1 ? (size_t)t->name.len : sizeof key - 1;
        memcpy(key, t->name.ptr, n);
        key[n] = 0;
        const duet_gguf_tensor *found = duet_gguf_find_tensor(g, key);
        if (n == t->name.len && !memchr(key, 0, n) && found != t) abort();
    }
    sink = h;
    duet_gguf_close(g);
    return 0;
}
