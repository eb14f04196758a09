/* jinja_tool.c — renders a Jinja template for tests/test_chat_templates.py.
 *
 *   jinja_tool [--now UNIX_SECONDS] TEMPLATE.jinja CONTEXTS.json
 *
 * CONTEXTS.json is an array of variable objects; the tool renders the
 * template once per object and prints a JSON array with, per context,
 * {"ok": true, "output": TEXT} or {"ok": false, "kind": "syntax" | "render" |
 * "raised" | "limit" | "nomem", "error": MESSAGE}. A template that does not
 * parse gives the same syntax error for every context.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja.h"

static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) {
        b[n] = 0;
        *len = (size_t)n;
    }
    return b;
}

static const char *kind_name(duet__jinja_result r) {
    switch (r) {
    case DUET__JINJA_SYNTAX:
        return "syntax";
    case DUET__JINJA_RENDER:
        return "render";
    case DUET__JINJA_RAISED:
        return "raised";
    case DUET__JINJA_LIMIT:
        return "limit";
    default:
        return "nomem";
    }
}

int main(int argc, char **argv) {
    duet__jinja_options opt = {.now = -1};
    int i = 1;
    if (argc > 2 && !strcmp(argv[1], "--now")) {
        opt.now = strtoll(argv[2], NULL, 10);
        i = 3;
    }
    if (argc - i != 2) {
        fprintf(stderr, "usage: jinja_tool [--now UNIX_SECONDS] TEMPLATE.jinja CONTEXTS.json\n");
        return 2;
    }
    size_t tlen, clen;
    char *src = slurp(argv[i], &tlen), *ctxs = slurp(argv[i + 1], &clen);
    if (!src || !ctxs) {
        fprintf(stderr, "jinja_tool: cannot read %s\n", !src ? argv[i] : argv[i + 1]);
        return 2;
    }
    cJSON *contexts = cJSON_Parse(ctxs);
    if (!cJSON_IsArray(contexts)) {
        fprintf(stderr, "jinja_tool: %s is not a JSON array\n", argv[i + 1]);
        return 2;
    }
    char err[512];
    duet__jinja_template *t = NULL;
    duet__jinja_result pr = duet__jinja_parse(src, tlen, &t, err, sizeof err);
    cJSON *results = cJSON_CreateArray();
    for (cJSON *c = contexts->child; c; c = c->next) {
        cJSON *r = cJSON_CreateObject();
        if (pr != DUET__JINJA_OK) {
            cJSON_AddBoolToObject(r, "ok", 0);
            cJSON_AddStringToObject(r, "kind", kind_name(pr));
            cJSON_AddStringToObject(r, "error", err);
        } else {
            char *out = NULL;
            duet__jinja_result rr = duet__jinja_render(t, c, &opt, &out, NULL, err, sizeof err);
            cJSON_AddBoolToObject(r, "ok", rr == DUET__JINJA_OK);
            if (rr == DUET__JINJA_OK) {
                cJSON_AddStringToObject(r, "output", out);
            } else {
                cJSON_AddStringToObject(r, "kind", kind_name(rr));
                cJSON_AddStringToObject(r, "error", err);
            }
            free(out);
        }
        cJSON_AddItemToArray(results, r);
    }
    char *s = cJSON_PrintUnformatted(results);
    fputs(s, stdout);
    putchar('\n');
    free(s);
    cJSON_Delete(results);
    cJSON_Delete(contexts);
    duet__jinja_free(t);
    free(src);
    free(ctxs);
    return 0;
}
