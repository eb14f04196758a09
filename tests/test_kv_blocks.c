/* test_kv_blocks.c — the paged KV block allocator: free list, tables,
 * refcounts, truncate, exhaustion, and a random walk against a shadow. */
#include <check.h>

#include "kv_blocks.h"
#include "test_util.h"

static duet_kv_blocks *make(int bs, int n, int seqs, int per_seq) {
    duet_kv_blocks *kv = NULL;
    duet_status st = duet__kv_blocks_new(bs, n, seqs, per_seq, &kv);
    ck_assert_msg(st == DUET_OK && kv, "kv_blocks_new(%d, %d, %d, %d) failed: %s", bs, n, seqs, per_seq,
                  duet_last_error());
    return kv;
}

static void assert_ok(const duet_kv_blocks *kv, const int *extra) {
    duet_status st = duet__kv_blocks_check(kv, extra);
    ck_assert_msg(st == DUET_OK, "allocator invariants broken: %s", duet_last_error());
}

START_TEST(test_new_rejects_bad_sizes) {
    duet_kv_blocks *kv = (duet_kv_blocks *)1;
    ck_assert_msg(duet__kv_blocks_new(0, 8, 2, 4, &kv) == DUET_INVALID_ARGUMENT && kv == NULL,
                  "block_size 0 must be rejected and *out cleared");
    ck_assert_msg(duet__kv_blocks_new(16, 0, 2, 4, &kv) == DUET_INVALID_ARGUMENT, "0 blocks must be rejected");
    ck_assert_msg(duet__kv_blocks_new(16, 8, 0, 4, &kv) == DUET_INVALID_ARGUMENT, "0 seqs must be rejected");
    ck_assert_msg(duet__kv_blocks_new(16, 8, 2, -1, &kv) == DUET_INVALID_ARGUMENT, "negative per-seq rejected");
}
END_TEST

START_TEST(test_sizes_and_needed) {
    duet_kv_blocks *kv = make(16, 10, 3, 8);
    ck_assert_int_eq(duet__kv_blocks_block_size(kv), 16);
    ck_assert_int_eq(duet__kv_blocks_n_blocks(kv), 10);
    ck_assert_int_eq(duet__kv_blocks_max_seqs(kv), 3);
    ck_assert_int_eq(duet__kv_blocks_max_blocks_per_seq(kv), 8);
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 10);
    ck_assert_msg(duet__kv_blocks_usage(kv) == 0.0, "a new pool is empty");
    int lens[] = {0, 1, 15, 16, 17, 32, 33};
    int want[] = {0, 1, 1, 1, 2, 2, 3};
    for (int i = 0; i < 7; i++)
        ck_assert_msg(duet__kv_blocks_needed(kv, lens[i]) == want[i], "needed(%d) = %d, want %d", lens[i],
                      duet__kv_blocks_needed(kv, lens[i]), want[i]);
    const int32_t *all = duet__kv_blocks_tables(kv);
    for (int i = 0; i < 3 * 8; i++) ck_assert_msg(all[i] == -1, "unused table entry %d is %d, want -1", i, all[i]);
    assert_ok(kv, NULL);
    duet__kv_blocks_free(kv);
}
END_TEST

