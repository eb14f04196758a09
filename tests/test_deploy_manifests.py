#!/usr/bin/env python3
"""Checks tools/deploy offline: the Kubernetes manifests and the image's
entrypoint.

- Every built-in kind (the base's resources, the overlays rendered, the
  Prometheus adapter's ConfigMap) validates with the PyPI package
  kubernetes-validate, strict (unknown fields are errors), against the
  Kubernetes versions in K8S_VERSIONS (the schemas ship with the package).
- The InferencePool validates against INFERENCEPOOL_SCHEMA, written from the
  documented fields of inference.networking.k8s.io/v1 (Gateway API Inference
  Extension API reference: InferencePoolSpec, Port, EndpointPickerRef).
- The overlays are rendered here in Python: they use only JSON 6902 patches
  with targets (group/version/kind/name), which apply_json_patch implements.
  Where kubectl is installed (Debian 12 has no package for it), `kubectl
  kustomize` renders them too and must give the same objects.
- What the objects must agree on: probes on /ready and /health, a grace
  period that covers preStop + --drain-timeout + the 10 s cancel tail,
  Guaranteed QoS for the interactive tier and Burstable for batch, one GPU
  of the overlay's kind, references (PriorityClass, PVC, HPA target,
  InferencePool selector and port) that resolve.
- `duet serve` answers the probe paths and exports the metric names the
  manifests and the endpoint picker read.

usage: test_deploy_manifests.py DUET_BINARY SHARED_DIR BUILD_DIR
"""
import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

DUET, SHARED, BUILD = sys.argv[1], sys.argv[2], sys.argv[3]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "tools", "deploy")
K8S = os.path.join(DEPLOY, "k8s")
OVERLAYS = ("nvidia", "amd")
GPU_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
# The oldest Kubernetes these manifests support, and the newest the pinned
# kubernetes-validate (tools/bootstrap.sh) knows.
K8S_VERSIONS = ("1.31.0", "1.37.0")

try:
    import jsonschema
    import kubernetes_validate
    import yaml
except ImportError as e:  # CI installs them; a missing module is a failure, not a skip
    sys.exit(f"test_deploy_manifests.py: needs the PyPI packages kubernetes-validate and jsonschema ({e})")

# inference.networking.k8s.io/v1 InferencePool, from its API reference.
_LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
INFERENCEPOOL_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253}},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                # Pods of the pool's namespace, by labels only (like a Service's selector).
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {
                        "matchLabels": {"type": "object", "minProperties": 1, "additionalProperties": _LABEL_VALUE}
                    },
                },
                # Up to 8 ports, each podIP:number an endpoint; numbers unique.
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "uniqueItems": True,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["number"],
                        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
                    },
                },
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["number"],
                            "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
                        },
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    # The port is required when the picker is a Service (the default kind).
                    "if": {"anyOf": [{"not": {"required": ["kind"]}}, {"properties": {"kind": {"const": "Service"}}}]},
                    "then": {"required": ["name", "port"]},
                },
            },
        },
    },
}


def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def unescape(token):
    return token.replace("~1", "/").replace("~0", "~")


