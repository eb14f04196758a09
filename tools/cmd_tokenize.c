/* cmd_tokenize.c — `duet tokenize`: ids (and pieces) of a text; works on
 * vocabulary-only GGUF files. */
#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* Writes the n bytes of a token's text to out as valid UTF-8: complete
 * characters as they are; each byte that is not part of one (a byte-fallback
 * token's byte, half a character, invalid UTF-8) and NUL as "<0xNN>". out
 * needs 6 * n + 1 bytes. Returns out. */
static char *render_piece(const unsigned char *p, size_t n, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned c = p[i];
        size_t need = c < 0x80                 ? 0
                      : c >= 0xC2 && c <= 0xDF ? 1
                      : c >= 0xE0 && c <= 0xEF ? 2
                      : c >= 0xF0 && c <= 0xF4 ? 3
                                               : 4;
        bool ok = c != 0 && need < 4 && i + need < n;
        for (size_t k = 1; ok && k <= need; k++) {
            unsigned lo = 0x80, hi = 0xBF;
            if (k == 1 && c == 0xE0) lo = 0xA0;
            if (k == 1 && c == 0xED) hi = 0x9F;
            if (k == 1 && c == 0xF0) lo = 0x90;
            if (k == 1 && c == 0xF4) hi = 0x8F;
            ok = p[i + k] >= lo && p[i + k] <= hi;
        }
        if (ok) {
            memcpy(out + o, p + i, need + 1);
            o += need + 1;
            i += need + 1;
        } else {
            o += (size_t)snprintf(out + o, 7, "<0x%02X>", c);
            i++;
        }
    }
    out[o] = 0;
    return out;
}

/* The token's text, rendered (see render_piece); malloc'd, NULL on failure. */
static char *token_text(const duet_model *m, int32_t id) {
    int l = duet_token_piece(m, id, NULL, 0);
    if (l < 0) return NULL;
    unsigned char *raw = malloc((size_t)l + 1);
    char *out = malloc(6 * (size_t)l + 1);
    if (!raw || !out || duet_token_piece(m, id, (char *)raw, (size_t)l + 1) != l) {
        free(raw);
        free(out);
        return NULL;
    }
    render_piece(raw, (size_t)l, out);
    free(raw);
    return out;
}

int cmd_tokenize(int argc, char **argv) {
    const char *model = NULL, *text = NULL;
    bool json = false, bos = true, special = true;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-m") || !strcmp(argv[i], "--model")) {
            if (++i == argc) {
                fprintf(stderr, "duet: %s needs a file\n", argv[i - 1]);
                return 2;
            }
            model = argv[i];
        } else if (!strcmp(argv[i], "--json")) json = true;
        else if (!strcmp(argv[i], "--no-bos")) bos = false;
        else if (!strcmp(argv[i], "--no-special")) special = false;
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: duet tokenize -m MODEL [--no-bos] [--no-special] [--json] TEXT\n");
            return 0;
        } else if (!text) text = argv[i];
        else {
            fprintf(stderr, "duet: tokenize takes one text (quote it), got also '%s'\n", argv[i]);
            return 2;
        }
    }
    if (!model || !text) {
        fprintf(stderr, "usage: duet tokenize -m MODEL [--no-bos] [--no-special] [--json] TEXT\n");
        return 2;
    }
    duet_open_params op = duet_open_params_default();
    op.vocab_only = true;
    duet_model *m;
    duet_status st = duet_model_open(model, &op, &m);
    if (st) return cli_fail(model, st);
    int32_t *ids;
    int n = cli_tokenize(m, text, bos, special, &ids);
    if (n < 0) {
        duet_model_close(m);
        return 1;
    }
    /* Pieces are rendered as valid UTF-8 in both forms, so the JSON is
     * always valid and the text never prints half a character. */
    if (json) {
        cJSON *o = cJSON_CreateObject(), *a = cJSON_AddArrayToObject(o, "ids"),
              *p = cJSON_AddArrayToObject(o, "pieces");
        for (int i = 0; i < n; i++) {
            char *piece = token_text(m, ids[i]);
            cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
            cJSON_AddItemToArray(p, cJSON_CreateString(piece ? piece : ""));
            free(piece);
        }
        char *s = cJSON_PrintUnformatted(o);
        puts(s);
        cJSON_free(s);
        cJSON_Delete(o);
    } else {
        for (int i = 0; i < n; i++) {
            char *piece = token_text(m, ids[i]);
            printf("%6d  '%s'\n", ids[i], piece ? piece : "");
            free(piece);
        }
    }
    free(ids);
    duet_model_close(m);
    return 0;
}
