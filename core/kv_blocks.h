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
 *   sharing appends another sequence's block with
 *   duet__kv_blocks_append_shared (a second reference).
 * - A prefix cache: a full block whose KV is computed may be registered
 *   (duet__kv_blocks_cache) under the chain hash of its tokens and every
 *   token before it. A later sequence whose stream starts with the same
 *   tokens finds those blocks (duet__kv_blocks_lookup) and shares them. A
 *   cached block whose count drops to 0 keeps its contents and its entry
 *   and waits on an LRU list; it counts as free, and allocation takes it
 *   (evicting its entry, least recently released first) only when the
 *   plain free list is empty. Matches are exact, not just by hash: each
 *   entry keeps its tokens and its parent block (with the parent's
 *   generation, bumped at every eviction), so a hash collision or an
 *   evicted-and-reused parent never yields a wrong block.
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
/* Blocks free to allocate: the plain free list plus unreferenced cached
 * blocks (which allocation evicts last). */
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
 * ceil(n_tokens / block_size). A no-op if the table is already shorter.
 * The block that keeps only part of its tokens must not be cached (only
 * blocks below a sequence's computed length are, so roll back no further
 * than that). */
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

/* Takes one more reference to an allocated block, or the first one to an
 * unreferenced cached block (taking it off the LRU list). */
void duet__kv_blocks_ref(duet_kv_blocks *kv, int32_t block);
/* Drops one reference; the block returns to the free list at 0. */
void duet__kv_blocks_unref(duet_kv_blocks *kv, int32_t block);
/* References held on a block (0 = free). */
int duet__kv_blocks_refcount(const duet_kv_blocks *kv, int32_t block);
/* Appends an allocated or cached block (e.g. a shared prefix block of
 * another sequence) to seq's table and takes a reference to it. Returns
 * false when the table is full. */
bool duet__kv_blocks_append_shared(duet_kv_blocks *kv, int seq, int32_t block);

/* ---- prefix cache -------------------------------------------------------- */

/* The chain hash of a block: prev is the previous block's hash
 * (DUET_KV_HASH_SEED for the first block), tokens its n tokens. Depends on
 * every token of the stream so far, not on which blocks hold them, so equal
 * prefixes have equal hashes in any pool. */
#define DUET_KV_HASH_SEED UINT64_C(0x9E3779B97F4A7C15)
uint64_t duet__kv_hash_block(uint64_t prev, const int32_t *tokens, int n);
/* The longest run of cached blocks holding tokens[0, n_tokens) from the
 * start, in whole blocks, at most max_blocks: writes their ids to out[] and
 * returns how many (0 if the first is not cached). *last_hash receives the
 * chain hash of the last one found (untouched when none). Changes nothing
 * (no reference is taken: append them with duet__kv_blocks_append_shared
 * before anything allocates, or they may be evicted). */
int duet__kv_blocks_lookup(const duet_kv_blocks *kv, const int32_t *tokens, int n_tokens, int max_blocks,
                           int32_t *out, uint64_t *last_hash);
/* Registers entry `index` of seq's table, a full block whose KV is computed
 * and holds tokens[0, block_size), under `hash` (its chain hash). Its
 * parent is entry index - 1, which must be cached already (else nothing
 * happens and -1 is returned). If an equal block is cached already (same
 * tokens after the same parent), seq's table takes that one instead and its
 * own block is unreferenced (equal contents, one copy). Returns the block
 * now at that entry. A block that is already cached is left as is. */
int32_t duet__kv_blocks_cache(duet_kv_blocks *kv, int seq, int index, uint64_t hash, const int32_t *tokens);
/* Whether a block has a cache entry. */
bool duet__kv_blocks_is_cached(const duet_kv_blocks *kv, int32_t block);
/* Blocks with a cache entry (referenced or not). */
int duet__kv_blocks_n_cached(const duet_kv_blocks *kv);
/* Cache entries dropped to reuse their block, since creation. */
uint64_t duet__kv_blocks_evictions(const duet_kv_blocks *kv);
/* Forgets every cache entry (unreferenced cached blocks go back to the
 * plain free list): for when the device contents of the pool are
 * overwritten outside the tables (warm-up). */
void duet__kv_blocks_cache_clear(duet_kv_blocks *kv);

/* Checks the allocator's invariants (every block is either free with
 * refcount 0 or referenced exactly as often as tables plus extra refs say;
 * no block twice on the free list; a free block is on the LRU list exactly
 * when it is cached; each cached block in its hash bucket once; table
 * entries valid). extra_refs[b] are
 * references held outside the tables (NULL = none). Returns DUET_OK or
 * DUET_INVALID_ARGUMENT with a message naming the broken invariant. For
 * tests; O(n_blocks + max_seqs * max_blocks_per_seq), uses no heap. */
duet_status duet__kv_blocks_check(const duet_kv_blocks *kv, const int *extra_refs);

#endif /* DUET_KV_BLOCKS_H */