START_TEST(test_ensure_grows_in_blocks) {
    duet_kv_blocks *kv = make(16, 10, 3, 8);
    ck_assert(duet__kv_blocks_ensure(kv, 1, 1));
    ck_assert_int_eq(duet__kv_blocks_seq_blocks(kv, 1), 1);
    ck_assert(duet__kv_blocks_ensure(kv, 1, 16)); /* still one block */
    ck_assert_int_eq(duet__kv_blocks_seq_blocks(kv, 1), 1);
    ck_assert(duet__kv_blocks_ensure(kv, 1, 40));
    int n = 0;
    const int32_t *t = duet__kv_blocks_table(kv, 1, &n);
    ck_assert_msg(n == 3, "40 tokens need 3 blocks, table has %d", n);
    /* Deterministic order from a fresh pool: 0, 1, 2. */
    for (int i = 0; i < 3; i++) ck_assert_msg(t[i] == i, "entry %d is block %d, want %d", i, t[i], i);
    ck_assert_msg(t == duet__kv_blocks_tables(kv) + 8, "row 1 lives at offset max_blocks_per_seq in the dense array");
    ck_assert(duet__kv_blocks_ensure(kv, 1, 10)); /* shorter: no change */
    ck_assert_int_eq(duet__kv_blocks_seq_blocks(kv, 1), 3);
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 7);
    ck_assert_msg(duet__kv_blocks_usage(kv) > 0.29 && duet__kv_blocks_usage(kv) < 0.31, "usage %f, want 0.3",
                  duet__kv_blocks_usage(kv));
    for (int i = 0; i < 3; i++) ck_assert_int_eq(duet__kv_blocks_refcount(kv, t[i]), 1);
    assert_ok(kv, NULL);
    duet__kv_blocks_free(kv);
}
END_TEST

START_TEST(test_exhaustion_is_all_or_nothing) {
    duet_kv_blocks *kv = make(4, 5, 2, 8);
    ck_assert(duet__kv_blocks_ensure(kv, 0, 12)); /* 3 blocks */
    ck_assert_msg(!duet__kv_blocks_ensure(kv, 1, 12), "3 blocks requested with 2 free must fail");
    ck_assert_msg(duet__kv_blocks_seq_blocks(kv, 1) == 0 && duet__kv_blocks_n_free(kv) == 2,
                  "a failed ensure must change nothing (seq has %d blocks, %d free)", duet__kv_blocks_seq_blocks(kv, 1),
                  duet__kv_blocks_n_free(kv));
    ck_assert(duet__kv_blocks_ensure(kv, 1, 8));
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 0);
    ck_assert_msg(duet__kv_blocks_usage(kv) == 1.0, "full pool usage %f", duet__kv_blocks_usage(kv));
    ck_assert_msg(!duet__kv_blocks_ensure(kv, 0, 13), "no block left");
    ck_assert_msg(duet__kv_blocks_ensure(kv, 0, 12), "a length already covered needs no block");
    /* The per-sequence table limit is a hard cap too. */
    duet__kv_blocks_release(kv, 1);
    duet__kv_blocks_release(kv, 0);
    duet_kv_blocks *small = make(4, 64, 1, 2);
    ck_assert_msg(!duet__kv_blocks_ensure(small, 0, 9), "9 tokens need 3 blocks, table holds 2");
    ck_assert_int_eq(duet__kv_blocks_n_free(small), 64);
    assert_ok(kv, NULL);
    assert_ok(small, NULL);
    duet__kv_blocks_free(small);
    duet__kv_blocks_free(kv);
}
END_TEST

START_TEST(test_truncate_and_release) {
    duet_kv_blocks *kv = make(16, 8, 2, 8);
    ck_assert(duet__kv_blocks_ensure(kv, 0, 70)); /* 5 blocks: 0..4 */
    duet__kv_blocks_truncate(kv, 0, 33);        /* keep 3 */
    int n;
    const int32_t *t = duet__kv_blocks_table(kv, 0, &n);
    ck_assert_msg(n == 3 && t[0] == 0 && t[1] == 1 && t[2] == 2 && t[3] == -1 && t[4] == -1,
                  "truncate to 33 tokens keeps blocks 0..2 and clears the rest (n=%d, t3=%d)", n, t[3]);
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 5);
    ck_assert_int_eq(duet__kv_blocks_refcount(kv, 3), 0);
    duet__kv_blocks_truncate(kv, 0, 100); /* longer than the table: no-op */
    ck_assert_int_eq(duet__kv_blocks_seq_blocks(kv, 0), 3);
    duet__kv_blocks_truncate(kv, 0, 32); /* exact block boundary: 2 blocks */
    ck_assert_int_eq(duet__kv_blocks_seq_blocks(kv, 0), 2);
    /* Truncated blocks are reused first, in table order. */
    ck_assert(duet__kv_blocks_ensure(kv, 1, 48));
    t = duet__kv_blocks_table(kv, 1, &n);
    ck_assert_msg(t[0] == 2 && t[1] == 3 && t[2] == 4, "freed blocks 2,3,4 reused in order, got %d,%d,%d", t[0], t[1],
                  t[2]);
    duet__kv_blocks_release(kv, 0);
    duet__kv_blocks_release(kv, 1);
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 8);
    ck_assert_int_eq(duet__kv_blocks_seq_blocks(kv, 0), 0);
    duet__kv_blocks_release(kv, 0); /* releasing an empty table is fine */
    assert_ok(kv, NULL);
    duet__kv_blocks_free(kv);
}
END_TEST

