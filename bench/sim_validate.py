#!/usr/bin/env python3
"""Validates duet-bench --simulate against real runs on this machine.

For each backend: `duet profile` measures the step costs; a `duet serve`
(default knobs, seeded by the profile: it counts its steps' served and
profiled seconds) is started; its capacity is measured (every request at
once: the request throughput at saturation); then at each load (a share of
that capacity) `runs` real runs (duet-bench over HTTP, Poisson arrivals,
seeds of their own per load, the loads interleaved) and the same runs
simulated (duet-bench --simulate with the profile, every token delayed
by the measured client-server path; the same seeds, so the same prompts
and arrival times). The
predicted p50 TTFT and ITL should be within 15% of the real runs' median,
and the p99s within 25% or within the real runs' own range (min..max),
whichever is wider. Four step-cost models are simulated: the profile's,
the engine's online fit, and `duet profile --from-step-log` on the
capacity bursts' served steps (the server's --step-log) and on the other
loads' real runs' steps; and, as a diagnostic, the profile at each run's
own served speed, by step kind. Each real run's steps by kind sit beside its
simulations' (--sim-step-log). Writes a
markdown table and a JSON file with every number and command.

usage: bench/sim_validate.py [--model M] [--backends cpu,vulkan] [--runs 5]
                             [--loads 0.3,0.6,0.85] [--out bench/results/...]
       bench/sim_validate.py --resimulate DIR...   (finished validations:
                             their profile plainly and at each run's own speed)
"""
import argparse
import csv
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("profile", "online", "served", "loads", "own")  # the simulated models, in the table's order
LABELS = {"profile": "profile", "online": "online fit", "served": "served-step fit",
          "loads": "other loads' steps fit", "own": "profile at the run's own speed by kind"}


def sh(cmd, log=None, timeout=1800):
    line = " ".join(shlex.quote(c) for c in cmd)
    print("$", line, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if log is not None:
        log.append(line)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {line}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=2):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def point(out_dir):
    with open(os.path.join(out_dir, "points.csv"), newline="") as fh:
        row = list(csv.DictReader(fh))[0]
    f = lambda k: float(row[k]) if row[k] not in ("", "nan") else float("nan")
    return {"ttft_mean": f("ttft_mean_ms"), "ttft_p50": f("ttft_median_ms"), "ttft_p99": f("ttft_p99_ms"), "itl_p50": f("itl_median_ms"),
            "itl_p99": f("itl_p99_ms"), "completed": int(row["completed"]), "failed": int(row["failed"]),
            "req_s": f("request_throughput"), "other_cpu": f("other_cpu_ratio") if "other_cpu_ratio" in row else None,
            # The engine's side (the server's /metrics, or the simulated engines').
            "mean_batch": f("mean_batch_size"), "steps": f("engine_steps"), "busy": f("device_busy_ratio")}


