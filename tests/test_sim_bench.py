#!/usr/bin/env python3
"""End-to-end tests of `duet profile` and `duet-bench --simulate` on
stories260K: the profile file and its printed fit, the simulated report
against timelines worked out by hand, determinism, traces, the instance
search and its curve, and the errors for bad input.

usage: test_sim_bench.py DUET_BINARY SHARED_DIR BUILD_DIR
"""
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

DUET, SHARED, BUILD = sys.argv[1], sys.argv[2], sys.argv[3]
BENCH = os.path.join(BUILD, "duet-bench")
MODEL = os.path.join(SHARED, "models", "stories260K.gguf")
HAVE_GNUPLOT = shutil.which("gnuplot") is not None
TERMS = ["intercept", "per_decode_token", "per_prefill_token", "per_decode_context", "per_prefill_context"]


def run(cmd, check=True, timeout=120):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def bench(*args, check=True):
    return run([BENCH, "--disable-tqdm", *args], check=check)


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def write_profile(path, terms, n_ctx=512):
    with open(path, "w") as fh:
        json.dump({"format": "duet-step-cost", "version": 1, "model": "hand-made", "backend": "cpu",
                   "device": "test", "n_ctx": n_ctx, "terms": dict(zip(TERMS, terms))}, fh)


class Profile(unittest.TestCase):
    def test_profile_writes_a_fitted_model(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "p.json")
            p = run([DUET, "profile", "-m", MODEL, "--backend", "cpu", "--threads", "1", "--out", out,
                     "--decode-batches", "1,4,8", "--chunks", "16,64", "--contexts", "16,64", "--repeats", "3",
                     "--quiet"])
            with open(out) as fh:
                doc = json.load(fh)
            self.assertEqual(doc["format"], "duet-step-cost")
            self.assertEqual(doc["backend"], "cpu")
            # 3 decode batches x 2 contexts, 2 chunks from 0 and from each
            # context, 2 mixed: 14 shapes, each a median sample.
            self.assertEqual(len(doc["samples"]), 14)
            self.assertEqual(doc["fit"]["samples"], 14)
            for t in TERMS:
                self.assertGreaterEqual(doc["terms"][t], 0)
            self.assertGreater(doc["terms"]["intercept"] + doc["terms"]["per_decode_token"], 0)
            # The printed table has a row per shape and the fit quality.
            self.assertIn("quality: R^2", p.stdout)
            self.assertEqual(sum(1 for l in p.stdout.splitlines() if l[:1].isdigit() and l.rstrip().endswith("%")), 14)
            # More prompt tokens never cost less in the fitted model.
            s = doc["samples"]
            pred = lambda x: sum(doc["terms"][t] * v for t, v in zip(TERMS, [1, x["n_decode"], x["n_prefill"],
                                                                              x["decode_ctx"], x["prefill_ctx"]]))
            chunks = sorted((x for x in s if x["n_decode"] == 0), key=lambda x: (x["prefill_ctx"]))
            self.assertLessEqual(pred(chunks[0]), pred(chunks[-1]))
            # The dispersion of every timed repeat around the fit: quantiles
            # of measured / predicted, levels 0..1, ratios non-decreasing.
            q = doc["step_noise"]
            self.assertEqual((q[0][0], q[-1][0]), (0, 1))
            self.assertEqual([r for _, r in q], sorted(r for _, r in q))
            self.assertTrue(0 < q[0][1] <= 1 <= q[-1][1] < 100, q)

    def test_profile_from_step_log(self):
        """--from-step-log fits the steps a server ran: a log made by hand
        from known terms gives them back; its cold lines stay out."""
        terms = [0.002, 0.001, 0.0005, 1e-6, 0]
        header = ("start_s,idle_s,seqs,decode_tokens,prefill_tokens,decode_ctx,prefill_ctx,seconds,draft_seconds,"
                  "predicted_s,profile_s,learnt")
        lines, t = [header], 0.0
        shapes = [(d, 0, d * c, 0) for d in (1, 2, 3, 5, 8) for c in (20, 90)]
        shapes += [(0, n, 0, n * at + n * (n + 1) / 2) for n in (16, 40) for at in (0, 64)]
        shapes += [(4, 24, 4 * 50, 24 * 10 + 300), (7, 9, 7 * 33, 9 * 5 + 45)]
        for dec, pre, dctx, pctx in shapes:
            secs = sum(c * v for c, v in zip(terms, (1, dec, pre, dctx, pctx)))
            lines.append(f"{t:.6f},0.000100,{max(dec, 1)},{dec},{pre},{dctx:.0f},{pctx:.0f},{secs:.9f},0,,,1")
            t += secs
        # Two cold steps (a kind's first, kernels compiling): far off the terms.
        lines.insert(1, "0.000000,,1,1,0,17,0,5.000000,0,,,0")
        lines.insert(2, "5.000000,,1,0,16,0,136,7.000000,0,,,0")
        with tempfile.TemporaryDirectory() as d:
            log, out = os.path.join(d, "steps.csv"), os.path.join(d, "served.json")
            with open(log, "w") as fh:
                fh.write("\n".join(lines) + "\n")
            p = run([DUET, "profile", "--from-step-log", log, "--out", out, "-c", "512"])
            self.assertIn(f"{len(shapes)} served steps", p.stdout)
            self.assertIn("2 cold ones left out", p.stdout)
            # One step at each of its 16 token counts: too few for the
            # token-count correction, and it says so.
            self.assertIn("fewer than 8 a knot", p.stderr)
            with open(out) as fh:
                doc = json.load(fh)
            self.assertEqual(doc["n_ctx"], 512)
            for name, want in zip(TERMS, terms):
                self.assertAlmostEqual(doc["terms"][name], want, delta=1e-4 * max(want, 1e-3), msg=name)
            self.assertLess(doc["fit"]["mean_rel_err"], 1e-3)
            # Exact steps: no dispersion around the fit.
            self.assertTrue(all(abs(r - 1) < 1e-3 for _, r in doc["step_noise"]), doc["step_noise"])
            # The same steps 8 times over: enough, no warning, the same terms.
            with open(log, "w") as fh:
                fh.write("\n".join(lines[:1] + lines[1:] * 8) + "\n")
            p = run([DUET, "profile", "--from-step-log", log, "--out", out])
            self.assertNotIn("warning", p.stderr)
            with open(out) as fh:
                again = json.load(fh)
            for name, want in zip(TERMS, terms):
                self.assertAlmostEqual(again["terms"][name], want, delta=1e-4 * max(want, 1e-3), msg=name)
            # The file serves the simulator.
            sim = os.path.join(d, "sim")
            bench("--simulate", out, "--request-rate", "0.01", "--num-prompts", "2", "--random-input-len", "20",
                  "--random-output-len", "4", "--output-dir", sim, "--no-plots", "--sim-step-log")
            # A simulated log (no learnt column) is read too: every line.
            p = run([DUET, "profile", "--from-step-log", os.path.join(sim, "sim_steps.csv"), "--out",
                     os.path.join(d, "again.json")])
            self.assertIn("8 served steps", p.stdout)
            # What is refused, and how.
            bad = os.path.join(d, "bad.csv")
            for text, why in ((header.replace("prefill_ctx", "pctx") + "\n", 'no column "prefill_ctx"'),
                              (header + "\n", "no served step"),
                              (header + "\n" + lines[3].replace(",1\n", "") + "\n1,2\n", "bad.csv:3: 2 columns"),
                              (header + "\n0,,1,1,0,x,0,0.01,0,,,1\n", "bad.csv:2: decode_ctx is 'x'"),
                              (header + "\n0,,1,1e12,0,1,0,0.01,0,,,1\n", "decode_tokens is '1e12', not a whole"),
                              (header + "\n0,,1,0,2.5,0,1,0.01,0,,,1\n", "prefill_tokens is '2.5', not a whole"),
                              ("", "empty")):
                with open(bad, "w") as fh:
                    fh.write(text)
                p = run([DUET, "profile", "--from-step-log", bad, "--out", out], check=False)
                self.assertEqual(p.returncode, 1, text)
                self.assertIn(why, p.stderr)
            p = run([DUET, "profile", "--from-step-log", log, "--out", out, "-m", MODEL], check=False)
            self.assertEqual(p.returncode, 2)
            self.assertIn("no -m", p.stderr)
            for flag in (["--chunks", "16"], ["-t", "1"]):
                p = run([DUET, "profile", "--from-step-log", log, "--out", out, *flag], check=False)
                self.assertEqual(p.returncode, 2)
                self.assertIn(f"--{'threads' if flag[0] == '-t' else 'chunks'} does not apply", p.stderr)
            p = run([DUET, "profile", "--from-step-log", os.path.join(d, "none.csv"), "--out", out], check=False)
            self.assertEqual(p.returncode, 1)
            self.assertIn("none.csv", p.stderr)

    def test_profile_errors(self):
        p = run([DUET, "profile", "-m", MODEL], check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--out", p.stderr)
        p = run([DUET, "profile", "-m", MODEL, "--out", "/tmp/x.json", "--chunks", "16,x"], check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--chunks wants a list", p.stderr)
        p = run([DUET, "profile", "-m", "/nonexistent.gguf", "--out", "/tmp/x.json"], check=False)
        self.assertEqual(p.returncode, 1)
        self.assertIn("/nonexistent.gguf", p.stderr)


class Simulate(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.prof = os.path.join(self.dir, "prof.json")
        # 10 ms a step, plus 0.1 ms a prompt token.
        write_profile(self.prof, [0.010, 0, 0.0001, 0, 0])

    def tearDown(self):
        shutil.rmtree(self.dir)

    def points(self, out):
        return read_csv(os.path.join(out, "points.csv"))

    def test_lone_requests_match_the_hand_timeline(self):
        out = os.path.join(self.dir, "a")
        # Far apart (0.01 req/s): each request runs alone. 2 ms batch
        # timeout, a 20-token prompt step (10 + 2 ms), then 10 ms decodes.
        bench("--simulate", self.prof, "--request-rate", "0.01", "--num-prompts", "5", "--random-input-len", "20",
              "--random-output-len", "8", "--output-dir", out, "--no-plots", "--save-detailed", "--sim-step-log")
        pt = self.points(out)[0]
        self.assertEqual(int(pt["completed"]), 5)
        self.assertAlmostEqual(float(pt["ttft_median_ms"]), 14.0, places=6)
        self.assertAlmostEqual(float(pt["itl_p99_ms"]), 10.0, places=6)
        self.assertAlmostEqual(float(pt["e2el_median_ms"]), 14.0 + 7 * 10.0, places=6)
        with open(os.path.join(out, "results.json")) as fh:
            doc = json.load(fh)
        self.assertIn("simulated", json.dumps(doc))
        reqs = read_csv(os.path.join(out, "requests.csv"))
        self.assertEqual(len(reqs), 5)
        # The engine's side, as a server's /metrics would give it: 8 steps
        # of one sequence a request (a prompt step, 7 decodes), 82 ms each.
        self.assertEqual(read_csv(os.path.join(out, "batch_hist.csv")),
                         [{"point": "0", "batch_size_le": "1", "steps": "40"}])
        self.assertEqual(float(pt["mean_batch_size"]), 1.0)
        self.assertEqual(int(pt["engine_steps"]), 40)
        busy = 5 * (12 + 7 * 10) / 1e3
        self.assertAlmostEqual(float(pt["device_busy_ratio"]) * float(pt["duration_s"]), busy, delta=1e-5)  # CSV digits
        # --sim-step-log: each of those steps in duet serve --step-log's
        # columns. A request's prompt step (20 tokens at positions 0..19:
        # context 210, 12 ms) 2 ms after its arrival, then 7 one-token
        # decodes at contexts 21..27 right after one another (10 ms each).
        steps = read_csv(os.path.join(out, "sim_steps.csv"))
        self.assertEqual(len(steps), 40)
        for i, r in enumerate(steps):
            j = i % 8
            self.assertEqual((r["point"], r["instance"], r["seqs"]), ("0", "0", "1"))
            shape = (int(r["decode_tokens"]), int(r["prefill_tokens"]), float(r["decode_ctx"]), float(r["prefill_ctx"]))
            self.assertEqual(shape, (0, 20, 0, 210) if j == 0 else (1, 0, 20 + j, 0), r)
            self.assertAlmostEqual(float(r["seconds"]), 0.012 if j == 0 else 0.010, places=6)
            self.assertEqual(r["seconds"], r["predicted_s"])  # no dispersion in this profile
            if i == 0:
                self.assertEqual(r["idle_s"], "")
            elif j > 0:
                self.assertAlmostEqual(float(r["idle_s"]), 0, places=6)
                self.assertAlmostEqual(float(r["start_s"]), float(steps[i - 1]["start_s"]) + float(steps[i - 1]["seconds"]),
                                       places=5)
            else:  # 0.01 req/s: the next request comes long after
                self.assertGreater(float(r["idle_s"]), 0)
        for q in range(5):  # requests.csv's 6 digits
            arrival = float(reqs[q]["arrival_s"])
            self.assertAlmostEqual(float(steps[8 * q]["start_s"]), arrival + 0.002, delta=1e-5 * arrival + 1e-6)
        # The client-server path, when given, adds to every time.
        out2 = os.path.join(self.dir, "b")
        bench("--simulate", self.prof, "--request-rate", "0.01", "--num-prompts", "5", "--random-input-len", "20",
              "--random-output-len", "8", "--output-dir", out2, "--no-plots", "--sim-latency-ms", "3")
        self.assertAlmostEqual(float(self.points(out2)[0]["ttft_median_ms"]), 17.0, places=6)

    def test_load_sweep_is_deterministic_and_saturates(self):
        args = ["--simulate", self.prof, "--sweep-rate", "2,20,200", "--num-prompts", "300", "--random-input-len",
                "32", "--random-output-len", "16", "--no-plots", "--seed", "3", "-m", MODEL]
        a, b = os.path.join(self.dir, "a"), os.path.join(self.dir, "b")
        bench(*args, "--output-dir", a)
        bench(*args, "--output-dir", b)
        pa, pb = self.points(a), self.points(b)
        self.assertEqual(len(pa), 3)
        for x, y in zip(pa, pb):
            for k in ("ttft_p99_ms", "itl_p50_ms", "request_throughput"):
                self.assertEqual(x[k], y[k])
        # Throughput follows the offered load until the instance saturates,
        # and queueing shows up in TTFT.
        thr = [float(p["request_throughput"]) for p in pa]
        ttft = [float(p["ttft_p99_ms"]) for p in pa]
        self.assertAlmostEqual(thr[0], 2, delta=0.6)
        self.assertLess(thr[2], 200 * 0.5)
        self.assertLess(ttft[0], ttft[2])
        self.assertEqual(int(pa[2]["completed"]) + int(pa[2]["failed"]), 300)

    def test_step_noise(self):
        """A profile's dispersion: on by default, the same run for a seed,
        off on request; a profile without one simulates as before."""
        noisy = os.path.join(self.dir, "noisy.json")
        with open(self.prof) as fh:
            doc = json.load(fh)
        doc["step_noise"] = [[0, 0.5], [0.9, 1.0], [1, 3.0]]
        with open(noisy, "w") as fh:
            json.dump(doc, fh)
        args = ["--request-rate", "40", "--num-prompts", "200", "--random-input-len", "32", "--random-output-len",
                "16", "--no-plots", "-m", MODEL]
        got = {}
        for name, extra in (("on", ["--simulate", noisy, "--seed", "3"]), ("again", ["--simulate", noisy, "--seed", "3"]),
                            ("seed", ["--simulate", noisy, "--seed", "4"]),
                            ("draws", ["--simulate", noisy, "--seed", "3", "--sim-noise-seed", "1"]),
                            ("off", ["--simulate", noisy, "--seed", "3", "--sim-step-noise", "off"]),
                            ("plain", ["--simulate", self.prof, "--seed", "3"])):
            out = os.path.join(self.dir, name)
            bench(*extra, *args, "--output-dir", out)
            got[name] = self.points(out)[0]
        keys = ("ttft_median_ms", "ttft_p99_ms", "itl_median_ms", "itl_p99_ms")
        self.assertEqual([got["on"][k] for k in keys], [got["again"][k] for k in keys])
        self.assertEqual([got["off"][k] for k in keys], [got["plain"][k] for k in keys])
        self.assertNotEqual([got["on"][k] for k in keys], [got["off"][k] for k in keys])
        self.assertNotEqual([got["on"][k] for k in keys], [got["seed"][k] for k in keys])
        self.assertNotEqual([got["on"][k] for k in keys], [got["draws"][k] for k in keys])
        p = bench("--simulate", noisy, "--sim-step-noise", "maybe", "--no-plots", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("on or off", p.stderr)

    def test_trace(self):
        trace = os.path.join(self.dir, "t.csv")
        with open(trace, "w") as fh:
            fh.write("# a comment\narrival_s,prompt_tokens,output_tokens,priority\n")
            for i in range(30):
                fh.write(f"{100 + i * 1.0},{10 + i},{4},{'batch' if i % 2 else 'interactive'}\n")
        out = os.path.join(self.dir, "t")
        bench("--simulate", self.prof, "--trace", trace, "--output-dir", out, "--no-plots", "--save-detailed")
        pt = self.points(out)[0]
        self.assertEqual(int(pt["completed"]), 30)
        reqs = read_csv(os.path.join(out, "requests.csv"))
        self.assertEqual(sorted(int(r["prompt_tokens"]) for r in reqs), list(range(10, 40)))
        # Times start at the first arrival; 1 s apart: no queueing.
        self.assertAlmostEqual(float(pt["duration_s"]), 29 + 0.002 + 0.010 + 0.0001 * 39 + 3 * 0.010, places=6)
        # --sim-step-scale: every step costs twice the profile's prediction (the
        # 2 ms batching wait is no step's).
        out2 = os.path.join(self.dir, "t2")
        bench("--simulate", self.prof, "--trace", trace, "--output-dir", out2, "--no-plots", "--sim-step-scale", "2")
        self.assertAlmostEqual(float(self.points(out2)[0]["duration_s"]),
                               29 + 0.002 + 2 * (0.010 + 0.0001 * 39 + 3 * 0.010), places=6)
        # By kind: prompt steps twice, decode-only steps three times.
        bench("--simulate", self.prof, "--trace", trace, "--output-dir", out2, "--no-plots", "--sim-step-scale",
              "prompt=2,decode=3")
        self.assertAlmostEqual(float(self.points(out2)[0]["duration_s"]),
                               29 + 0.002 + 2 * (0.010 + 0.0001 * 39) + 3 * 3 * 0.010, places=6)
        for bad in (["--simulate", self.prof, "--sim-step-scale", "0"], ["--sim-step-scale", "2"],
                    ["--simulate", self.prof, "--sim-step-scale", "prompt=0"],
                    ["--simulate", self.prof, "--sim-step-scale", "2,decode=3"],
                    ["--simulate", self.prof, "--sim-step-scale", "batch=2"]):
            p = bench(*bad, "--no-plots", check=False)
            self.assertEqual(p.returncode, 2, p.stderr)
        # A JSONL trace, rescaled to 10 req/s by --request-rate.
        jtrace = os.path.join(self.dir, "t.jsonl")
        with open(jtrace, "w") as fh:
            for i in range(11):
                fh.write(json.dumps({"arrival": i * 2.0, "prompt_tokens": 8, "output_tokens": 2}) + "\n")
        out = os.path.join(self.dir, "j")
        bench("--simulate", self.prof, "--trace", jtrace, "--request-rate", "10", "--output-dir", out, "--no-plots")
        self.assertAlmostEqual(float(self.points(out)[0]["duration_s"]), 1.0 + 0.002 + 0.0108 + 0.010, places=6)
        # Bad traces name the line.
        with open(trace, "w") as fh:
            fh.write("0,10,4\n1,10,4\n0.5,10,4\n")
        p = bench("--simulate", self.prof, "--trace", trace, "--no-plots", "--output-dir", out, check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("t.csv:3: arrival", p.stderr)
        with open(trace, "w") as fh:
            fh.write("0,10,0\n")
        p = bench("--simulate", self.prof, "--trace", trace, "--no-plots", "--output-dir", out, check=False)
        self.assertIn("t.csv:1: prompt_tokens and output_tokens", p.stderr)

    def test_find_instances(self):
        out = os.path.join(self.dir, "f")
        # 10 ms a step, 5 ms a decode token, 0.5 ms a prompt token: one
        # instance cannot keep 4 req/s of 32+32 tokens under 60 ms a token.
        write_profile(self.prof, [0.010, 0.005, 0.0005, 0, 0])
        p = bench("--simulate", self.prof, "--find-instances", "12", "--sweep-rate", "4,8", "--num-prompts", "400",
                  "--random-input-len", "32", "--random-output-len", "32", "--slo-ttft-ms", "200",
                  "--slo-itl-ms", "60", "--output-dir", out, *([] if HAVE_GNUPLOT else ["--no-plots"]))
        rows = read_csv(os.path.join(out, "instances.csv"))
        needed = {float(r["request_rate"]): int(r["instances_needed"])
                  for r in read_csv(os.path.join(out, "needed.csv"))}
        self.assertEqual(set(needed), {4.0, 8.0})
        self.assertGreater(needed[4.0], 1)
        self.assertGreaterEqual(needed[8.0], needed[4.0])
        for rate, n in needed.items():
            at = {int(r["instances"]): r for r in rows if float(r["request_rate"]) == rate}
            self.assertEqual(at[n]["meets_slo"], "1")
            self.assertEqual(at[n - 1]["meets_slo"], "0")
            self.assertLessEqual(float(at[n]["ttft_p99_ms"]), 200)
        self.assertIn("instances needed", p.stdout)
        self.assertTrue(os.path.isdir(os.path.join(out, f"x{needed[8.0]}")))
        if HAVE_GNUPLOT:
            self.assertGreater(os.path.getsize(os.path.join(out, "instances.png")), 1000)

    def test_errors(self):
        bad = os.path.join(self.dir, "bad.json")
        with open(bad, "w") as fh:
            fh.write("{not json")
        p = bench("--simulate", bad, "--no-plots", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("bad.json: not JSON", p.stderr)
        write_profile(bad, [0.01, -1, 0, 0, 0])
        p = bench("--simulate", bad, "--no-plots", check=False)
        self.assertIn("\"per_decode_token\" is -1", p.stderr)
        p = bench("--simulate", self.prof, "--base-url", "http://127.0.0.1:1", check=False)
        self.assertIn("choose one target", p.stderr)
        p = bench("--simulate", self.prof, "--find-instances", "4", "--no-plots", check=False)
        self.assertIn("--slo-ttft-ms", p.stderr)
        p = bench("--in-process", "-m", MODEL, "--instances", "2", check=False)
        self.assertIn("belong to --simulate", p.stderr)
        p = bench("--simulate", self.prof, "--sim-slo-itl-ms", "interactive=fast", "--no-plots", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--sim-slo-itl-ms wants MS or interactive=MS,batch=MS", p.stderr)
        p = bench("--in-process", "-m", MODEL, "--sim-slo-ttft-ms", "500", check=False)
        self.assertIn("belong to --simulate", p.stderr)
        p = bench("--simulate", self.prof, "--sim-step-log", "--no-plots", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--sim-step-log writes into --output-dir", p.stderr)

    def test_server_targets(self):
        """--sim-slo-itl-ms runs the simulated servers as duet serve
        --slo-itl-ms would: long prompts joining running decodes are cut
        to the step budget, so the p99 ITL drops (and TTFT grows)."""
        prof = os.path.join(self.dir, "slo.json")
        write_profile(prof, [0.005, 0.001, 0.0005, 0, 0], n_ctx=2048)
        args = ["--simulate", prof, "--request-rate", "4", "--num-prompts", "60", "--random-input-len", "600",
                "--random-output-len", "40", "--random-range-ratio", "0.5", "--no-plots", "--seed", "1", "-m",
                MODEL]
        a, b = os.path.join(self.dir, "plain"), os.path.join(self.dir, "slo")
        bench(*args, "--output-dir", a)
        bench(*args, "--sim-slo-itl-ms", "40", "--output-dir", b)
        pa, pb = self.points(a)[0], self.points(b)[0]
        self.assertGreater(float(pa["itl_p99_ms"]), 60)
        self.assertLess(float(pb["itl_p99_ms"]), 40)
        self.assertGreater(float(pb["ttft_p50_ms"]), float(pa["ttft_p50_ms"]))

    def test_rate_profile(self):
        """--rate-profile on the virtual clock: arrivals follow the ramp (the
        timeline's windows), and --sim-static-knobs runs the same servers
        without the controller."""
        prof = os.path.join(self.dir, "ramp.json")
        write_profile(prof, [0.005, 0.001, 0.0005, 0, 0], n_ctx=2048)
        args = ["--simulate", prof, "--rate-profile", "0:2,20:30,40:2", "--timeline", "5", "--random-input-len",
                "100", "--random-output-len", "20", "--sim-slo-itl-ms", "40", "--no-plots", "--seed", "3",
                "--save-detailed", "-m", MODEL]
        for extra in ([], ["--sim-static-knobs"]):
            out = os.path.join(self.dir, "ramp" + "".join(extra))
            bench(*args, *extra, "--output-dir", out)
            with open(os.path.join(out, "timeline.csv")) as fh:
                win = list(csv.DictReader(fh))
            with open(os.path.join(out, "requests.csv")) as fh:
                reqs = list(csv.DictReader(fh))
            self.assertGreaterEqual(len(win), 8)
            self.assertEqual(sum(int(w["interactive_arrivals"]) + int(w["batch_arrivals"]) for w in win), len(reqs))
            # 640 expected in all: a Poisson count within 5 standard deviations.
            self.assertLess(abs(len(reqs) - 640), 5 * 640 ** 0.5, len(reqs))
            rates = [float(w["arrival_rate"]) for w in win[:8]]
            self.assertGreater(rates[3] + rates[4], 2 * (rates[0] + rates[7]), rates)
            self.assertTrue(all(r["ok"] == "1" for r in reqs))


class ServeStepCost(unittest.TestCase):
    """`duet serve --step-cost FILE`: a profile seeds the model the step
    budget uses; a broken one is refused with a message naming it."""

    def test_serve_step_cost(self):
        from duet_server import Server
        with tempfile.TemporaryDirectory() as d:
            bad = os.path.join(d, "bad.json")
            with open(bad, "w") as fh:
                fh.write("{not json")
            p = run([DUET, "serve", "-m", MODEL, "--port", "0", "--step-cost", bad], check=False, timeout=60)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("--step-cost", p.stderr)
            self.assertIn("bad.json", p.stderr)
            write_profile(bad, [0.01, -1, 0, 0, 0])
            p = run([DUET, "serve", "-m", MODEL, "--port", "0", "--step-cost", bad], check=False, timeout=60)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("per_decode_token", p.stderr)
            good = os.path.join(d, "good.json")
            write_profile(good, [0.002, 0.001, 0.0005, 0, 0])
            # A step log that cannot be written is refused, naming it.
            p = run([DUET, "serve", "-m", MODEL, "--port", "0", "--step-log", os.path.join(d, "no", "steps.csv")],
                    check=False, timeout=60)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("step log", p.stderr)
            self.assertIn("steps.csv", p.stderr)
            p = run([DUET, "serve", "-m", MODEL, "--port", "0", "--step-log", os.path.join(d, "s.csv"), "--instance",
                     "backend=cpu", "--instance", "backend=cpu"], check=False, timeout=60)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("--step-log", p.stderr)
            steps_csv = os.path.join(d, "steps.csv")
            srv = Server(DUET, MODEL, "--step-cost", good, "--slo-itl-ms", "25", "--step-log", steps_csv, ctx=256)
            try:
                import urllib.request
                body = json.dumps({"prompt": "Once upon a time", "max_tokens": 4}).encode()
                req = urllib.request.Request(srv.base + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    reply = json.load(r)
                    self.assertEqual(reply["object"], "text_completion")
                with urllib.request.urlopen(srv.base + "/metrics", timeout=60) as r:
                    metrics = r.read().decode()
                line = [x for x in metrics.splitlines()
                        if x.startswith("duet_step_budget_seconds{") and 'priority="interactive"' in x]
                self.assertEqual(len(line), 1, metrics[:2000])
                self.assertAlmostEqual(float(line[0].split()[-1]), 0.02, places=9)
                # The fleet path's /metrics carries each instance's step-cost
                # model: one sample per term, labelled with the instance.
                cost = [x for x in metrics.splitlines() if x.startswith("duet_step_cost_seconds{")]
                self.assertEqual(len(cost), 5, metrics[-3000:])
                self.assertTrue(all('instance="0"' in x and 'backend="cpu"' in x for x in cost), cost)
                steps = [x for x in metrics.splitlines() if x.startswith("duet_step_cost_steps_total{")]
                self.assertEqual(len(steps), 1, metrics[-3000:])
                self.assertGreater(float(steps[0].split()[-1]), 0)
                # Seeded by the profile: the served steps' seconds, the
                # profile's prediction for them (at least its 2 ms intercept
                # a step) and each step's ratio, a histogram.
                def one(name):
                    got = [x for x in metrics.splitlines() if x.startswith(name + "{")]
                    self.assertEqual(len(got), 1, metrics[-3000:])
                    self.assertIn('instance="0"', got[0])
                    return float(got[0].split()[-1])
                n = one("duet_step_cost_served_ratio_count")
                self.assertGreater(n, 0)
                self.assertGreater(one("duet_step_cost_served_seconds_total"), 0)
                self.assertGreaterEqual(one("duet_step_cost_profiled_seconds_total"), 0.002 * n * (1 - 1e-9))
                inf = [x for x in metrics.splitlines()
                       if x.startswith("duet_step_cost_served_ratio_bucket{") and 'le="+Inf"' in x]
                self.assertEqual([float(x.split()[-1]) for x in inf], [n])
                batch_steps = sum(float(x.split()[-1]) for x in metrics.splitlines()
                                  if x.startswith("duet_batch_size_count"))
                # An idle engine has written every step so far: a reader
                # between runs sees them all while the server runs on.
                deadline = time.time() + 30
                while True:
                    with open(steps_csv) as fh:
                        n_lines = sum(1 for _ in fh) - 1
                    if n_lines == batch_steps or time.time() > deadline:
                        break
                    time.sleep(0.05)
                self.assertEqual(n_lines, batch_steps)
            finally:
                rc, log = srv.stop()
            self.assertEqual(rc, 0, log)
            # The step log: a line for every step the metrics counted, the
            # request's prompt in prompt chunks and its later tokens in
            # decodes, the profile's prediction beside each (at least its
            # 2 ms intercept), and the learnt ones those the served-ratio
            # histogram counted.
            with open(steps_csv, newline="") as fh:
                rows = list(csv.DictReader(fh))
            self.assertEqual(len(rows), batch_steps)
            self.assertEqual(sum(int(r["prefill_tokens"]) for r in rows), reply["usage"]["prompt_tokens"])
            self.assertEqual(sum(int(r["decode_tokens"]) for r in rows), reply["usage"]["completion_tokens"] - 1)
            self.assertTrue(all(float(r["seconds"]) > 0 and float(r["profile_s"]) >= 0.002 for r in rows), rows)
            self.assertEqual(rows[0]["idle_s"], "")
            self.assertTrue(all(float(r["idle_s"]) >= 0 for r in rows[1:]), rows)
            self.assertEqual(sum(int(r["learnt"]) for r in rows), n)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
