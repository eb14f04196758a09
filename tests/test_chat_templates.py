#!/usr/bin/env python3
"""Renders every chat template in SHARED_DIR/models/chat-templates/ with
duet's Jinja interpreter (core/jinja.c, through BUILD_DIR/jinja_tool) and
with the PyPI jinja2 package, called the way Hugging Face transformers calls
it for apply_chat_template, on a fixed set of conversations, and compares
the two byte for byte.

Usage (from CTest): test_chat_templates.py DUET_BINARY SHARED_DIR BUILD_DIR

Per template the listing says:
  identical  every conversation renders the same bytes (or raises in both,
             e.g. a template's own raise_exception for a role it refuses);
  refused    duet reports an error where jinja2 renders (a construct it
             does not support), with duet's reason;
  DIFFERS    duet renders something else, or renders where jinja2 raises.
The test fails on any DIFFERS (a wrong prompt is worse than a refusal) and
when fewer than MIN_IDENTICAL templates are identical.
"""
import datetime
import json
import os
import subprocess
import sys
import tempfile

try:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError as e:  # CI installs it; a missing module is a failure, not a skip
    print(f"FAIL: the reference renderer is missing ({e}); pip install jinja2", file=sys.stderr)
    sys.exit(1)

MIN_IDENTICAL = 50
# strftime_now() is pinned in both renderers: 2026-01-15 10:30:00 UTC.
NOW = datetime.datetime(2026, 1, 15, 10, 30, 0)
NOW_UNIX = int(NOW.replace(tzinfo=datetime.timezone.utc).timestamp())


class Generation(Extension):
    """transformers' {% generation %} tag (it marks the assistant's tokens);
    rendering it is rendering its body, as a call block."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def reference_env():
    """The environment of transformers' _compile_jinja_template."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return NOW.strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city. Says <celsius> & 'fahrenheit'.",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "description": "How many days ahead"},
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
]

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
USER1 = {"role": "user", "content": "What is the capital of France?"}
ASSIST1 = {"role": "assistant", "content": "The capital of France is Paris."}
USER2 = {"role": "user", "content": "And of Japan? Réponds « vite » — 日本 <b>&amp;</b> it's fine.\n  Thanks!  "}
TOOL_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}},
        }
    ],
}
TOOL_CALL_STR = {  # OpenAI's shape: the arguments as a JSON string
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"query": "Paris"}'}}
    ],
}
USER_PARTS = {"role": "user", "content": [{"type": "text", "text": "Describe this."}, {"type": "text", "text": "Briefly."}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temperature": 21}'}
ASSIST_AFTER_TOOL = {"role": "assistant", "content": "It is 21 °C in Paris."}


def conversations(source):
    """(name, variables) pairs; the tool ones only where the template mentions tools."""
    base = {"bos_token": "<s>", "eos_token": "</s>"}
    convs = [
        ("system+user", {"messages": [SYSTEM, USER1], "add_generation_prompt": True}),
        ("system+user, no generation prompt", {"messages": [SYSTEM, USER1], "add_generation_prompt": False}),
        ("user only", {"messages": [USER1], "add_generation_prompt": True}),
        ("multi-turn", {"messages": [USER1, ASSIST1, USER2], "add_generation_prompt": True}),
        ("multi-turn with system, no generation prompt",
         {"messages": [SYSTEM, USER1, ASSIST1, USER2, ASSIST1], "add_generation_prompt": False}),
        ("content as text parts", {"messages": [SYSTEM, USER_PARTS], "add_generation_prompt": True}),
    ]
    if "tool" in source:
        convs += [
            ("tools offered", {"messages": [SYSTEM, USER1], "tools": TOOLS, "add_generation_prompt": True}),
            ("tool call and result",
             {"messages": [SYSTEM, USER1, TOOL_CALL, TOOL_RESULT], "tools": TOOLS, "add_generation_prompt": True}),
            ("tool round trip, no generation prompt",
             {"messages": [USER1, TOOL_CALL, TOOL_RESULT, ASSIST_AFTER_TOOL], "tools": TOOLS,
              "add_generation_prompt": False}),
            ("tool call with string arguments",
             {"messages": [USER1, TOOL_CALL_STR, TOOL_RESULT], "tools": TOOLS, "add_generation_prompt": True}),
        ]
    return [(name, {**base, **v}) for name, v in convs]


def reference(env, source, variables, cache={}):
    try:
        if source not in cache:
            cache.clear()
            cache[source] = env.from_string(source)
        return True, cache[source].render(**variables)
    except Exception as e:  # any error is "raised" for the comparison
        return False, f"{type(e).__name__}: {e}"


def main():
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    shared, build = sys.argv[2], sys.argv[3]
    tool = os.environ.get("DUET_JINJA_TOOL", os.path.join(build, "jinja_tool"))
    folder = os.path.join(shared, "models", "chat-templates")
    names = sorted(f for f in os.listdir(folder) if f.endswith(".jinja"))
    env = reference_env()
    counts = {"identical": 0, "refused": 0, "DIFFERS": 0}
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                source = f.read()
            convs = conversations(source)
            ctx_path = os.path.join(tmp, "contexts.json")
            with open(ctx_path, "w", encoding="utf-8") as f:
                json.dump([v for _, v in convs], f, ensure_ascii=False)
            run = subprocess.run([tool, "--now", str(NOW_UNIX), path, ctx_path], capture_output=True, timeout=120)
            if run.returncode != 0:
                print(f"FAIL: jinja_tool exited {run.returncode} on {name}: {run.stderr.decode(errors='replace')}")
                return 1
            got = json.loads(run.stdout.decode("utf-8"))
            status, detail, both_raised = "identical", "", 0
            for (cname, variables), g in zip(convs, got):
                ok, want = reference(env, source, variables)
                if g["ok"] and ok and g["output"] == want:
                    continue
                if not g["ok"] and not ok:
                    both_raised += 1
                    continue
                if not g["ok"] and ok:
                    if status == "identical":
                        status, detail = "refused", f"{g['kind']}: {g['error']} ({cname})"
                    continue
                status = "DIFFERS"
                if g["ok"] and ok:
                    i = next((k for k in range(min(len(want), len(g["output"])))
                              if want[k] != g["output"][k]), min(len(want), len(g["output"])))
                    detail = (f"{cname}: at byte {i}: jinja2 {want[max(0, i - 40):i + 40]!r}"
                              f" duet {g['output'][max(0, i - 40):i + 40]!r}")
                else:
                    detail = f"{cname}: jinja2 raised ({want}) but duet rendered"
                break
            if status == "identical" and both_raised == len(convs):
                status, detail = "refused", f"jinja2 fails too: {reference(env, source, convs[0][1])[1]}"
            elif status == "identical" and both_raised:
                detail = f"{both_raised} of {len(convs)} conversations raise in both"
            counts[status] += 1
            lines.append(f"{status:9} {name}" + (f"  [{detail}]" if detail else ""))
    for line in lines:
        print(line)
    total = len(names)
    print(f"\n{counts['identical']} identical, {counts['refused']} refused, {counts['DIFFERS']} differ, of {total} templates")
    if counts["DIFFERS"]:
        print("FAIL: duet rendered a template differently from jinja2 without refusing it")
        return 1
    if counts["identical"] < MIN_IDENTICAL:
        print(f"FAIL: fewer than {MIN_IDENTICAL} templates render identically")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
