#!/usr/bin/env python3
"""End-to-end tests of duet-bench: short sweeps on the tiny synthetic model,
in process (cpu backend) and over HTTP against a `duet serve` this test
starts, and a knob sweep through --serve-cmd. Each checks that the CSV,
JSON, markdown and plots exist and agree with each other: the percentiles in
points.csv are recomputed with numpy from requests.csv, the operating point
is re-chosen from points.csv, and the engine's batch-size histogram obeys
the max_batch_seqs knob.

usage: test_duet_bench.py DUET_BINARY SHARED_DIR BUILD_DIR
"""
import csv
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

DUET, SHARED, BUILD = sys.argv[1], sys.argv[2], sys.argv[3]
BENCH = os.path.join(BUILD, "duet-bench")

try:
    import numpy as np
except ImportError as e:  # CI installs it; a missing module is a failure, not a skip
    sys.exit(f"test_duet_bench.py: needs numpy ({e}); pip install numpy")

HAVE_GNUPLOT = shutil.which("gnuplot") is not None


def bench(*args, check=True, timeout=120):
    p = subprocess.run([BENCH, "--disable-tqdm", "--save-detailed", *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"duet-bench {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def num(s):
    return float(s) if s not in ("", None) else math.nan


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sweep(unittest.TestCase):
    """Helpers that check one results folder for consistency."""

    def check_folder(self, out, n_points, n_req, out_len, slo_ttft, slo_itl, plots=True):
        for f in ("points.csv", "requests.csv", "batch_hist.csv", "results.json", "summary.md"):
            self.assertTrue(os.path.isfile(os.path.join(out, f)), f"{f} missing in {out}")
        if HAVE_GNUPLOT and plots:
            for f in ("latency_throughput.png", "batch_size.png"):
                with open(os.path.join(out, f), "rb") as fh:
                    self.assertEqual(fh.read(8), b"\x89PNG\r\n\x1a\n", f"{f} is not a PNG")
        points = read_csv(os.path.join(out, "points.csv"))
        reqs = read_csv(os.path.join(out, "requests.csv"))
        with open(os.path.join(out, "results.json")) as fh:
            res = json.load(fh)
        self.assertEqual(len(points), n_points)
        self.assertEqual(len(res["points"]), n_points)
        meta = res["meta"]
        for key in ("device", "driver", "backend", "model", "commit", "started", "command", "workload", "engine"):
            self.assertIn(key, meta, f"results.json meta lacks {key}")
        self.assertTrue(meta["commit"] == "unknown" or len(meta["commit"]) >= 40, meta["commit"])
        for p in points:
            i = int(p["point"])
            self.assertEqual(int(p["completed"]), n_req, f"point {i}: all requests complete")
            self.assertEqual(int(p["failed"]), 0)
            self.assertEqual(p["device"], meta["device"])
            self.assertEqual(p["commit"], meta["commit"])
            # Knobs are recorded even when left at their defaults.
            self.assertNotEqual(p["max_batch_seqs"], "", f"point {i}: max_batch_seqs recorded")
            self.assertNotEqual(p["batch_timeout_ms"], "", f"point {i}: batch_timeout_ms recorded")
            rows = [r for r in reqs if int(r["point"]) == i]
            self.assertEqual(len(rows), n_req)
            out_tok = [int(r["output_tokens"]) for r in rows]
            self.assertTrue(all(t == out_len for t in out_tok), f"point {i}: every request made {out_len}: {out_tok}")
            for r in rows:
                self.assertEqual(r["ok"], "1")
                self.assertLessEqual(num(r["ttft_ms"]), num(r["e2el_ms"]) + 1e-6)
                self.assertLessEqual(int(r["itl_count"]), out_len - 1)
                self.assertGreaterEqual(num(r["sent_s"]), num(r["arrival_s"]) - 1e-6, "sent no earlier than due")
            # Throughput = output tokens / duration.
            dur = num(p["duration_s"])
            self.assertAlmostEqual(num(p["output_throughput"]), sum(out_tok) / dur, delta=1e-4 * sum(out_tok) / dur)
            # Percentiles recomputed with numpy from the per-request data.
            ttft = np.array([num(r["ttft_ms"]) for r in rows])
            for q in (50, 90, 99):
                want = float(np.percentile(ttft, q))
                got = num(p[f"ttft_p{q}_ms"])
                self.assertAlmostEqual(got, want, delta=1e-4 * max(1.0, abs(want)) + 1e-3,
                                       msg=f"point {i}: TTFT p{q} {got} vs numpy {want}")
            e2el = np.array([num(r["e2el_ms"]) for r in rows])
            self.assertAlmostEqual(num(p["e2el_mean_ms"]), float(e2el.mean()), delta=1e-3 * e2el.mean() + 1e-3)
            # The JSON holds the same numbers as the CSV.
            jp = res["points"][i]
            self.assertAlmostEqual(jp["output_throughput"], num(p["output_throughput"]),
                                   delta=1e-5 * num(p["output_throughput"]))
            self.assertAlmostEqual(jp["ttft_ms"]["p99"], num(p["ttft_p99_ms"]), delta=1e-4 * num(p["ttft_p99_ms"]))
        # The operating point, chosen again from points.csv.
        ok = [p for p in points
              if int(p["failed"]) == 0 and num(p["ttft_p99_ms"]) <= slo_ttft
              and (math.isnan(num(p["itl_p99_ms"])) or num(p["itl_p99_ms"]) <= slo_itl)]
        best = max(ok, key=lambda p: num(p["output_throughput"])) if ok else None
        flagged = [p for p in points if p["operating_point"] == "1"]
        if best is None:
            self.assertEqual(flagged, [])
            self.assertIsNone(res["operating_point"])
        else:
            self.assertEqual(len(flagged), 1)
            self.assertAlmostEqual(num(flagged[0]["output_throughput"]), num(best["output_throughput"]), delta=1e-6)
            self.assertEqual(res["operating_point"]["point"], int(flagged[0]["point"]))
        return points, reqs, res

    def check_batch_limit(self, out, points):
        """No engine step holds more sequences than the point's max_batch_seqs."""
        hist = read_csv(os.path.join(out, "batch_hist.csv"))
        for p in points:
            i = int(p["point"])
            rows = sorted(((num(h["batch_size_le"]), int(h["steps"])) for h in hist if int(h["point"]) == i))
            self.assertTrue(rows, f"point {i}: batch-size histogram from /metrics")
            self.assertGreater(sum(n for _, n in rows), 0, f"point {i}: engine steps counted")
            limit = int(p["max_batch_seqs"])
            # A bucket whose lower bound (the previous le) is >= limit holds only larger steps.
            too_big = sum(n for k, (le, n) in enumerate(rows) if k > 0 and rows[k - 1][0] >= limit)
            self.assertEqual(too_big, 0, f"point {i}: steps larger than max_batch_seqs={limit}: {rows}")
            self.assertLessEqual(num(p["mean_batch_size"]), limit + 1e-9)


class InProcess(Sweep):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.model = os.path.join(cls.tmp.name, "tiny.gguf")
        subprocess.run([DUET, "mkmodel", "--shape", "tiny", "--type", "f32", "--seed", "3", "-o", cls.model],
                       check=True, capture_output=True, timeout=60)

    def test_rate_and_knob_sweep(self):
        out = os.path.join(self.tmp.name, "inproc")
        # 32-token outputs: the tiny model's requests outlive the gaps of a
        # submitting thread starved of CPU (a parallel test), so the burst
        # batches (with 6 tokens, one cold CI run saw mean batch 1.23).
        p = bench("--in-process", "-m", self.model, "--backend", "cpu", "--threads", "1", "--num-prompts", "16",
                  "--random-input-len", "12", "--random-output-len", "32", "--sweep-rate", "200,inf",
                  "--sweep-max-batch-seqs", "1,8", "--batch-timeout-ms", "0", "--priority-mix", "1:1",
                  "--goodput", "ttft:10000", "e2el:20000", "--slo-ttft-ms", "10000", "--slo-itl-ms", "10000",
                  "--output-dir", out)
        points, reqs, res = self.check_folder(out, 4, 16, 32, 10000, 10000)
        self.assertIn("operating point", p.stdout)
        self.assertEqual(res["meta"]["backend"], "cpu")
        self.assertEqual(res["meta"]["mode"], "in-process")
        self.assertEqual(sorted({int(p["max_batch_seqs"]) for p in points}), [1, 8])
        self.assertEqual(sorted({p["request_rate"] for p in points}), ["200", "inf"])
        # Generous SLOs: every request is good, goodput = request throughput.
        for p in points:
            self.assertAlmostEqual(num(p["goodput"]), num(p["request_throughput"]), delta=1e-6)
        # The priority mix 1:1 alternates.
        pr = [r["priority"] for r in reqs if r["point"] == "0"]
        self.assertEqual(pr.count("interactive"), 8, pr)
        for p in points:
            self.assertEqual((p["interactive_completed"], p["batch_completed"]), ("8", "8"))
            both = [num(p["interactive_ttft_p99_ms"]), num(p["batch_ttft_p99_ms"])]
            self.assertTrue(all(v > 0 for v in both), f"p99 TTFT per priority class: {both}")
            self.assertLessEqual(min(both), num(p["ttft_p99_ms"]) + 1e-3, "a class's p99 <= the max of all")
        self.check_batch_limit(out, [p for p in points if p["max_batch_seqs"] == "1"])
        # Batching happened where it could: all at once with 8 slots.
        burst = [p for p in points if p["max_batch_seqs"] == "8" and p["request_rate"] == "inf"][0]
        self.assertGreater(num(burst["mean_batch_size"]), 1.5)
        self.assertGreater(num(burst["device_busy_ratio"]), 0)

    def test_impossible_targets_and_concurrency(self):
        out = os.path.join(self.tmp.name, "conc")
        p = bench("--in-process", "-m", self.model, "--backend", "cpu", "--threads", "1", "--num-prompts", "8",
                  "--random-input-len", "8", "--random-output-len", "4", "--sweep-concurrency", "1,2",
                  "--slo-ttft-ms", "0.000001", "--slo-itl-ms", "0.000001", "--output-dir", out, "--no-plots")
        self.assertIn("none meets the targets", p.stdout)
        points, reqs, res = self.check_folder(out, 2, 8, 4, 1e-6, 1e-6, plots=False)
        self.assertIsNone(res["operating_point"])
        # Closed loop at concurrency 1: requests never overlap.
        rows = sorted((r for r in reqs if r["point"] == "0"), key=lambda r: num(r["sent_s"]))
        for a, b in zip(rows, rows[1:]):
            self.assertGreaterEqual(num(b["sent_s"]) * 1e3, num(a["sent_s"]) * 1e3 + num(a["e2el_ms"]) - 1.0,
                                    "concurrency 1 sends the next request after the previous one ends")

    def test_all_devices(self):
        out = os.path.join(self.tmp.name, "all")
        bench("--in-process", "-m", self.model, "--all-devices", "--num-prompts", "4", "--random-input-len", "8",
              "--random-output-len", "4", "--warmup", "2", "--slo-ttft-ms", "10000", "--slo-itl-ms", "10000",
              "--output-dir", out, timeout=300)
        devs = json.loads(subprocess.run([DUET, "devices", "--json"], capture_output=True, text=True, check=True,
                                         timeout=60).stdout)
        with open(os.path.join(out, "comparison.md")) as fh:
            md = fh.read()
        rows = {}
        for line in md.splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if line.startswith("|") and len(cells) == 11 and cells[0] not in ("backend", "---"):
                rows.setdefault(cells[0], []).append(cells)
        for b in devs:
            name = b["backend"]
            self.assertIn(name, rows, f"comparison.md has a row for backend {name}")
            if not b["available"]:
                self.assertEqual(rows[name][0][3], "unavailable", f"{name}: {rows[name]}")
                self.assertIn(b["reason"][:40], md, "the reason a backend is unavailable is given")
            else:
                self.assertEqual(len(rows[name]), len(b["devices"]), f"{name}: one row per device")
                for r in rows[name]:
                    self.assertIn(r[3], ("ok", "incomplete", "unavailable"), r)
        self.assertEqual(rows["cpu"][0][3], "ok", "the cpu backend is measured")
        comp = read_csv(os.path.join(out, "comparison.csv"))
        self.assertTrue(any(r["backend"] == "cpu" and r["operating_point"] == "1" for r in comp))
        if HAVE_GNUPLOT:
            with open(os.path.join(out, "comparison.png"), "rb") as fh:
                self.assertEqual(fh.read(8), b"\x89PNG\r\n\x1a\n")

    def test_bad_arguments(self):
        p = bench(check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("choose one target", p.stderr)
        p = bench("--base-url", "http://127.0.0.1:9", "--sweep-max-batch-seqs", "1,2", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--serve-cmd", p.stderr)
        p = bench("--in-process", "-m", self.model, "--goodput", "latency:3", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("unknown metric", p.stderr)
        p = bench("--in-process", "-m", self.model, "--sweep-rate", "1,x", check=False)
        self.assertEqual(p.returncode, 2)


class Http(Sweep):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.model = os.path.join(cls.tmp.name, "tiny.gguf")
        subprocess.run([DUET, "mkmodel", "--shape", "tiny", "--type", "f32", "--seed", "3", "-o", cls.model],
                       check=True, capture_output=True, timeout=60)
        cls.port = free_port()
        cls.log = open(os.path.join(cls.tmp.name, "serve.log"), "w")
        cls.server = subprocess.Popen([DUET, "serve", "-m", cls.model, "--backend", "cpu", "--threads", "1",
                                       "--host", "127.0.0.1", "--port", str(cls.port)],
                                      stdout=cls.log, stderr=subprocess.STDOUT)
        cls.url = f"http://127.0.0.1:{cls.port}"
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(cls.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if cls.server.poll() is not None or time.time() > deadline:
                cls.log.close()
                with open(os.path.join(cls.tmp.name, "serve.log")) as fh:
                    raise AssertionError(f"duet serve did not come up:\n{fh.read()}")
            time.sleep(0.1)

    @classmethod
    def tearDownClass(cls):
        cls.server.send_signal(signal.SIGTERM)
        try:
            cls.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            cls.server.kill()
            cls.server.wait()
        cls.log.close()
        cls.tmp.cleanup()

    def test_http_concurrency_sweep(self):
        out = os.path.join(self.tmp.name, "http")
        # -m gives duet-bench the tokenizer: the prompts go as token ids.
        p = bench("--base-url", self.url, "-m", self.model, "--num-prompts", "12", "--random-input-len", "10",
                  "--random-output-len", "5", "--sweep-concurrency", "1,4", "--slo-ttft-ms", "5000",
                  "--slo-itl-ms", "5000", "--label", "tiny-on-cpu", "--output-dir", out)
        points, reqs, res = self.check_folder(out, 2, 12, 5, 5000, 5000)
        self.assertEqual(res["meta"]["mode"], "http")
        self.assertEqual(res["meta"]["device"], "tiny-on-cpu")
        for p in points:
            self.assertNotEqual(p["mean_batch_size"], "", "batch sizes read from the server's /metrics")
        # Prompt tokens come back in the usage chunk: the ids sent, as sent.
        self.assertTrue(all(int(r["prompt_tokens"]) == 10 for r in reqs), [r["prompt_tokens"] for r in reqs])

    def test_text_prompts_and_rate(self):
        out = os.path.join(self.tmp.name, "http-text")
        bench("--base-url", self.url, "--num-prompts", "8", "--random-input-len", "6", "--random-output-len", "3",
              "--request-rate", "100", "--slo-ttft-ms", "5000", "--slo-itl-ms", "5000", "--output-dir", out,
              "--no-plots")
        reqs = read_csv(os.path.join(out, "requests.csv"))
        self.assertEqual(len(reqs), 8)
        self.assertTrue(all(r["ok"] == "1" and int(r["output_tokens"]) == 3 for r in reqs))
        self.assertTrue(all(int(r["prompt_tokens"]) > 0 for r in reqs), "the server counted the text prompts")
        with open(os.path.join(out, "results.json")) as fh:
            served = json.load(fh)["meta"]["model"]
        self.assertTrue(served, "without -m the report names the model the server serves")

    def test_serve_cmd_knob_sweep(self):
        out = os.path.join(self.tmp.name, "served")
        cmd = f"'{DUET}' serve -m '{self.model}' --threads 1"
        bench("--serve-cmd", cmd, "--backend", "cpu", "-m", self.model, "--num-prompts", "8",
              "--random-input-len", "8", "--random-output-len", "4", "--sweep-max-batch-seqs", "1,4",
              "--slo-ttft-ms", "5000", "--slo-itl-ms", "5000", "--output-dir", out, "--no-plots")
        points = read_csv(os.path.join(out, "points.csv"))
        self.assertEqual([p["max_batch_seqs"] for p in points], ["1", "4"])
        with open(os.path.join(out, "results.json")) as fh:
            meta = json.load(fh)["meta"]
        self.assertEqual(meta["mode"], "http (--serve-cmd)")
        self.assertNotEqual(meta["device"], "unknown", "the cpu backend's device is named")
        self.assertTrue(all(int(p["completed"]) == 8 for p in points))
        self.check_batch_limit(out, points)

    def test_peer_side_by_side(self):
        # The same load against a server duet-bench starts and a running peer,
        # alternating point by point; one comparison table for both.
        out = os.path.join(self.tmp.name, "peer")
        cmd = f"'{DUET}' serve -m '{self.model}' --threads 1"
        p = bench("--serve-cmd", cmd, "--backend", "cpu", "-m", self.model, "--peer", f"other={self.url}",
                  "--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "3",
                  "--sweep-concurrency", "1,3", "--slo-ttft-ms", "5000", "--slo-itl-ms", "5000",
                  "--output-dir", out, "--no-plots")
        order = re.findall(r"=== load point (\d)/2: (\w+) ===", p.stdout)
        self.assertEqual(order, [("1", "duet"), ("1", "other"), ("2", "duet"), ("2", "other")])
        with open(os.path.join(out, "comparison.md")) as fh:
            md = fh.read()
        rows = [line for line in md.splitlines() if line.startswith("| ") and "](" in line]
        self.assertEqual(len(rows), 2, md)
        self.assertIn("| remote | other |", md)
        for sub in ("duet", "other"):
            points = read_csv(os.path.join(out, sub, "points.csv"))
            self.assertEqual([p["max_concurrency"] for p in points], ["1", "3"])
            self.assertTrue(all(int(p["completed"]) == 6 for p in points), points)
        comp = read_csv(os.path.join(out, "comparison.csv"))
        self.assertEqual(len(comp), 4)

    def test_rate_profile_timeline_and_static_knobs(self):
        # A ramp up and down against a server started with fixed knobs under
        # an ITL target: the timeline's windows follow the profile, and the
        # knobs sampled from /metrics are the configured ones throughout.
        out = os.path.join(self.tmp.name, "ramp")
        cmd = (f"'{DUET}' serve -m '{self.model}' --threads 1 --slo-itl-ms 2000 --static-knobs "
               "--step-budget-share 0.5")
        bench("--serve-cmd", cmd, "--backend", "cpu", "-m", self.model, "--rate-profile", "0:4,3:40,6:4",
              "--timeline", "1", "--random-input-len", "6", "--random-output-len", "3", "--max-batch-seqs", "6",
              "--output-dir", out, "--save-detailed", timeout=180)
        win = read_csv(os.path.join(out, "timeline.csv"))
        reqs = read_csv(os.path.join(out, "requests.csv"))
        self.assertGreaterEqual(len(win), 6)
        # The profile's own rate per window: the integral over the window.
        want = [4 + 6 * (2 * k + 1) for k in range(3)] + [40 - 6 * (2 * k + 1) for k in range(3)]
        for k in range(6):
            self.assertAlmostEqual(float(win[k]["profile_rate"]), want[k], places=6)
        arrived = sum(int(w["interactive_arrivals"]) + int(w["batch_arrivals"]) for w in win)
        self.assertEqual(arrived, len(reqs), "every request in one window")
        self.assertTrue(all(float(r["sent_s"]) < 6.5 for r in reqs), "nothing sent after the profile ends")
        # Poisson counts: the peak windows get more than the edges.
        peak = sum(float(win[k]["arrival_rate"]) for k in (2, 3))
        edge = sum(float(win[k]["arrival_rate"]) for k in (0, 5))
        self.assertGreater(peak, edge, [w["arrival_rate"] for w in win])
        sampled = [w for w in win if w["budget_share"] != ""]
        self.assertGreaterEqual(len(sampled), 4, "the knobs were sampled during the run")
        self.assertTrue(all(float(w["budget_share"]) == 0.5 and float(w["max_batch_seqs"]) == 6
                            for w in sampled), sampled)
        self.assertTrue(all(r["ok"] == "1" for r in reqs))
        if shutil.which("gnuplot"):
            self.assertTrue(os.path.getsize(os.path.join(out, "timeline.png")) > 0)
        p = bench("--base-url", self.url, "--rate-profile", "0:1,5:2", "--request-rate", "3", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--rate-profile is the load itself", p.stderr)
        p = bench("--base-url", self.url, "--rate-profile", "1:1,5:2", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("times start at 0", p.stderr)

    def test_peer_bad_arguments(self):
        p = bench("--base-url", self.url, "--peer", "nolabel", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("LABEL=http", p.stderr)
        p = bench("--in-process", "-m", self.model, "--peer", f"x={self.url}", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--base-url or --serve-cmd", p.stderr)
        # --per-instance: the instances of one running server, nothing else.
        for args in (("--in-process", "-m", self.model), ("--base-url", self.url, "--peer", f"x={self.url}")):
            p = bench(*args, "--per-instance", check=False)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("--per-instance compares the instances of one running duet server", p.stderr)
        p = bench("--base-url", "http://127.0.0.1:9", "--per-instance", check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--per-instance: GET http://127.0.0.1:9/v1/models failed", p.stderr)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
