/* kv_blocks.c — paged KV block allocator: free list, refcounts, tables. */
#include "kv_blocks.h"

#include <assert.h>
#include <stdlib.h>

#include "../backends/backend.h"

struct duet_kv_blocks {
    int block_size, n_blocks, max_seqs, max_per_seq;
    int n_free;
    int32_t *free_list; /* [n_blocks] stack; the top is free_list[n_free - 1] */
    int32_t *refs;      /* [n_blocks] references held; 0 = on the free list */
    int32_t *tables;    /* [max_seqs][max_per_seq], -1 past the end */
    int32_t *lens;      /* [max_seqs] blocks in each table */
    int32_t *scratch;   /* [n_blocks] for duet__kv_blocks_check */
};

duet_status duet__kv_blocks_new(int block_size, int n_blocks, int max_seqs, int max_blocks_per_seq,
                                duet_kv_blocks **out) {
    *out = NULL;
    if (block_size <= 0 || n_blocks <= 0 || max_seqs <= 0 || max_blocks_per_seq <= 0)
        return duet__error(DUET_INVALID_ARGUMENT, "kv blocks: sizes must be positive (block %d, blocks %d, seqs %d, per seq %d)",
                           block_size, n_blocks, max_seqs, max_blocks_per_seq);
    if ((int64_t)max_seqs * max_blocks_per_seq > INT32_MAX / 2)
        return duet__error(DUET_INVALID_ARGUMENT, "kv blocks: %d tables of %d blocks is too many", max_seqs,
                           max_blocks_per_seq);
    duet_kv_blocks *kv = calloc(1, sizeof *kv);
    if (!kv) return duet__error(DUET_OUT_OF_MEMORY, "kv blocks: out of memory");
    kv->block_size = block_size;
    kv->n_blocks = n_blocks;
    kv->max_seqs = max_seqs;
    kv->max_per_seq = max_blocks_per_seq;
    kv->free_list = malloc((size_t)n_blocks * sizeof *kv->free_list);
    kv->refs = calloc((size_t)n_blocks, sizeof *kv->refs);
    kv->tables = malloc((size_t)max_seqs * max_blocks_per_seq * sizeof *kv->tables);
    kv->lens = calloc((size_t)max_seqs, sizeof *kv->lens);
    kv->scratch = malloc((size_t)n_blocks * sizeof *kv->scratch);
    if (!kv->free_list || !kv->refs || !kv->tables || !kv->lens || !kv->scratch) {
        duet__kv_blocks_free(kv);
        return duet__error(DUET_OUT_OF_MEMORY, "kv blocks: out of memory for %d blocks", n_blocks);
    }
    /* Pushed in reverse so block 0 comes off first: tables read 0, 1, 2... */
    for (int i = 0; i < n_blocks; i++) kv->free_list[i] = n_blocks - 1 - i;
    kv->n_free = n_blocks;
    for (size_t i = 0; i < (size_t)max_seqs * max_blocks_per_seq; i++) kv->tables[i] = -1;
    *out = kv;
    return DUET_OK;
}

void duet__kv_blocks_free(duet_kv_blocks *kv) {
    if (!kv) return;
    free(kv->free_list);
    free(kv->refs);
    free(kv->tables);
    free(kv->lens);
    free(kv->scratch);
    free(kv);
}

int duet__kv_blocks_block_size(const duet_kv_blocks *kv) { return kv->block_size; }
int duet__kv_blocks_n_blocks(const duet_kv_blocks *kv) { return kv->n_blocks; }
int duet__kv_blocks_max_seqs(const duet_kv_blocks *kv) { return kv->max_seqs; }
int duet__kv_blocks_max_blocks_per_seq(const duet_kv_blocks *kv) { return kv->max_per_seq; }
int duet__kv_blocks_n_free(const duet_kv_blocks *kv) { return kv->n_free; }

double duet__kv_blocks_usage(const duet_kv_blocks *kv) {
    return (double)(kv->n_blocks - kv->n_free) / (double)kv->n_blocks;
}

int duet__kv_blocks_needed(const duet_kv_blocks *kv, int n_tokens) {
    assert(n_tokens >= 0);
    return (int)(((int64_t)n_tokens + kv->block_size - 1) / kv->block_size);
}

static int32_t *table_row(const duet_kv_blocks *kv, int seq) {
    assert(seq >= 0 && seq < kv->max_seqs);
    return kv->tables + (size_t)seq * kv->max_per_seq;
}

bool duet__kv_blocks_ensure(duet_kv_blocks *kv, int seq, int n_tokens) {
    int32_t *row = table_row(kv, seq);
    int want = duet__kv_blocks_needed(kv, n_tokens);
    int have = kv->lens[seq];
    if (want <= have) return true;
    if (want > kv->max_per_seq || want - have > kv->n_free) return false;
    for (int i = have; i < want; i++) {
        int32_t b = kv->free_list[--kv->n_free];
        assert(kv->refs[b] == 0);
        kv->refs[b] = 1;
        row[i] = b;
    }
    kv->lens[seq] = want;
    return true;
}

