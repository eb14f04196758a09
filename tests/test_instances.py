"""One `duet serve` with cpu, Vulkan (lavapipe) and OpenCL (PoCL) instances
behind the router (issue 20): 64 concurrent greedy requests, each answered
with exactly the text a single-instance server of the backend that served it
gives for the same prompt, with requests on every instance; the per-instance
and router metrics parse with prometheus_client and add up.

CI (DUET_REQUIRE_BACKENDS) fails when a backend cannot run; elsewhere the
backends that cannot run are left out (the test needs two)."""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

DUET, SHARED, BUILD = sys.argv[1], sys.argv[2], sys.argv[3]
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

    def complete(self, prompt, priority):
        body = {"model": "stories260K", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "priority": priority}
        req = urllib.request.Request(self.base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
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
        finally:
            rc, log = server.stop()
        self.assertEqual(rc, 0, log[-2000:])


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