START_TEST(test_refcounts_and_sharing) {
    duet_kv_blocks *kv = make(16, 6, 3, 4);
    ck_assert(duet__kv_blocks_ensure(kv, 0, 32)); /* blocks 0, 1 */
    const int32_t *t0 = duet__kv_blocks_table(kv, 0, NULL);
    int32_t shared = t0[0];
    /* Sequence 1 shares the prefix block of sequence 0, then grows its own. */
    ck_assert(duet__kv_blocks_append_shared(kv, 1, shared));
    ck_assert_int_eq(duet__kv_blocks_refcount(kv, shared), 2);
    ck_assert(duet__kv_blocks_ensure(kv, 1, 20));
    ck_assert_int_eq(duet__kv_blocks_seq_blocks(kv, 1), 2);
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 3);
    assert_ok(kv, NULL);
    /* The owner leaves: the shared block survives with one reference. */
    duet__kv_blocks_release(kv, 0);
    ck_assert_int_eq(duet__kv_blocks_refcount(kv, shared), 1);
    ck_assert_msg(duet__kv_blocks_n_free(kv) == 4, "only the unshared block returns (free %d)",
                  duet__kv_blocks_n_free(kv));
    /* An outside reference (e.g. a prefix cache) keeps it past the last table. */
    duet__kv_blocks_ref(kv, shared);
    ck_assert_msg(duet__kv_blocks_check(kv, NULL) != DUET_OK,
                  "check must notice a reference that no table accounts for");
    int extra[6] = {0};
    extra[shared] = 1;
    assert_ok(kv, extra);
    duet__kv_blocks_release(kv, 1);
    ck_assert_int_eq(duet__kv_blocks_refcount(kv, shared), 1);
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 5);
    duet__kv_blocks_unref(kv, shared);
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 6);
    assert_ok(kv, NULL);
    /* A full table refuses a shared block without taking a reference. */
    ck_assert(duet__kv_blocks_ensure(kv, 2, 64));
    ck_assert(duet__kv_blocks_ensure(kv, 0, 1));
    int32_t b = duet__kv_blocks_table(kv, 0, NULL)[0];
    ck_assert_msg(!duet__kv_blocks_append_shared(kv, 2, b), "a full table must refuse");
    ck_assert_int_eq(duet__kv_blocks_refcount(kv, b), 1);
    assert_ok(kv, NULL);
    duet__kv_blocks_free(kv);
}
END_TEST

static uint64_t rng_state;
static uint32_t rnd(uint32_t n) {
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rng_state >> 33) % n;
}

/* A random walk of ensure/truncate/release against a shadow of the lengths:
 * blocks are conserved, tables match lengths, no block has two owners. */
