"""One `duet serve` with cpu, Vulkan (lavapipe) and OpenCL (PoCL) instances
behind the router (issue 20): 64 concurrent greedy requests, each answered
with exactly the text a single-instance server of the backend that served it
gives for the same prompt, with requests on every instance; the per-instance
and router metrics parse with prometheus_client and add up. Then, on the
same server: GET /v1/models lists the instances; a request pinned to one
(X-Duet-Instance) is served there whatever its tier, with the same text,
and is counted in that instance's metrics; an unknown name gets 400; and
`duet-bench --per-instance` runs a short load against each instance in turn
and writes one table with a row per instance.

CI (DUET_REQUIRE_BACKENDS) fails when a backend cannot run; elsewhere the
backends that cannot run are left out (the test needs two)."""
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

DUET, SHARED, BUILD = sys.argv[1], sys.argv[2], sys.argv[3]
BENCH = os.path.join(BUILD, "duet-bench")
STORIES = os.path.join(SHARED, "models", "stories260K.gguf")

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as e:  # CI installs it; a missing module is a failure, not a skip
    sys.exit(f"test_instances.py: needs the PyPI package prometheus-client ({e})")

N_REQ = 64
MAX_TOKENS = 24
NAMES = ["Lily", "Tom", "Ben", "Sue", "Max", "Mia", "Sam", "Zoe"]
THINGS = ["ball", "cat", "tree", "boat", "cake", "dog", "sun", "box"]
PROMPTS = [f"Once upon a time, {NAMES[i % 8]} saw a {THINGS[i // 8]}" for i in range(N_REQ)]


