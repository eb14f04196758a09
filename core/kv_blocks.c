/* kv_blocks.c — paged KV block allocator: free list, refcounts, tables,
 * and the prefix cache (hash buckets and an LRU list of unreferenced cached
 * blocks). */
#include "kv_blocks.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "../backends/backend.h"

struct duet_kv_blocks {
    int block_size, n_blocks, max_seqs, max_per_seq;
    int n_plain;        /* uncached free blocks, on free_list */
    int32_t *free_list; /* [n_blocks] stack; the top is free_list[n_plain - 1] */
    int32_t *refs;      /* [n_blocks] references held; 0 = free (plain or LRU) */
    int32_t *tables;    /* [max_seqs][max_per_seq], -1 past the end */
    int32_t *lens;      /* [max_seqs] blocks in each table */
    int32_t *scratch;   /* [n_blocks] for duet__kv_blocks_check */
    int32_t *scratch2;  /* [n_blocks] for duet__kv_blocks_check */

    /* Prefix cache. A cached block has an entry: its chain hash, its tokens,
     * its parent (the block before it, -1 for a stream's first) and the
     * parent's generation when it was registered. */
    bool *cached;         /* [n_blocks] */
    uint64_t *hash;       /* [n_blocks] */
    int32_t *tokens;      /* [n_blocks][block_size] */
    int32_t *parent;      /* [n_blocks] */
    uint32_t *parent_gen; /* [n_blocks] */
    uint32_t *gen;        /* [n_blocks] bumped when the block's entry goes */
    int32_t *hnext;       /* [n_blocks] next cached block in the same bucket */
    int32_t *buckets;     /* [n_buckets] first cached block per bucket, -1 */
    uint32_t n_buckets;   /* a power of two >= n_blocks */
    /* Unreferenced cached blocks, least recently released first. */
    int32_t *lru_prev, *lru_next; /* [n_blocks] */
    int32_t lru_head, lru_tail;
    int n_lru, n_cached;
    uint64_t evictions;
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
    kv->scratch2 = malloc((size_t)n_blocks * sizeof *kv->scratch2);
    kv->n_buckets = 1;
    while (kv->n_buckets < (uint32_t)n_blocks)
        kv->n_buckets <<= 1;
    kv->cached = calloc((size_t)n_blocks, sizeof *kv->cached);
    kv->hash = calloc((size_t)n_blocks, sizeof *kv->hash);
    kv->tokens = malloc((size_t)n_blocks * block_size * sizeof *kv->tokens);
    kv->parent = malloc((size_t)n_blocks * sizeof *kv->parent);
    kv->parent_gen = calloc((size_t)n_blocks, sizeof *kv->parent_gen);
    kv->gen = calloc((size_t)n_blocks, sizeof *kv->gen);
    kv->hnext = malloc((size_t)n_blocks * sizeof *kv->hnext);
    kv->buckets = malloc((size_t)kv->n_buckets * sizeof *kv->buckets);
    kv->lru_prev = malloc((size_t)n_blocks * sizeof *kv->lru_prev);
    kv->lru_next = malloc((size_t)n_blocks * sizeof *kv->lru_next);
    if (!kv->free_list || !kv->refs || !kv->tables || !kv->lens || !kv->scratch || !kv->scratch2 ||
        !kv->cached || !kv->hash || !kv->tokens || !kv->parent || !kv->parent_gen || !kv->gen || !kv->hnext ||
        !kv->buckets || !kv->lru_prev || !kv->lru_next) {
        duet__kv_blocks_free(kv);
        return duet__error(DUET_OUT_OF_MEMORY, "kv blocks: out of memory for %d blocks", n_blocks);
    }
    /* Pushed in reverse so block 0 comes off first: tables read 0, 1, 2... */
    for (int i = 0; i < n_blocks; i++) kv->free_list[i] = n_blocks - 1 - i;
    kv->n_plain = n_blocks;
    for (size_t i = 0; i < (size_t)max_seqs * max_blocks_per_seq; i++) kv->tables[i] = -1;
    for (int i = 0; i < n_blocks; i++)
        kv->parent[i] = kv->hnext[i] = kv->lru_prev[i] = kv->lru_next[i] = -1;
    for (uint32_t i = 0; i < kv->n_buckets; i++)
        kv->buckets[i] = -1;
    kv->lru_head = kv->lru_tail = -1;
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
    free(kv->scratch2);
    free(kv->cached);
    free(kv->hash);
    free(kv->tokens);
    free(kv->parent);
    free(kv->parent_gen);
    free(kv->gen);
    free(kv->hnext);
    free(kv->buckets);
    free(kv->lru_prev);
    free(kv->lru_next);
    free(kv);
}