def step_cost_metrics(base):
    try:
        text = get(base + "/metrics")
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("duet_step_cost_seconds{"):
            term = line.split('term="')[1].split('"')[0]
            out[term] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("duet_step_cost_relative_error{"):
            out["relative_error"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("duet_step_cost_steps_total{"):
            out["steps"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("duet_step_cost_served_seconds_total{"):
            out["served_s"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("duet_step_cost_profiled_seconds_total{"):
            out["profiled_s"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:time_to_first_token_seconds_sum{"):
            out["server_ttft_s"] = out.get("server_ttft_s", 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:time_to_first_token_seconds_count{"):
            out["server_ttft_n"] = out.get("server_ttft_n", 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("duet_batch_size_count"):  # every step the engine ran
            out["engine_steps"] = out.get("engine_steps", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def read_steps(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def logged_steps(path, base, timeout=30):
    """The server's step log once it holds every step /metrics counted (the
    engine writes it out when idle)."""
    deadline = time.time() + timeout
    while True:
        rows = read_steps(path)
        if len(rows) >= step_cost_metrics(base).get("engine_steps", 0) or time.time() > deadline:
            return rows
        time.sleep(0.05)


def step_summary(rows):
    """A run's steps by kind (a step log's lines, `duet serve --step-log`
    or `duet-bench --sim-step-log`): counts, median times, busy seconds."""
    prompt = [r for r in rows if int(r["prefill_tokens"]) > 0]
    decode = [r for r in rows if int(r["prefill_tokens"]) == 0]
    one = [float(r["seconds"]) for r in decode if int(r["decode_tokens"]) == 1]
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    return {"steps": len(rows), "prompt_steps": len(prompt), "decode_steps": len(decode),
            "prompt_ms": 1e3 * med([float(r["seconds"]) for r in prompt]),
            "decode_ms": 1e3 * med([float(r["seconds"]) for r in decode]),
            "one_token_ms": 1e3 * med(one),
            "decode_seqs": med([int(r["seqs"]) for r in decode]) if decode else float("nan"),
            "busy_s": sum(float(r["seconds"]) for r in rows)}


def kind_speed(rows):
    """A run's served over profiled step seconds (the step log's seconds
    over profile_s) for steps with a prompt chunk and decode-only steps:
    duet-bench's --sim-step-scale prompt=F,decode=G."""
    out = {}
    for kind, has_prompt in (("prompt", True), ("decode", False)):
        sel = [r for r in rows if (int(r["prefill_tokens"]) > 0) == has_prompt and r.get("profile_s")]
        prof = sum(float(r["profile_s"]) for r in sel)
        out[kind] = sum(float(r["seconds"]) for r in sel) / prof if prof > 0 else 1.0
    return out


def served_delta(before, after):
    """The served and profiled step seconds and the server's TTFT sum and
    count between two /metrics reads."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("served_s", "profiled_s", "server_ttft_s",
                                                                 "server_ttft_n")}


def checks(real, sim):
    """The four checks of one load: its real runs against each model's
    simulated runs (sim: model name -> runs, in the real runs' order)."""
    out = {}
    for k, tol in (("ttft_p50", 0.15), ("itl_p50", 0.15), ("ttft_p99", 0.25), ("itl_p99", 0.25)):
        meas = [r[k] for r in real]
        m = statistics.median(meas)
        c = {"measured_median": m, "measured_min": min(meas), "measured_max": max(meas)}
        for name, runs in sim.items():
            pred = statistics.median(s[k] for s in runs)
            err = (pred - m) / m if m else float("nan")
            in_range = min(meas) <= pred <= max(meas)
            # Each run against its own simulation (the same prompts and
            # arrivals): where a percentile sits between two modes, a small
            # speed difference flips it, run by run; this says whether the
            # model misses the runs or the median flips.
            paired = [abs(s[k] - r[k]) <= tol * r[k] for s, r in zip(runs, real) if r[k] > 0]
            c[name] = {"predicted": pred, "error": err, "ok": abs(err) <= tol or (k.endswith("p99") and in_range),
                       "paired_ok": sum(paired), "paired_n": len(paired)}
        out[k] = c
    return out


def resimulate(folder, build):
    """Re-simulates a finished validation's runs with its profile, plainly
    and at each run's own speed (one factor: the run's served / profiled
    seconds, kept in validation.json), with the same seeds, rates and
    client-server path; prints the checks passed by each."""
    d = json.load(open(os.path.join(folder, "validation.json")))
    bench = os.path.join(build, "duet-bench")
    for backend, b in d["backends"].items():
        if any("served" not in r or "sim_latency_ms" not in r for r in b["rows"]):
            print(f"{folder} {backend}: predates the recorded served seconds or client-server path: skipped")
            continue
        prof = os.path.join(folder, f"profile-{backend}.json")
        passed = {"profile": 0, "own": 0}
        for li, r in enumerate(b["rows"]):
            seeds = range(1 + 100 * (li + 1), len(r["real"]) + 1 + 100 * (li + 1))
            sim = {n: [] for n in passed}
            for seed, x in zip(seeds, r["served"]):
                for name, f in (("profile", 1.0), ("own", x["served_s"] / x["profiled_s"])):
                    with tempfile.TemporaryDirectory() as out:
                        sh([bench, "--simulate", prof, "--request-rate", str(r["rate"]), "--seed", str(seed),
                            "--output-dir", out, "--sim-latency-ms", f"{r['sim_latency_ms']:.4f}",
                            "--sim-step-scale", f"{f:.5f}", *d["workload"]])
                        sim[name].append(point(out))
            for c in checks(r["real"], sim).values():
                for n in passed:
                    passed[n] += c[n]["ok"]
        n = 4 * len(b["rows"])
        print(f"{folder} {backend}: {passed['profile']} of {n} with the profile, {passed['own']} of {n} at each run's "
              "own speed", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--model", default=os.path.join(ROOT, "..", "shared", "models", "smollm2-135m-instruct-q4_k_m.gguf"))
    ap.add_argument("--backends", default="cpu,vulkan")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--loads", default="0.3,0.6,0.85")
    ap.add_argument("--num-prompts", type=int, default=30)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="lengths drawn uniformly within +-this share of --input-len and --output-len (duet-bench's "
                         "--random-range-ratio; 0: every request the same lengths)")
    ap.add_argument("--profile-args", default="--decode-batches 1,2,4,8,16 --chunks 16,32,64 --contexts 16,64,128",
                    help="grid flags for duet profile (cover the workload's batch sizes and contexts)")
    ap.add_argument("--profile", default=None,
                    help="a step-cost file duet profile already wrote for this backend (skips profiling)")
    ap.add_argument("--sim-latency-ms", type=float, default=-1.0,
                    help="the client-server path's latency added to every simulated token (default: measured, "
                         "the client's mean TTFT over the server's for the same requests at the other loads)")
    ap.add_argument("--capacity-runs", type=int, default=3,
                    help="bursts (every request at once) whose median request throughput is the capacity")
    ap.add_argument("--out", default=None, help="folder for the table, JSON and every run's report")
    ap.add_argument("--resimulate", nargs="+", metavar="DIR",
                    help="no real runs: re-simulate these finished validations with their profiles, plainly and "
                         "at each run's own speed, and print the checks passed")
    a = ap.parse_args()
    if a.resimulate:
        for folder in a.resimulate:
            resimulate(folder, a.build)
        return 0

    duet, bench = os.path.join(a.build, "duet"), os.path.join(a.build, "duet-bench")
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    out = a.out or os.path.join(ROOT, "bench", "results", f"sim-validation-{stamp}")
    os.makedirs(out, exist_ok=True)
    loads = [float(x) for x in a.loads.split(",")]
    wl = ["-m", a.model, "--num-prompts", str(a.num_prompts), "--random-input-len", str(a.input_len),
          "--random-output-len", str(a.output_len), "--random-range-ratio", str(a.range_ratio), "--disable-tqdm",
          "--no-plots"]
    # The devices' own knobs (PoCL's thread count, lavapipe's, duet's), as
    # the run had them: they change what a "device" is on this machine.
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("POCL_", "LP_", "DUET_"))}
    report = {"model": a.model, "threads": a.threads, "runs": a.runs, "workload": wl, "environment": env,
              "backends": {}}

    for backend in a.backends.split(","):
        cmds = []
        t0 = time.time()
        prof = os.path.join(out, f"profile-{backend}.json")
        if a.profile:
            if os.path.abspath(a.profile) != os.path.abspath(prof):
                with open(a.profile) as src, open(prof, "w") as dst:
                    dst.write(src.read())
            cmds.append(f"# step costs from {a.profile}")
        else:
            p = sh([duet, "profile", "-m", a.model, "--backend", backend, "--threads", str(a.threads), "--out",
                    prof, "--quiet", *a.profile_args.split()], cmds)
            print(p.stdout)
            with open(os.path.join(out, f"profile-{backend}.txt"), "w") as fh:
                fh.write(p.stdout)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        # Seeded by the profile, the server counts its steps' served and
        # profiled seconds (duet_step_cost_{served,profiled}_seconds_total).
        # Its step log splits each real run's steps by kind, beside its
        # simulations' (--sim-step-log).
        step_log = os.path.join(out, f"steps-{backend}.csv")
        serve = [duet, "serve", "-m", a.model, "--backend", backend, "--threads", str(a.threads), "--port", str(port),
                 "--step-cost", prof, "--step-log", step_log]
        cmds.append(" ".join(shlex.quote(c) for c in serve))
        log = open(os.path.join(out, f"serve-{backend}.log"), "w")
        srv = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(600):
                try:
                    get(base + "/health")
                    break
                except OSError:
                    time.sleep(0.2)
            # Capacity: everything at once, the request throughput at
            # saturation; the median of a few bursts (one burst lands in one
            # minute of a machine whose speed drifts), each with prompts of
            # its own (seeds 0.., below the loads' 101..: the prefix cache
            # never hits).
            caps, sim_caps = [], []
            for seed in range(a.capacity_runs):
                cap_dir = os.path.join(out, f"real-{backend}-capacity-{seed}")
                sh([bench, "--base-url", base, "--request-rate", "inf", "--seed", str(seed), "--output-dir", cap_dir,
                    *wl], cmds)
                caps.append(point(cap_dir)["req_s"])
                sim_cap_dir = os.path.join(out, f"sim-{backend}-capacity-{seed}")
                sh([bench, "--simulate", prof, "--request-rate", "inf", "--seed", str(seed), "--output-dir",
                    sim_cap_dir, "--sim-latency-ms", str(max(0.0, a.sim_latency_ms)), *wl], cmds)
                sim_caps.append(point(sim_cap_dir)["req_s"])
            capacity, sim_capacity = statistics.median(caps), statistics.median(sim_caps)
            print(f"{backend}: capacity {capacity:.3f} req/s measured, {sim_capacity:.3f} simulated", flush=True)
            # The engine's own online fit after the capacity runs: a second
            # step-cost model, measured under the server's real conditions.
            online0 = step_cost_metrics(base)
            prof_online = os.path.join(out, f"profile-{backend}-online.json")
            doc = json.load(open(prof))
            doc["terms"] = {k: online0.get(k, 0.0) for k in doc["terms"]}
            doc.pop("samples", None)
            doc["fit"] = {"samples": int(online0.get("steps", 0)), "rmse_s": 0, "r2": 0,
                          "mean_rel_err": online0.get("relative_error", 0)}
            with open(prof_online, "w") as fh:
                json.dump(doc, fh, indent=1)
            # A third: `duet profile --from-step-log` on the capacity
            # bursts' steps (the server's log so far), with their own
            # dispersion: what a user can fit from a server's log.
            cap_log = os.path.join(out, f"steps-{backend}-capacity.csv")
            with open(step_log) as src, open(cap_log, "w") as dst:
                head = src.readline()
                dst.write(head + "".join(src.readline() for _ in range(len(logged_steps(step_log, base)))))
            prof_served = os.path.join(out, f"profile-{backend}-served.json")
            p = sh([duet, "profile", "--from-step-log", cap_log, "--out", prof_served], cmds)
            with open(os.path.join(out, f"profile-{backend}-served.txt"), "w") as fh:
                fh.write(p.stdout)
            # The real runs, the loads interleaved (a round visits each
            # load once): a minute of a slower machine lands on every load,
            # not on one. Seeds of their own per load: the same seed's
            # prompts again would be served from the server's prefix cache
            # (a 32-token prompt's first 32 tokens are two cached blocks),
            # which the simulator does not model.
            rates = [round(f * capacity, 4) for f in loads]
            seeds = [list(range(1 + 100 * (li + 1), a.runs + 1 + 100 * (li + 1))) for li in range(len(loads))]
            real = [[] for _ in loads]
            served = [[] for _ in loads]
            run_steps = [[] for _ in loads]  # each real run's step log lines
            for k in range(a.runs):
                for li, f in enumerate(loads):
                    d = os.path.join(out, f"real-{backend}-{f}-{seeds[li][k]}")
                    m0 = step_cost_metrics(base)
                    n0 = len(logged_steps(step_log, base))
                    sh([bench, "--base-url", base, "--request-rate", str(rates[li]), "--seed", str(seeds[li][k]),
                        "--warmup", "0", "--output-dir", d, *wl], cmds)
                    served[li].append(served_delta(m0, step_cost_metrics(base)))
                    real[li].append(point(d))
                    run_steps[li].append(logged_steps(step_log, base)[n0:])
                    real[li][-1]["step_log"] = step_summary(run_steps[li][-1])
                    real[li][-1]["kind_speed"] = kind_speed(run_steps[li][-1])
                    # The client-server path: the client's TTFT over the
                    # server's own (from arrival in the engine) for the
                    # same requests.
                    served[li][-1]["client_ttft_s"] = real[li][-1]["ttft_mean"] / 1e3 * real[li][-1]["completed"]
            # Serving's speed against the profile's (served over profiled
            # step seconds, summed over the runs), reported; and the
            # client-server path, which each load's simulation adds from
            # the other loads' runs (its own stay out).
            def speed(runs):
                tot = {k: sum(x[k] for x in runs) for k in ("served_s", "profiled_s")}
                return tot["served_s"] / tot["profiled_s"] if tot["profiled_s"] > 0 else 1.0

            def path_ms(runs):
                n = sum(x["server_ttft_n"] for x in runs)
                return 1e3 * sum(x["client_ttft_s"] - x["server_ttft_s"] for x in runs) / n if n else 0.0

            scale = speed([x for row in served for x in row])
            print(f"{backend}: served / profiled step time {scale:.3f}", flush=True)
            # A fourth model per load: `duet profile --from-step-log` on the
            # other loads' real runs' steps (its own runs stay out), traffic
            # like the predicted one, served in the same half hour.
            prof_loads = []
            for li, f in enumerate(loads):
                path = os.path.join(out, f"steps-{backend}-without-{f}.csv")
                with open(path, "w", newline="") as fh:
                    w = csv.DictWriter(fh, fieldnames=list(run_steps[0][0][0].keys()))
                    w.writeheader()
                    for lj in range(len(loads)):
                        if lj != li:
                            for rows_k in run_steps[lj]:
                                w.writerows(rows_k)
                prof_loads.append(os.path.join(out, f"profile-{backend}-without-{f}.json"))
                p = sh([duet, "profile", "--from-step-log", path, "--out", prof_loads[-1]], cmds)
                with open(prof_loads[-1][:-len(".json")] + ".txt", "w") as fh:
                    fh.write(p.stdout)
            rows = []
            for li, f in enumerate(loads):
                other_runs = [x for lj, row in enumerate(served) if lj != li for x in row]
                # Every simulated token arrives the path's latency later,
                # measured over the other loads' runs (or --sim-latency-ms).
                latency = a.sim_latency_ms if a.sim_latency_ms >= 0 else max(0.0, path_ms(other_runs))
                # The profile's model with its measured step-time dispersion
                # (duet-bench's default when the profile has one), the
                # online fit (with the profile's dispersion: it copies the
                # file), the capacity bursts' served steps fitted, the other
                # loads' served steps fitted; and, a diagnostic rather than
                # a prediction, the profile times the run's own served /
                # profiled step time by kind (prompt chunks, decodes): the
                # simulator's error once the machine's speed in that minute
                # is known.
                models = {"profile": (prof, []), "online": (prof_online, []), "served": (prof_served, []),
                          "loads": (prof_loads[li], []), "own": (prof, None)}
                sim = {m: [] for m in models}
                for k, seed in enumerate(seeds[li]):
                    for name, (path, extra) in models.items():
                        if extra is None:
                            x = real[li][k]["kind_speed"]
                            extra = ["--sim-step-scale", f"prompt={x['prompt']:.5f},decode={x['decode']:.5f}"]
                        d = os.path.join(out, f"sim-{name}-{backend}-{f}-{seed}")
                        sh([bench, "--simulate", path, "--request-rate", str(rates[li]), "--seed", str(seed),
                            "--output-dir", d, "--sim-latency-ms", f"{latency:.4f}", "--sim-step-log", *extra, *wl],
                           cmds)
                        sim[name].append(point(d))
                        sim[name][-1]["step_log"] = step_summary(read_steps(os.path.join(d, "sim_steps.csv")))
                ratios = [x["served_s"] / x["profiled_s"] for x in served[li] if x["profiled_s"] > 0]
                row = {"load": f, "rate": rates[li], "real": real[li], "sim": sim, "served": served[li],
                       "served_ratio": speed(served[li]), "served_ratio_median": statistics.median(ratios) if ratios
                       else None, "path_ms": path_ms(served[li]), "sim_latency_ms": latency, "checks": {}}
                row["checks"] = checks(real[li], sim)
                rows.append(row)
            online = step_cost_metrics(base)
        finally:
            srv.terminate()
            try:
                srv.wait(timeout=30)
            except subprocess.TimeoutExpired:
                srv.kill()
            log.close()
        report["backends"][backend] = {"capacity_req_s": capacity, "sim_capacity_req_s": sim_capacity,
                                       "capacity_runs_req_s": caps, "sim_capacity_runs_req_s": sim_caps,
                                       "served_scale": scale,
                                       "profile": json.load(open(prof)), "online_step_cost": online, "rows": rows,
                                       "commands": cmds, "wall_s": time.time() - t0}

    with open(os.path.join(out, "validation.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    lines = [f"# duet-bench --simulate against real runs", "",
             f"Model `{os.path.basename(a.model)}`, {a.threads} threads (the cpu backend's), {a.num_prompts} requests a run "
             f"({a.input_len} prompt tokens, {a.output_len} output tokens"
             + (f", each within +-{100 * a.range_ratio:g}%" if a.range_ratio > 0 else "")
             + f", Poisson arrivals), {a.runs} real and "
             f"{a.runs} simulated runs per load (seeds 101.., 201.., 301.. by load: the same prompts and arrival "
             "times in both; no prompt twice, so the server's prefix cache, which the simulator does not model, "
             "never hits; the loads interleaved, a round visiting each once). "
             "Measured: median over the real runs (min..max); predicted: median over the simulated runs. "
             "Pass: p50 within 15%; p99 within 25% or inside the real runs' range. Every simulated token "
             "arrives the client-server path's latency later (measured, see below). Five simulations, each "
             "simulated step's cost times a draw from its model's measured dispersion (`step_noise`, seeded by "
             "the run's seed): `duet profile`'s model (measured before the server started), the engine's own "
             "online fit, read from /metrics after the capacity runs (with the profile's dispersion), "
             "`duet profile --from-step-log` on the capacity runs' steps (the server's `--step-log`; their own "
             "dispersion), the same on the other loads' real runs' steps (the load's own runs left out), and, a "
             "diagnostic rather than a prediction, the profile's model times each run's own served / profiled "
             "step time by kind (`--sim-step-scale prompt=F,decode=G`, from its step log): the simulator's error once the machine's speed in the run's "
             "minute is known. \"Runs within\": the real runs whose "
             "own simulation (same seed) is within the check's tolerance of them (15% or 25%), a diagnostic "
             "beside the pass, which compares medians."
             + (" Environment: " + ", ".join(f"`{k}={v}`" for k, v in env.items()) + "." if env else ""), ""]
    total = 0
    passed = {n: 0 for n in NAMES}
    for backend, b in report["backends"].items():
        prof = b["profile"]
        lines += [f"## {backend}: {prof.get('device', '')}", "",
                  f"Capacity {b['capacity_req_s']:.3f} req/s measured (all requests at once; the median of "
                  f"{', '.join(f'{x:.3f}' for x in b['capacity_runs_req_s'])}), "
                  f"{b['sim_capacity_req_s']:.3f} simulated. Profile fit R^2 {prof['fit']['r2']:.4f}, mean relative "
                  f"error {100 * prof['fit']['mean_rel_err']:.1f}%; terms "
                  + ", ".join(f"{k} {v:.4g}" for k, v in prof["terms"].items())
                  + (f". The engine's online fit after the runs: "
                     + ", ".join(f"{k} {v:.4g}" for k, v in b["online_step_cost"].items()
                              if k in prof["terms"] or k in ("steps", "relative_error"))
                  if b["online_step_cost"] else "")
                  + ".", "",
                  f"Served / profiled step time (the server's duet_step_cost_served_seconds_total over "
                  f"..._profiled_seconds_total) over all real runs: {b['served_scale']:.3f}; by load: "
                  + ", ".join(f"{int(100 * r['load'])}% {r['served_ratio']:.3f}" for r in b["rows"])
                  + ". The client-server path (the client's mean TTFT over the "
                  "server's, `vllm:time_to_first_token_seconds`, for the same requests), by load (and the latency "
                  "its simulations add to every token: the other loads' path, or --sim-latency-ms): "
                  + ", ".join(f"{int(100 * r['load'])}% {r['path_ms']:.2f} ms ({r['sim_latency_ms']:.2f})"
                              for r in b["rows"]) + ".", ""]
        if prof.get("step_noise"):
            lines += ["Step-time dispersion (measured / predicted over every timed repeat of the profile): "
                      + ", ".join(f"p{100 * l:g} {r:.3f}" for l, r in prof["step_noise"]) + ".", ""]
        lines += ["| load | rate req/s | metric | measured median (min..max) ms |"
                  + "".join(f" predicted: {LABELS[n]} | error | pass | runs within |" for n in NAMES),
                  "|---|---|---|---|" + "---|---|---|---|" * len(NAMES)]
        for r in b["rows"]:
            for k, c in r["checks"].items():
                total += 1
                for n in NAMES:
                    passed[n] += c[n]["ok"]
                cells = "".join(f" {c[n]['predicted']:.1f} | {100 * c[n]['error']:+.0f}% | "
                                f"{'yes' if c[n]['ok'] else 'NO'} | {c[n]['paired_ok']}/{c[n]['paired_n']} |"
                                for n in NAMES)
                lines.append(f"| {int(100 * r['load'])}% | {r['rate']:.3g} | {k.replace('_', ' ')} | "
                             f"{c['measured_median']:.1f} ({c['measured_min']:.1f}..{c['measured_max']:.1f}) |"
                             + cells)
        # The engine's side, real against simulated (profile): a run that
        # batched differently, or kept the device busier, shows here.
        med = lambda xs: statistics.median(xs) if xs else float("nan")
        lines += ["", "The engine's side, medians over the runs, real / simulated with the profile's model: "
                  "sequences per step, steps, device busy share of the run.", "",
                  "| load | mean batch | steps | busy |", "|---|---|---|---|"]
        for r in b["rows"]:
            cell = lambda k, fmt: (fmt.format(med([x.get(k, float("nan")) for x in r["real"]])) + " / "
                                   + fmt.format(med([x.get(k, float("nan")) for x in r["sim"]["profile"]])))
            lines.append(f"| {int(100 * r['load'])}% | {cell('mean_batch', '{:.2f}')} | {cell('steps', '{:.0f}')} | "
                         f"{cell('busy', '{:.3f}')} |")
        # Step by step (the server's step log against the simulations'):
        # the same steps slower, or other steps?
        sl = lambda runs, k: med([x["step_log"][k] for x in runs if "step_log" in x])
        lines += ["", "Steps by kind, medians over the runs, real / simulated with the profile's model / with the "
                  "online fit / with the served-step fit (the server's `--step-log` against `duet-bench --sim-step-log`): steps with a prompt "
                  "chunk and their median time; decode-only steps, their median sequences and time; one-token "
                  "decodes' median time; the device's busy seconds.", "",
                  "| load | prompt steps | prompt ms | decode steps | decode seqs | decode ms | one-token ms | busy s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in b["rows"]:
            cell = lambda k, fmt: " / ".join(fmt.format(sl(runs, k)) for runs in
                                             [r["real"]] + [r["sim"][n] for n in NAMES])
            lines.append(f"| {int(100 * r['load'])}% | {cell('prompt_steps', '{:.0f}')} | {cell('prompt_ms', '{:.1f}')} "
                         f"| {cell('decode_steps', '{:.0f}')} | {cell('decode_seqs', '{:.0f}')} | "
                         f"{cell('decode_ms', '{:.2f}')} | {cell('one_token_ms', '{:.2f}')} | "
                         f"{cell('busy_s', '{:.2f}')} |")
        other = [x["other_cpu"] for r in b["rows"] for x in r["real"] if x.get("other_cpu") is not None]
        if other:
            lines += ["", f"Other processes' share of the machine's CPU during the real runs: median "
                          f"{100 * statistics.median(other):.0f}%, max {100 * max(other):.0f}% (the server counts as "
                          "other: it is the client's view)."]
        lines += ["", "Commands:", "", "```"] + b["commands"][:4] + [f"... ({len(b['commands'])} commands in all, "
                                                                     "every one in validation.json)", "```", ""]
    lines.insert(2, f"**{passed['profile']} of {total} checks pass with the profile's model and its step-time "
                    f"dispersion ({passed['online']} of {total} with the engine's online fit, {passed['served']} "
                    f"of {total} with the capacity runs' served steps fitted, {passed['loads']} of {total} with the other "
                    f"loads' served steps fitted; {passed['own']} of {total} with the profile at each run's own "
                    "speed, a diagnostic).**\n")
    with open(os.path.join(out, "validation.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
