#!/usr/bin/env bash
# run_fuzzers.sh — builds every tests/fuzz/fuzz_*.c libFuzzer target and runs
# each for a fixed number of inputs from a seed corpus made at run time.
#
# usage: tests/fuzz/run_fuzzers.sh [BUILD_DIR] [RUNS]
#   BUILD_DIR  where to configure and build (default: <repo>/build-fuzz)
#   RUNS       inputs per target (default: 20000; env FUZZ_RUNS also works)
# env: CC (default clang), DUET_SHARED (default <repo>/../shared),
#      FUZZ_JOBS (build jobs, default 2), FUZZ_ARGS (extra libFuzzer flags).
#
# Seeds: for the GGUF targets (fuzz_gguf*), every <shared>/models/*.gguf and
# a small hand-made GGUF with every value type; for every target,
# tests/fuzz/seeds/<target>/* when that folder exists. The
# corpus lives in a temporary folder, never in the repository.
# Exits non-zero if a target fails to build or any input crashes; crash
# inputs are kept and their paths printed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
build="${1:-$repo/build-fuzz}"
runs="${2:-${FUZZ_RUNS:-20000}}"
shared="${DUET_SHARED:-$repo/../shared}"
cc="${CC:-clang}"

# The library is instrumented too (fuzzer-no-link), so coverage guides the
# fuzzer through the parser and not only through the target's own code.
cmake -S "$repo" -B "$build" -DCMAKE_C_COMPILER="$cc" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DDUET_FUZZ=ON -DDUET_TESTS=OFF \
    "-DCMAKE_C_FLAGS=-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer" >/dev/null

targets=()
for src in "$here"/fuzz_*.c; do
    [ -e "$src" ] || continue
    targets+=("$(basename "$src" .c)")
done
if [ ${#targets[@]} -eq 0 ]; then
    echo "run_fuzzers: no tests/fuzz/fuzz_*.c targets" >&2
    exit 1
fi
cmake --build "$build" -j "${FUZZ_JOBS:-2}" --target "${targets[@]}"

work="$(mktemp -d "${TMPDIR:-/tmp}/duet-fuzz.XXXXXX")"
keep=0
cleanup() { if [ "$keep" = 0 ]; then rm -rf "$work"; fi; }
trap cleanup EXIT

# A small valid GGUF v3 with every metadata type, nested and string arrays
# and two tensors, so mutations start from a file the reader accepts.
seeds="$work/seeds"
mkdir -p "$seeds"
python3 - "$seeds/small.gguf" <<'PY' || echo "run_fuzzers: python3 missing, skipping the hand-made seed" >&2
import struct, sys
def s(x): b = x.encode(); return struct.pack('<Q', len(b)) + b
def kv(k, t, payload): return s(k) + struct.pack('<I', t) + payload
kvs = [
    kv('a.u8', 0, b'\x07'), kv('a.i8', 1, b'\xff'), kv('a.u16', 2, struct.pack('<H', 9)),
    kv('a.i16', 3, struct.pack('<h', -9)), kv('a.u32', 4, struct.pack('<I', 64)),
    kv('a.i32', 5, struct.pack('<i', -1)), kv('a.f32', 6, struct.pack('<f', 1e-5)),
    kv('a.bool', 7, b'\x01'), kv('general.architecture', 8, s('llama')),
    kv('a.u64', 10, struct.pack('<Q', 1 << 40)), kv('a.i64', 11, struct.pack('<q', -5)),
    kv('a.f64', 12, struct.pack('<d', 0.5)),
    kv('tokenizer.ggml.tokens', 9, struct.pack('<IQ', 8, 3) + s('<unk>') + s('a') + s('b')),
    kv('tokenizer.ggml.scores', 9, struct.pack('<IQ3f', 6, 3, 0.0, -1.0, -2.0)),
    kv('a.nested', 9, struct.pack('<IQ', 9, 2) + struct.pack('<IQi', 5, 1, 3) + struct.pack('<IQ', 8, 1) + s('x')),
    kv('general.alignment', 4, struct.pack('<I', 32)),
]
tensors = [('w', [32, 2], 8, 2 * 34), ('n', [4], 0, 16)]  # q8_0 and f32
infos, off = b'', 0
for name, ne, t, size in tensors:
    infos += s(name) + struct.pack('<I', len(ne)) + b''.join(struct.pack('<Q', n) for n in ne)
    infos += struct.pack('<IQ', t, off)
    off += (size + 31) // 32 * 32
head = b'GGUF' + struct.pack('<IQQ', 3, len(tensors), len(kvs)) + b''.join(kvs) + infos
head += b'\0' * (-len(head) % 32)
data = b''
for i, (_, _, _, size) in enumerate(tensors):
    data += bytes((j * 7 + i) & 0xff for j in range(size)) + b'\0' * (-size % 32)
open(sys.argv[1], 'wb').write(head + data)
PY
found_models=0
for f in "$shared"/models/*.gguf; do
    [ -e "$f" ] || continue
    cp "$f" "$seeds/"
    found_models=1
done
[ "$found_models" = 1 ] || echo "run_fuzzers: no seed models under $shared/models" >&2

status=0
for t in "${targets[@]}"; do
    corpus="$work/corpus-$t"
    mkdir -p "$corpus" "$work/crash-$t"
    # The GGUF seeds only where the input is a GGUF file: a text target
    # given multi-megabyte files would size its inputs (-max_len) by them
    # and spend its runs tokenizing megabytes.
    case "$t" in
    *gguf*) cp "$seeds"/* "$corpus/" 2>/dev/null || true ;;
    *jinja*) cp "$shared"/models/chat-templates/*.jinja "$corpus/" 2>/dev/null || true ;;
    esac
    if [ -d "$here/seeds/$t" ]; then cp -r "$here/seeds/$t/." "$corpus/"; fi
    echo "== $t: $runs runs"
    # shellcheck disable=SC2086
    if ! "$build/$t" -runs="$runs" -rss_limit_mb=4096 -timeout=30 -print_final_stats=1 \
        -artifact_prefix="$work/crash-$t/" ${FUZZ_ARGS:-} "$corpus" >"$work/$t.log" 2>&1; then
        tail -n 60 "$work/$t.log" >&2
        echo "run_fuzzers: $t FAILED; crash inputs in $work/crash-$t/" >&2
        keep=1
        status=1
    else
        grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb|Done)" "$work/$t.log" || true
    fi
done
exit $status