int duet__kv_blocks_block_size(const duet_kv_blocks *kv) { return kv->block_size; }
int duet__kv_blocks_n_blocks(const duet_kv_blocks *kv) { return kv->n_blocks; }
int duet__kv_blocks_max_seqs(const duet_kv_blocks *kv) { return kv->max_seqs; }
int duet__kv_blocks_max_blocks_per_seq(const duet_kv_blocks *kv) { return kv->max_per_seq; }
int duet__kv_blocks_n_free(const duet_kv_blocks *kv) {
    return kv->n_plain + kv->n_lru;
}

double duet__kv_blocks_usage(const duet_kv_blocks *kv) {
    return (double)(kv->n_blocks - duet__kv_blocks_n_free(kv)) / (double)kv->n_blocks;
}

int duet__kv_blocks_needed(const duet_kv_blocks *kv, int n_tokens) {
    assert(n_tokens >= 0);
    return (int)(((int64_t)n_tokens + kv->block_size - 1) / kv->block_size);
}

/* ---- the LRU list and the hash buckets ------------------------------------ */

static void lru_unlink(duet_kv_blocks *kv, int32_t b) {
    if (kv->lru_prev[b] >= 0)
        kv->lru_next[kv->lru_prev[b]] = kv->lru_next[b];
    else
        kv->lru_head = kv->lru_next[b];
    if (kv->lru_next[b] >= 0)
        kv->lru_prev[kv->lru_next[b]] = kv->lru_prev[b];
    else
        kv->lru_tail = kv->lru_prev[b];
    kv->lru_prev[b] = kv->lru_next[b] = -1;
    kv->n_lru--;
}

static void lru_push_tail(duet_kv_blocks *kv, int32_t b) {
    kv->lru_prev[b] = kv->lru_tail;
    kv->lru_next[b] = -1;
    if (kv->lru_tail >= 0)
        kv->lru_next[kv->lru_tail] = b;
    else
        kv->lru_head = b;
    kv->lru_tail = b;
    kv->n_lru++;
}

static uint32_t bucket_of(const duet_kv_blocks *kv, uint64_t h) {
    return (uint32_t)(h ^ (h >> 32)) & (kv->n_buckets - 1);
}

/* Removes b's cache entry; its children's entries go stale with the
 * generation bump (they no longer match any lookup). */
static void uncache(duet_kv_blocks *kv, int32_t b) {
    assert(kv->cached[b]);
    int32_t *link = &kv->buckets[bucket_of(kv, kv->hash[b])];
    while (*link != b)
        link = &kv->hnext[*link];
    *link = kv->hnext[b];
    kv->hnext[b] = -1;
    kv->cached[b] = false;
    kv->parent[b] = -1;
    kv->gen[b]++;
    kv->n_cached--;
}

/* A free block: from the plain list, else the least recently released
 * cached one (its entry is evicted). */
