#!/usr/bin/env python3
"""decode_rates.py — decode tok/s of several models, interleaved rounds (order reversed every other round), medians and ratios to the first model (duet run --json, greedy, --ignore-eos).

usage: decode_rates.py DUET PROMPT_FILE ROUNDS N_PREDICT THREADS MODEL [MODEL ...]
"""
import json, statistics, subprocess, sys
duet, prompt_file, rounds, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
models = sys.argv[6:]
prompt = open(prompt_file).read()
res = {m: [] for m in models}
for r in range(rounds):
    for m in (models if r % 2 == 0 else models[::-1]):
        o = json.loads(subprocess.run([duet, "run", "-m", m, "-p", prompt, "-n", n, "--temp", "0", "--seed", "1",
                                       "-t", threads, "--json", "--ignore-eos"], check=True, capture_output=True, text=True).stdout)
        res[m].append(o["decode_tokens_per_s"])
    print(f"round {r+1}: " + ", ".join(f"{m.split('/')[-1]} {res[m][-1]:.1f}" for m in models), flush=True)
base = models[0]
for m in models:
    ratios = [a / b for a, b in zip(res[m], res[base])]
    print(f"{m}: median {statistics.median(res[m]):.1f} tok/s (min {min(res[m]):.1f} max {max(res[m]):.1f}); "
          f"median ratio to {base.split('/')[-1]}: {statistics.median(ratios):.3f}")
