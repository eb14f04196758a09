#!/usr/bin/env python3
"""Re-simulates a bench/sim_validate.py result's loads (no real runs, a
virtual clock: seconds): the profile's step-time dispersion drawn with
other noise seeds (--sim-noise-seed 0..9), and the dispersion scaled
(ratio -> 1 + k (ratio - 1), k = 3 and 10, 3 noise seeds each), against
the real runs' p50 medians in validation.json. A sensitivity, not a fit.

usage: resimulate.py RESULT_DIR BUILD/duet-bench   (from the repo root)"""
import json, os, statistics, subprocess, sys, tempfile, csv
d, bench = sys.argv[1], sys.argv[2]
rep = json.load(open(os.path.join(d, "validation.json")))
wl = rep["workload"]
for backend, b in rep["backends"].items():
    prof = os.path.join(d, f"profile-{backend}.json")
    doc = json.load(open(prof))
    tmp = tempfile.mkdtemp()
    def sim(path, rate, seed, extra):
        out = os.path.join(tmp, "o")
        subprocess.run([bench, "--simulate", path, "--request-rate", str(rate), "--seed", str(seed), "--output-dir", out,
                        *extra, *wl], check=True, capture_output=True)
        row = list(csv.DictReader(open(os.path.join(out, "points.csv"))))[0]
        return float(row["ttft_median_ms"]), float(row["itl_median_ms"])
    for k in (1, 3, 10):
        doc2 = dict(doc); doc2["step_noise"] = [[l, max(1e-3, 1 + k * (r - 1))] for l, r in doc["step_noise"]]
        p2 = os.path.join(tmp, f"k{k}.json"); json.dump(doc2, open(p2, "w"))
        for row in b["rows"]:
            seeds = range(1 + 100 * (b["rows"].index(row) + 1), rep["runs"] + 1 + 100 * (b["rows"].index(row) + 1))
            ttft, itl = [], []
            for ns in range(0, 10 if k == 1 else 3):
                t = [sim(p2, row["rate"], s, ["--sim-noise-seed", str(ns)]) for s in seeds]
                ttft.append(statistics.median(x[0] for x in t)); itl.append(statistics.median(x[1] for x in t))
            off = [sim(prof, row["rate"], s, ["--sim-step-noise", "off"]) for s in seeds]
            mt, mi = row["checks"]["ttft_p50"]["measured_median"], row["checks"]["itl_p50"]["measured_median"]
            print(f"{backend} load {row['load']} k={k} ({len(ttft)} noise seeds): ttft p50 measured {mt:.1f}, "
                  f"off {statistics.median(x[0] for x in off):.1f}, noise median {statistics.median(ttft):.1f} "
                  f"range {min(ttft):.1f}..{max(ttft):.1f}; itl p50 measured {mi:.1f}, off "
                  f"{statistics.median(x[1] for x in off):.1f}, noise {statistics.median(itl):.1f} "
                  f"({min(itl):.1f}..{max(itl):.1f})", flush=True)
