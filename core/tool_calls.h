/* tool_calls.h — the tool-call syntaxes of chat templates: which one a
 * template writes, parsing a model's reply into calls (as it streams), and
 * the grammar that makes a model write one call.
 *
 * The public side (duet_tool_calls_parse, duet_tool_call_grammar,
 * duet_chat_template_tool_syntax) is declared in duet.h. The syntaxes:
 *
 *   hermes   text? <tool_call> {"name": N, "arguments": {...}} </tool_call> ...
 *   llama3   <|python_tag|>? {"name": N, "parameters": {...}} (; {...})*
 *   mistral  [TOOL_CALLS]? [{"name": N, "arguments": {...}}, ...]
 *
 * Llama's <|python_tag|> and Mistral's [TOOL_CALLS] are control tokens,
 * which the detokenizer writes as nothing, so the parser takes the JSON
 * alone as a call too: for llama3 and mistral a reply is a call when its
 * first JSON key (after leading whitespace, the marker and the opening
 * brackets) is "name", "arguments" or "parameters"; anything else is text.
 * Either key name is accepted in every syntax.
 */
#ifndef DUET_TOOL_CALLS_H
#define DUET_TOOL_CALLS_H

#include "duet.h"

/* The name of the probe function chat_template.c renders, and what the
 * rendered call probe says about the syntax: `rendered` is the template's
 * text for a conversation whose last message is an assistant turn with one
 * call of DUET__TOOL_PROBE_NAME. */
#define DUET__TOOL_PROBE_NAME "duet_probe_fn"
duet_tool_syntax duet__tool_syntax_detect(const char *rendered);

#endif /* DUET_TOOL_CALLS_H */
