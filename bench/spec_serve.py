#!/usr/bin/env python3
"""spec_serve.py — speculative decoding inside `duet serve`: concurrent
streams with it on vs off, and greedy identity under continuous batching.

Starts two servers on one model with the same knobs, one plain and one
speculating (--spec ngram, or --draft DRAFT), then runs one of:

  streams N [N ...]   for each stream count N, rounds alternating off, on,
                      off, on, ...: N concurrent greedy completions of the
                      prompt file (max_tokens M, ignore_eos). A round's rate
                      is all generated tokens over the wall time from the
                      first request to the last answer (which server goes
                      first alternates by round); the figure to quote
                      is the median of the per-round on/off ratios (the
                      machine may be shared). Acceptance and the draft
                      tokens the throttle refused come from /metrics deltas.
  identity            each reference prompt alone, then C concurrent mixed
                      requests (the prompts cycled, max_tokens varied,
                      interactive and batch), greedy with logprobs 2 on
                      both servers; compares the token sequences and, at
                      each divergence, reports the plain run's top-2
                      logprob gap there (a near-tie when < 1e-3).

usage: spec_serve.py DUET MODEL (--draft DRAFT | --ngram | --control) [--spec-max-batch N]
                     [--backend cpu|vulkan|opencl] [--request-timeout S] [--threads T] [--ctx N] [--max-batch-seqs N] [--json OUT]
                     streams N [N ...] [--rounds R] [--max-tokens M] [--prompt-file F]
       spec_serve.py ... identity --prompts REF.json [--concurrent C] [--max-tokens M]
"""
import argparse
import concurrent.futures
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


class Server:
    def __init__(self, cmd, timeout=3600):
        self.timeout = timeout
        self.log = tempfile.NamedTemporaryFile(prefix="spec-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.port = None
        deadline = time.time() + 300
        while self.port is None:
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"duet serve did not start: {' '.join(cmd)}\n{self.text()}")
            m = re.search(r" on http://[^\s]*:(\d+)\n", self.text())
            if m:
                self.port = int(m.group(1))
            time.sleep(0.05)

    def text(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def post(self, body):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return json.load(r)

    def metric(self, name):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=60) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        os.unlink(self.log.name)


SPEC_METRICS = ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
                "duet_spec_decode_throttled_tokens_total")


def concurrent_posts(srv, bodies):
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
        return list(ex.map(srv.post, bodies))


def streams(a, off, on):
    prompt = open(a.prompt_file).read()
    body = {"prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True}
    out = []
    for n in a.streams:
        rounds = []
        for i in range(a.rounds):
            r = {"streams": n, "load": os.getloadavg()[0]}
            order = (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off))
            for name, srv in order:  # ABBA: neither side always runs first
                before = [on.metric(m) for m in SPEC_METRICS]
                t0 = time.monotonic()
                res = concurrent_posts(srv, [body] * n)
                dt = time.monotonic() - t0
                toks = sum(x["usage"]["completion_tokens"] for x in res)
                r[name + "_tps"] = toks / dt
                if name == "on":
                    d = [on.metric(m) - b for m, b in zip(SPEC_METRICS, before)]
                    r.update(draft_tokens=d[0], accepted_tokens=d[1], throttled_tokens=d[2])
                r[name + "_texts"] = [x["choices"][0]["text"] for x in res]
            r["ratio"] = r["on_tps"] / r["off_tps"]
            r["identical"] = r.pop("off_texts") == r.pop("on_texts")
            rounds.append(r)
            print(f"{n} streams, round {i + 1}: off {r['off_tps']:.1f} tok/s, on {r['on_tps']:.1f} tok/s, "
                  f"ratio {r['ratio']:.2f}, kept {r['accepted_tokens']:.0f}/{r['draft_tokens']:.0f} drafted, "
                  f"throttled {r['throttled_tokens']:.0f}, identical {r['identical']}, load {r['load']:.1f}",
                  flush=True)
        summary = {"streams": n, "median_ratio": statistics.median(r["ratio"] for r in rounds),
                   "min_ratio": min(r["ratio"] for r in rounds), "max_ratio": max(r["ratio"] for r in rounds),
                   "median_off_tps": statistics.median(r["off_tps"] for r in rounds),
                   "median_on_tps": statistics.median(r["on_tps"] for r in rounds),
                   "accepted_tokens": sum(r["accepted_tokens"] for r in rounds),
                   "draft_tokens": sum(r["draft_tokens"] for r in rounds),
                   "throttled_tokens": sum(r["throttled_tokens"] for r in rounds),
                   "all_identical": all(r["identical"] for r in rounds)}
        print(json.dumps(summary), flush=True)
        out.append({"rounds": rounds, "summary": summary})
    return out


