/* kv_blocks.h — host-side bookkeeping of a paged KV cache.
 *
 * The KV pool on the device is split into `n_blocks` blocks of `block_size`
 * tokens each (per layer; the same block index is used in every layer).
 * This allocator only decides which block holds which tokens; it never
 * touches device memory.
 *
 * - A free list (LIFO stack, so allocation order is deterministic).
 * - A reference count per block: a block returns to the free list when its
 *   count drops to 0. Sequences hold one reference per table entry; prefix
 *   sharing later appends another sequence's block with
 *   duet__kv_blocks_append_shared (a second reference).
 * - A block table per sequence slot, in one dense row-major array
 *   [max_seqs][max_blocks_per_seq] of int32 block ids (unused entries are
 *   -1), so the engine can upload all tables in one copy.
 *
 * All memory is allocated by duet__kv_blocks_new; no call allocates after
 * that. Not thread safe: one owner (the scheduler of one instance).
 * Programmer errors (slot out of range, unref of a free block) are asserts;
 * running out of blocks is a normal outcome reported by return value. */
#ifndef DUET_KV_BLOCKS_H
#define DUET_KV_BLOCKS_H

#include <stdbool.h>
#include <stdint.h>

#include "duet.h"

typedef struct duet_kv_blocks duet_kv_blocks;

/* Creates a pool of n_blocks blocks of block_size tokens (block_size > 0,
 * typically 16 or 32) with block tables for max_seqs sequence slots of up
 * to max_blocks_per_seq blocks each (usually ceil(n_ctx / block_size)).
 * Returns DUET_INVALID_ARGUMENT on non-positive sizes and
 * DUET_OUT_OF_MEMORY when allocation fails (message in duet_last_error). */
duet_status duet__kv_blocks_new(int block_size, int n_blocks, int max_seqs, int max_blocks_per_seq,
                                duet_kv_blocks **out);
void duet__kv_blocks_free(duet_kv_blocks *kv);

/* ---- sizes and queries ------------------------------------------------ */

int duet__kv_blocks_block_size(const duet_kv_blocks *kv);
int duet__kv_blocks_n_blocks(const duet_kv_blocks *kv);
int duet__kv_blocks_max_seqs(const duet_kv_blocks *kv);
int duet__kv_blocks_max_blocks_per_seq(const duet_kv_blocks *kv);
/* Blocks on the free list. */
int duet__kv_blocks_n_free(const duet_kv_blocks *kv);
/* Fraction of blocks in use, in [0, 1]. */
double duet__kv_blocks_usage(const duet_kv_blocks *kv);
/* Blocks that hold n_tokens tokens: ceil(n_tokens / block_size); 0 for 0. */
int duet__kv_blocks_needed(const duet_kv_blocks *kv, int n_tokens);

/* ---- per-sequence block tables ---------------------------------------- */

/* Grows seq's table so that it covers n_tokens tokens, taking blocks from
 * the free list. All or nothing: returns false (and changes nothing) when
 * the free list is too short or n_tokens exceeds max_blocks_per_seq blocks.
 * A table that already covers n_tokens is left as is (returns true). */
bool duet__kv_blocks_ensure(duet_kv_blocks *kv, int seq, int n_tokens);
/* Shrinks seq's table to cover n_tokens tokens (speculative-decoding
 * rollback): drops one reference of every block past
 * ceil(n_tokens / block_size). A no-op if the table is already shorter. */
void duet__kv_blocks_truncate(duet_kv_blocks *kv, int seq, int n_tokens);
/* Drops every block of seq (finish, cancel, preemption). */
void duet__kv_blocks_release(duet_kv_blocks *kv, int seq);
/* seq's block table: *n_blocks entries (may be NULL to ignore). The pointer
 * stays valid for the allocator's lifetime; its contents change with
 * ensure/truncate/release. */
const int32_t *duet__kv_blocks_table(const duet_kv_blocks *kv, int seq, int *n_blocks);
/* Blocks in seq's table. */
int duet__kv_blocks_seq_blocks(const duet_kv_blocks *kv, int seq);
/* All tables: [max_seqs][max_blocks_per_seq], unused entries -1. */
const int32_t *duet__kv_blocks_tables(const duet_kv_blocks *kv);

/* ---- reference counts (prefix sharing) -------------------------------- */

/* Takes one more reference to an allocated block. */
void duet__kv_blocks_ref(duet_kv_blocks *kv, int32_t block);
/* Drops one reference; the block returns to the free list at 0. */
void duet__kv_blocks_unref(duet_kv_blocks *kv, int32_t block);
/* References held on a block (0 = free). */
int duet__kv_blocks_refcount(const duet_kv_blocks *kv, int32_t block);
/* Appends an allocated block (e.g. a shared prefix block of another
 * sequence) to seq's table and takes a reference to it. Returns false when
 * the table is full. */
bool duet__kv_blocks_append_shared(duet_kv_blocks *kv, int seq, int32_t block);

/* Checks the allocator's invariants (every block is either free with
 * refcount 0 or referenced exactly as often as tables plus extra refs say;
 * no block twice on the free list; table entries valid). extra_refs[b] are
 * references held outside the tables (NULL = none). Returns DUET_OK or
 * DUET_INVALID_ARGUMENT with a message naming the broken invariant. For
 * tests; O(n_blocks + max_seqs * max_blocks_per_seq), uses no heap. */
duet_status duet__kv_blocks_check(const duet_kv_blocks *kv, const int *extra_refs);

#endif /* DUET_KV_BLOCKS_H */
