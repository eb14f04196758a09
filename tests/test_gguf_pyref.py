#!/usr/bin/env python3
"""Reads the GGUF sample written by duet's writer (tests/test_gguf.c) with the
reference Python reader (`gguf` from PyPI) and checks every key, value type,
value, tensor shape, type, offset and data byte.

Usage (from CTest): test_gguf_pyref.py DUET_BINARY SHARED_DIR BUILD_DIR

The expected values here mirror test_gguf.c's sample_writer(); keep them in
step. The script first runs `test_gguf` (only its "sample" case) from
BUILD_DIR so the sample is fresh.
"""
import math
import os
import struct
import subprocess
import sys

try:
    import gguf
    import numpy as np
except ImportError as e:  # CI installs gguf; its absence is a failure
    print(f"FAIL: the reference reader is missing ({e}); pip install gguf numpy", file=sys.stderr)
    sys.exit(1)

T = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)


def leaf_values(field):
    """The field's leaf values, flattened (gguf's reader flattens nested arrays)."""
    leaf_type = field.types[-1]
    out = []
    for i in field.data:
        part = field.parts[i]
        if leaf_type == T.STRING:
            out.append(bytes(part).decode("utf-8"))
        else:
            out.append(part.tolist()[0])
    return out


# key -> (types list as gguf reports them, flattened leaf values)
EXPECTED_KV = {
    "t.u8": ([T.UINT8], [200]),
    "t.i8": ([T.INT8], [-100]),
    "t.u16": ([T.UINT16], [60000]),
    "t.i16": ([T.INT16], [-30000]),
    "t.i64": ([T.INT64], [-5000000000]),
    "t.f64": ([T.FLOAT64], [3.141592653589793]),
    "t.nested": ([T.ARRAY, T.ARRAY, T.INT32], [1, 2, 3, 4]),
    "t.nested_str": ([T.ARRAY, T.ARRAY, T.STRING], ["a", "bc", "def"]),
    "t.deep": ([T.ARRAY, T.ARRAY, T.ARRAY, T.UINT16], [7]),
    "general.architecture": ([T.STRING], ["test"]),
    "t.u32": ([T.UINT32], [4000000000]),
    "t.i32": ([T.INT32], [-2000000000]),
    "t.u64": ([T.UINT64], [(1 << 60) + 1]),
    "t.f32": ([T.FLOAT32], [0.5]),
    "t.bool": ([T.BOOL], [True]),
    "t.bool_false": ([T.BOOL], [False]),
    "t.str": ([T.STRING], ["hello, gguf \u2713"]),
    "t.empty_str": ([T.STRING], [""]),
    "t.arr.u8": ([T.ARRAY, T.UINT8], [1, 2, 255]),
    "t.arr.i8": ([T.ARRAY, T.INT8], [-1, 0, 1, -128]),
    "t.arr.u16": ([T.ARRAY, T.UINT16], [0, 65535]),
    "t.arr.i16": ([T.ARRAY, T.INT16], [-32768, 32767, 5]),
    "t.arr.u32": ([T.ARRAY, T.UINT32], [7, 4000000000]),
    "t.arr.i32": ([T.ARRAY, T.INT32], [-2000000000, 2000000000, 0]),
    "t.arr.f32": ([T.ARRAY, T.FLOAT32], [0.25, -1.5]),
    "t.arr.bool": ([T.ARRAY, T.BOOL], [True, False, True]),
    "t.arr.u64": ([T.ARRAY, T.UINT64], [2**64 - 1, 1]),
    "t.arr.i64": ([T.ARRAY, T.INT64], [-(2**63), -1]),
    "t.arr.f64": ([T.ARRAY, T.FLOAT64], [1e300, -0.125]),
    "t.arr.empty": ([T.ARRAY], []),
    "t.strs": ([T.ARRAY, T.STRING], ["", "x", "hello world", "\u00fcn\u00ef"]),
    "t.replaced": ([T.UINT32], [2]),
    "general.alignment": ([T.UINT32], [64]),
}

# name, type, shape (ne order), bytes
EXPECTED_TENSORS = [
    ("f32", Q.F32, [4, 3], 4 * 3 * 4),
    ("f16", Q.F16, [8, 2], 8 * 2 * 2),
    ("bf16", Q.BF16, [5], 5 * 2),
    ("q8_0", Q.Q8_0, [64, 2], 2 * 2 * 34),
    ("i32", Q.I32, [2, 3, 1, 2], 2 * 3 * 1 * 2 * 4),
]
ALIGNMENT = 64


def tensor_bytes(k, n):
    return bytes((i * 31 + k * 7) & 0xFF for i in range(n))