START_TEST(test_random_walk) {
    enum { BS = 16, NB = 40, SEQS = 6, PER = 10 };
    duet_kv_blocks *kv = make(BS, NB, SEQS, PER);
    int len[SEQS] = {0};
    rng_state = 12345;
    for (int it = 0; it < 20000; it++) {
        int s = (int)rnd(SEQS);
        int op = (int)rnd(10);
        if (op < 6) {
            int want = len[s] + (int)rnd(40);
            int need = duet__kv_blocks_needed(kv, want) - duet__kv_blocks_needed(kv, len[s]);
            bool fits = duet__kv_blocks_needed(kv, want) <= PER && need <= duet__kv_blocks_n_free(kv);
            bool ok = duet__kv_blocks_ensure(kv, s, want);
            ck_assert_msg(ok == fits, "iteration %d: ensure(%d -> %d) returned %d, expected %d", it, len[s], want, ok,
                          fits);
            if (ok) len[s] = want;
        } else if (op < 9) {
            int to = len[s] ? (int)rnd((uint32_t)len[s] + 1) : 0;
            duet__kv_blocks_truncate(kv, s, to);
            len[s] = to;
        } else {
            duet__kv_blocks_release(kv, s);
            len[s] = 0;
        }
        int used = 0;
        for (int q = 0; q < SEQS; q++) {
            ck_assert_msg(duet__kv_blocks_seq_blocks(kv, q) == duet__kv_blocks_needed(kv, len[q]),
                          "iteration %d: seq %d holds %d blocks for %d tokens", it, q, duet__kv_blocks_seq_blocks(kv, q),
                          len[q]);
            used += duet__kv_blocks_seq_blocks(kv, q);
        }
        ck_assert_msg(used + duet__kv_blocks_n_free(kv) == NB, "iteration %d: %d used + %d free != %d", it, used,
                      duet__kv_blocks_n_free(kv), NB);
        if (it % 97 == 0) assert_ok(kv, NULL);
    }
    assert_ok(kv, NULL);
    duet__kv_blocks_free(kv);
}
END_TEST

/* ---- prefix cache ---------------------------------------------------------- */

/* Registers the first n blocks of seq's table as holding tokens[0, n * bs). */
static void cache_blocks(duet_kv_blocks *kv, int seq, const int32_t *tokens, int n) {
    int bs = duet__kv_blocks_block_size(kv);
    uint64_t h = DUET_KV_HASH_SEED;
    for (int i = 0; i < n; i++) {
        h = duet__kv_hash_block(h, tokens + i * bs, bs);
        int32_t b = duet__kv_blocks_cache(kv, seq, i, h, tokens + i * bs);
        ck_assert_msg(b == duet__kv_blocks_table(kv, seq, NULL)[i], "cache of entry %d returned %d", i, b);
        ck_assert(duet__kv_blocks_is_cached(kv, b));
    }
}

static int lookup(const duet_kv_blocks *kv, const int32_t *tokens, int n_tokens, int32_t *out) {
    uint64_t h = 0;
    return duet__kv_blocks_lookup(kv, tokens, n_tokens, 64, out, &h);
}

START_TEST(test_hash_chain) {
    int32_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {1, 2, 3, 4, 5, 6, 7, 9};
    uint64_t h0 = duet__kv_hash_block(DUET_KV_HASH_SEED, a, 4);
    ck_assert_msg(h0 == duet__kv_hash_block(DUET_KV_HASH_SEED, a, 4), "the hash is a function");
    ck_assert_msg(h0 != duet__kv_hash_block(DUET_KV_HASH_SEED, a + 4, 4), "other tokens, other hash");
    ck_assert_msg(h0 != duet__kv_hash_block(DUET_KV_HASH_SEED, a, 3), "the count is part of the hash");
    /* The second block's hash depends on the first block's tokens. */
    uint64_t ha = duet__kv_hash_block(h0, a + 4, 4);
    uint64_t hb = duet__kv_hash_block(duet__kv_hash_block(DUET_KV_HASH_SEED, b + 4, 4), a + 4, 4);
    ck_assert_msg(ha != hb, "same block after another prefix must hash differently");
    ck_assert_msg(duet__kv_hash_block(h0, a + 4, 4) != duet__kv_hash_block(h0, b + 4, 4),
                  "last token matters");
    int32_t swapped[4] = {2, 1, 3, 4};
    ck_assert_msg(h0 != duet__kv_hash_block(DUET_KV_HASH_SEED, swapped, 4), "token order matters");
}
END_TEST

