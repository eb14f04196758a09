"""Interactive TTFT under a flood of batch work on the real machine (issue 20): one
shared instance with its priority classes vs a dedicated small interactive instance
beside a batch instance (the two share the weights). No floor: both share the
machine's cores. Usage: python3 bench/tier_compare.py build/duet MODEL.gguf"""
import json, sys, threading, time, urllib.request, subprocess, re, tempfile, signal, os
DUET, MODEL = sys.argv[1], sys.argv[2]
def start(args):
    log = tempfile.NamedTemporaryFile(delete=False)
    p = subprocess.Popen([DUET, "serve", "-m", MODEL, "--port", "0", "-c", "512", "-t", "1", *args], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        m = re.search(r" on http://[^\s]*:(\d+)\n", open(log.name).read())
        if m: return p, int(m.group(1))
        time.sleep(0.05)
    raise SystemExit(open(log.name).read())
def ttft(port, prio, max_tokens):
    body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True, "priority": prio}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.time(); first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if first is None and line.startswith(b"data: {"): first = time.time() - t0
    return first
def run(args, dur=20):
    p, port = start(args)
    stop = time.time() + dur
    def batch():
        while time.time() < stop: ttft(port, "batch", 256)
    ts = [threading.Thread(target=batch) for _ in range(32)]
    for t in ts: t.start()
    time.sleep(2)
    out = []
    while time.time() < stop:
        out.append(ttft(port, "interactive", 16)); time.sleep(0.25)
    for t in ts: t.join()
    p.send_signal(signal.SIGTERM); p.wait()
    out.sort()
    return len(out), out[len(out)//2], out[min(len(out)-1, int(0.99*len(out)))]
shared = run(["--max-batch-seqs", "32"])
print("one shared instance (priority classes on), 32 seqs:", "n=%d p50=%.1f ms p99=%.1f ms" % (shared[0], shared[1]*1e3, shared[2]*1e3))
ded = run(["--instance", "backend=cpu,tier=interactive,max-batch-seqs=4", "--instance", "backend=cpu,tier=batch,max-batch-seqs=32"])
print("dedicated interactive instance + batch instance (shared weights):", "n=%d p50=%.1f ms p99=%.1f ms" % (ded[0], ded[1]*1e3, ded[2]*1e3))
