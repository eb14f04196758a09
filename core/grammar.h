/* grammar.h — grammar-constrained decoding: GBNF grammars (llama.cpp's
 * notation) compiled to rules over Unicode code points, a recognizer that
 * follows every way the text so far can be parsed, and the mask of the
 * vocabulary tokens whose bytes may come next.
 *
 * Grammar: `name ::= alternatives`, with "literals", [classes] ([^...]
 * negated, ranges a-z, escapes \n \t \r \\ \" \] \xHH \uHHHH), `.` (any
 * character), rule names, ( groups ), and the postfix operators * + ? {m}
 * {m,} {m,n}. `#` starts a comment. The start rule is `root`. A rule ends
 * at the end of its line unless a parenthesis is open or the next line
 * begins with `|`. Left recursion is refused.
 *
 * Recognizer state: a set of stacks (llama.cpp's design). A stack lists
 * grammar positions, the top being the character class that must match
 * next and those below where to continue when a rule ends; an empty stack
 * means the text so far is a whole sentence. A rule reference at the end
 * of an alternative pushes no return position (tail calls), so right
 * recursion such as `item*` keeps the stack flat. Bytes of a character
 * split across tokens wait in the state until the character is whole.
 *
 * Mask: the vocabulary's token bytes in a trie, walked depth first from
 * the current state, so a prefix that many tokens share is advanced once
 * and a subtree is skipped as soon as its prefix is refused. Masks are
 * cached per state (the same state comes back often: inside a string, after
 * each comma), so most steps cost a hash look-up.
 *
 * Threads: a duet_grammar and a duet_vocab are read-only once built and
 * may be shared; a duet_grammar_state belongs to one sequence.
 */
#ifndef DUET_GRAMMAR_H
#define DUET_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "duet.h"

typedef struct duet_grammar duet_grammar;
typedef struct duet_grammar_state duet_grammar_state;
typedef struct duet_vocab duet_vocab;

/* Compiles GBNF text. DUET_BAD_REQUEST with a message naming the line and
 * what was wrong (an undefined rule, no root, left recursion, ...). */
duet_status duet_grammar_parse(const char *gbnf, duet_grammar **out);
void duet_grammar_free(duet_grammar *g);
/* The number of rules after compilation (generated ones included). */
int duet_grammar_n_rules(const duet_grammar *g);

/* A recognizer at the start of `g` (which must outlive it). */
duet_status duet_grammar_state_new(const duet_grammar *g, duet_grammar_state **out);
void duet_grammar_state_free(duet_grammar_state *s);
/* Back to the start. */
void duet_grammar_state_reset(duet_grammar_state *s);
/* Advances over n bytes; false (and the state unchanged) when the grammar
 * refuses them. */
bool duet_grammar_accept(duet_grammar_state *s, const char *bytes, size_t n);
/* Whether the text so far is a whole sentence of the grammar (the model may
 * end here). */
bool duet_grammar_complete(const duet_grammar_state *s);
/* Whether any character may follow (false: the sentence is closed). */
bool duet_grammar_can_continue(const duet_grammar_state *s);

/* The token bytes of a vocabulary as the constraint sees them: bytes[i] of
 * len[i] for token i (0: never allowed, e.g. control tokens), eog[i] for
 * tokens that end generation. Copied. */
duet_status duet_vocab_new(int n_vocab, const char *const *bytes, const int *len, const bool *eog,
                           duet_vocab **out);
void duet_vocab_free(duet_vocab *v);
int duet_vocab_size(const duet_vocab *v);
bool duet_vocab_is_eog(const duet_vocab *v, int32_t id);
/* Whether token id may come next from state s (EOG tokens: when complete). */
bool duet_grammar_allows(duet_grammar_state *s, const duet_vocab *v, int32_t id);
/* Sets bit id of mask[(n_vocab + 31) / 32] for every token that may come
 * next. Returns the number of tokens allowed. */
int duet_grammar_mask(duet_grammar_state *s, const duet_vocab *v, uint32_t *mask);
/* Accepts token id's bytes (EOG: nothing to advance); false when refused. */
bool duet_grammar_accept_token(duet_grammar_state *s, const duet_vocab *v, int32_t id);

#endif /* DUET_GRAMMAR_H */