void duet__kv_blocks_unref(duet_kv_blocks *kv, int32_t block) {
    assert(block >= 0 && block < kv->n_blocks);
    assert(kv->refs[block] > 0 && "unref of a free block");
    if (--kv->refs[block] == 0) kv->free_list[kv->n_free++] = block;
}

void duet__kv_blocks_ref(duet_kv_blocks *kv, int32_t block) {
    assert(block >= 0 && block < kv->n_blocks);
    assert(kv->refs[block] > 0 && "ref of a free block");
    kv->refs[block]++;
}

int duet__kv_blocks_refcount(const duet_kv_blocks *kv, int32_t block) {
    assert(block >= 0 && block < kv->n_blocks);
    return kv->refs[block];
}

void duet__kv_blocks_truncate(duet_kv_blocks *kv, int seq, int n_tokens) {
    int32_t *row = table_row(kv, seq);
    int keep = duet__kv_blocks_needed(kv, n_tokens);
    /* Release from the end so the free list pops them back in table order. */
    while (kv->lens[seq] > keep) {
        int i = --kv->lens[seq];
        duet__kv_blocks_unref(kv, row[i]);
        row[i] = -1;
    }
}

void duet__kv_blocks_release(duet_kv_blocks *kv, int seq) { duet__kv_blocks_truncate(kv, seq, 0); }

const int32_t *duet__kv_blocks_table(const duet_kv_blocks *kv, int seq, int *n_blocks) {
    const int32_t *row = table_row(kv, seq);
    if (n_blocks) *n_blocks = kv->lens[seq];
    return row;
}

int duet__kv_blocks_seq_blocks(const duet_kv_blocks *kv, int seq) {
    assert(seq >= 0 && seq < kv->max_seqs);
    return kv->lens[seq];
}

const int32_t *duet__kv_blocks_tables(const duet_kv_blocks *kv) { return kv->tables; }

bool duet__kv_blocks_append_shared(duet_kv_blocks *kv, int seq, int32_t block) {
    int32_t *row = table_row(kv, seq);
    if (kv->lens[seq] >= kv->max_per_seq) return false;
    duet__kv_blocks_ref(kv, block);
    row[kv->lens[seq]++] = block;
    return true;
}

duet_status duet__kv_blocks_check(const duet_kv_blocks *kv, const int *extra_refs) {
    int32_t *seen = kv->scratch; /* references counted from the tables */
    for (int b = 0; b < kv->n_blocks; b++) seen[b] = extra_refs ? extra_refs[b] : 0;
    if (kv->n_free < 0 || kv->n_free > kv->n_blocks)
        return duet__error(DUET_INVALID_ARGUMENT, "kv check: n_free %d out of [0, %d]", kv->n_free, kv->n_blocks);
    for (int s = 0; s < kv->max_seqs; s++) {
        const int32_t *row = kv->tables + (size_t)s * kv->max_per_seq;
        if (kv->lens[s] < 0 || kv->lens[s] > kv->max_per_seq)
            return duet__error(DUET_INVALID_ARGUMENT, "kv check: seq %d has %d blocks", s, kv->lens[s]);
        for (int i = 0; i < kv->max_per_seq; i++) {
            if (i >= kv->lens[s]) {
                if (row[i] != -1)
                    return duet__error(DUET_INVALID_ARGUMENT, "kv check: seq %d entry %d past the end is %d", s, i,
                                       row[i]);
                continue;
            }
            if (row[i] < 0 || row[i] >= kv->n_blocks)
                return duet__error(DUET_INVALID_ARGUMENT, "kv check: seq %d entry %d is block %d", s, i, row[i]);
            seen[row[i]]++;
        }
    }
    int in_use = 0;
    for (int b = 0; b < kv->n_blocks; b++) {
        if (seen[b] != kv->refs[b])
            return duet__error(DUET_INVALID_ARGUMENT, "kv check: block %d has refcount %d but %d references", b,
                               kv->refs[b], seen[b]);
        if (kv->refs[b] > 0) in_use++;
    }
    if (in_use + kv->n_free != kv->n_blocks)
        return duet__error(DUET_INVALID_ARGUMENT, "kv check: %d blocks in use + %d free != %d", in_use, kv->n_free,
                           kv->n_blocks);
    /* Every free-list entry must be a distinct block with refcount 0; reuse
     * seen[] as a mark (refs are 0 there, so mark with -1). */
    for (int i = 0; i < kv->n_free; i++) {
        int32_t b = kv->free_list[i];
        if (b < 0 || b >= kv->n_blocks)
            return duet__error(DUET_INVALID_ARGUMENT, "kv check: free list entry %d is block %d", i, b);
        if (kv->refs[b] != 0)
            return duet__error(DUET_INVALID_ARGUMENT, "kv check: block %d is free but has refcount %d", b, kv->refs[b]);
        if (seen[b] == -1) return duet__error(DUET_INVALID_ARGUMENT, "kv check: block %d is free twice", b);
        seen[b] = -1;
    }
    return DUET_OK;
}
