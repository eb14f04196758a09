/* stop_strings.h — where a request's stop strings cut its text.
 *
 * Stop strings belong to the request: the engine matches them in each
 * sequence's detokenised text, delivers only the text before the first
 * match, and finishes the request there as STOP (so it is counted as one). */
#ifndef DUET_STOP_STRINGS_H
#define DUET_STOP_STRINGS_H

#include <stdbool.h>
#include <stddef.h>

/* How many leading bytes of text[0..len) are safe to deliver: with a stop
 * string in the text, the bytes before the earliest one (*hit = true);
 * otherwise all but the longest tail that could begin a stop string. */
size_t duet__stop_scan(const char *text, size_t len, const char *const *stop, int n_stop, bool *hit);

#endif
