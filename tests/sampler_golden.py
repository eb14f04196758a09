#!/usr/bin/env python3
"""Independent reference for core/sampler.c: regenerates the golden token
sequences in tests/test_sampler.c (test_golden_reference) from the sampler's
specification alone (sampler.h), in float32 with numpy.

Usage: python3 tests/sampler_golden.py   (prints the C arrays)
"""
import numpy as np

M64 = (1 << 64) - 1
f32 = np.float32


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


class Xoshiro:
    def __init__(self, seed):
        self.s = []
        for _ in range(4):
            seed, out = splitmix64(seed)
            self.s.append(out)

    @staticmethod
    def rotl(x, k):
        return ((x << k) | (x >> (64 - k))) & M64

    def next(self):
        s = self.s
        out = (self.rotl((s[1] * 5) & M64, 7) * 9) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = self.rotl(s[3], 45)
        return out

    def uniform(self):
        return (self.next() >> 11) * 2.0**-53


class Lcg:
    """The test's data generator (lcg_uniform in test_sampler.c)."""

    def __init__(self, state):
        self.state = state

    def uniform(self):
        self.state = (self.state * 6364136223846793005 + 1442695040888963407) & M64
        return (self.state >> 11) * 2.0**-53


def sample(logits, cfg, window, rng):
    x = logits.astype(np.float32).copy()
    # penalties: once per distinct token in the window
    counts = {}
    for t in window:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        v = x[t]
        if cfg["rep"] != 1.0:
            v = f32(v / f32(cfg["rep"])) if v > 0 else f32(v * f32(cfg["rep"]))
        v = f32(v - f32(f32(f32(c) * f32(cfg["freq"])) + f32(cfg["pres"])))
        x[t] = v
    ids = [i for i in range(len(x)) if np.isfinite(x[i])]
    order = sorted(ids, key=lambda i: (-float(x[i]), i))
    if cfg["top_k"] > 0:
        order = order[: cfg["top_k"]]
    xmax = x[order[0]]
    inv_t = f32(f32(1.0) / f32(cfg["temp"]))
    p = {}
    for i in order:
        d = f32(x[i] - xmax)
        p[i] = f32(1.0) if d == 0 else f32(np.exp(f32(d * inv_t), dtype=np.float32))
    z = sum(float(p[i]) for i in order)
    if cfg["min_p"] > 0:
        order = [i for i in order if p[i] >= f32(cfg["min_p"])]
    if cfg["top_p"] < 1.0:
        target = float(f32(cfg["top_p"])) * z
        cum, keep = 0.0, 0
        for i in order:
            cum += float(p[i])
            keep += 1
            if cum >= target:
                break
        order = order[:keep]
    kept = sorted(order)
    total = sum(float(p[i]) for i in kept)
    r = rng.uniform() * total
    cum = 0.0
    last = None
    for i in kept:
        if p[i] <= 0:
            continue
        cum += float(p[i])
        last = i
        if cum > r:
            return i
    return last


def run(name, n_vocab, data_seed, scale, shift, cfg, seed, draws):
    lcg = Lcg(data_seed)
    logits = np.array([f32(lcg.uniform() * scale + shift) for _ in range(n_vocab)], dtype=np.float32)
    rng = Xoshiro(seed)
    window, out = [], []
    for _ in range(draws):
        t = sample(logits, cfg, window if cfg["last_n"] == 0 else window[-cfg["last_n"]:], rng)
        out.append(t)
        window.append(t)
    print(f"/* {name} */")
    print("{" + ", ".join(str(t) for t in out) + "}")


if __name__ == "__main__":
    base = dict(temp=0.8, top_k=40, top_p=0.95, min_p=0.05, rep=1.1, pres=0.25, freq=0.125, last_n=8)
    run("defaults + penalties, vocab 1000", 1000, 1, 6.0, -3.0, base, 0xC0FFEE, 48)
    cfg = dict(base, temp=1.3, top_k=0, top_p=0.9, min_p=0.0, rep=1.0, pres=0.0, freq=0.0)
    run("top-p 0.9 only, T 1.3, vocab 5000", 5000, 2, 4.0, 0.0, cfg, 42, 48)
    cfg = dict(base, temp=1.0, top_k=0, top_p=0.5, min_p=0.0, rep=1.0, pres=0.0, freq=0.0)
    run("top-p 0.5, flat, vocab 152064 (nucleus > 4096)", 152064, 3, 1.0, 0.0, cfg, 7, 12)
    cfg = dict(base, temp=0.7, top_k=2000, top_p=1.0, min_p=0.0, rep=1.3, pres=0.0, freq=0.0, last_n=0)
    run("top-k 2000 (quickselect), vocab 152064", 152064, 4, 8.0, 0.0, cfg, 9, 12)
