#!/usr/bin/env python3
"""Structured outputs on a real model: N varied chat requests with a
response_format json_schema against a running `duet serve`, each answer
checked with PyPI jsonschema, and the decode speed with and without the
constraint (the same requests, streamed one at a time; tokens/s after the
first token).

usage: structured_outputs.py BASE_URL [N] [--max-tokens 160] [--json OUT]
"""
import argparse
import json
import random
import sys
import time

import jsonschema
import openai

S, I, N_, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(props, required=None):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


SCHEMAS = [
    ("a person", obj({"name": S, "age": I, "hobbies": {"type": "array", "items": S, "maxItems": 3}})),
    ("a book", obj({"title": S, "author": S, "year": I, "genres": {"type": "array", "items": S, "minItems": 1,
                                                                    "maxItems": 3}})),
    ("a city", obj({"name": S, "country": S, "population": I, "is_capital": B})),
    ("a product", obj({"name": S, "price": N_, "in_stock": B, "tags": {"type": "array", "items": S, "maxItems": 4}},
                      ["name", "price"])),
    ("the weather", obj({"city": S, "temperature_c": N_, "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]}})),
    ("a movie", obj({"title": S, "rating": {"type": "integer"}, "director": obj({"first": S, "last": S})})),
    ("a recipe", obj({"dish": S, "servings": I, "ingredients": {"type": "array", "minItems": 2, "maxItems": 4,
                                                                 "items": obj({"item": S, "grams": I})}})),
    ("a pet", obj({"name": S, "species": {"enum": ["dog", "cat", "bird", "fish"]}, "age": I,
                   "vaccinated": B})),
    ("a company", obj({"name": S, "employees": I, "public": B, "ceo": {"anyOf": [S, {"type": "null"}]}})),
    ("a song", obj({"title": S, "artist": S, "duration_s": I, "explicit": B}, ["title", "artist"])),
    ("a car", obj({"make": S, "model": S, "year": I, "electric": B, "color": {"type": ["string", "null"]}})),
    ("a task list", obj({"tasks": {"type": "array", "minItems": 1, "maxItems": 3,
                                   "items": obj({"task": S, "done": B})}})),
    ("a point", obj({"x": N_, "y": N_, "label": {"const": "point"}})),
    ("an event", obj({"name": S, "date": {"type": "string", "format": "date"}, "attendees": I,
                      "online": B})),
    ("a user profile", {"$defs": {"addr": obj({"street": S, "city": S})}, **obj(
        {"username": S, "email": {"type": "string", "format": "email"}, "address": {"$ref": "#/$defs/addr"}})}),
]
SUBJECTS = ["", " from France", " for children", " in the future", " from a fairy tale", " that is famous",
            " you like", " from Japan", " that is unusual", " for a school project"]


def requests(n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        what, schema = SCHEMAS[i % len(SCHEMAS)]
        subject = SUBJECTS[(i // len(SCHEMAS) + i) % len(SUBJECTS)]
        prompt = (f"Give me {what}{subject} as a JSON object matching this JSON schema:\n{json.dumps(schema)}\n"
                  "Answer with the JSON only.")
        out.append(dict(schema=schema, messages=[{"role": "user", "content": prompt}],
                        temperature=rng.choice([0.0, 0.3, 0.7]), seed=i))
    return out


def run(client, model, req, max_tokens, constrained):
    kw = dict(model=model, messages=req["messages"], max_tokens=max_tokens, temperature=req["temperature"],
              seed=req["seed"], stream=True, stream_options={"include_usage": True})
    if constrained:
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": req["schema"],
                                                                         "strict": True}}
    t0, first, text, finish, usage = time.time(), None, "", None, None
    for ch in client.chat.completions.create(**kw):
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.content:
                if first is None:
                    first = time.time()
                text += c.delta.content
            finish = c.finish_reason or finish
    t1 = time.time()
    return dict(text=text, finish=finish, tokens=usage.completion_tokens, seconds=t1 - t0,
                decode_seconds=t1 - (first or t1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("n", type=int, nargs="?", default=50)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-baseline", action="store_true", help="skip the unconstrained runs")
    ap.add_argument("--json", help="write the per-request results here")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    reqs = requests(a.n, a.seed)
    rows, stop, valid = [], 0, 0
    tok = {True: 0, False: 0}
    sec = {True: 0.0, False: 0.0}
    for i, req in enumerate(reqs):
        r = run(client, model, req, a.max_tokens, True)
        ok, err = None, ""
        if r["finish"] == "stop":
            stop += 1
            try:
                jsonschema.validate(json.loads(r["text"]), req["schema"])
                ok = True
                valid += 1
            except Exception as e:  # a failure to parse or validate is counted, and shown
                ok, err = False, str(e)[:200]
        tok[True] += max(r["tokens"] - 1, 0)
        sec[True] += r["decode_seconds"]
        row = dict(i=i, finish=r["finish"], tokens=r["tokens"], valid=ok, error=err, text=r["text"])
        if not a.no_baseline:
            b = run(client, model, req, a.max_tokens, False)
            tok[False] += max(b["tokens"] - 1, 0)
            sec[False] += b["decode_seconds"]
            row["baseline_tokens"] = b["tokens"]
        rows.append(row)
        print(f"{i:3d} {r['finish']:6s} {r['tokens']:4d} tok valid={ok} {err} {r['text'][:100]!r}", flush=True)
    summary = dict(requests=a.n, max_tokens=a.max_tokens, finish_stop=stop, stop_and_valid=valid,
                   stop_fraction=stop / a.n, valid_fraction_of_stop=valid / stop if stop else None,
                   constrained_tokens_per_s=tok[True] / sec[True] if sec[True] else None)
    if not a.no_baseline:
        summary["unconstrained_tokens_per_s"] = tok[False] / sec[False] if sec[False] else None
        if summary["constrained_tokens_per_s"] and summary["unconstrained_tokens_per_s"]:
            summary["overhead_per_token_ms"] = 1000 * (1 / summary["constrained_tokens_per_s"] -
                                                       1 / summary["unconstrained_tokens_per_s"])
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(summary=summary, rows=rows), f, indent=1)
    return 0 if stop >= 0.9 * a.n and valid == stop else 1


if __name__ == "__main__":
    sys.exit(main())
