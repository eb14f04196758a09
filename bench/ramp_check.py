#!/usr/bin/env python3
"""Reads the timelines of a load ramp run twice, once with the adaptive
controller and once with a fixed knob setting (duet serve --static-knobs),
and prints issue 18's checks:

- every window whose offered rate is below capacity keeps the interactive
  p99 ITL within its target (adaptive run);
- the adaptive run's total output throughput is >= 90% of the fixed one's;
- at constant load (windows inside a plateau of the profile, and the one
  before) the knobs change by less than 10% from window to window.

usage: ramp_check.py ADAPTIVE_DIR STATIC_DIR --capacity REQ_S --itl-ms MS

Each DIR is a duet-bench output folder of a --rate-profile run (points.csv,
timeline.csv). Exits 1 when a check fails.
"""
import argparse
import csv
import os
import sys


def read(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def num(s):
    return float(s) if s not in ("", None) else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("adaptive")
    ap.add_argument("static")
    ap.add_argument("--capacity", type=float, required=True, help="req/s: the best fixed setting's saturation")
    ap.add_argument("--itl-ms", type=float, required=True, help="the interactive p99 ITL target")
    a = ap.parse_args()
    ok = True
    win = read(os.path.join(a.adaptive, "timeline.csv"))

    below = [w for w in win if num(w["profile_rate"]) is not None and num(w["profile_rate"]) < a.capacity]
    miss = [w for w in below if num(w["interactive_itl_p99_ms"]) is not None
            and num(w["interactive_itl_p99_ms"]) > a.itl_ms]
    print(f"windows below capacity ({a.capacity:g} req/s): {len(below)}, interactive p99 ITL over "
          f"{a.itl_ms:g} ms in {len(miss)}")
    for w in miss:
        print(f"  {w['t_start_s']}-{w['t_end_s']} s: offered {num(w['profile_rate']):.2f} req/s, "
              f"ITL p99 {num(w['interactive_itl_p99_ms']):.0f} ms")
    ok &= not miss and bool(below)

    tput = [num(read(os.path.join(d, "points.csv"))[0]["output_throughput"]) for d in (a.adaptive, a.static)]
    ratio = tput[0] / tput[1]
    print(f"output throughput: adaptive {tput[0]:.1f} tok/s, fixed {tput[1]:.1f} tok/s, ratio {ratio:.3f} "
          f"(floor 0.90)")
    ok &= ratio >= 0.9

    # Constant load: this window and the one before both have the same
    # profile rate (a plateau).
    worst = 0.0
    pairs = 0
    for prev, cur in zip(win, win[1:]):
        r0, r1 = num(prev["profile_rate"]), num(cur["profile_rate"])
        if r0 is None or r1 is None or abs(r1 - r0) > 1e-9 * max(r0, 1):
            continue
        pairs += 1
        for k in ("max_batch_seqs", "budget_share", "batch_timeout_ms"):
            x, y = num(prev[k]), num(cur[k])
            if x is None or y is None or max(abs(x), abs(y)) == 0:
                continue
            change = abs(y - x) / max(abs(x), abs(y))
            if change > worst:
                worst = change
            if change >= 0.10:
                print(f"  {cur['t_start_s']} s: {k} {x:g} -> {y:g} ({100 * change:.0f}%)")
    print(f"constant-load window pairs: {pairs}, largest knob change {100 * worst:.1f}% (limit 10%)")
    ok &= pairs > 0 and worst < 0.10
    print("all checks pass" if ok else "a check failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