START_TEST(test_cache_lookup_and_reuse) {
    duet_kv_blocks *kv = make(4, 12, 3, 8);
    int32_t t[16], u[16];
    for (int i = 0; i < 16; i++)
        t[i] = u[i] = 100 + i;
    u[5] = 7;                                     /* differs in block 1 */
    ck_assert(duet__kv_blocks_ensure(kv, 0, 14)); /* 4 blocks, 3 full */
    int32_t out[8];
    ck_assert_msg(lookup(kv, t, 16, out) == 0, "nothing cached yet");
    cache_blocks(kv, 0, t, 3);
    ck_assert_int_eq(duet__kv_blocks_n_cached(kv), 3);
    assert_ok(kv, NULL);
    const int32_t *row = duet__kv_blocks_table(kv, 0, NULL);
    ck_assert_int_eq(lookup(kv, t, 16, out), 3);
    for (int i = 0; i < 3; i++)
        ck_assert_msg(out[i] == row[i], "hit %d is block %d, want %d", i, out[i], row[i]);
    ck_assert_msg(lookup(kv, t, 11, out) == 2, "only whole blocks of the tokens given");
    uint64_t h = 0;
    ck_assert_msg(duet__kv_blocks_lookup(kv, t, 16, 1, out, &h) == 1, "max_blocks bounds the run");
    ck_assert_msg(h == duet__kv_hash_block(DUET_KV_HASH_SEED, t, 4),
                  "last_hash is the chain hash of the last hit");
    ck_assert_msg(lookup(kv, u, 16, out) == 1, "a different block 1 stops the run after block 0");
    u[0] = 99;
    ck_assert_msg(lookup(kv, u, 16, out) == 0, "a different first token finds nothing");

    /* Released, the cached blocks stay (free but cached); another sequence
     * shares them and takes them off the free count. */
    duet__kv_blocks_release(kv, 0);
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 12);
    ck_assert_int_eq(duet__kv_blocks_n_cached(kv), 3);
    assert_ok(kv, NULL);
    ck_assert_int_eq(lookup(kv, t, 16, out), 3);
    for (int i = 0; i < 3; i++)
        ck_assert(duet__kv_blocks_append_shared(kv, 1, out[i]));
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 9);
    ck_assert(duet__kv_blocks_ensure(kv, 1, 16)); /* one new block for the rest */
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 8);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(duet__kv_blocks_refcount(kv, out[i]), 1);
    ck_assert_msg(!duet__kv_blocks_is_cached(kv, duet__kv_blocks_table(kv, 1, NULL)[3]),
                  "the new block is not");
    assert_ok(kv, NULL);
    /* A second sharer: refcount 2. */
    for (int i = 0; i < 2; i++)
        ck_assert(duet__kv_blocks_append_shared(kv, 2, out[i]));
    ck_assert_int_eq(duet__kv_blocks_refcount(kv, out[0]), 2);
    assert_ok(kv, NULL);
    duet__kv_blocks_release(kv, 1);
    duet__kv_blocks_release(kv, 2);
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 12);
    assert_ok(kv, NULL);
    duet__kv_blocks_cache_clear(kv);
    ck_assert_int_eq(duet__kv_blocks_n_cached(kv), 0);
    ck_assert_msg(lookup(kv, t, 16, out) == 0, "a cleared cache finds nothing");
    assert_ok(kv, NULL);
    duet__kv_blocks_free(kv);
}
END_TEST