def main():
    if len(sys.argv) != 4:
        print(f"usage: {sys.argv[0]} DUET_BINARY SHARED_DIR BUILD_DIR", file=sys.stderr)
        return 2
    build_dir = sys.argv[3]
    test_bin = os.path.join(build_dir, "test_gguf")
    path = os.path.join(build_dir, "gguf_sample.gguf")
    if os.path.exists(test_bin):
        env = dict(os.environ, CK_RUN_CASE="sample")
        r = subprocess.run([test_bin], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"FAIL: {test_bin} could not write the sample:\n{r.stdout}{r.stderr}", file=sys.stderr)
            return 1
    if not os.path.exists(path):
        print(f"FAIL: {path} is missing and {test_bin} was not built", file=sys.stderr)
        return 1

    reader = gguf.GGUFReader(path)
    check(reader.alignment == ALIGNMENT, f"alignment {reader.alignment}, expected {ALIGNMENT}")
    check(reader.data_offset % ALIGNMENT == 0, f"data offset {reader.data_offset} not aligned")

    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    check(reader.fields["GGUF.version"].contents() == 3, "version is not 3")
    check(reader.fields["GGUF.kv_count"].contents() == len(EXPECTED_KV),
          f"kv_count {reader.fields['GGUF.kv_count'].contents()}, expected {len(EXPECTED_KV)}")
    check(set(fields) == set(EXPECTED_KV),
          f"keys differ: extra {sorted(set(fields) - set(EXPECTED_KV))}, "
          f"missing {sorted(set(EXPECTED_KV) - set(fields))}")
    for key, (types, values) in EXPECTED_KV.items():
        f = fields.get(key)
        if f is None:
            continue
        got_types = list(f.types)
        if key == "t.arr.empty":
            got_types = got_types[:1]  # the reader only learns the element type from an element
        check(got_types == types, f"{key}: types {got_types}, expected {types}")
        got = leaf_values(f)
        if types[-1] in (T.FLOAT32, T.FLOAT64):
            ok = len(got) == len(values) and all(math.isclose(a, b, rel_tol=0, abs_tol=0) or a == b
                                                 for a, b in zip(got, values))
        elif types[-1] == T.BOOL:
            ok = [bool(v) for v in got] == values
        else:
            ok = got == values
        check(ok, f"{key}: values {got}, expected {values}")
    # The empty array's element type and length are still in its parts.
    f = fields.get("t.arr.empty")
    if f is not None:
        check(int(f.parts[-2][0]) == T.UINT32 and int(f.parts[-1][0]) == 0,
              f"t.arr.empty: element type {f.parts[-2]}, length {f.parts[-1]}")

    check(len(reader.tensors) == len(EXPECTED_TENSORS),
          f"{len(reader.tensors)} tensors, expected {len(EXPECTED_TENSORS)}")
    file_size = os.path.getsize(path)
    for k, (name, qtype, shape, nbytes) in enumerate(EXPECTED_TENSORS):
        if k >= len(reader.tensors):
            break
        t = reader.tensors[k]
        check(t.name == name, f"tensor {k}: name {t.name!r}, expected {name!r}")
        check(t.tensor_type == qtype, f"{name}: type {t.tensor_type!r}, expected {qtype!r}")
        check([int(x) for x in t.shape] == shape, f"{name}: shape {list(t.shape)}, expected {shape}")
        check(t.n_bytes == nbytes, f"{name}: {t.n_bytes} bytes, expected {nbytes}")
        check(t.data_offset % ALIGNMENT == 0, f"{name}: data at {t.data_offset}, not {ALIGNMENT}-aligned")
        data = np.ascontiguousarray(t.data).tobytes()
        check(data == tensor_bytes(k, nbytes), f"{name}: data bytes differ")
    # Every tensor, the last one included, is padded to the alignment.
    check(file_size % ALIGNMENT == 0, f"file size {file_size} is not a multiple of {ALIGNMENT}")
    if reader.tensors:
        last = reader.tensors[-1]
        end = last.data_offset + last.n_bytes
        check(file_size == end + (-end) % ALIGNMENT, f"file size {file_size}, last tensor ends at {end}")

    if failures:
        for m in failures:
            print("FAIL:", m, file=sys.stderr)
        return 1
    try:
        from importlib.metadata import version
        ref = f"gguf {version('gguf')}"
    except Exception:
        ref = "gguf"
    print(f"ok: {len(EXPECTED_KV)} keys and {len(EXPECTED_TENSORS)} tensors match the {ref} reader")
    return 0


if __name__ == "__main__":
    sys.exit(main())