def apply_json_patch(doc, ops):
    """RFC 6902 add/replace/remove on doc (in place), as kustomize applies them."""
    for op in ops:
        parts = [unescape(t) for t in op["path"].lstrip("/").split("/")]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if op["op"] in ("add", "replace"):
            if isinstance(parent, list):
                i = len(parent) if last == "-" else int(last)
                if op["op"] == "add":
                    parent.insert(i, copy.deepcopy(op["value"]))
                else:
                    parent[i] = copy.deepcopy(op["value"])
            else:
                if op["op"] == "replace" and last not in parent:
                    raise KeyError(f"replace of a missing {op['path']}")
                parent[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        else:
            raise ValueError(f"patch op {op['op']} is not used by these overlays")
    return doc


def matches(target, doc):
    group, _, version = doc["apiVersion"].rpartition("/")
    return all(
        target.get(k) is None or target[k] == v
        for k, v in (("group", group), ("version", version), ("kind", doc["kind"]), ("name", doc["metadata"]["name"]))
    )


def render(path):
    """kustomize build of a kustomization that uses resources and JSON 6902 patches only."""
    with open(os.path.join(path, "kustomization.yaml")) as f:
        k = yaml.safe_load(f)
    unsupported = set(k) - {"apiVersion", "kind", "resources", "patches"}
    assert not unsupported, f"{path}: the Python renderer does not do {sorted(unsupported)}"
    docs = []
    for r in k.get("resources", []):
        full = os.path.join(path, r)
        docs += render(full) if os.path.isdir(full) else load_docs(full)
    for p in k.get("patches", []):
        assert set(p) == {"path", "target"}, f"{path}: only JSON 6902 patches with a target: {p}"
        with open(os.path.join(path, p["path"])) as f:
            ops = yaml.safe_load(f)
        hit = [d for d in docs if matches(p["target"], d)]
        assert hit, f"{path}: patch {p['path']} matches nothing"
        for d in hit:
            apply_json_patch(d, ops)
    return docs


def by_key(docs):
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container(dep):
    return dep["spec"]["template"]["spec"]["containers"][0]


def arg(c, name):
    a = c["args"]
    return a[a.index(name) + 1]


def quantity(q):
    """CPU or memory quantity as a float (enough for comparisons)."""
    q = str(q)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for u, f in units.items():
        if q.endswith(u):
            return float(q[: -len(u)]) * f
    return float(q)


class Manifests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.rendered = {o: render(os.path.join(K8S, "overlays", o)) for o in OVERLAYS}

    def validate_builtin(self, doc, where):
        for v in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, v, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                self.fail(f"{where}: {doc['kind']}/{doc['metadata']['name']} against Kubernetes {v}: {path}: {e.message}")

    def test_every_builtin_kind_validates(self):
        checked = set()
        files = [os.path.join(K8S, "base", f) for f in sorted(os.listdir(os.path.join(K8S, "base")))]
        files.append(os.path.join(K8S, "prometheus-adapter-rules.yaml"))
        for f in files:
            if os.path.basename(f) == "kustomization.yaml":
                continue
            for d in load_docs(f):
                if d["kind"] == "InferencePool":
                    continue
                self.validate_builtin(d, os.path.relpath(f, ROOT))
                checked.add(d["kind"])
        for o, docs in self.rendered.items():
            for d in docs:
                if d["kind"] != "InferencePool":
                    self.validate_builtin(d, f"overlay {o}")
        self.assertEqual(
            checked,
            {"PriorityClass", "PersistentVolumeClaim", "Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"},
        )

    def test_inferencepool_matches_its_documented_schema(self):
        pools = [d for o in OVERLAYS for d in self.rendered[o] if d["kind"] == "InferencePool"]
        self.assertEqual(len(pools), 2)
        for p in pools:
            jsonschema.validate(p, INFERENCEPOOL_SCHEMA)
        # The schema is not vacuous: it refuses what the API refuses.
        bad = copy.deepcopy(pools[0])
        del bad["spec"]["endpointPickerRef"]["port"]
        self.assertRaises(jsonschema.ValidationError, jsonschema.validate, bad, INFERENCEPOOL_SCHEMA)
        bad = copy.deepcopy(pools[0])
        bad["spec"]["targetPorts"] = [{"number": 8000}] * 9
        self.assertRaises(jsonschema.ValidationError, jsonschema.validate, bad, INFERENCEPOOL_SCHEMA)

    def test_kubectl_kustomize_agrees(self):
        kubectl = shutil.which("kubectl")
        if not kubectl:
            print("test_deploy_manifests: no kubectl; overlays rendered by the Python renderer only", file=sys.stderr)
            return
        for o in OVERLAYS:
            out = subprocess.run(
                [kubectl, "kustomize", os.path.join(K8S, "overlays", o)], capture_output=True, text=True, timeout=60
            )
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(by_key(yaml.safe_load_all(out.stdout)), by_key(self.rendered[o]), f"overlay {o}")

    def test_deployments_probes_drain_qos_and_gpus(self):
        for o, docs in self.rendered.items():
            objs = by_key(docs)
            deps = [d for d in docs if d["kind"] == "Deployment"]
            self.assertEqual(sorted(d["metadata"]["name"] for d in deps), [f"duet-batch-{o}", f"duet-interactive-{o}"])
            for d in deps:
                name, pod, c = d["metadata"]["name"], d["spec"]["template"]["spec"], container(d)
                self.assertEqual(c["readinessProbe"]["httpGet"]["path"], "/ready", name)
                self.assertEqual(c["livenessProbe"]["httpGet"]["path"], "/health", name)
                self.assertEqual(c["startupProbe"]["httpGet"]["path"], "/health", name)
                # SIGTERM comes after preStop; then the drain, then up to 10 s of cancelling.
                pre = c["lifecycle"]["preStop"]["sleep"]["seconds"]
                drain = float(arg(c, "--drain-timeout"))
                self.assertGreaterEqual(pod["terminationGracePeriodSeconds"], pre + drain + 10, name)
                self.assertTrue(arg(c, "--model").startswith("/models/"), name)
                mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/models")
                vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
                self.assertIn(("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]), objs)
                self.assertIn(("PriorityClass", pod["priorityClassName"]), objs)
                req, lim = c["resources"]["requests"], c["resources"]["limits"]
                gpu = GPU_RESOURCE[o]
                self.assertEqual((req.get(gpu), lim.get(gpu)), ("1", "1"), f"{name}: one {gpu}")
                self.assertFalse(any(g in lim for g in GPU_RESOURCE.values() if g != gpu), name)
                same = all(quantity(req[r]) == quantity(lim[r]) for r in ("cpu", "memory"))
                if "interactive" in name:  # Guaranteed: every request equals its limit
                    self.assertTrue(same, f"{name} must be Guaranteed")
                else:  # Burstable: requested below the limits
                    self.assertFalse(same, f"{name} must be Burstable")
                    self.assertTrue(all(quantity(req[r]) <= quantity(lim[r]) for r in ("cpu", "memory")), name)
                labels = d["spec"]["template"]["metadata"]["labels"]
                for k, v in d["spec"]["selector"]["matchLabels"].items():
                    self.assertEqual(labels.get(k), v, f"{name}: the selector must match its pods")
                port = next(p for p in c["ports"] if p["name"] == "http")["containerPort"]
                self.assertEqual(int(arg(c, "--port")), port, name)
        # The classes' Deployments may share a namespace: no selector takes
        # the other class's pods.
        for a, b in ((OVERLAYS[0], OVERLAYS[1]), (OVERLAYS[1], OVERLAYS[0])):
            for da in (d for d in self.rendered[a] if d["kind"] == "Deployment"):
                for db in (d for d in self.rendered[b] if d["kind"] == "Deployment"):
                    sel, labels = da["spec"]["selector"]["matchLabels"], db["spec"]["template"]["metadata"]["labels"]
                    self.assertFalse(all(labels.get(k) == v for k, v in sel.items()))

    def test_autoscaler_pool_and_priorities_resolve(self):
        with open(os.path.join(K8S, "prometheus-adapter-rules.yaml")) as f:
            rules = yaml.safe_load(yaml.safe_load(f)["data"]["config.yaml"])["rules"]
        for o, docs in self.rendered.items():
            objs = by_key(docs)
            hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
            target = objs[("Deployment", hpa["spec"]["scaleTargetRef"]["name"])]
            self.assertIn("interactive", target["metadata"]["name"])
            metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
            # The adapter's rule turns duet's gauge into the HPA's metric name.
            served = {
                re.sub(r["name"]["matches"], r["name"]["as"].replace("${1}", r"\1"), "vllm:num_requests_waiting")
                for r in rules
                if "vllm:num_requests_waiting" in r["seriesQuery"]
            }
            self.assertEqual(served, {metric})
            pool = objs[("InferencePool", "duet")]
            labels = target["spec"]["template"]["metadata"]["labels"]
            sel = pool["spec"]["selector"]["matchLabels"]
            self.assertTrue(all(labels.get(k) == v for k, v in sel.items()), "the pool selects the interactive pods")
            batch = objs[(f"Deployment", f"duet-batch-{o}")]["spec"]["template"]["metadata"]["labels"]
            self.assertFalse(all(batch.get(k) == v for k, v in sel.items()), "the pool leaves the batch pods out")
            port = next(p for p in container(target)["ports"] if p["name"] == "http")["containerPort"]
            self.assertEqual(pool["spec"]["targetPorts"], [{"number": port}])
            pcs = {n: d for (k, n), d in objs.items() if k == "PriorityClass"}
            self.assertGreater(pcs["duet-interactive"]["value"], pcs["duet-batch"]["value"])
            self.assertEqual(pcs["duet-batch"].get("preemptionPolicy"), "Never")


class Image(unittest.TestCase):
    def test_containerfile_installs_the_package_runtime_only_non_root(self):
        with open(os.path.join(DEPLOY, "Containerfile")) as f:
            text = f.read()
        stages = re.split(r"^FROM ", text, flags=re.M)[1:]
        self.assertEqual(len(stages), 2, "a build stage and a runtime stage")
        self.assertTrue(stages[0].startswith("docker.io/library/debian:12 "))
        run = stages[1]
        self.assertTrue(run.startswith("docker.io/library/debian:12"))
        for pkg in ("/tmp/debs/duet_*.deb", "libvulkan1", "ocl-icd-libopencl1", "mesa-vulkan-drivers", "pocl-opencl-icd"):
            self.assertIn(pkg, run)
        for dev in ("-dev ", "build-essential", "cmake"):
            self.assertNotIn(dev, run, "the runtime image holds no build tools")
        self.assertRegex(run, r"(?m)^USER 10001")
        self.assertIn("cpack -G DEB", stages[0])

    def test_entrypoint_runs_duet_with_its_arguments(self):
        with tempfile.TemporaryDirectory() as d:
            stub = os.path.join(d, "duet")
            with open(stub, "w") as f:
                f.write('#!/bin/sh\necho "args: $*"\n')
            os.chmod(stub, 0o755)
            env = {"PATH": f"{d}:/usr/bin:/bin", "DUET_ENTRYPOINT_QUIET": "1"}
            ep = os.path.join(DEPLOY, "entrypoint.sh")
            for argv, want in ((["serve", "--port", "9"], "serve --port 9"), (["--port", "9"], "serve --port 9"),
                               (["devices"], "devices")):
                out = subprocess.run(["sh", ep, *argv], env=env, capture_output=True, text=True, timeout=30)
                self.assertEqual((out.returncode, out.stdout.strip()), (0, f"args: {want}"), out.stderr)


class Server(unittest.TestCase):
    """The paths the probes use and the metrics the HPA and the endpoint picker read."""

    def test_probe_paths_and_metric_names(self):
        model = os.path.join(SHARED, "models", "stories260K.gguf")
        with tempfile.TemporaryFile() as log:
            p = subprocess.Popen(
                [DUET, "serve", "-m", model, "--backend", "cpu", "--port", "0", "-c", "256"], stdout=log, stderr=log
            )
            try:
                port, t0 = None, time.time()
                while port is None and time.time() - t0 < 60 and p.poll() is None:
                    log.seek(0)
                    m = re.search(rb" on http://[^:]+:(\d+)\n", log.read())
                    port = int(m.group(1)) if m else time.sleep(0.05)
                self.assertIsNotNone(port, "duet serve did not start")
                get = lambda path: urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
                self.assertEqual(get("/health").status, 200)
                self.assertEqual(get("/ready").status, 200)
                metrics = get("/metrics").read().decode()
                for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
                    self.assertTrue(re.search(rf"(?m)^{name}{{model_name=\"stories260K\"}} ", metrics), name)
                info = re.search(r'(?m)^vllm:cache_config_info\{[^}]*block_size="16"[^}]*num_gpu_blocks="\d+"', metrics)
                self.assertTrue(info, "vllm:cache_config_info with block_size and num_gpu_blocks")
            finally:
                p.terminate()
                p.wait(timeout=30)
            log.seek(0)
            self.assertIn(b"duet: ready in ", log.read())


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]], verbosity=1)