START_TEST(test_lru_eviction_order) {
    /* 6 blocks of 2 tokens. A and B each cache 2 blocks and leave; 2 plain
     * blocks remain. */
    duet_kv_blocks *kv = make(2, 6, 3, 8);
    int32_t a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8}, out[8];
    ck_assert(duet__kv_blocks_ensure(kv, 0, 4));
    cache_blocks(kv, 0, a, 2);
    ck_assert(duet__kv_blocks_ensure(kv, 1, 4));
    cache_blocks(kv, 1, b, 2);
    const int32_t *ra = duet__kv_blocks_table(kv, 0, NULL);
    int32_t a0 = ra[0], a1 = ra[1];
    duet__kv_blocks_release(kv, 0); /* LRU: a1, a0 (the end goes first) */
    duet__kv_blocks_release(kv, 1); /* then b1, b0 */
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 6);
    assert_ok(kv, NULL);
    /* Plain blocks go first: nothing is evicted for 2 blocks. */
    ck_assert(duet__kv_blocks_ensure(kv, 2, 4));
    ck_assert_int_eq(duet__kv_blocks_evictions(kv), 0);
    ck_assert_int_eq(duet__kv_blocks_n_cached(kv), 4);
    /* A touch refreshes: A's first block is shared and released again, so
     * it is now the most recently released. */
    ck_assert(duet__kv_blocks_append_shared(kv, 1, a0));
    duet__kv_blocks_release(kv, 1); /* LRU: a1, b1, b0, a0 */
    /* The third block evicts the least recently released: a1. */
    ck_assert(duet__kv_blocks_ensure(kv, 2, 6));
    ck_assert_int_eq(duet__kv_blocks_evictions(kv), 1);
    ck_assert_msg(duet__kv_blocks_table(kv, 2, NULL)[2] == a1, "evicted block %d, want A's tail %d",
                  duet__kv_blocks_table(kv, 2, NULL)[2], a1);
    ck_assert_msg(lookup(kv, a, 4, out) == 1 && out[0] == a0, "A keeps its first block");
    ck_assert_msg(lookup(kv, b, 4, out) == 2, "B is whole");
    /* Then b1, b0; then a0. */
    ck_assert(duet__kv_blocks_ensure(kv, 2, 8));
    ck_assert_msg(lookup(kv, b, 4, out) == 1, "B lost its tail next");
    ck_assert(duet__kv_blocks_ensure(kv, 2, 10));
    ck_assert_msg(lookup(kv, b, 4, out) == 0 && lookup(kv, a, 4, out) == 1, "then B's head, A's head last");
    ck_assert(duet__kv_blocks_ensure(kv, 2, 12));
    ck_assert_msg(lookup(kv, a, 4, out) == 0, "everything evicted");
    ck_assert_int_eq(duet__kv_blocks_evictions(kv), 4);
    ck_assert_msg(!duet__kv_blocks_ensure(kv, 0, 1), "the pool is full");
    assert_ok(kv, NULL);
    duet__kv_blocks_free(kv);
}
END_TEST

