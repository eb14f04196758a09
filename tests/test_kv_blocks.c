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
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return test_run_suite(suite()); }
