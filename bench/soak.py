#!/usr/bin/env python3
"""soak.py — a long-running load against `duet serve` that looks for leaks.

Not a CI test: it runs for --minutes (default 30) and then checks that the
server came back to where it started.

    python3 bench/soak.py                       # starts duet serve itself
    python3 bench/soak.py --minutes 3 --concurrency 32
    python3 bench/soak.py --url http://127.0.0.1:8000 [--pid PID]

Load: --concurrency client loops (threads, http.client), each drawing at
random one of
  - a streamed completion or chat completion (stream: true, max_tokens
    1..200), some of them cancelled by the client: the socket is closed
    (FIN or RST) after a random number of events, or before the response;
  - the same, not streamed (some cancelled while waiting);
  - a bad request: invalid JSON, wrong types, absurd max_tokens, unknown
    model, an oversized body (expected 400, 404 or 413).
429 (the queue is bounded by --max-waiting) and 503 count as rejected;
they are expected under load.

Every --interval seconds (default 10) it samples the server process (VmRSS,
open fds, threads from /proc/PID) and GET /metrics (KV cache usage,
running/waiting requests, the request counters).

At the end it stops the load, waits for the server to go idle and checks:
  rss_growth     VmRSS at the end of the load vs minute 5 (< 5%); runs
                 shorter than 10 minutes compare against the sample at
                 half the run instead, and say so;
  fds, threads,  back to their values before the load;
  kv_usage
  accounting     duet_server_requests_received_total equals the sum of
                 duet_server_requests_finished_total over its outcomes, and
                 both agree with what the client sent and saw: 400/404/413
                 (any 4xx) are invalid, 429/503 rejected, 5xx or an error event
                 failed, a client close cancelled. A cancel can race the
                 request's own end, so the server may count fewer cancelled
                 and more stop/length than the client; the sums must match.
                 A request closed before any response may never have been
                 read whole by the server (a reset drops unread data): up
                 to that many may be missing from received.
                 Counters are compared as deltas from before the load, so a
                 server attached with --url may have served earlier traffic.
plus: no transport errors (resets, timeouts) on requests the client did not
cancel, every bad request refused with 4xx, no failed requests, the server
still alive and (when started here) a clean exit on SIGTERM.

RSS and 9 MiB bodies: the oversized requests (a few per minute) are buffered
up to the server's 8 MiB body limit before the 413; glibc then seems to keep
about 8 MiB in each malloc arena the connection threads use, so VmRSS
climbs in 8 MiB steps to a plateau (~150 MiB on 2 cores) within the first
minutes. That is why rss_growth starts at minute 5; --no-oversize leaves
these requests out (VmRSS then stays near 24 MiB with stories260K).

It writes a JSON result (samples, checks, client counts, duet's git commit,
the CPU model) to --out (default bench/results/soak-<date>.json), prints a
summary, and exits 1 when a check fails (2 when it could not run at all).
Python 3 standard library only.
"""

import argparse
import datetime
import http.client
import json
import os
import random
import re
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

OUTCOMES = ("stop", "length", "cancelled", "failed", "rejected", "invalid")
RECEIVED = "duet_server_requests_received_total"
FINISHED = "duet_server_requests_finished_total"

PROMPTS = [
    "Once upon a time",
    "One day, a little girl named Lily",
    "The cat sat on the mat and",
    "Tom and his dog went to the park.",
    "There was a big tree in the garden",
    "Sue wanted to play with her ball, but",
    "x",
    "The sun was shining and the birds",
]


# ---- /proc and /metrics ---------------------------------------------------


def proc_stats(pid):
    """VmRSS (KiB), open fds and threads of pid, or None when it is gone."""
    try:
        rss = threads = None
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return {"rss_kb": rss, "fds": fds, "threads": threads}
    except (OSError, ValueError):
        return None


def pid_listening_on(port):
    """The pid of the local process listening on TCP port, or None."""
    inodes = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    p = line.split()
                    if int(p[1].rsplit(":", 1)[1], 16) == port and p[3] == "0A":  # LISTEN
                        inodes.add(p[9])
        except (OSError, StopIteration, IndexError, ValueError):
            pass
    if not inodes:
        return None
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{d}/fd"):
                link = os.readlink(f"/proc/{d}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(d)
        except OSError:
            continue
    return None


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text):
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), v))
    return out


def msum(series, name, **labels):
    """Sum of the samples of `name` whose labels include `labels`; None when absent."""
    total, found = 0.0, False
    for n, l, v in series:
        if n == name and all(l.get(k) == x for k, x in labels.items()):
            total += v
            found = True
    return total if found else None