def tokens_and_gaps(res):
    lp = res["choices"][0]["logprobs"]
    gaps = []
    for top in lp["top_logprobs"]:
        v = sorted(top.values(), reverse=True) if top else []
        gaps.append(v[0] - v[1] if len(v) > 1 else float("inf"))
    return lp["tokens"], gaps


def identity(a, off, on):
    prompts = [c["prompt"] for c in json.load(open(a.prompts))]
    bodies = []
    for i in range(a.concurrent):
        bodies.append({"prompt": prompts[i % len(prompts)], "max_tokens": a.max_tokens - (i * 7) % (a.max_tokens // 2),
                       "temperature": 0, "ignore_eos": True, "logprobs": 2,
                       "priority": "batch" if i % 3 else "interactive"})
    alone = [{"prompt": p, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 2}
             for p in prompts]
    report = {"requests": 0, "identical": 0, "divergences": []}
    for what, batch in (("alone", alone), ("concurrent", bodies)):
        if what == "alone":
            ref = [off.post(b) for b in batch]
            got = [on.post(b) for b in batch]
        else:
            ref = concurrent_posts(off, batch)
            got = concurrent_posts(on, batch)
        for i, (x, y) in enumerate(zip(ref, got)):
            tx, gaps = tokens_and_gaps(x)
            ty, _ = tokens_and_gaps(y)
            report["requests"] += 1
            if tx == ty:
                report["identical"] += 1
                continue
            at = next((j for j in range(min(len(tx), len(ty))) if tx[j] != ty[j]), min(len(tx), len(ty)))
            d = {"set": what, "request": i, "position": at, "top2_gap": gaps[at] if at < len(gaps) else None,
                 "near_tie": at < len(gaps) and gaps[at] < 1e-3}
            report["divergences"].append(d)
            print(f"divergence: {what} request {i} at token {at}, plain run's top-2 gap {d['top2_gap']}", flush=True)
    report["draft_tokens"] = on.metric(SPEC_METRICS[0])
    report["accepted_tokens"] = on.metric(SPEC_METRICS[1])
    print(json.dumps(report), flush=True)
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("duet")
    ap.add_argument("model")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--draft")
    g.add_argument("--ngram", action="store_true")
    g.add_argument("--control", action="store_true", help="both servers plain: the A/A noise floor")
    ap.add_argument("--spec-k", type=int, default=0)
    ap.add_argument("--spec-max-batch", type=int, default=0)
    ap.add_argument("--backend", default="cpu", help="duet serve --backend (both servers)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--max-batch-seqs", type=int, default=16)
    ap.add_argument("--request-timeout", type=float, default=3600, help="seconds a request may take")
    ap.add_argument("--json")
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("streams")
    s.add_argument("streams", type=int, nargs="+")
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--prompt-file", default=os.path.join(os.path.dirname(__file__), "spec_prompt_fix_spelling.txt"))
    i = sub.add_parser("identity")
    i.add_argument("--prompts", required=True)
    i.add_argument("--concurrent", type=int, default=32)
    i.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()

    base = [a.duet, "serve", "-m", a.model, "--backend", a.backend, "--port", "0", "-c", str(a.ctx), "-t", str(a.threads),
            "--max-batch-seqs", str(a.max_batch_seqs)]
    spec = ["--draft", a.draft] if a.draft else [] if a.control else ["--spec", "ngram"]
    if a.spec_k and not a.control:
        spec += ["--spec-k", str(a.spec_k)]
    if a.spec_max_batch and not a.control:
        spec += ["--spec-max-batch", str(a.spec_max_batch)]
    off = Server(base, a.request_timeout)
    on = Server(base + spec, a.request_timeout)
    try:
        result = streams(a, off, on) if a.mode == "streams" else identity(a, off, on)
    except Exception:
        for name, srv in (("off", off), ("on", on)):  # where a stuck run stands
            print(name, "running", srv.metric("vllm:num_requests_running"), "waiting",
                  srv.metric("vllm:num_requests_waiting"), "generated", srv.metric("vllm:generation_tokens_total"),
                  file=sys.stderr)
        raise
    finally:
        off.stop()
        on.stop()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "result": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