class Server:
    def __init__(self, *args):
        self.log = tempfile.NamedTemporaryFile(prefix="duet-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([DUET, "serve", "-m", STORIES, "--port", "0", "-c", "256", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.port = None
        deadline = time.time() + 300
        while time.time() < deadline and self.port is None:
            if self.proc.poll() is not None:
                break
            m = re.search(r" on http://[^\s]*:(\d+)\n", self.text())
            if m:
                self.port = int(m.group(1))
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{self.port}"

    def text(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=120)
        log = self.text()
        os.unlink(self.log.name)
        return rc, log

    def complete(self, prompt, priority, pin=None):
        body = {"model": "stories260K", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "priority": priority}
        headers = {"Content-Type": "application/json"}
        if pin is not None:
            headers["X-Duet-Instance"] = pin
        req = urllib.request.Request(self.base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers=headers)
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())["choices"][0]["text"], resp.headers.get("X-Duet-Instance")

    def complete_all(self, workers):
        """Every prompt at once (`workers` client threads); [(text, instance)]."""
        out = [None] * N_REQ
        errors = []
        lock = threading.Lock()
        todo = list(range(N_REQ))

        def work():
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                try:
                    out[i] = self.complete(PROMPTS[i], "batch" if i % 2 else "interactive")
                except Exception as e:  # reported below, with the server's log
                    errors.append(f"request {i}: {e}")

        threads = [threading.Thread(target=work) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out, errors


def required(backend):
    return backend in (os.environ.get("DUET_REQUIRE_BACKENDS") or "").split(",")


class Instances(unittest.TestCase):
    def test_mixed_backends_answer_as_single_instances(self):
        # The reference: each backend alone, one instance.
        ref = {}
        for backend in ("cpu", "vulkan", "opencl"):
            server = Server("--backend", backend, "--max-batch-seqs", "16")
            if server.port is None:
                rc, log = server.stop()
                self.assertFalse(required(backend), f"{backend} is required but its server did not start:\n{log}")
                print(f"SKIP {backend}: its server did not start:\n{log[-400:]}")
                continue
            out, errors = server.complete_all(16)
            rc, log = server.stop()
            self.assertEqual(errors, [], log[-2000:])
            self.assertEqual(rc, 0, log[-2000:])
            ref[backend] = [text for text, _ in out]
        backends = list(ref)
        if len(backends) < 2:
            self.skipTest(f"needs two backends that run here; have {backends}")

        # One server, one instance per backend: the first interactive and
        # small, the others batch; interactive requests spill over to the
        # batch instances once the first holds 2 x 4.
        args = []
        for k, backend in enumerate(backends):
            tier = "interactive" if k == 0 else "batch"
            seqs = 4 if k == 0 else 8
            args += ["--instance", f"backend={backend},tier={tier},max-batch-seqs={seqs}"]
        server = Server(*args)
        self.assertIsNotNone(server.port, server.text())
        try:
            out, errors = server.complete_all(N_REQ)
            self.assertEqual(errors, [], server.text()[-2000:])
            served = {b: 0 for b in backends}
            for i, (text, inst) in enumerate(out):
                self.assertIsNotNone(inst, "the answer names its instance (X-Duet-Instance)")
                backend = backends[int(inst)]
                served[backend] += 1
                self.assertEqual(text, ref[backend][i],
                                 f"request {i} ({PROMPTS[i]!r}) on instance {inst} ({backend}) differs from "
                                 f"a single {backend} instance")
            print(f"instances: {N_REQ} concurrent requests served by {served}")
            for backend, n in served.items():
                self.assertGreater(n, 0, f"no request ran on the {backend} instance: {served}")

            with urllib.request.urlopen(server.base + "/metrics") as resp:
                fams = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
            info = fams["duet_instance_info"].samples
            self.assertEqual(sorted(s.labels["backend"] for s in info), sorted(backends))
            self.assertEqual({s.labels["tier"] for s in info}, {"interactive", "batch"})
            routed = {s.labels["backend"]: s.value for s in fams["duet_router_requests_routed"].samples
                      if s.name.endswith("_total")}
            self.assertEqual(routed, {b: float(n) for b, n in served.items()})
            finished = sum(s.value for s in fams["duet_instance_requests_finished"].samples
                           if s.name.endswith("_total"))
            self.assertEqual(finished, N_REQ)
            # The aggregate families are the single engine's, summed over the instances.
            ok = sum(s.value for s in fams["vllm:request_success"].samples if s.name.endswith("_total"))
            self.assertEqual(ok, N_REQ)
            gen = sum(s.value for s in fams["vllm:generation_tokens"].samples if s.name.endswith("_total"))
            self.assertEqual(gen, N_REQ * MAX_TOKENS)
            self.check_pinning(server, backends, ref, routed)
            self.check_bench_per_instance(server, backends)
        finally:
            rc, log = server.stop()
        self.assertEqual(rc, 0, log[-2000:])

    def counters(self, server, family):
        with urllib.request.urlopen(server.base + "/metrics") as resp:
            fams = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
        return {s.labels["instance"]: s.value for s in fams[family].samples if s.name.endswith("_total")}

    def check_pinning(self, server, backends, ref, routed_before):
        with urllib.request.urlopen(server.base + "/v1/models") as resp:
            insts = json.loads(resp.read())["data"][0]["instances"]
        self.assertEqual([i["name"] for i in insts], [str(k) for k in range(len(backends))])
        self.assertEqual([i["backend"] for i in insts], backends)
        self.assertEqual([i["tier"] for i in insts], ["interactive"] + ["batch"] * (len(backends) - 1))
        self.assertTrue(all(i["healthy"] and i["device"] for i in insts), insts)
        # Each instance, pinned, with a request of the other tier: served
        # there, the same text as a single instance of its backend.
        for k, backend in enumerate(backends):
            for i in (k, k + 8):
                text, inst = server.complete(PROMPTS[i], "batch" if k == 0 else "interactive", pin=str(k))
                self.assertEqual(inst, str(k), f"pinned to {k}, served by {inst}")
                self.assertEqual(text, ref[backend][i], f"request {i} pinned to {k} ({backend})")
        pinned = self.counters(server, "duet_router_requests_pinned")
        self.assertEqual(pinned, {str(k): 2.0 for k in range(len(backends))})
        routed = self.counters(server, "duet_router_requests_routed")
        for k, backend in enumerate(backends):
            self.assertEqual(routed[str(k)], routed_before[backend] + 2, "a pinned request is a routed one")
        # An unknown instance: 400 naming the ones there are; the server goes on.
        with self.assertRaises(urllib.error.HTTPError) as cm:
            server.complete(PROMPTS[0], "interactive", pin="no-such")
        self.assertEqual(cm.exception.code, 400)
        err = json.loads(cm.exception.read())["error"]
        self.assertIn("X-Duet-Instance", err["message"])
        self.assertIn(f"0 ({backends[0]}, interactive)", err["message"])
        text, _ = server.complete(PROMPTS[1], "batch")
        self.assertTrue(text)

    def check_bench_per_instance(self, server, backends):
        out = tempfile.mkdtemp(prefix="duet-bench-instances-")
        before = self.counters(server, "duet_router_requests_pinned")
        p = subprocess.run([BENCH, "--base-url", server.base, "--per-instance", "--num-prompts", "4",
                            "--random-input-len", "8", "--random-output-len", "4", "--warmup", "1",
                            "--sweep-concurrency", "1,4", "--no-plots", "--disable-tqdm", "--output-dir", out],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        # Point by point, each instance in turn.
        order = re.findall(r"=== load point (\d)/2: (\S+) ===", p.stdout)
        labels = [f"{k}-{b}-{'interactive' if k == 0 else 'batch'}" for k, b in enumerate(backends)]
        self.assertEqual(order, [(str(pt), lb) for pt in (1, 2) for lb in labels], p.stdout)
        with open(os.path.join(out, "comparison.md")) as fh:
            md = fh.read()
        rows = [line for line in md.splitlines() if line.startswith("| ") and "](" in line]
        self.assertEqual(len(rows), len(backends), md)
        for k, backend in enumerate(backends):
            self.assertTrue(rows[k].startswith(f"| {k} | {backend} | "), rows[k])
            self.assertIn(" | ok |", rows[k])
        with open(os.path.join(out, "comparison.csv"), newline="") as fh:
            comp = list(csv.DictReader(fh))
        self.assertEqual(len(comp), 2 * len(backends))
        for r in comp:
            self.assertEqual(r["backend"], backends[int(r["instance"])])
            self.assertEqual(r["max_batch_seqs"], "4" if r["instance"] == "0" else "8", "the instance's own knob")
            self.assertEqual(int(r["completed"]), 4)
            self.assertGreater(float(r["output_throughput"]), 0)
        # Every request duet-bench sent was pinned: per instance, at each of
        # the two points, a warm-up request and the 4 measured ones.
        after = self.counters(server, "duet_router_requests_pinned")
        self.assertEqual({k: after[k] - before[k] for k in after}, {str(k): 10.0 for k in range(len(backends))})
        shutil.rmtree(out)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