def mby(series, name, label):
    """{label value: sum} over the samples of `name`."""
    out = {}
    for n, l, v in series:
        if n == name:
            out[l.get(label, "")] = out.get(l.get(label, ""), 0.0) + v
    return out


def metrics_summary(series):
    """The few numbers soak looks at, from one /metrics scrape."""
    kv = msum(series, "vllm:kv_cache_usage_perc")
    if kv is None:
        kv = msum(series, "duet_kv_cache_usage_ratio")
    running = msum(series, "vllm:num_requests_running")
    waiting = msum(series, "vllm:num_requests_waiting")
    if running is None:
        running = msum(series, "duet_requests_running")
    if waiting is None:
        waiting = msum(series, "duet_requests_waiting")
    received = msum(series, RECEIVED)
    finished = mby(series, FINISHED, "outcome") if msum(series, FINISHED) is not None else None
    return {
        "kv_usage": kv,
        "running": running,
        "waiting": waiting,
        "received": received,
        "finished": finished,
        "engine_requests": mby(series, "duet_requests_total", "status"),
        "http": {
            f"{l.get('path')} {l.get('code')}": v
            for n, l, v in series
            if n == "duet_http_requests_total" and v
        },
        "generation_tokens": msum(series, "duet_generation_tokens_total"),
    }


# ---- the client -------------------------------------------------------------


class Stats:
    """What the client sent and saw; shared by the loops under one lock."""

    def __init__(self):
        self.mu = threading.Lock()
        self.sent = 0  # requests to /v1/completions and /v1/chat/completions
        self.by_kind = {}  # kind -> count
        self.status = {}  # HTTP status (str) -> count
        self.outcome = {k: 0 for k in OUTCOMES}
        self.outcome["transport_error"] = 0
        self.cancel_planned = 0  # cancels drawn
        self.cancel_outran = 0  # the request ended before the planned cancel point
        self.cancel_unanswered = 0  # closed before any response: the server may not have read it whole
        self.bad_unexpected = []  # bad requests not refused with 4xx (first 20)
        self.bad_unexpected_by = {}  # "kind status request" -> count, all of them
        self.errors = []  # transport errors and oddities (first 30)
        self.n_errors = 0
        self.stream_events = 0
        self.tokens_seen = 0

    def add(self, kind, outcome, status=None, **extra):
        with self.mu:
            self.sent += 1
            self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
            self.outcome[outcome] += 1
            if status is not None:
                self.status[str(status)] = self.status.get(str(status), 0) + 1
            for k, v in extra.items():
                setattr(self, k, getattr(self, k) + v)

    def note(self, what):
        with self.mu:
            self.n_errors += 1
            if len(self.errors) < 30:
                self.errors.append(what)

    def snapshot(self):
        with self.mu:
            return {
                "sent": self.sent,
                "by_kind": dict(self.by_kind),
                "status": dict(self.status),
                "outcome": dict(self.outcome),
                "cancel_planned": self.cancel_planned,
                "cancel_outran": self.cancel_outran,
                "cancel_unanswered": self.cancel_unanswered,
                "stream_events": self.stream_events,
                "tokens_seen": self.tokens_seen,
                "bad_unexpected": list(self.bad_unexpected),
                "bad_unexpected_by": dict(self.bad_unexpected_by),
                "n_errors": self.n_errors,
                "errors": list(self.errors),
            }


def outcome_of_status(code):
    """The outcome the server should book for a refusal with this status:
    429/503 rejected, other 4xx (400, 404, 413, ...) invalid, 5xx failed."""
    if code in (429, 503):
        return "rejected"
    if 400 <= code < 500:
        return "invalid"
    return "failed"


