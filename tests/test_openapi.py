#!/usr/bin/env python3
"""tools/openapi.json against a live `duet serve` (stories260K on the cpu
backend): the file is what GET /openapi.json serves, it names every
endpoint the server answers (and the server answers every path it names),
and PyPI `schemathesis` (pinned in tools/bootstrap.sh) generates requests
from it for every operation, checking that none gets a server error (5xx),
an undocumented status code or content type, or a response that violates
the schema. Bounded: a fixed number of examples per operation and a fixed
seed, so a run takes about a minute on two cores.

usage: test_openapi.py DUET_BINARY SHARED_DIR BUILD_DIR
"""
import json
import os
import re
import subprocess
import sys
import time
import unittest
import urllib.error
import urllib.request

DUET, SHARED, BUILD = sys.argv[1], sys.argv[2], sys.argv[3]
HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = os.path.join(HERE, "..", "tools", "openapi.json")
SERVER_C = os.path.join(HERE, "..", "tools", "server.c")
STORIES = os.path.join(SHARED, "models", "stories260K.gguf")
EXAMPLES = os.environ.get("DUET_SCHEMATHESIS_EXAMPLES", "30")

import duet_server  # tests/duet_server.py

try:
    import schemathesis  # noqa: F401 (the CLI below is its own)
except ImportError as e:  # CI installs it; a missing module is a failure, not a skip
    sys.exit(f"test_openapi.py: needs the PyPI package schemathesis ({e}); see tools/bootstrap.sh")


def Server():
    # A short context keeps the longest generated request (n=16, no
    # max_tokens) quick; the queue is long enough for schemathesis.
    return duet_server.Server(DUET, STORIES, ctx=128, start_timeout=60)


class OpenAPI(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server()
        with open(SPEC) as f:
            cls.spec = json.load(f)

    @classmethod
    def tearDownClass(cls):
        rc, log = cls.server.stop()
        if rc != 0:
            raise AssertionError(f"duet serve exited {rc} after SIGTERM:\n{log}")

    def status(self, method, path):
        req = urllib.request.Request(self.server.base + path, method=method, data=b"{}" if method == "POST" else None,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def test_served_file_is_the_repository_file(self):
        with urllib.request.urlopen(self.server.base + "/openapi.json") as r:
            self.assertEqual(r.headers["Content-Type"], "application/json")
            self.assertEqual(json.loads(r.read()), self.spec)

    def test_every_endpoint_is_described(self):
        # The server's routes (route_paths in tools/server.c) are the spec's paths.
        with open(SERVER_C) as f:
            src = f.read()
        table = re.search(r"route_paths\[N_ROUTES\] = \{(.*?)\};", src, re.S).group(1)
        routes = set(re.findall(r'"(/[^"]*)"', table))
        self.assertEqual(routes, set(self.spec["paths"]))
        for path, ops in self.spec["paths"].items():
            for method in ops:
                self.assertNotIn(self.status(method.upper(), path), (404, 405), f"{method} {path}")
        self.assertEqual(self.status("GET", "/v1/nothing"), 404)

    def test_schemathesis_finds_no_server_error_or_schema_violation(self):
        st = os.path.join(os.path.dirname(sys.executable), "st")
        cmd = [st, "run", SPEC, "--url", self.server.base, "--checks",
               "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
               "--max-examples", EXAMPLES, "--seed", "20261202", "--phases", "examples,coverage,fuzzing",
               "--request-timeout", "60", "--no-color",
               # The generated requests run on the server's one instance: a
               # random X-Duet-Instance name would only ever meet its 400
               # (test_instances.py checks pinning), not the body's checks.
               "-H", "X-Duet-Instance: 0"]
        t0 = time.time()
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        took = time.time() - t0
        print(r.stdout[-3000:])
        print(f"schemathesis: {took:.0f} s")
        self.assertEqual(r.returncode, 0, r.stdout[-12000:])


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