static int32_t take_free(duet_kv_blocks *kv) {
    if (kv->n_plain > 0) return kv->free_list[--kv->n_plain];
    int32_t b = kv->lru_head;
    assert(b >= 0 && "take_free with no free block");
    lru_unlink(kv, b);
    uncache(kv, b);
    kv->evictions++;
    return b;
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
    if (want > kv->max_per_seq || want - have > duet__kv_blocks_n_free(kv)) return false;
    for (int i = have; i < want; i++) {
        int32_t b = take_free(kv);
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
    if (--kv->refs[block] > 0) return;
    if (kv->cached[block])
        lru_push_tail(kv, block); /* keeps its contents until evicted */
    else
        kv->free_list[kv->n_plain++] = block;
}

void duet__kv_blocks_ref(duet_kv_blocks *kv, int32_t block) {
    assert(block >= 0 && block < kv->n_blocks);
    assert((kv->refs[block] > 0 || kv->cached[block]) && "ref of a free block");
    if (kv->refs[block] == 0) lru_unlink(kv, block);
    kv->refs[block]++;
}

int duet__kv_blocks_refcount(const duet_kv_blocks *kv, int32_t block) {
    assert(block >= 0 && block < kv->n_blocks);
    return kv->refs[block];
}

void duet__kv_blocks_truncate(duet_kv_blocks *kv, int seq, int n_tokens) {
    int32_t *row = table_row(kv, seq);
    int keep = duet__kv_blocks_needed(kv, n_tokens);
    /* A block cut in the middle gets new tokens: it must not be shared. */
    assert((n_tokens % kv->block_size == 0 || keep > kv->lens[seq] || !kv->cached[row[keep - 1]]) &&
           "truncate into a cached block");
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

/* ---- prefix cache ---------------------------------------------------------- */

uint64_t duet__kv_hash_block(uint64_t prev, const int32_t *tokens, int n) {
    /* splitmix64's finalizer over (previous hash, each token, the count). */
    uint64_t h = prev;
    for (int i = 0; i <= n; i++) {
        h += (i < n ? (uint64_t)(uint32_t)tokens[i] : (uint64_t)n) + UINT64_C(0x9E3779B97F4A7C15);
        h = (h ^ (h >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
        h = (h ^ (h >> 27)) * UINT64_C(0x94D049BB133111EB);
        h ^= h >> 31;
    }
    return h;
}

/* The cached block equal to (hash, tokens) after `parent` (-1: first), or -1. */
static int32_t find_cached(const duet_kv_blocks *kv, uint64_t h, const int32_t *tokens, int32_t parent) {
    for (int32_t b = kv->buckets[bucket_of(kv, h)]; b >= 0; b = kv->hnext[b]) {
        if (kv->hash[b] != h || kv->parent[b] != parent) continue;
        if (parent >= 0 && kv->parent_gen[b] != kv->gen[parent]) continue;
        if (!memcmp(kv->tokens + (size_t)b * kv->block_size, tokens, (size_t)kv->block_size * sizeof *tokens))
            return b;
    }
    return -1;
}

int duet__kv_blocks_lookup(const duet_kv_blocks *kv, const int32_t *tokens, int n_tokens, int max_blocks,
                           int32_t *out, uint64_t *last_hash) {
    int bs = kv->block_size, n = 0;
    uint64_t h = DUET_KV_HASH_SEED;
    int32_t parent = -1;
    while (n < max_blocks && (int64_t)(n + 1) * bs <= n_tokens) {
        const int32_t *t = tokens + (size_t)n * bs;
        h = duet__kv_hash_block(h, t, bs);
        int32_t b = find_cached(kv, h, t, parent);
        if (b < 0) break;
        out[n++] = b;
        parent = b;
        *last_hash = h;
    }
    return n;
}

int32_t duet__kv_blocks_cache(duet_kv_blocks *kv, int seq, int index, uint64_t hash, const int32_t *tokens) {
    int32_t *row = table_row(kv, seq);
    assert(index >= 0 && index < kv->lens[seq]);
    int32_t b = row[index];
    if (kv->cached[b]) return b;
    int32_t parent = index > 0 ? row[index - 1] : -1;
    if (parent >= 0 && !kv->cached[parent]) return -1;
    int32_t same = find_cached(kv, hash, tokens, parent);
    if (same >= 0) { /* computed twice (two streams at once): keep one copy */
        duet__kv_blocks_ref(kv, same);
        row[index] = same;
        duet__kv_blocks_unref(kv, b);
        return same;
    }
    kv->cached[b] = true;
    kv->hash[b] = hash;
    kv->parent[b] = parent;
    kv->parent_gen[b] = parent >= 0 ? kv->gen[parent] : 0;
    memcpy(kv->tokens + (size_t)b * kv->block_size, tokens, (size_t)kv->block_size * sizeof *tokens);
    uint32_t k = bucket_of(kv, hash);
    kv->hnext[b] = kv->buckets[k];
    kv->buckets[k] = b;
    kv->n_cached++;
    return b;
}

bool duet__kv_blocks_is_cached(const duet_kv_blocks *kv, int32_t block) {
    assert(block >= 0 && block < kv->n_blocks);
    return kv->cached[block];
}

int duet__kv_blocks_n_cached(const duet_kv_blocks *kv) {
    return kv->n_cached;
}
uint64_t duet__kv_blocks_evictions(const duet_kv_blocks *kv) {
    return kv->evictions;
}

void duet__kv_blocks_cache_clear(duet_kv_blocks *kv) {
    while (kv->lru_head >= 0) {
        int32_t b = kv->lru_head;
        lru_unlink(kv, b);
        uncache(kv, b);
        kv->free_list[kv->n_plain++] = b;
    }
    for (int32_t b = 0; b < kv->n_blocks; b++)
        if (kv->cached[b]) uncache(kv, b);
}

duet_status duet__kv_blocks_check(const duet_kv_blocks *kv, const int *extra_refs) {
    int32_t *seen = kv->scratch; /* references counted from the tables */
    int n_free = kv->n_plain + kv->n_lru;
    for (int b = 0; b < kv->n_blocks; b++) seen[b] = extra_refs ? extra_refs[b] : 0;
    if (kv->n_plain < 0 || kv->n_lru < 0 || n_free > kv->n_blocks)
        return duet__error(DUET_INVALID_ARGUMENT, "kv check: %d plain + %d cached free blocks out of [0, %d]",
                           kv->n_plain, kv->n_lru, kv->n_blocks);
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
    if (in_use + n_free != kv->n_blocks)
        return duet__error(DUET_INVALID_ARGUMENT, "kv check: %d blocks in use + %d free != %d", in_use,
                           n_free, kv->n_blocks);
    /* Every free block is on exactly one list: the plain one when it is not
     * cached, the LRU one when it is. Reuse seen[] as a mark (refs are 0
     * there, so mark with -1). */
    for (int i = 0; i < kv->n_plain; i++) {
        int32_t b = kv->free_list[i];
        if (b < 0 || b >= kv->n_blocks)
            return duet__error(DUET_INVALID_ARGUMENT, "kv check: free list entry %d is block %d", i, b);
        if (kv->refs[b] != 0)
            return duet__error(DUET_INVALID_ARGUMENT, "kv check: block %d is free but has refcount %d", b, kv->refs[b]);
        if (kv->cached[b])
            return duet__error(DUET_INVALID_ARGUMENT, "kv check: cached block %d on the plain free list", b);
        if (seen[b] == -1) return duet__error(DUET_INVALID_ARGUMENT, "kv check: block %d is free twice", b);
        seen[b] = -1;
    }
    int n_lru = 0;
    for (int32_t b = kv->lru_head, prev = -1; b >= 0; prev = b, b = kv->lru_next[b]) {
        if (b >= kv->n_blocks || ++n_lru > kv->n_lru || kv->lru_prev[b] != prev)
            return duet__error(DUET_INVALID_ARGUMENT, "kv check: LRU list broken at block %d", b);
        if (kv->refs[b] != 0 || !kv->cached[b])
            return duet__error(DUET_INVALID_ARGUMENT, "kv check: LRU block %d has refcount %d, cached %d", b,
                               kv->refs[b], kv->cached[b]);
        if (seen[b] == -1) return duet__error(DUET_INVALID_ARGUMENT, "kv check: block %d is free twice", b);
        seen[b] = -1;
        if (kv->lru_next[b] < 0 && kv->lru_tail != b)
            return duet__error(DUET_INVALID_ARGUMENT, "kv check: LRU tail is %d, list ends at %d",
                               kv->lru_tail, b);
    }
    if (n_lru != kv->n_lru)
        return duet__error(DUET_INVALID_ARGUMENT, "kv check: LRU list has %d blocks, count %d", n_lru,
                           kv->n_lru);
    /* Each cached block sits in its hash's bucket once; a cached parent
     * entry names a block. */
    int32_t *mark = kv->scratch2;
    for (int b = 0; b < kv->n_blocks; b++)
        mark[b] = 0;
    int n_cached = 0;
    for (uint32_t k = 0; k < kv->n_buckets; k++)
        for (int32_t b = kv->buckets[k]; b >= 0; b = kv->hnext[b]) {
            if (b >= kv->n_blocks || !kv->cached[b] || bucket_of(kv, kv->hash[b]) != k || mark[b]++ ||
                ++n_cached > kv->n_cached)
                return duet__error(DUET_INVALID_ARGUMENT, "kv check: hash bucket %u broken at block %d", k,
                                   b);
            if (kv->parent[b] < -1 || kv->parent[b] >= kv->n_blocks || kv->parent[b] == b)
                return duet__error(DUET_INVALID_ARGUMENT, "kv check: cached block %d has parent %d", b,
                                   kv->parent[b]);
        }
    for (int b = 0; b < kv->n_blocks; b++)
        if (kv->cached[b] && !mark[b])
            return duet__error(DUET_INVALID_ARGUMENT, "kv check: cached block %d is in no bucket", b);
    if (n_cached != kv->n_cached)
        return duet__error(DUET_INVALID_ARGUMENT, "kv check: %d cached blocks, count %d", n_cached,
                           kv->n_cached);
    return DUET_OK;
}