START_TEST(test_duplicate_is_merged) {
    /* Two sequences computed the same tokens at once: registering the
     * second gives it the first one's block and frees its own. */
    duet_kv_blocks *kv = make(4, 8, 2, 4);
    int32_t t[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    ck_assert(duet__kv_blocks_ensure(kv, 0, 8));
    ck_assert(duet__kv_blocks_ensure(kv, 1, 8));
    cache_blocks(kv, 0, t, 2);
    int32_t own0 = duet__kv_blocks_table(kv, 1, NULL)[0];
    uint64_t h = duet__kv_hash_block(DUET_KV_HASH_SEED, t, 4);
    int32_t got = duet__kv_blocks_cache(kv, 1, 0, h, t);
    const int32_t *r0 = duet__kv_blocks_table(kv, 0, NULL), *r1 = duet__kv_blocks_table(kv, 1, NULL);
    ck_assert_msg(got == r0[0] && r1[0] == r0[0], "seq 1 must now share block %d (got %d)", r0[0], got);
    ck_assert_int_eq(duet__kv_blocks_refcount(kv, r0[0]), 2);
    ck_assert_int_eq(duet__kv_blocks_refcount(kv, own0), 0);
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 5);
    ck_assert_int_eq(duet__kv_blocks_n_cached(kv), 2);
    /* Its second block now follows the shared first one and merges too. */
    h = duet__kv_hash_block(h, t + 4, 4);
    ck_assert_int_eq(duet__kv_blocks_cache(kv, 1, 1, h, t + 4), r0[1]);
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), 6);
    assert_ok(kv, NULL);
    /* A block whose parent is not cached is not registered. */
    duet__kv_blocks_release(kv, 0);
    duet__kv_blocks_release(kv, 1);
    ck_assert(duet__kv_blocks_ensure(kv, 0, 8));
    int32_t other[4] = {9, 9, 9, 9};
    ck_assert_msg(duet__kv_blocks_cache(kv, 0, 1, duet__kv_hash_block(h, other, 4), other) == -1,
                  "entry 1 of a table whose entry 0 is not cached");
    assert_ok(kv, NULL);
    duet__kv_blocks_free(kv);
}
END_TEST

START_TEST(test_evicted_parent_breaks_the_chain) {
    /* A's head is evicted while its tail stays cached: the tail is
     * unreachable (no lookup starts past a missing head), and it is still
     * evictable. */
    duet_kv_blocks *kv = make(2, 3, 3, 4);
    int32_t a[4] = {1, 2, 3, 4}, out[4];
    ck_assert(duet__kv_blocks_ensure(kv, 0, 4));
    cache_blocks(kv, 0, a, 2);
    int32_t a0 = duet__kv_blocks_table(kv, 0, NULL)[0], a1 = duet__kv_blocks_table(kv, 0, NULL)[1];
    ck_assert(duet__kv_blocks_append_shared(kv, 1, a1));
    duet__kv_blocks_release(kv, 0);              /* LRU: a0 (a1 is still held) */
    duet__kv_blocks_release(kv, 1);              /* LRU: a0, a1 */
    ck_assert(duet__kv_blocks_ensure(kv, 2, 4)); /* the plain block, then a0 */
    ck_assert_int_eq(duet__kv_blocks_table(kv, 2, NULL)[1], a0);
    ck_assert_int_eq(duet__kv_blocks_evictions(kv), 1);
    ck_assert_msg(!duet__kv_blocks_is_cached(kv, a0) && duet__kv_blocks_is_cached(kv, a1),
                  "a0 evicted, a1 kept");
    ck_assert_msg(lookup(kv, a, 4, out) == 0, "no head, no chain");
    assert_ok(kv, NULL);
    ck_assert(duet__kv_blocks_ensure(kv, 2, 6));
    ck_assert_int_eq(duet__kv_blocks_n_cached(kv), 0);
    assert_ok(kv, NULL);
    duet__kv_blocks_free(kv);
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("kv_blocks");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_new_rejects_bad_sizes);
    tcase_add_test(tc, test_sizes_and_needed);
    tcase_add_test(tc, test_ensure_grows_in_blocks);
    tcase_add_test(tc, test_exhaustion_is_all_or_nothing);
    tcase_add_test(tc, test_truncate_and_release);
    tcase_add_test(tc, test_refcounts_and_sharing);
    tcase_add_test(tc, test_random_walk);
    tcase_add_test(tc, test_hash_chain);
    tcase_add_test(tc, test_cache_lookup_and_reuse);
    tcase_add_test(tc, test_lru_eviction_order);
    tcase_add_test(tc, test_duplicate_is_merged);
    tcase_add_test(tc, test_evicted_parent_breaks_the_chain);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return test_run_suite(suite()); }
