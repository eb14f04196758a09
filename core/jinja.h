/* jinja.h — a Jinja interpreter for chat templates (internal).
 *
 * GGUF files carry their chat template as Jinja text. This renders it the
 * way Hugging Face transformers renders it with the PyPI jinja2 package: an
 * immutable sandboxed environment with trim_blocks and lstrip_blocks, the
 * loop controls (break, continue), the `generation` block as a plain block,
 * the globals raise_exception(msg) and strftime_now(fmt), and a tojson filter
 * that is Python's json.dumps(x, ensure_ascii=False, indent=..., sort_keys=...)
 * (no HTML escaping, keys in insertion order unless sort_keys=true).
 *
 * Covered: text with {{ }}, {% %}, {# #} and their whitespace control;
 * if/elif/else, for (loop.*, else, `if` filter, unpacking, break,
 * continue), set (names, namespace attributes, block set), macro and
 * calls with defaults and keyword arguments, raw, filter blocks;
 * expressions with Python semantics for arithmetic, comparison, `in`,
 * `~`, ternaries, slicing, attribute and subscript access; the string,
 * list and dict methods templates use (strip, split, startswith, items,
 * get, format, ...); jinja2's builtin filters and tests. Not covered:
 * include/import/extends (a template is one file), call blocks, recursive
 * loops; each is a parse error naming the tag.
 *
 * Values live in an arena freed when a render ends. A hostile template
 * cannot hang or exhaust the caller: the output size, the loop iterations,
 * the call depth and the memory are bounded, and each limit is a render
 * error. Errors are messages with the template's line number.
 */
#ifndef DUET_JINJA_H
#define DUET_JINJA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct cJSON;

typedef struct duet__jinja_template duet__jinja_template;

typedef enum duet__jinja_result {
    DUET__JINJA_OK = 0,
    DUET__JINJA_SYNTAX = -1, /* the template does not parse (or uses a tag we do not have) */
    DUET__JINJA_RENDER = -2, /* rendering failed: a type error, an unknown filter, ... */
    DUET__JINJA_RAISED = -3, /* the template called raise_exception(message) */
    DUET__JINJA_LIMIT = -4,  /* output, loop, depth or memory limit reached */
    DUET__JINJA_NOMEM = -5,
} duet__jinja_result;

typedef struct duet__jinja_options {
    int64_t now;        /* Unix time strftime_now() formats (UTC); < 0: the current local time */
    size_t max_output;  /* bytes; 0: 16 MiB */
    size_t max_steps;   /* loop iterations + macro calls; 0: 10 million */
    size_t max_memory;  /* arena bytes; 0: 256 MiB */
    bool jinja2_tojson; /* jinja2's own tojson (sorted keys, ASCII, <>&' escaped, indent only) instead of
                           transformers' json.dumps(ensure_ascii=False) */
} duet__jinja_options;

/* Parses SRC (LEN bytes). On failure writes a message ("line N: ...") to
 * ERR and returns DUET__JINJA_SYNTAX or DUET__JINJA_NOMEM. */
duet__jinja_result duet__jinja_parse(const char *src, size_t len, duet__jinja_template **out, char *err,
                                     size_t errlen);
void duet__jinja_free(duet__jinja_template *t);

/* Renders T with the members of the JSON object VARS as its variables
 * (NULL: none). On success *OUT is a malloc'd NUL-terminated string of
 * *OUT_LEN bytes (OUT_LEN may be NULL). OPT may be NULL. */
duet__jinja_result duet__jinja_render(const duet__jinja_template *t, const struct cJSON *vars,
                                      const duet__jinja_options *opt, char **out, size_t *out_len, char *err,
                                      size_t errlen);

#endif
