#!/usr/bin/env python3
"""spec_ab.py — speculative decoding on vs off at batch 1, interleaved.

Runs `duet run --json` on one prompt with and without `--spec ngram`
(or `--draft DRAFT` with --draft),
alternating (off, on, off, on, ...) so that both see the same machine
load, and reports each round's decode tokens/s, the per-round on/off
ratio and its median, the acceptance rate, and whether the greedy tokens
were identical. The machine may be shared and noisy: the median of
interleaved ratios is the figure to quote, not either rate alone.

usage: spec_ab.py DUET MODEL [--rounds N] [--n-predict N] [--threads N]
                  [--spec-k K] [--draft DRAFT] [--prompt-file FILE] [--json OUT]
"""
import argparse
import json
import statistics
import subprocess
import sys

# A request to repeat a text with small edits (n-gram drafting's case):
# SmolLM2's chat template written out, so `duet run` sees exactly it.
DEFAULT_TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. "
    "Visitors may borrow up to five books at a time for three weeks. "
    "Books can be renewed twice, online or at the front desk, unless another reader has reserved them. "
    "Late returns cost ten cents per day per book. "
    "The reading room on the second floor is quiet; phones must be silent there. "
    "Children's events take place every Saturday at eleven in the story corner."
)
DEFAULT_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nRepeat the following text exactly, but replace \"nine\" with \"ten\":\n\n"
    + DEFAULT_TEXT
    + "<|im_end|>\n<|im_start|>assistant\n"
)


def run(duet, model, prompt, n_predict, threads, spec, spec_k, draft=None):
    cmd = [duet, "run", "-m", model, "-p", prompt, "-n", str(n_predict), "--temp", "0", "--seed", "1",
           "-t", str(threads), "--json"]
    if spec:
        cmd += ["--draft", draft] if draft else ["--spec", "ngram"]
        if spec_k:
            cmd += ["--spec-k", str(spec_k)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("duet")
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n-predict", type=int, default=160)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--spec-k", type=int, default=0)
    ap.add_argument("--draft", help="a draft model instead of n-gram drafting")
    ap.add_argument("--prompt-file")
    ap.add_argument("--json", help="write the rounds and the summary here")
    a = ap.parse_args()
    prompt = open(a.prompt_file).read() if a.prompt_file else DEFAULT_PROMPT

    rounds = []
    for i in range(a.rounds):
        off = run(a.duet, a.model, prompt, a.n_predict, a.threads, False, a.spec_k)
        on = run(a.duet, a.model, prompt, a.n_predict, a.threads, True, a.spec_k, a.draft)
        sp = on.get("speculative", {})
        n = len(on["tokens"]) - 1  # decode_tokens_per_s's count: tokens after the first
        r = {
            "off_tps": off["decode_tokens_per_s"],
            "on_tps": on["decode_tokens_per_s"],
            "ratio": on["decode_tokens_per_s"] / off["decode_tokens_per_s"],
            # CPU time of the decode (all threads): robust to the neighbours' load.
            "off_cpu_tps": n / off["decode_cpu_seconds"],
            "on_cpu_tps": n / on["decode_cpu_seconds"],
            "cpu_ratio": off["decode_cpu_seconds"] / on["decode_cpu_seconds"],
            "generated": len(on["tokens"]),
            "identical": off["tokens"] == on["tokens"],
            "draft_tokens": sp.get("draft_tokens", 0),
            "accepted_tokens": sp.get("accepted_tokens", 0),
            "acceptance_rate": sp.get("acceptance_rate", 0),
        }
        rounds.append(r)
        print(f"round {i + 1}: off {r['off_tps']:.1f} tok/s, on {r['on_tps']:.1f} tok/s, ratio {r['ratio']:.2f}, "
              f"cpu-time ratio {r['cpu_ratio']:.2f}, acceptance {r['acceptance_rate']:.2f} ({r['accepted_tokens']}/{r['draft_tokens']}), "
              f"{r['generated']} tokens, identical {r['identical']}", flush=True)
    summary = {
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "min_ratio": min(r["ratio"] for r in rounds),
        "max_ratio": max(r["ratio"] for r in rounds),
        "median_cpu_ratio": statistics.median(r["cpu_ratio"] for r in rounds),
        "median_off_tps": statistics.median(r["off_tps"] for r in rounds),
        "median_on_tps": statistics.median(r["on_tps"] for r in rounds),
        "acceptance_rate": rounds[0]["acceptance_rate"],
        "all_identical": all(r["identical"] for r in rounds),
    }
    print(json.dumps(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rounds": rounds, "summary": summary, "prompt": prompt, "n_predict": a.n_predict,
                       "threads": a.threads, "spec_k": a.spec_k, "draft": a.draft}, f, indent=1)
    return 0 if summary["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
