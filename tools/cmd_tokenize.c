/* cmd_tokenize.c — `duet tokenize`: ids (and pieces) of a text; works on
 * vocabulary-only GGUF files. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

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
    char piece[256];
    if (json) {
        cJSON *o = cJSON_CreateObject(), *a = cJSON_AddArrayToObject(o, "ids"),
              *p = cJSON_AddArrayToObject(o, "pieces");
        for (int i = 0; i < n; i++) {
            int l = duet_token_piece(m, ids[i], piece, sizeof piece);
            cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
            piece[l < 0 ? 0 : l < (int)sizeof piece ? l : (int)sizeof piece - 1] = 0;
            cJSON_AddItemToArray(p, cJSON_CreateString(piece));
        }
        char *s = cJSON_PrintUnformatted(o);
        puts(s);
        cJSON_free(s);
        cJSON_Delete(o);
    } else {
        for (int i = 0; i < n; i++) {
            int l = duet_token_piece(m, ids[i], piece, sizeof piece);
            piece[l < 0 ? 0 : l < (int)sizeof piece ? l : (int)sizeof piece - 1] = 0;
            printf("%6d  '%s'\n", ids[i], piece);
        }
    }
    free(ids);
    duet_model_close(m);
    return 0;
}