class Loop(threading.Thread):
    """One client loop: draws a request, sends it, records what happened."""

    TIMEOUT = 300.0  # a request that takes longer than this is a hang

    def __init__(self, idx, host, port, model, stop, stats, seed, oversize=True):
        super().__init__(name=f"loop{idx}", daemon=True)
        self.oversize = oversize
        self.host, self.port, self.model = host, port, model
        self.stop, self.stats = stop, stats
        self.rng = random.Random(seed)
        self.conn = None

    # -- connections --

    def connection(self):
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.TIMEOUT)
        return self.conn

    def drop(self, reset=False):
        c, self.conn = self.conn, None
        if c is None:
            return
        try:
            if reset and c.sock is not None:
                c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        c.close()

    # -- requests --

    def body(self, chat, stream):
        r = self.rng
        b = {"max_tokens": r.randint(1, 200)}
        if chat:
            msgs = []
            if r.random() < 0.3:
                msgs.append({"role": "system", "content": "You tell short stories."})
            msgs.append({"role": "user", "content": r.choice(PROMPTS)})
            b["messages"] = msgs
        else:
            b["prompt"] = r.choice(PROMPTS)
        if r.random() < 0.7:
            b["model"] = self.model
        if stream:
            b["stream"] = True
            if r.random() < 0.3:
                b["stream_options"] = {"include_usage": True}
        if r.random() < 0.5:
            b["temperature"] = round(r.uniform(0, 1.5), 2)
        if r.random() < 0.2:
            b["seed"] = r.randint(0, 1 << 31)
        if r.random() < 0.2:
            b["stop"] = r.choice([".", ["\n", "!"], " the", "Lily"])
        if r.random() < 0.15:
            b["priority"] = r.choice(["interactive", "batch", 0, 5])
        if r.random() < 0.1:
            b["ignore_eos"] = True
        return json.dumps(b).encode()

    def bad_body(self):
        """(kind, body, endpoint) of a request the server must refuse."""
        r = self.rng
        chat = r.random() < 0.4
        base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "Once upon a time"}
        k = r.choice(["json", "json", "type", "type", "max_tokens", "max_tokens", "model", "model", "empty", "big"])
        if k == "big" and (not self.oversize or r.random() < 0.8):  # 9 MB bodies: rare
            k = "type"
        if k == "json":
            body = r.choice([b'{"prompt": "abc", ', b"{", b"not json", b'{"prompt": "a"}}', b'{"prompt":"\\x"}'])
        elif k == "empty":
            body = r.choice([b"", b"[]", b"null", b"[1,2]", b"{}"])
        elif k == "type":
            b = dict(base)
            key, val = r.choice(
                [("max_tokens", "ten"), ("stream", "yes"), ("temperature", "hot"), ("n", [1]),
                 ("stop", 5), ("model", 7), ("seed", "x"), ("priority", "urgent"),
                 ("prompt" if not chat else "messages", 5), ("stream_options", True)]
            )
            b[key] = val
            body = json.dumps(b).encode()
        elif k == "max_tokens":
            b = dict(base)
            b["max_tokens"] = r.choice([0, -1, -(10 ** 9), 10 ** 9, 10 ** 12, 1e30, 100000, 4097, 2.5])
            if r.random() < 0.5:
                b["stream"] = True
            body = json.dumps(b).encode()
        elif k == "model":
            b = dict(base)
            b["model"] = r.choice(["gpt-4", "nope", "", self.model + "-x", "../" + self.model])
            if r.random() < 0.5:
                b["stream"] = True
            body = json.dumps(b).encode()
        else:  # big: past the server's 8 MiB body limit
            body = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
        return "bad_" + k, body, "/v1/chat/completions" if chat else "/v1/completions"

    def send(self, path, body):
        c = self.connection()
        c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        return c

    def one(self):
        r = self.rng
        x = r.random()
        if x < 0.12:
            return self.bad()
        chat = r.random() < 0.45
        stream = r.random() < 0.7
        path = "/v1/chat/completions" if chat else "/v1/completions"
        kind = ("chat" if chat else "cmpl") + ("_stream" if stream else "")
        body = self.body(chat, stream)
        cancel_at = None  # events after which to close; -1: before the response
        if r.random() < 0.25:
            cancel_at = -1 if (not stream or r.random() < 0.15) else r.randint(0, 60)
            kind += "_cancel"
            with self.stats.mu:
                self.stats.cancel_planned += 1
        reset = r.random() < 0.5
        if self.conn is not None and r.random() < 0.4:
            self.drop()
        try:
            c = self.send(path, body)
        except OSError as e:
            # The request may not have reached the server; a fresh
            # connection is used for every retry.
            self.drop()
            self.stats.note(f"{kind}: send failed: {e!r}")
            self.stats.add(kind, "transport_error")
            return
        try:
            if cancel_at == -1:
                c.sock.settimeout(r.uniform(0.0, 0.5))
                try:
                    resp = c.getresponse()
                except (socket.timeout, TimeoutError):
                    self.drop(reset)
                    self.stats.add(kind, "cancelled", cancel_unanswered=1)
                    return
                if c.sock is not None:
                    c.sock.settimeout(self.TIMEOUT)
                if not stream:  # a stream counts below, when it ends
                    with self.stats.mu:
                        self.stats.cancel_outran += 1
            else:
                resp = c.getresponse()
            if resp.status != 200:
                data = resp.read()
                oc = outcome_of_status(resp.status)
                if resp.status not in (429, 503):  # a good request refused: worth a look
                    self.stats.note(f"{kind}: HTTP {resp.status}: {data[:200]!r}")
                self.stats.add(kind, oc, resp.status)
                if resp.will_close:
                    self.drop()
                if oc == "rejected":  # back off, as a client honouring Retry-After would
                    time.sleep(r.uniform(0.1, 1.0))
                return
            if not stream:
                data = resp.read()
                try:
                    fin = json.loads(data)["choices"][0]["finish_reason"]
                except (ValueError, KeyError, IndexError, TypeError):
                    fin = None
                if fin not in ("stop", "length"):
                    self.stats.note(f"{kind}: 200 with finish_reason {fin!r}: {data[:200]!r}")
                    self.stats.add(kind, "failed", 200)
                else:
                    self.stats.add(kind, fin, 200)
                if resp.will_close or r.random() < 0.3:
                    self.drop()
                return
            # Streamed.
            events = tokens = 0
            fin = None
            failed = False
            done = False
            while True:
                if cancel_at is not None and cancel_at >= 0 and events >= cancel_at and fin is None:
                    self.drop(reset)
                    self.stats.add(kind, "cancelled", 200, stream_events=events, tokens_seen=tokens)
                    return
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    rest = resp.read()  # the chunked body's end: the connection can be reused
                    if rest.strip():
                        self.stats.note(f"{kind}: data after [DONE]: {rest[:200]!r}")
                    break
                events += 1
                try:
                    ev = json.loads(payload)
                except ValueError:
                    self.stats.note(f"{kind}: bad event {payload[:200]!r}")
                    failed = True
                    continue
                if "error" in ev:
                    self.stats.note(f"{kind}: error event {payload[:200]!r}")
                    failed = True
                    continue
                for ch in ev.get("choices") or []:
                    if ch.get("text") or (ch.get("delta") or {}).get("content"):
                        tokens += 1
                    if ch.get("finish_reason"):
                        fin = ch["finish_reason"]
            if cancel_at is not None:
                with self.stats.mu:
                    self.stats.cancel_outran += 1
            if failed:
                oc = "failed"
            elif not done:
                self.stats.note(f"{kind}: stream ended without [DONE] after {events} events (finish {fin!r})")
                oc = "transport_error"
            elif fin in ("stop", "length"):
                oc = fin
            else:
                self.stats.note(f"{kind}: stream ended with finish_reason {fin!r}")
                oc = "failed"
            self.stats.add(kind, oc, 200, stream_events=events, tokens_seen=tokens)
            if resp.will_close or oc != fin or r.random() < 0.3:
                self.drop()
        except (OSError, http.client.HTTPException) as e:
            self.drop()
            self.stats.note(f"{kind}: {e!r}")
            self.stats.add(kind, "transport_error")

    def early_status(self, path, body):
        """Sends a body past the server's limit over a raw socket: the server
        may answer 413 at the headers and close while the body is still going
        out (a broken pipe here), so the answer is read whatever the send did."""
        sock = socket.create_connection((self.host, self.port), timeout=self.TIMEOUT)
        try:
            head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
            try:
                sock.sendall(head + body)
            except OSError:
                pass  # refused early: the status is already in the receive buffer
            data = b""
            while b"\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
            line = data.split(b"\r\n", 1)[0].split()
            return int(line[1]) if len(line) >= 2 and line[1].isdigit() else None
        finally:
            sock.close()

    def bad(self):
        kind, body, path = self.bad_body()
        self.drop()  # a fresh connection: the server may close it after an error
        if kind == "bad_big":
            try:
                status = self.early_status(path, body)
            except OSError as e:
                status = None
                self.stats.note(f"{kind}: {e!r}")
            if status is None:
                self.stats.add(kind, "transport_error")
            elif status in (400, 404, 413, 429, 503):
                self.stats.add(kind, "invalid" if status < 429 else "rejected", status)
            else:
                self.stats.add(kind, outcome_of_status(status), status)
                with self.stats.mu:
                    key = f"{kind} -> {status}"
                    self.stats.bad_unexpected_by[key] = self.stats.bad_unexpected_by.get(key, 0) + 1
                    if len(self.stats.bad_unexpected) < 20:
                        self.stats.bad_unexpected.append(key)
            return
        try:
            c = self.send(path, body)
            resp = c.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            self.drop()
            self.stats.note(f"{kind}: {e!r}")
            self.stats.add(kind, "transport_error")
            return
        self.drop()
        if resp.status in (400, 404, 413):
            self.stats.add(kind, "invalid", resp.status)
            return
        if resp.status in (429, 503):
            self.stats.add(kind, "rejected", resp.status)
            return
        with self.stats.mu:
            key = f"{kind} -> {resp.status}: {body[:60].decode('utf-8', 'replace')}"
            self.stats.bad_unexpected_by[key] = self.stats.bad_unexpected_by.get(key, 0) + 1
            if len(self.stats.bad_unexpected) < 20:
                self.stats.bad_unexpected.append(
                    {"kind": kind, "status": resp.status, "request": body[:200].decode("utf-8", "replace"),
                     "response": data[:300].decode("utf-8", "replace")}
                )
        if resp.status == 200:
            # Accepted: the server ran it, so it finished as stop/length
            # (or the stream's own finish); keep the books straight.
            fin = "stop"
            try:
                fin = json.loads(data)["choices"][0]["finish_reason"]
            except (ValueError, KeyError, IndexError, TypeError):
                m = re.findall(rb'"finish_reason":"(\w+)"', data)
                fin = m[-1].decode() if m else "failed"
            self.stats.add(kind, fin if fin in ("stop", "length") else "failed", 200)
        else:
            self.stats.add(kind, outcome_of_status(resp.status), resp.status)

    def run(self):
        while not self.stop.is_set():
            try:
                self.one()
            except Exception as e:  # a bug here must not stop the loop silently
                self.drop()
                self.stats.note(f"client exception: {e!r}")
        self.drop()


