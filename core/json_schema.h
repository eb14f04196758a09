/* json_schema.h — a JSON Schema to a GBNF grammar (core/grammar.h) whose
 * sentences are exactly the JSON texts the schema accepts, within the
 * subset below, written compactly (no whitespace beyond what a model may
 * put between tokens).
 *
 * Subset: "type" (a name or a list: object, array, string, number,
 * integer, boolean, null), "properties" with "required" (required ones
 * first, then the optional ones in schema order, each at most once), "enum"
 * and "const" (any JSON values), "items" with "minItems"/"maxItems",
 * "minLength"/"maxLength" of strings, "anyOf"/"oneOf" (as alternatives),
 * "allOf" with one schema, "$ref" to "#/$defs/..." or "#/definitions/..."
 * (recursion allowed). Properties not listed are not generated (whatever
 * "additionalProperties" says), "format" and "pattern" leave strings free.
 * Integers keep "minimum", "maximum", "exclusiveMinimum" and
 * "exclusiveMaximum" (as numbers); a number keeps "minimum" and "maximum"
 * when both are non-negative integers (it is then written without an
 * exponent); other bounds on numbers are not enforced. An empty schema (or
 * true) is any JSON value.
 *
 * Whitespace: at most a newline and 20 spaces or tabs, or two spaces,
 * between tokens; none before the value or after it, so the grammar closes
 * with the value and the model ends there.
 */
#ifndef DUET_JSON_SCHEMA_H
#define DUET_JSON_SCHEMA_H

#include "duet.h"

/* schema_json: the schema as JSON text; NULL means any JSON object
 * (response_format json_object). *out is malloc'd GBNF. DUET_BAD_REQUEST
 * with a message for a schema that is not JSON or uses what the subset
 * lacks in a way that matters (allOf of several schemas, a $ref elsewhere). */
duet_status duet_json_schema_to_gbnf(const char *schema_json, char **out);
/* The same with the value between two literal texts: root ::= prefix value
 * suffix (NULL or "" for none), as a tool call's wrapper needs. */
duet_status duet__json_schema_to_gbnf_wrapped(const char *schema_json, const char *prefix, const char *suffix,
                                              char **out);

#endif /* DUET_JSON_SCHEMA_H */
