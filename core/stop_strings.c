/* stop_strings.c — the stop-string scan (see stop_strings.h). */
#include "stop_strings.h"

#include <string.h>

size_t duet__stop_scan(const char *text, size_t len, const char *const *stop, int n_stop, bool *hit) {
    *hit = false;
    size_t safe = len;
    for (int i = 0; i < n_stop; i++) {
        size_t sl = strlen(stop[i]);
        if (sl == 0) continue;
        /* A full match anywhere: the earliest one wins. */
        for (size_t at = 0; at + sl <= len && at < safe; at++)
            if (!memcmp(text + at, stop[i], sl)) {
                safe = at;
                *hit = true;
                break;
            }
    }
    if (*hit) return safe;
    /* No match: hold back the longest tail that is a prefix of a stop string. */
    for (int i = 0; i < n_stop; i++) {
        size_t sl = strlen(stop[i]);
        if (sl == 0) continue;
        size_t max = sl - 1 < len ? sl - 1 : len;
        for (size_t k = max; k > 0; k--)
            if (len - k < safe && !memcmp(text + len - k, stop[i], k)) {
                safe = len - k;
                break;
            }
    }
    return safe;
}
