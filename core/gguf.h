/* gguf.h — GGUF v2/v3 reader (mmap, every field bounds-checked) and writer.
 *
 * The reader trusts nothing in the file: every count, length, offset and
 * size is checked against the file size before use, and a malformed file
 * gets DUET_BAD_MODEL with a message naming what is wrong and at which byte
 * offset (see duet_last_error()).
 */
#ifndef DUET_GGUF_H
#define DUET_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../backends/backend.h"

/* GGUF metadata value types (the file's ids). */
typedef enum duet_gguf_type {
    DUET_GGUF_UINT8 = 0,
    DUET_GGUF_INT8 = 1,
    DUET_GGUF_UINT16 = 2,
    DUET_GGUF_INT16 = 3,
    DUET_GGUF_UINT32 = 4,
    DUET_GGUF_INT32 = 5,
    DUET_GGUF_FLOAT32 = 6,
    DUET_GGUF_BOOL = 7,
    DUET_GGUF_STRING = 8,
    DUET_GGUF_ARRAY = 9,
    DUET_GGUF_UINT64 = 10,
    DUET_GGUF_INT64 = 11,
    DUET_GGUF_FLOAT64 = 12,
} duet_gguf_type;

/* A string inside the mapped file: not NUL-terminated. */
typedef struct duet_gguf_str {
    const char *ptr;
    uint64_t len;
} duet_gguf_str;

typedef struct duet_gguf_value duet_gguf_value;
struct duet_gguf_value {
    duet_gguf_type type;
    union {
        uint64_t u64; /* every unsigned integer type and bool, widened */
        int64_t i64;  /* every signed integer type, widened */
        double f64;   /* float32 and float64, widened */
        duet_gguf_str str;
        struct {
            duet_gguf_type type; /* element type */
            uint64_t n;
            const void *data;          /* raw elements in the file, for scalar arrays */
            duet_gguf_str *strs;       /* decoded, for string arrays (n entries) */
            duet_gguf_value *arrays;   /* decoded, for nested arrays (n entries) */
        } arr;
    };
};

typedef struct duet_gguf_kv {
    duet_gguf_str key;
    duet_gguf_value value;
} duet_gguf_kv;

#define DUET_GGUF_MAX_DIMS 4

typedef struct duet_gguf_tensor {
    duet_gguf_str name;
    int n_dims;
    int64_t ne[DUET_GGUF_MAX_DIMS]; /* ne[0] is the fastest-varying (row length) */
    duet_dtype type;
    uint64_t offset;   /* relative to the data section */
    uint64_t size;     /* bytes */
    const void *data;  /* into the mapping */
} duet_gguf_tensor;

typedef struct duet_gguf {
    uint32_t version;
    uint64_t n_kv, n_tensors;
    duet_gguf_kv *kv;
    duet_gguf_tensor *tensors;
    uint64_t alignment;
    uint64_t data_offset; /* file offset of the data section */
    const uint8_t *base;  /* the mapping (or the caller's memory) */
    uint64_t size;
    bool mapped;
    void *arena; /* private: allocations owned by the reader */
} duet_gguf;

/* Opens and validates a file (mmap). */
duet_status duet_gguf_open(const char *path, duet_gguf **out);
/* Validates a file already in memory; `data` must outlive the result. */
duet_status duet_gguf_open_memory(const void *data, size_t size, duet_gguf **out);
void duet_gguf_close(duet_gguf *g);

/* Look-ups; NULL / -1 when absent. */
const duet_gguf_kv *duet_gguf_find(const duet_gguf *g, const char *key);
const duet_gguf_tensor *duet_gguf_find_tensor(const duet_gguf *g, const char *name);

/* Typed getters: return false when absent or of an incompatible type
 * (integer getters accept any integer type whose value fits). */
bool duet_gguf_get_u32(const duet_gguf *g, const char *key, uint32_t *out);
bool duet_gguf_get_i64(const duet_gguf *g, const char *key, int64_t *out);
bool duet_gguf_get_f32(const duet_gguf *g, const char *key, float *out);
bool duet_gguf_get_bool(const duet_gguf *g, const char *key, bool *out);
/* Copies a string value into buf (NUL-terminated, truncated); false if absent. */
bool duet_gguf_get_str(const duet_gguf *g, const char *key, char *buf, size_t size);
const char *duet_gguf_type_name(duet_gguf_type t);

/* ---- writer --------------------------------------------------------- */

typedef struct duet_gguf_writer duet_gguf_writer;

duet_gguf_writer *duet_gguf_writer_new(void);
void duet_gguf_writer_free(duet_gguf_writer *w);
void duet_gguf_writer_set_alignment(duet_gguf_writer *w, uint32_t alignment);

/* Metadata setters copy their arguments. */
void duet_gguf_set_u32(duet_gguf_writer *w, const char *key, uint32_t v);
void duet_gguf_set_i32(duet_gguf_writer *w, const char *key, int32_t v);
void duet_gguf_set_u64(duet_gguf_writer *w, const char *key, uint64_t v);
void duet_gguf_set_f32(duet_gguf_writer *w, const char *key, float v);
void duet_gguf_set_bool(duet_gguf_writer *w, const char *key, bool v);
void duet_gguf_set_str(duet_gguf_writer *w, const char *key, const char *v);
/* Scalar array of `type` (n elements, copied from data). */
void duet_gguf_set_array(duet_gguf_writer *w, const char *key, duet_gguf_type type, const void *data,
                         uint64_t n);
void duet_gguf_set_str_array(duet_gguf_writer *w, const char *key, const char *const *strs, uint64_t n);
/* Copies every key of `g` (used by quantize to keep metadata). */
void duet_gguf_copy_kv(duet_gguf_writer *w, const duet_gguf *g);

/* Adds a tensor; `data` (duet_dtype_row_bytes(type, ne0) * rows bytes) is
 * copied unless `borrow` is true, then it must live until write returns. */
void duet_gguf_add_tensor(duet_gguf_writer *w, const char *name, duet_dtype type, int n_dims,
                          const int64_t *ne, const void *data, bool borrow);

/* Writes version 3 to path. */
duet_status duet_gguf_write(duet_gguf_writer *w, const char *path);

#endif /* DUET_GGUF_H */
