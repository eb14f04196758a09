/* quantize.c — rewrite a GGUF model's weight matrices as q8_0 or f16. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "gguf.h"

/* Appends a line to a growing malloc'd report. */
static void report_add(char **rep, size_t *len, const char *line) {
    size_t n = strlen(line);
    char *r = realloc(*rep, *len + n + 2);
    if (!r) return;
    memcpy(r + *len, line, n);
    r[*len + n] = '\n';
    r[*len + n + 1] = 0;
    *rep = r;
    *len += n + 1;
}

duet_status duet_quantize_file(const char *in, const char *out, const char *type, char **report) {
    if (report) *report = NULL;
    if (!in || !out || !type) return duet__error(DUET_INVALID_ARGUMENT, "quantize: NULL argument");
    duet_dtype target;
    if (strcmp(type, "q8_0") == 0) target = DUET_DTYPE_Q8_0;
    else if (strcmp(type, "f16") == 0) target = DUET_DTYPE_F16;
    else return duet__error(DUET_INVALID_ARGUMENT, "quantize: type '%s' is not supported (use q8_0 or f16)", type);
    /* The output is written while the input is still mapped: writing over
     * the input would truncate the mapping under the reader (SIGBUS). */
    struct stat si, so;
    if (stat(in, &si) == 0 && stat(out, &so) == 0 && si.st_dev == so.st_dev && si.st_ino == so.st_ino)
        return duet__error(DUET_INVALID_ARGUMENT, "quantize: '%s' and '%s' are the same file; write to a new one",
                           in, out);
    duet_gguf *g;
    duet_status st = duet_gguf_open(in, &g);
    if (st) return st;
    duet_gguf_writer *w = duet_gguf_writer_new();
    if (!w) {
        duet_gguf_close(g);
        return duet__error(DUET_OUT_OF_MEMORY, "quantize: out of memory");
    }
    duet_gguf_copy_kv(w, g);
    duet_gguf_set_u32(w, "general.file_type", target == DUET_DTYPE_Q8_0 ? 7 : 1);
    duet_gguf_set_u32(w, "general.quantization_version", 2);
    char *rep = NULL;
    size_t rep_len = 0;
    char line[512];
    float *row = NULL;
    int64_t row_cap = 0;
    for (uint64_t i = 0; i < g->n_tensors && !st; i++) {
        const duet_gguf_tensor *t = &g->tensors[i];
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)(t->name.len < 255 ? t->name.len : 255), t->name.ptr);
        /* Only 2-D weight matrices change; norms and biases stay as they are. */
        duet_dtype to = t->type;
        if (t->n_dims == 2 && strstr(name, ".weight") && duet_dtype_is_weight(t->type)) {
            to = target;
            if (target == DUET_DTYPE_Q8_0 && t->ne[0] % DUET_QK8_0 != 0) {
                to = DUET_DTYPE_F16;
                snprintf(line, sizeof line, "%s: row length %lld is not a multiple of %d, kept as f16", name,
                         (long long)t->ne[0], DUET_QK8_0);
                report_add(&rep, &rep_len, line);
            }
        }
        if (to == t->type) {
            duet_gguf_add_tensor(w, name, t->type, t->n_dims, t->ne, t->data, true);
            continue;
        }
        int64_t cols = t->ne[0], rows = 1;
        for (int d = 1; d < t->n_dims; d++) rows *= t->ne[d];
        if (cols > row_cap) {
            free(row);
            row = malloc((size_t)cols * sizeof(float));
            row_cap = cols;
        }
        size_t src_row = duet_dtype_row_bytes(t->type, cols), dst_row = duet_dtype_row_bytes(to, cols);
        uint8_t *dst = malloc(dst_row * (size_t)rows);
        if (!row || !dst) {
            free(dst);
            st = duet__error(DUET_OUT_OF_MEMORY, "quantize: out of memory for '%s'", name);
            break;
        }
        for (int64_t r = 0; r < rows; r++) {
            duet_dequantize_row(t->type, (const uint8_t *)t->data + r * src_row, row, cols);
            duet_convert_row(to, row, dst + r * dst_row, cols);
        }
        duet_gguf_add_tensor(w, name, to, t->n_dims, t->ne, dst, false);
        free(dst);
    }
    free(row);
    if (!st) st = duet_gguf_write(w, out);
    duet_gguf_writer_free(w);
    duet_gguf_close(g);
    if (report) *report = rep;
    else free(rep);
    return st;
}