# ---- the harness ------------------------------------------------------------


def http_get(host, port, path, timeout=30.0):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request("GET", path, headers={"Connection": "close"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def scrape(host, port):
    st, body = http_get(host, port, "/metrics")
    if st != 200:
        raise RuntimeError(f"GET /metrics: HTTP {st}")
    return parse_prometheus(body.decode("utf-8", "replace"))


def git_commit():
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no", "--", "core",
                                "tools", "backends", "kernels", "CMakeLists.txt"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return {"commit": head or None, "dirty": bool(dirty), "dirty_files": dirty.splitlines()[:20]}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}


def machine():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        for line in out.splitlines():
            if line.strip().lower().startswith("model name"):
                return {"cpu": line.split(":", 1)[1].strip(), "cores": os.cpu_count()}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": None, "cores": os.cpu_count()}


def start_server(args, log_path):
    cmd = [args.duet, "serve", "-m", args.model, "--backend", "cpu", "--port", "0",
           "--max-waiting", str(args.max_waiting)] + shlex.split(args.server_args)
    log = open(log_path, "wb")
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    log.close()
    pat = re.compile(r" on http://(\[[^\]]+\]|[^\s:/]+):(\d+)")
    deadline = time.time() + 120
    while time.time() < deadline:
        with open(log_path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
        m = pat.search(text)
        if m:
            host = m.group(1).strip("[]")
            if host in ("0.0.0.0", "::"):
                host = "127.0.0.1"
            return p, cmd, host, int(m.group(2))
        if p.poll() is not None:
            raise RuntimeError(f"duet serve exited with {p.returncode}:\n{text[-2000:]}")
        time.sleep(0.1)
    p.kill()
    raise RuntimeError("duet serve printed no address within 120 s")


def log_tail(path, n=40):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace").splitlines()[-n:]
    except OSError:
        return []


def take_sample(t0, host, port, pid, stats, phase):
    s = {"t": round(time.time() - t0, 1), "phase": phase}
    if pid:
        ps = proc_stats(pid)
        s.update(ps if ps else {"rss_kb": None, "fds": None, "threads": None, "gone": True})
    try:
        s.update(metrics_summary(scrape(host, port)))
    except (OSError, http.client.HTTPException, RuntimeError) as e:
        s["metrics_error"] = repr(e)
    c = stats.snapshot()
    s["client"] = {"sent": c["sent"], "outcome": c["outcome"]}
    return s


def fmt_kb(kb):
    return "?" if kb is None else f"{kb / 1024:.1f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--minutes", type=float, default=30.0, help="load duration (default 30)")
    ap.add_argument("--concurrency", type=int, default=32, help="client loops (default 32)")
    ap.add_argument("--url", help="attach to a running server instead of starting one")
    ap.add_argument("--pid", type=int, help="with --url: the server's pid (default: found from the listening port)")
    ap.add_argument("--duet", default=os.path.join(ROOT, "build", "duet"), help="duet binary (default build/duet)")
    ap.add_argument("--model", default=os.path.normpath(os.path.join(ROOT, "..", "shared", "models",
                                                                     "stories260K.gguf")),
                    help="GGUF model (default ../shared/models/stories260K.gguf)")
    ap.add_argument("--max-waiting", type=int, default=12,
                    help="duet serve --max-waiting (default 12: with 32 loops and 16 batch slots some "
                         "requests get 429)")
    ap.add_argument("--server-args", default="", help="more duet serve options, one string")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between samples (default 10)")
    ap.add_argument("--idle-timeout", type=float, default=120.0,
                    help="seconds to wait for the server to settle after the load (default 120)")
    ap.add_argument("--rss-limit", type=float, default=0.05, help="allowed RSS growth (default 0.05)")
    ap.add_argument("--no-oversize", action="store_true", help="send no 9 MiB bodies (the 413 case)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock)")
    ap.add_argument("--out", help="JSON result (default bench/results/soak-<date>.json)")
    args = ap.parse_args()

    started = datetime.datetime.now()
    out_path = args.out or os.path.join(HERE, "results", f"soak-{started.strftime('%Y%m%d-%H%M%S')}.json")
    seed = args.seed if args.seed is not None else int(time.time())
    duration = args.minutes * 60.0

    proc = None
    cmd = None
    log_path = None
    if args.url:
        u = urllib.parse.urlsplit(args.url)
        host, port = u.hostname or "127.0.0.1", u.port or 80
        pid = args.pid or pid_listening_on(port)
    else:
        fd, log_path = tempfile.mkstemp(prefix="duet-soak-", suffix=".log")
        os.close(fd)
        try:
            proc, cmd, host, port = start_server(args, log_path)
        except (OSError, RuntimeError) as e:
            print(f"soak: cannot start the server: {e}", file=sys.stderr)
            return 2
        pid = proc.pid

    def stop_server():
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return "killed after 90 s"

    try:
        st, body = http_get(host, port, "/v1/models")
        model = json.loads(body)["data"][0]["id"]
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
        print(f"soak: GET /v1/models on {host}:{port} failed: {e!r}", file=sys.stderr)
        stop_server()
        return 2

    print(f"soak: {host}:{port} pid {pid} model {model}; {args.minutes:g} min, {args.concurrency} loops, "
          f"seed {seed}" + (f", server log {log_path}" if log_path else ""), flush=True)

    # Baseline: let the server settle, then take it.
    time.sleep(1.0)
    t0 = time.time()
    stats = Stats()
    base_series = scrape(host, port)
    baseline = take_sample(t0, host, port, pid, stats, "baseline")
    # A connection thread of the scrapes above may still be on its way
    # out: the baseline fds and threads are the least of a few readings.
    for _ in range(5) if pid else ():
        time.sleep(0.3)
        ps = proc_stats(pid)
        if ps:
            baseline["fds"] = min(baseline["fds"], ps["fds"])
            baseline["threads"] = min(baseline["threads"], ps["threads"])
    samples = [baseline]
    print(f"  baseline: rss {fmt_kb(baseline.get('rss_kb'))}, fds {baseline.get('fds')}, "
          f"threads {baseline.get('threads')}, kv {baseline.get('kv_usage')}", flush=True)

    stop = threading.Event()
    loops = [Loop(i, host, port, model, stop, stats, seed * 1000 + i, oversize=not args.no_oversize)
             for i in range(args.concurrency)]
    t_load = time.time()
    for lp in loops:
        lp.start()
    server_died = False
    next_t = t_load + args.interval
    while time.time() - t_load < duration:
        time.sleep(max(0.0, min(next_t, t_load + duration) - time.time()))
        if time.time() >= next_t:
            next_t += args.interval
            s = take_sample(t_load, host, port, pid, stats, "load")
            samples.append(s)
            print(f"  t={s['t']:6.0f}s rss {fmt_kb(s.get('rss_kb'))} fds {s.get('fds')} thr {s.get('threads')} "
                  f"kv {s.get('kv_usage')} run {s.get('running')} wait {s.get('waiting')} "
                  f"sent {s['client']['sent']}", flush=True)
            if proc is not None and proc.poll() is not None:
                server_died = True
                break
    end_load = take_sample(t_load, host, port, pid, stats, "end_of_load")
    samples.append(end_load)
    stop.set()
    for lp in loops:
        lp.join(Loop.TIMEOUT + 30)
    stuck = [lp.name for lp in loops if lp.is_alive()]
    t_stopped = time.time()

    # Wait for idle: nothing running or waiting, the books balanced (when
    # the counters exist) and stable, fds and threads back at the baseline.
    final = None
    prev = None
    deadline = time.time() + args.idle_timeout
    while True:
        s = take_sample(t_load, host, port, pid, stats, "idle")
        idle = s.get("running") == 0 and s.get("waiting") == 0
        rec, fin = s.get("received"), s.get("finished")
        books = rec is None or fin is None or rec == sum(fin.values())
        settled = (not pid or (s.get("fds") is not None and s["fds"] <= baseline.get("fds", 0)
                               and s.get("threads") is not None and s["threads"] <= baseline.get("threads", 0)))
        stable = prev is not None and prev.get("received") == rec and prev.get("finished") == fin
        prev = s
        if (idle and books and settled and stable) or time.time() > deadline or s.get("gone"):
            final = s
            break
        time.sleep(1.0)
    final["waited_s"] = round(time.time() - t_stopped, 1)
    samples.append(final)
    client = stats.snapshot()
    alive = proc.poll() is None if proc else (proc_stats(pid) is not None if pid else None)

    # ---- checks ----
    checks = []

    def check(name, ok, detail):
        checks.append({"name": name, "ok": bool(ok) if ok is not None else None, "detail": detail})

    check("server_alive", alive is not False and not server_died,
          "the server process is running" if alive else "the server process exited during the run")
    check("loops_stopped", not stuck, f"client loops still in a request after stop: {stuck}" if stuck else
          "every client loop finished its last request")
    check("idle_reached", final.get("running") == 0 and final.get("waiting") == 0,
          f"running {final.get('running')}, waiting {final.get('waiting')} after {final['waited_s']} s")

    load = [s for s in samples if s["phase"] in ("load", "end_of_load") and s.get("rss_kb")]
    if pid and load:
        ref_t = 300.0 if duration >= 600 else duration / 2
        ref = next((s for s in load if s["t"] >= ref_t), load[0])
        end = load[-1]
        growth = (end["rss_kb"] - ref["rss_kb"]) / ref["rss_kb"]
        how = ("minute 5" if duration >= 600 else
               f"the sample at half the run (t={ref['t']:.0f} s; the run is shorter than 10 minutes)")
        check("rss_growth", growth < args.rss_limit,
              f"VmRSS {fmt_kb(ref['rss_kb'])} at {how} -> {fmt_kb(end['rss_kb'])} at the end of the load "
              f"(t={end['t']:.0f} s): {growth * 100:+.2f}% (limit {args.rss_limit * 100:g}%); "
              f"baseline {fmt_kb(baseline.get('rss_kb'))}, idle after {fmt_kb(final.get('rss_kb'))}")
        peak = max(s["fds"] for s in load if s.get("fds") is not None)
        check("fds_back", final.get("fds") is not None and final["fds"] <= baseline["fds"],
              f"open fds {baseline['fds']} before the load, peak {peak}, {final.get('fds')} after")
        peak = max(s["threads"] for s in load if s.get("threads") is not None)
        check("threads_back", final.get("threads") is not None and final["threads"] <= baseline["threads"],
              f"threads {baseline['threads']} before the load, peak {peak}, {final.get('threads')} after")
    else:
        for n in ("rss_growth", "fds_back", "threads_back"):
            check(n, None, "skipped: no server pid (pass --pid)")
    kvs = [s.get("kv_usage") for s in samples if s["phase"] == "load" and s.get("kv_usage") is not None]
    check("kv_back", final.get("kv_usage") is not None and final["kv_usage"] <= (baseline.get("kv_usage") or 0),
          f"KV usage {baseline.get('kv_usage')} before, peak sampled {max(kvs) if kvs else None}, "
          f"{final.get('kv_usage')} after")

    # Accounting: deltas from before the load.
    co = client["outcome"]
    rec0 = msum(base_series, RECEIVED)
    fin0 = mby(base_series, FINISHED, "outcome")
    acct = None
    if final.get("received") is None or final.get("finished") is None:
        missing = [n for n, v in ((RECEIVED, final.get("received")), (FINISHED, final.get("finished"))) if v is None]
        check("accounting_identity", False, f"accounting metrics missing: {', '.join(missing)} not in /metrics")
        check("accounting_vs_client", False, "accounting metrics missing")
    else:
        rec = final["received"] - (rec0 or 0)
        fin = {k: v - fin0.get(k, 0) for k, v in final["finished"].items()}
        for k in OUTCOMES:
            fin.setdefault(k, 0.0)
        total = sum(fin.values())
        acct = {"received": rec, "finished": fin}
        check("accounting_identity", rec == total,
              f"received {rec:.0f}, finished {total:.0f} = " +
              " + ".join(f"{k} {v:.0f}" for k, v in sorted(fin.items())))
        problems = []
        # A request the client closed before any response may not have
        # arrived whole (a reset drops what the server had not read yet):
        # the server never received it. Up to that many may be missing.
        missing = client["sent"] - rec
        if not 0 <= missing <= client["cancel_unanswered"]:
            problems.append(f"received {rec:.0f} vs client sent {client['sent']} (of which "
                            f"{client['cancel_unanswered']} closed before any response)")
        for k in ("invalid", "failed"):
            if fin[k] != co[k]:
                problems.append(f"{k}: server {fin[k]:.0f} != client {co[k]}")
        # A client that closed before any response cannot know whether the
        # server refused its request (429): it booked it as cancelled.
        refused_unseen = fin["rejected"] - co["rejected"]
        if not 0 <= refused_unseen <= client["cancel_unanswered"] - missing:
            problems.append(f"rejected: server {fin['rejected']:.0f} != client {co['rejected']} (+ up to "
                            f"{client['cancel_unanswered'] - missing:.0f} closed before any response)")
        s_done = fin["stop"] + fin["length"] + fin["cancelled"] + refused_unseen
        c_done = co["stop"] + co["length"] + co["cancelled"]
        if s_done + missing != c_done:
            problems.append(f"stop+length+cancelled: server {s_done:.0f} (+{missing:.0f} never received) "
                            f"!= client {c_done}")
        if fin["cancelled"] + missing > co["cancelled"]:
            problems.append(f"cancelled: server {fin['cancelled']:.0f} (+{missing:.0f} never received) "
                            f"> client {co['cancelled']}")
        for k in ("stop", "length"):
            if fin[k] < co[k]:
                problems.append(f"{k}: server {fin[k]:.0f} < client {co[k]}")
        unknown = sorted(k for k in fin if k not in OUTCOMES and fin[k])
        if unknown:
            problems.append(f"outcomes the client does not know: {unknown}")
        if co["transport_error"]:
            problems.append(f"{co['transport_error']} requests with transport errors: their outcome is unknown")
        races = co["cancelled"] - missing - fin["cancelled"]
        check("accounting_vs_client", not problems,
              "; ".join(problems) if problems else
              f"received {rec:.0f} = sent {client['sent']} - {missing:.0f} closed before the server had "
              f"read them; invalid {co['invalid']}, rejected {co['rejected']}, failed {co['failed']}; "
              f"client cancelled {co['cancelled']}, server {fin['cancelled']:.0f} ({races:.0f} cancels raced "
              f"the request's end and were booked as stop/length)")
    check("no_transport_errors", co["transport_error"] == 0,
          f"{co['transport_error']} requests ended in a connection error or timeout" +
          (f"; first: {client['errors'][:3]}" if co["transport_error"] else ""))
    n_bad = sum(v for k, v in client["by_kind"].items() if k.startswith("bad_"))
    check("bad_requests_refused", not client["bad_unexpected"],
          f"{sum(client['bad_unexpected_by'].values())} of {n_bad} bad requests were not refused with 4xx: " +
          "; ".join(f"{k} (x{v})" for k, v in sorted(client["bad_unexpected_by"].items()))
          if client["bad_unexpected"] else
          f"every bad request got 400/404/413 (or 429/503): {n_bad}")
    check("no_failed_requests", co["failed"] == 0,
          f"{co['failed']} requests failed (HTTP 500 or an error event); first: {client['errors'][:3]}"
          if co["failed"] else "no HTTP 500 and no error events")

    exit_code = None
    if proc is not None:
        exit_code = stop_server()
        check("clean_shutdown", exit_code == 0, f"duet serve exited with {exit_code} on SIGTERM")

    failed = [c for c in checks if c["ok"] is False]
    result = {
        "benchmark": "soak",
        "started": started.isoformat(timespec="seconds"),
        "duet": git_commit(),
        "machine": machine(),
        "args": vars(args),
        "seed": seed,
        "server": {"url": f"http://{host}:{port}", "pid": pid, "cmd": cmd, "model": model,
                   "exit_code": exit_code, "log": log_path, "log_tail": log_tail(log_path) if log_path else None},
        "duration_s": round(t_stopped - t_load, 1),
        "client": client,
        "server_accounting": acct,
        "baseline": baseline,
        "final": final,
        "samples": samples,
        "checks": checks,
        "passed": not failed,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)

    # ---- summary ----
    dur = t_stopped - t_load
    print(f"\nsoak: {dur / 60:.1f} min, {args.concurrency} loops, {client['sent']} requests "
          f"({client['sent'] / dur:.1f}/s), {client['tokens_seen']} streamed tokens seen")
    print("  client outcomes: " + ", ".join(f"{k} {v}" for k, v in co.items()))
    print("  HTTP statuses:   " + ", ".join(f"{k} {v}" for k, v in sorted(client["status"].items())))
    print(f"  cancels: {client['cancel_planned']} drawn, {client['cancel_outran']} outran by the request's end, "
          f"{client['cancel_unanswered']} closed before any response")
    if acct:
        print("  server finished: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(acct["finished"].items())) +
              f"; received {acct['received']:.0f}")
    for c in checks:
        mark = "ok  " if c["ok"] else ("skip" if c["ok"] is None else "FAIL")
        print(f"  [{mark}] {c['name']}: {c['detail']}")
    print(f"  result: {out_path}")
    print("soak: " + ("PASSED" if not failed else f"FAILED ({', '.join(c['name'] for c in failed)})"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
