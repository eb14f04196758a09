#!/bin/sh
# gpu_check.sh — one command that measures a GPU in minutes (issue 23): op
# parity, decode and prefill, batched decode, op GB/s and GFLOP/s against the
# device's peak, optionally llama.cpp side by side and DUET_VK_TUNE /
# DUET_OPENCL_TUNE sweeps. Every figure is appended, as it comes, to one JSON
# Lines file named after the device. Needs only sh, coreutils, awk, sed and a
# duet build made elsewhere (no compiler, no network, no python).
#
#     sh bench/gpu_check.sh [--build DIR] [--quick] [--cpu-devices] [options]
#
# Usage, every option, every JSON field and how a result becomes a tuning
# entry: bench/gpu_check.md.
set -u

version=1
here="$(cd "$(dirname "$0")" && pwd)"

usage() {
    cat <<'EOF'
usage: sh bench/gpu_check.sh [options]
  --build DIR         the duet build (duet, bench_backend_ops, bench_decode, bench_batching, libduet.so);
                      default: $DUET_BUILD, next to this script, ../build from it, or duet on PATH
  --quick             small matrix (125m shape, contexts 128,512, prefill 256, fewer types)
  --cpu-devices       also measure CPU-type devices (lavapipe, PoCL): how it is tested without a GPU;
                      without it the run stops early when no backend sees a GPU
  --backends LIST     vulkan,opencl (default); cpu is allowed too
  --shape S           model shape for mkmodel (default 1b; --quick: 125m)
  --types LIST        weight types (default f16,q8_0,q4_0,q4_k_m; order = measurement order after q8_0)
  --ctx LIST          decode contexts (default 128,4096; --quick: 128,512)
  --prefill N         prefill prompt tokens (default 512; --quick: 256)
  --tokens N          decode tokens per measurement (default 32; --quick: 8)
  --batch LIST        batched-decode sequences (default 16,64)
  --batch-types LIST  types for batched decode (default q8_0)
  --budget S          whole-run budget in seconds (default 480; --quick: 900)
  --scale F           multiply every step's time box and the budget by F (e.g. 4 on CPU devices)
  --out DIR           where the JSON Lines file goes (default: the current directory)
  --name NAME         the file's device part (default: from the first measured device's name)
  --work DIR          models and scratch (default /tmp/duet-gpu-check; models are kept for reruns)
  --llama-bench PATH  llama.cpp's llama-bench: the same files, side by side
  --no-parity --no-perf --no-batch --no-sweep   skip those steps
  -h, --help
EOF
}

# ---- options -----------------------------------------------------------------------------
build="${DUET_BUILD:-}" quick=0 cpu_devices=0 backends=vulkan,opencl shape="" types="" ctxs=""
prefill="" tokens="" batch=16,64 batch_types=q8_0 budget="" scale=1 outdir=. name="" work=/tmp/duet-gpu-check
llama="" do_parity=1 do_perf=1 do_batch=1 do_sweep=1
argv="$*"
while [ $# -gt 0 ]; do
    case "$1" in
    --build) build="$2"; shift 2 ;;
    --quick) quick=1; shift ;;
    --cpu-devices) cpu_devices=1; shift ;;
    --backends) backends="$2"; shift 2 ;;
    --shape) shape="$2"; shift 2 ;;
    --types) types="$2"; shift 2 ;;
    --ctx) ctxs="$2"; shift 2 ;;
    --prefill) prefill="$2"; shift 2 ;;
    --tokens) tokens="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    --batch-types) batch_types="$2"; shift 2 ;;
    --budget) budget="$2"; shift 2 ;;
    --scale) scale="$2"; shift 2 ;;
    --out) outdir="$2"; shift 2 ;;
    --name) name="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --llama-bench) llama="$2"; shift 2 ;;
    --no-parity) do_parity=0; shift ;;
    --no-perf) do_perf=0; shift ;;
    --no-batch) do_batch=0; shift ;;
    --no-sweep) do_sweep=0; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
if [ "$quick" = 1 ]; then
    : "${shape:=125m}" "${types:=f16,q8_0,q4_0,q4_k_m}" "${ctxs:=128,512}" "${prefill:=256}" "${tokens:=8}"
    : "${budget:=900}"
    perf_filter="q8_0 1b-up,f16 1b-up,q4_0 1b-up,q4_k 1b-up"
    parity_variants=default batch_tokens=8 perf_opts=--quick tune_perf=0
else
    : "${shape:=1b}" "${types:=f16,q8_0,q4_0,q4_k_m}" "${ctxs:=128,4096}" "${prefill:=512}" "${tokens:=32}"
    : "${budget:=480}"
    perf_filter="1b-up,1b-out,c4096,125m-pf4096,125m-16seq"
    parity_variants="default all" batch_tokens=32 perf_opts="--min-time 0.1" tune_perf=1
fi
# Time boxes (seconds) of one step, before --scale: GPU-sized for the full
# run, sized for lavapipe/PoCL on 2 cores for --quick.
if [ "$quick" = 1 ]; then
    t_devices=30 t_parity=120 t_models=240 t_decode=90 t_prefill=60 t_batch=120 t_perf=120 t_llama=120 t_sweep=60
    t_perf_variants=0
else
    t_devices=30 t_parity=60 t_models=180 t_decode=30 t_prefill=20 t_batch=40 t_perf=60 t_llama=60 t_sweep=25
    t_perf_variants=90
fi
sc() { awk -v a="$1" -v s="$scale" 'BEGIN { printf "%d", a * s + 0.5 }'; }
budget="$(sc "$budget")"
max_ctx="$(echo "$ctxs" | tr ',' '\n' | sort -n | tail -1)"
model_ctx=$((max_ctx + tokens + 64))
[ "$model_ctx" -lt $((prefill + tokens + 64)) ] && model_ctx=$((prefill + tokens + 64))

# ---- the build ---------------------------------------------------------------------------
find_build() {
    for d in "$build" "$here" "$here/../build" "$(dirname "$(command -v duet 2>/dev/null || echo /nonexistent/x)")"; do
        [ -n "$d" ] && [ -x "$d/duet" ] && [ -x "$d/bench_decode" ] && { (cd "$d" && pwd); return 0; }
    done
    return 1
}
build="$(find_build)" || {
    echo "gpu_check: no duet build found: give --build DIR (a folder with duet, bench_decode, bench_backend_ops, bench_batching)" >&2
    exit 2
}
for t in duet bench_decode bench_backend_ops bench_batching; do
    [ -x "$build/$t" ] || { echo "gpu_check: $build/$t is missing" >&2; exit 2; }
done
missing="$(LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$build/duet" "$build/bench_decode" 2>/dev/null | grep 'not found' | sort -u)"
[ -z "$missing" ] || { echo "gpu_check: the build needs libraries this machine lacks (install the runtime packages, bench/gpu_check.md):" >&2; echo "$missing" >&2; exit 2; }
command -v timeout >/dev/null || { echo "gpu_check: needs timeout (coreutils)" >&2; exit 2; }
# A build copied from elsewhere: its RPATH names the folder it was built in.
LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
mkdir -p "$work/cache" "$work/tmp" "$outdir" || exit 2
outdir="$(cd "$outdir" && pwd)"
# Synthetic models go to the work folder's cache (bench_decode finds them there).
XDG_CACHE_HOME="$work/cache"
export XDG_CACHE_HOME
DUET="$build/duet"

# ---- time --------------------------------------------------------------------------------
now() { date +%s.%N; }
t_start="$(now)"
elapsed() { awk -v a="$t_start" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
left() { awk -v a="$t_start" -v b="$(now)" -v g="$budget" 'BEGIN { printf "%d", g - (b - a) }'; }
# box LIMIT: the step's time box, cut to what the budget has left (0: skip)
box() {
    l="$(sc "$1")" r="$(left)"
    [ "$r" -lt 5 ] && { echo 0; return; }
    [ "$l" -gt "$r" ] && l="$r"
    echo "$l"
}
say() { printf '[%6ss] %s\n' "$(elapsed)" "$*"; }

# ---- JSON Lines --------------------------------------------------------------------------
errf="$work/tmp/err" recf="$work/tmp/rec.main"
out="" # set once the device is known; records before that wait in $pending
pending="$work/tmp/pending.$$.jsonl"
: >"$pending"
jstr() { # a JSON string: backslashes, quotes, control characters
    [ -z "$1" ] && { printf '""'; return; }
    printf '%s' "$1" | tr '\n\t\r' '   ' | LC_ALL=C tr -d '\000-\037' | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/^/"/' -e 's/$/"/'
}
# json_ok FILE: one JSON value (object or array) whose brackets balance outside strings
json_ok() {
    [ -s "$1" ] || return 1
    LC_ALL=C awk 'BEGIN { d = 0; s = 0; e = 0; first = ""; bad = 0 }
    {
        n = length($0)
        for (i = 1; i <= n; i++) {
            c = substr($0, i, 1)
            if (s) { if (e) e = 0; else if (c == "\\") e = 1; else if (c == "\"") s = 0; continue }
            if (c == " " || c == "\t" || c == "\r") continue
            if (first == "") { first = c; if (c != "{" && c != "[") bad = 1 }
            else if (d == 0) bad = 1
            if (c == "\"") s = 1
            else if (c == "{" || c == "[") d++
            else if (c == "}" || c == "]") { d--; if (d < 0) bad = 1 }
        }
    }
    END { exit (bad || s || d != 0 || first == "") ? 1 : 0 }' "$1"
}
# emit STEP WHAT RC WALL LIMIT DATAFILE [EXTRA]: appends one record. WHAT is
# "key":value pairs (already JSON) naming the measurement; DATAFILE is the
# tool's JSON output (or empty); EXTRA more pairs.
emit() {
    step="$1" what="$2" rc="$3" wall="$4" limit="$5" data="$6" extra="${7:-}"
    timed_out=false
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && timed_out=true
    {
        printf '{"gpu_check":%s,"time":"%s","elapsed_s":%s,"step":"%s"' "$version" \
            "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(elapsed)" "$step"
        [ -n "$what" ] && printf ',%s' "$what"
        printf ',"rc":%s,"timed_out":%s,"wall_s":%s,"limit_s":%s' "$rc" "$timed_out" "$wall" "$limit"
        [ -n "$extra" ] && printf ',%s' "$extra"
        if [ -n "$data" ] && json_ok "$data"; then
            printf ',"data":'
            tr -d '\n\t\r' <"$data"
        else
            printf ',"data":null'
        fi
        if [ -s "$errf" ] && [ "$rc" != 0 ]; then
            printf ',"error":%s' "$(jstr "$(tail -n 3 "$errf")")"
        fi
        printf '}\n'
    } >"$recf"
    # one write per record (O_APPEND): the background model maker appends too
    if [ -n "$out" ]; then cat "$recf" >>"$out"; else cat "$recf" >>"$pending"; fi
    rm -f "$recf"
}
# run LIMIT OUTFILE CMD...: the command under timeout, stdout to OUTFILE,
# stderr to $errf; sets rc and wall.
run() {
    lim="$1" of="$2"; shift 2
    : >"$errf"
    t0="$(now)"
    timeout -k 5 "$lim" "$@" >"$of" 2>"$errf"
    rc=$?
    wall="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }')"
}
# skipped STEP WHAT WHY
skipped() { emit "$1" "$2" -1 0 0 "" "\"skipped\":$(jstr "$3")"; say "  skipped: $3"; }

# ---- devices -----------------------------------------------------------------------------
devjson="$work/tmp/devices.json"
# list_devices: "backend<TAB>index<TAB>type<TAB>name" for each device in $devjson
list_devices() {
    { tr -d '\n' <"$devjson" | sed 's/{"backend":/\n&/g'; echo; } | while IFS= read -r blk; do
        be="$(printf '%s' "$blk" | sed -n 's/^{"backend":"\([^"]*\)".*/\1/p')"
        [ -n "$be" ] || continue
        printf '%s\n' "$blk" | sed 's/{"index":/\n&/g' | while IFS= read -r d; do
            i="$(printf '%s' "$d" | sed -n 's/^{"index":\([0-9]*\),.*/\1/p')"
            [ -n "$i" ] || continue
            n="$(printf '%s' "$d" | sed -n 's/.*"name":"\([^"]*\)".*/\1/p')"
            ty="$(printf '%s' "$d" | sed -n 's/.*"type":"\([^"]*\)".*/\1/p')"
            printf '%s\t%s\t%s\t%s\n' "$be" "$i" "$ty" "$n"
        done
    done
}
in_list() { case ",$2," in *",$1,"*) return 0 ;; esac; return 1; }
is_gpu() { case "$1" in discrete-gpu | integrated-gpu | other) return 0 ;; esac; return 1; }

echo "gpu_check $version: build $build, $(nproc 2>/dev/null || echo ?) cores, budget ${budget} s$([ "$quick" = 1 ] && echo ', --quick')"
"$DUET" --version 2>/dev/null | sed 's/^/  /'
meta="$work/tmp/meta.json"
{
    printf '{"script_version":%s,"args":%s,"quick":%s,"cpu_devices":%s,' "$version" "$(jstr "$argv")" \
        "$([ "$quick" = 1 ] && echo true || echo false)" "$([ "$cpu_devices" = 1 ] && echo true || echo false)"
    printf '"build":%s,"duet_version":%s,"host":%s,"cores":%s,' "$(jstr "$build")" \
        "$(jstr "$("$DUET" --version 2>&1 | tr '\n' ' ')")" "$(jstr "$(uname -a)")" "$(nproc 2>/dev/null || echo 0)"
    printf '"cpu":%s,' "$(jstr "$(sed -n 's/^model name[^:]*: //p' /proc/cpuinfo 2>/dev/null | head -1)")"
    printf '"shape":"%s","types":"%s","contexts":"%s","prefill_tokens":%s,"decode_tokens":%s,' \
        "$shape" "$types" "$ctxs" "$prefill" "$tokens"
    printf '"batch_sequences":"%s","batch_types":"%s","budget_s":%s,"scale":%s,"backends":"%s"}' \
        "$batch" "$batch_types" "$budget" "$scale" "$backends"
} >"$meta"
emit meta "" 0 0 0 "$meta"

run "$(sc $t_devices)" "$devjson" "$DUET" devices --json
emit devices '"phase":"all"' "$rc" "$wall" "$(sc $t_devices)" "$devjson"
echo "devices (duet devices --json):"
list_devices | while IFS="$(printf '\t')" read -r be i ty n; do
    printf '  %-7s %s  %-14s %s\n' "$be" "$i" "$ty" "$n"
done
has_gpu=0 has_cpu_dev=0
for be in $(echo "$backends" | tr ',' ' '); do
    list_devices | awk -F'\t' -v b="$be" '$1 == b { print $3 }' >"$work/tmp/types"
    while read -r ty; do
        if is_gpu "$ty"; then has_gpu=1; else has_cpu_dev=1; fi
    done <"$work/tmp/types"
done
if [ "$has_gpu" = 0 ] && [ "$cpu_devices" = 0 ]; then
    echo "gpu_check: no GPU: none of the devices above (backends $backends) is a GPU." >&2
    echo "  Check the driver's Vulkan ICD (vulkaninfo --summary) and OpenCL ICD (/etc/OpenCL/vendors)," >&2
    echo "  or pass --cpu-devices to measure CPU devices (lavapipe, PoCL) instead." >&2
    out="$outdir/gpu-check-no-gpu-$(date -u +%Y%m%d-%H%M%S).jsonl"
    cat "$pending" >"$out"
    emit stop '"reason":"no GPU"' 3 0 0 ""
    echo "gpu_check: wrote $out"
    exit 3
fi
# With a GPU, hide lavapipe and PoCL: every bench_backend_ops run covers all
# of a backend's devices, and a CPU device's slow run would spend the GPU's
# time box (and a killed run loses the GPU's figures with it).
if [ "$cpu_devices" = 0 ] && [ "$has_cpu_dev" = 1 ]; then
    VK_LOADER_DRIVERS_DISABLE='*lvp*'
    export VK_LOADER_DRIVERS_DISABLE
    vend="${OCL_ICD_VENDORS:-/etc/OpenCL/vendors}"
    if [ -d "$vend" ]; then
        rm -rf "$work/tmp/ocl-vendors"
        mkdir -p "$work/tmp/ocl-vendors"
        for f in "$vend"/*.icd; do
            [ -e "$f" ] || continue
            case "$(basename "$f") $(cat "$f")" in *pocl* | *POCL* | *Pocl*) continue ;; esac
            cp "$f" "$work/tmp/ocl-vendors/"
        done
        OCL_ICD_VENDORS="$work/tmp/ocl-vendors"
        export OCL_ICD_VENDORS
    fi
    run "$(sc $t_devices)" "$devjson" "$DUET" devices --json
    emit devices '"phase":"gpus-only"' "$rc" "$wall" "$(sc $t_devices)" "$devjson" \
        "\"VK_LOADER_DRIVERS_DISABLE\":$(jstr "$VK_LOADER_DRIVERS_DISABLE"),\"OCL_ICD_VENDORS\":$(jstr "${OCL_ICD_VENDORS:-}")"
    echo "devices with lavapipe and PoCL hidden:"
    list_devices | while IFS="$(printf '\t')" read -r be i ty n; do
        printf '  %-7s %s  %-14s %s\n' "$be" "$i" "$ty" "$n"
    done
fi
# The devices measured: "backend<TAB>index<TAB>type<TAB>name".
sel="$work/tmp/selected"
: >"$sel"
list_devices | while IFS="$(printf '\t')" read -r be i ty n; do
    in_list "$be" "$backends" || continue
    if is_gpu "$ty" || [ "$cpu_devices" = 1 ]; then printf '%s\t%s\t%s\t%s\n' "$be" "$i" "$ty" "$n"; fi
done >"$sel"
[ -s "$sel" ] || { echo "gpu_check: no device left to measure" >&2; exit 3; }
slug() { printf '%s' "$1" | tr 'A-Z' 'a-z' | sed -e 's/([^)]*)//g' -e 's/[^a-z0-9]\{1,\}/-/g' -e 's/^-//' -e 's/-$//' | cut -c1-40; }
if [ -z "$name" ]; then
    name="$(cut -f4 "$sel" | while read -r n; do slug "$n"; done | awk '!seen[$0]++' | paste -sd+ -)"
fi
out="$outdir/gpu-check-$name-$(date -u +%Y%m%d-%H%M%S).jsonl"
cat "$pending" >"$out"
rm -f "$pending"
echo "measuring: $(cut -f1,2 "$sel" | tr '\t\n' '/ ')-> $out"

# ---- the device's peak -------------------------------------------------------------------
# Vulkan and OpenCL report no memory bandwidth or FLOP rate: a table by device
# name (vendor spec sheets: GB/s, dense FP16 TFLOP/s without sparsity), and
# nvidia-smi's memory clock and bus width when it is there. bench_backend_ops
# also measures its own peak (a large ADD on GPUs, the STREAM triad on CPU
# devices: "peak_gbs"/"peak_source" in its perf records).
peak_table() { # NAME -> "GB/s TFLOP/s" or nothing
    case "$1" in
    *H200*) echo "4800 989" ;;
    *H100*PCIe* | *H100*PCIE*) echo "2000 756" ;;
    *H100*) echo "3350 989" ;;
    *A100*80GB*) echo "2039 312" ;;
    *A100*) echo "1555 312" ;;
    *L40S*) echo "864 362" ;;
    *L40*) echo "864 181" ;;
    *L4*) echo "300 121" ;;
    *A10G*) echo "600 70" ;;
    *A10*) echo "600 125" ;;
    *T4*) echo "320 65" ;;
    *"RTX 4090"*) echo "1008 165" ;;
    *"RTX 3090"*) echo "936 71" ;;
    *"RTX A6000"*) echo "768 155" ;;
    *MI300X* | *"gfx942"*) echo "5300 1307" ;;
    *MI250*) echo "3277 362" ;;
    *MI210*) echo "1638 181" ;;
    *"RX 7900 XTX"*) echo "960 123" ;;
    *"Arc(TM) A770"* | *"A770"*) echo "560 39" ;;
    esac
}
smi=""
command -v nvidia-smi >/dev/null 2>&1 && smi="$(timeout 10 nvidia-smi \
    --query-gpu=name,driver_version,memory.total,clocks.max.memory,clocks.max.sm,power.limit --format=csv,noheader 2>/dev/null | head -4 | tr '\n' ';')"
while IFS="$(printf '\t')" read -r be i ty n; do
    pk="$(peak_table "$n")"
    if [ -n "$pk" ]; then
        src="table in bench/gpu_check.sh by device name (vendor spec sheet)"
        gbs="${pk% *}" tfl="${pk#* }"
    else
        src="none: not in the table (bench_backend_ops's measured peak_gbs applies)"
        gbs=null tfl=null
    fi
    emit peak "\"backend\":\"$be\",\"device_index\":$i,\"device\":$(jstr "$n"),\"device_type\":\"$ty\"" 0 0 0 "" \
        "\"peak_gbs\":$gbs,\"peak_tflops_f16\":$tfl,\"peak_source\":$(jstr "$src"),\"nvidia_smi\":$(jstr "$smi")"
    say "peak $be/$i $n: ${gbs} GB/s, ${tfl} TFLOP/s f16 ($src)"
done <"$sel"

# ---- models, made in the background while parity runs ---------------------------------
# f16 by mkmodel, the rest by duet quantize from it. Each lands at the name
# bench_decode's duet_mkmodel_cached looks for (shape-type, seed 1, ctx 0),
# so `bench_decode --models SHAPE-TYPE` takes it, 4-bit types included; it
# is made with --ctx large enough for the longest context measured.
probe="$("$DUET" mkmodel --shape tiny --type f32 2>/dev/null | tail -1)"
mver="$(printf '%s' "$probe" | sed -n 's/.*synthetic-v\([0-9]*\)-tiny-f32-.*/\1/p')"
mdir="$(dirname "$probe")"
[ -n "$mver" ] && [ -d "$mdir" ] || { echo "gpu_check: duet mkmodel did not print its cache path ($probe)" >&2; exit 2; }
model_path() { echo "$mdir/synthetic-v$mver-$shape-$1-ctx0-seed1.gguf"; }
stamp_ok() { [ -f "$work/tmp/model-$1.done" ] && [ -s "$(model_path "$1")" ] && [ "$(cat "$work/tmp/model-$1.done")" = "$model_ctx" ]; }
make_models() {
    lim="$(sc $t_models)"
    f16="$(model_path f16)"
    if ! stamp_ok f16; then
        rm -f "$work/tmp/model-f16.done"
        run "$lim" "$work/tmp/mk.out" "$DUET" mkmodel --shape "$shape" --type f16 --seed 1 --ctx "$model_ctx" -o "$f16.tmp"
        [ "$rc" = 0 ] && mv "$f16.tmp" "$f16" && echo "$model_ctx" >"$work/tmp/model-f16.done"
        emit model "\"model\":\"$shape-f16\",\"type\":\"f16\",\"how\":\"mkmodel\"" "$rc" "$wall" "$lim" "" \
            "\"bytes\":$(stat -c %s "$f16" 2>/dev/null || echo 0),\"path\":$(jstr "$f16"),\"model_ctx\":$model_ctx"
    else
        emit model "\"model\":\"$shape-f16\",\"type\":\"f16\",\"how\":\"kept\"" 0 0 0 "" \
            "\"bytes\":$(stat -c %s "$f16"),\"path\":$(jstr "$f16"),\"model_ctx\":$model_ctx"
    fi
    for ty in $(echo "$types,$batch_types" | tr ',' '\n' | awk '!s[$0]++'); do
        [ "$ty" = f16 ] && continue
        p="$(model_path "$ty")"
        if stamp_ok "$ty"; then
            emit model "\"model\":\"$shape-$ty\",\"type\":\"$ty\",\"how\":\"kept\"" 0 0 0 "" "\"bytes\":$(stat -c %s "$p"),\"path\":$(jstr "$p")"
        elif stamp_ok f16; then
            rm -f "$work/tmp/model-$ty.done"
            run "$lim" "$work/tmp/q.out" "$DUET" quantize "$f16" "$p.tmp" --type "$ty"
            [ "$rc" = 0 ] && mv "$p.tmp" "$p" && echo "$model_ctx" >"$work/tmp/model-$ty.done"
            emit model "\"model\":\"$shape-$ty\",\"type\":\"$ty\",\"how\":\"quantize from f16\"" "$rc" "$wall" "$lim" "" \
                "\"bytes\":$(stat -c %s "$p" 2>/dev/null || echo 0),\"path\":$(jstr "$p")"
        fi
        [ -f "$work/tmp/model-$ty.done" ] || echo failed >"$work/tmp/model-$ty.failed"
    done
    : >"$work/tmp/models.finished"
}
rm -f "$work/tmp/models.finished" "$work"/tmp/model-*.failed
(errf="$work/tmp/err.models" recf="$work/tmp/rec.models" make_models) >"$work/tmp/models.log" 2>&1 &
models_pid=$!
say "making $shape models ($types, model context $model_ctx) in the background (pid $models_pid)"
# wait_model TYPE: until its file is there (or the maker gave up); 0 when ready
wait_model() {
    while :; do
        [ -f "$work/tmp/model-$1.done" ] && return 0
        [ -f "$work/tmp/model-$1.failed" ] || [ -f "$work/tmp/models.finished" ] && return 1
        [ "$(left)" -lt 5 ] && return 1
        sleep 1
    done
}

backend_devices() { awk -F'\t' -v b="$1" '$1 == b { print $2 }' "$sel"; }
dev_name() { awk -F'\t' -v b="$1" -v i="$2" '$1 == b && $2 == i { print $4 }' "$sel"; }
sel_backends="$(cut -f1 "$sel" | awk '!s[$0]++' | tr '\n' ' ')"

# ---- 1. op parity ------------------------------------------------------------------------
if [ "$do_parity" = 1 ]; then
    # the default variant first (what runs in production; quick), then every forced path
    for pv in $parity_variants; do for be in $sel_backends; do
        lim="$(box $t_parity)"
        w="\"backend\":\"$be\",\"variants\":\"$pv\",\"cases\":\"small\""
        [ "$lim" = 0 ] && { skipped parity "$w" "budget spent"; continue; }
        say "parity $be: bench_backend_ops --mode test --cases small --variants $pv (box ${lim} s)"
        rm -f "$work/tmp/parity.json"
        run "$lim" "$work/tmp/parity.txt" "$build/bench_backend_ops" --mode test --cases small --backends "$be" \
            --variants "$pv" --json --out "$work/tmp/parity.json"
        emit parity "$w" "$rc" "$wall" "$lim" "$work/tmp/parity.json"
        say "  rc $rc in ${wall} s: $(sed -n 's/.*"passed":[[:space:]]*\([0-9]*\).*/\1/p' "$work/tmp/parity.json" 2>/dev/null | tail -1) passed," \
            "$(sed -n 's/.*"failed":[[:space:]]*\([0-9]*\).*/\1/p' "$work/tmp/parity.json" 2>/dev/null | tail -1) failed (summary)"
    done; done
fi

# ---- 2. decode (batch 1) and prefill, per type, backend and device ------------------------
prompt_words() { # N words the synthetic tokenizer makes about one token each
    awk -v n="$1" 'BEGIN { k = split("the cat sat on a mat and it ran to see the dog by the old red", w, " ");
        for (i = 0; i < n; i++) printf "%s%s", (i ? " " : ""), w[i % k + 1] }'
}
n_ids() { # tokens of a prompt (with BOS) under a model's tokenizer
    "$DUET" tokenize --json -m "$1" "$2" 2>/dev/null | sed -n 's/.*"ids":\[\([^]]*\)\].*/\1/p' | tr ',' '\n' | grep -c .
}
prompt="" prompt_n=$((prefill - 1))
ordered_types="$(echo "q8_0,$types" | tr ',' '\n' | awk -v t=",$types," 'index(t, "," $0 ",") && !s[$0]++' | tr '\n' ' ')"
for ty in $ordered_types; do
    if ! wait_model "$ty"; then
        skipped decode "\"model\":\"$shape-$ty\",\"type\":\"$ty\"" "model not made (see the model records)"
        continue
    fi
    mp="$(model_path "$ty")"
    if [ -z "$prompt" ]; then # scale the word count to the target, then trim any excess (a word is >= 1 token)
        prompt="$(prompt_words "$prompt_n")"
        k="$(n_ids "$mp" "$prompt")"
        if [ "$k" -gt 0 ]; then
            prompt_n=$((prompt_n * prefill / k))
            [ "$prompt_n" -lt 1 ] && prompt_n=1
            prompt="$(prompt_words "$prompt_n")"
            k="$(n_ids "$mp" "$prompt")"
            if [ "$k" -gt "$prefill" ] && [ "$prompt_n" -gt $((k - prefill)) ]; then
                prompt_n=$((prompt_n - (k - prefill)))
                prompt="$(prompt_words "$prompt_n")"
            fi
        fi
    fi
    for be in $sel_backends; do
        for i in $(backend_devices "$be"); do
            dn="$(dev_name "$be" "$i")"
            w="\"backend\":\"$be\",\"device_index\":$i,\"device\":$(jstr "$dn"),\"model\":\"$shape-$ty\",\"type\":\"$ty\""
            # one bench_decode per context: a long context that runs out of
            # its box does not take the short one's figures with it
            for c in $(echo "$ctxs" | tr ',' ' '); do
            lim="$(box $t_decode)"
            if [ "$lim" = 0 ]; then skipped decode "$w,\"contexts\":\"$c\"" "budget spent"; else
                say "decode $be/$i $shape-$ty: bench_decode --ctx $c --tokens $tokens (box ${lim} s)"
                run "$lim" "$work/tmp/decode.json" "$build/bench_decode" --backend "$be" --device "$i" \
                    --models "$shape-$ty" --ctx "$c" --tokens "$tokens" --json
                emit decode "$w,\"contexts\":\"$c\",\"tokens\":$tokens" "$rc" "$wall" "$lim" "$work/tmp/decode.json"
                say "  rc $rc in ${wall} s: $(tr -d '\n\t' <"$work/tmp/decode.json" | sed -n 's/.*"prefill_tokens_per_s":\([0-9.]*\).*/prefill-128 \1 tok\/s;/p')" \
                    "$(tr -d '\n\t' <"$work/tmp/decode.json" | grep -o '"context":[0-9]*,"tokens_per_s":[0-9.]*' | sed 's/"context":\([0-9]*\),"tokens_per_s":\([0-9.]*\)/ctx \1: \2 tok\/s/' | tr '\n' ' ')"
            fi
            done
            lim="$(box $t_prefill)"
            if [ "$lim" = 0 ]; then skipped prefill "$w" "budget spent"; else
                say "prefill $be/$i $shape-$ty: duet run --json, $prefill-token prompt (box ${lim} s)"
                run "$lim" "$work/tmp/run.json" "$DUET" run -m "$mp" --backend "$be" --device "$i" -p "$prompt" \
                    -n "$tokens" --temp 0 --ignore-eos -c "$((prefill + tokens + 64))" --json
                # token lists and generated text (arbitrary bytes) are left out
                n_prompt="$(sed -n 's/.*"prompt_tokens":\[\([^]]*\)\].*/\1/p' "$work/tmp/run.json" | tr ',' '\n' | grep -c .)"
                sed -e 's/"prompt_tokens":\[[^]]*\],//' -e 's/"tokens":\[[^]]*\],//' \
                    -e 's/"text":"\([^"\\]\|\\.\)*",//' "$work/tmp/run.json" | LC_ALL=C tr -d '\200-\377' >"$work/tmp/run2.json"
                emit prefill "$w,\"prompt_tokens\":$n_prompt,\"tokens\":$tokens" "$rc" "$wall" "$lim" "$work/tmp/run2.json"
                say "  rc $rc in ${wall} s: $n_prompt prompt tokens: $(sed -n 's/.*"prefill_tokens_per_s":\([0-9.]*\).*"decode_tokens_per_s":\([0-9.]*\).*/prefill \1 tok\/s, decode \2 tok\/s/p' "$work/tmp/run2.json")"
            fi
        done
    done
done

# ---- 3. batched decode -------------------------------------------------------------------
if [ "$do_batch" = 1 ]; then
    for ty in $(echo "$batch_types" | tr ',' ' '); do
        wait_model "$ty" || { skipped batched "\"type\":\"$ty\"" "model not made"; continue; }
        for be in $sel_backends; do
            # bench_batching has no --device: the backend's best device
            w="\"backend\":\"$be\",\"device_index\":null,\"device\":\"best of the backend\",\"model\":\"$shape-$ty\",\"type\":\"$ty\""
            lim="$(box $t_batch)"
            [ "$lim" = 0 ] && { skipped batched "$w" "budget spent"; continue; }
            say "batched $be $shape-$ty: bench_batching --concurrency $batch --tokens $batch_tokens (box ${lim} s)"
            run "$lim" "$work/tmp/batch.json" "$build/bench_batching" -m "$(model_path "$ty")" --backend "$be" \
                --concurrency "$batch" --tokens "$batch_tokens" --json
            emit batched "$w,\"sequences\":\"$batch\",\"tokens_per_request\":$batch_tokens" "$rc" "$wall" "$lim" "$work/tmp/batch.json"
            say "  rc $rc in ${wall} s: $(tr -d '\n\t' <"$work/tmp/batch.json" | grep -o '"concurrency":[0-9]*,"generation_tokens_per_s":[0-9.]*' | sed 's/"concurrency":\([0-9]*\),"generation_tokens_per_s":\([0-9.]*\)/\1 seqs: \2 tok\/s/' | tr '\n' ' ')"
        done
    done
fi

# ---- 4. op GB/s and GFLOP/s against the peak ----------------------------------------------
perf_run() { # VARIANTS BOX: bench_backend_ops --mode perf on each backend
    for be in $sel_backends; do
        lim="$(box "$2")"
        w="\"backend\":\"$be\",\"variants\":\"$1\",\"filter\":$(jstr "$perf_filter")"
        [ "$lim" = 0 ] && { skipped perf "$w" "budget spent"; continue; }
        say "perf $be: bench_backend_ops --mode perf --variants $1 $perf_opts --filter '$perf_filter' (box ${lim} s)"
        rm -f "$work/tmp/perf.json"
        # shellcheck disable=SC2086 # $perf_opts: options, split on purpose
        run "$lim" "$work/tmp/perf.txt" "$build/bench_backend_ops" --mode perf $perf_opts --backends "$be" \
            --variants "$1" --filter "$perf_filter" --json --out "$work/tmp/perf.json"
        emit perf "$w" "$rc" "$wall" "$lim" "$work/tmp/perf.json"
        # rows: case, variant, GB/s, GFLOP/s, fraction of bench_backend_ops's peak
        tr -d '\n\t' <"$work/tmp/perf.json" 2>/dev/null | sed 's/{"op":/\n&/g' |
            sed -n 's/.*"case":"\([^"]*\)".*"variant":"\([^"]*\)".*"gbs":\([0-9.e+-]*\),"gflops":\([0-9.e+-]*\),"frac_peak_bw":\([0-9.e+-]*\).*/\1|\2|\3|\4|\5/p' |
            awk -F'|' '{ printf "  %-34s %-28s %8.1f GB/s %9.1f GFLOP/s %5.1f%% of peak\n", substr($1, 1, 34), substr($2, 1, 28), $3, $4, 100 * $5 }'
        tr -d '\n\t' <"$work/tmp/perf.json" 2>/dev/null | grep -o '"peak_gbs":[0-9.e+-]*,"peak_source":"[^"]*"' | sed 's/^/  /'
    done
}
[ "$do_perf" = 1 ] && perf_run default "$t_perf"

# ---- 5. llama.cpp side by side -----------------------------------------------------------
if [ -n "$llama" ]; then
    ldir="$(dirname "$llama")"
    for ty in $ordered_types; do
        wait_model "$ty" || continue
        lim="$(box $t_llama)"
        w="\"engine\":\"llama.cpp\",\"model\":\"$shape-$ty\",\"type\":\"$ty\",\"binary\":$(jstr "$llama")"
        [ "$lim" = 0 ] && { skipped llama "$w" "budget spent"; continue; }
        say "llama-bench $shape-$ty: -p $prefill -n $tokens -d 0,$max_ctx -ngl 99 (box ${lim} s)"
        LD_LIBRARY_PATH="$ldir:$LD_LIBRARY_PATH" run "$lim" "$work/tmp/llama.txt" "$llama" -m "$(model_path "$ty")" \
            -p "$prefill" -n "$tokens" -d "0,$max_ctx" -ngl 99 -r 2 -o json
        emit llama "$w" "$rc" "$wall" "$lim" "$work/tmp/llama.txt"
        tr -d '\n\t' <"$work/tmp/llama.txt" | sed 's/},[[:space:]]*{/}\n{/g' |
            sed -n 's/.*"n_prompt": *\([0-9]*\).*"n_gen": *\([0-9]*\).*"n_depth": *\([0-9]*\).*"avg_ts": *\([0-9.e+-]*\).*/  pp \1 tg \2 depth \3: \4 tok\/s/p'; echo
    done
fi

# ---- 6. tuning sweeps (what time is left) ------------------------------------------------
# Each candidate: bench_decode on the q8_0 model at the first context, with
# DUET_VK_TUNE / DUET_OPENCL_TUNE set; the default runs first as the baseline.
vk_sweep="default matmul=subgroup,sg_rows=1 matmul=subgroup,sg_rows=2 matmul=subgroup,sg_rows=4 matmul=subgroup,sg_wg=128,sg_rows=2 matmul=subgroup,sg_wg=256,sg_rows=2 matmul=tile,tile_rows=4 matmul=tile,tile_rows=8 dot=0 attn=lane attn=flash mm_min=8 mm_min=32"
ocl_sweep="default mv_r=16,mv_wg=64 mv_r=32,mv_wg=128 mv_r=64,mv_wg=256 mv_r=32,mv_wg=64,mv_nr=4 mv_r=32,mv_wg=128,mv_vw=8 dot=0 mm_tile_min=8 mm_tile_min=32 clblast_min=0 clblast_min=16 att_mode=1"
if [ "$quick" = 1 ]; then
    vk_sweep="default tile_rows=4 dot=0"
    ocl_sweep="default mv_nr=4 dot=0"
fi
# every forced kernel path of the perf cases (bench_backend_ops's bo_perf_variants), full run only
[ "$do_perf" = 1 ] && [ "$tune_perf" = 1 ] && perf_run perf "$t_perf_variants"
if [ "$do_sweep" = 1 ] && wait_model q8_0; then
    c1="${ctxs%%,*}"
    for be in $sel_backends; do
        case "$be" in vulkan) var=DUET_VK_TUNE list="$vk_sweep" ;; opencl) var=DUET_OPENCL_TUNE list="$ocl_sweep" ;; *) continue ;; esac
        for i in $(backend_devices "$be"); do
            for cand in $list; do
                w="\"backend\":\"$be\",\"device_index\":$i,\"device\":$(jstr "$(dev_name "$be" "$i")"),\"model\":\"$shape-q8_0\",\"type\":\"q8_0\",\"tune_var\":\"$var\",\"tune\":$(jstr "$cand")"
                lim="$(box $t_sweep)"
                [ "$lim" = 0 ] && { skipped sweep "$w" "budget spent"; continue; }
                val=""; [ "$cand" != default ] && val="$cand"
                run "$lim" "$work/tmp/sweep.json" env "$var=$val" "$build/bench_decode" --backend "$be" --device "$i" \
                    --models "$shape-q8_0" --ctx "$c1" --tokens "$tokens" --json
                emit sweep "$w,\"contexts\":\"$c1\",\"tokens\":$tokens" "$rc" "$wall" "$lim" "$work/tmp/sweep.json"
                say "sweep $be/$i $var=$cand: rc $rc: $(tr -d '\n\t' <"$work/tmp/sweep.json" | sed -n 's/.*"prefill_tokens_per_s":\([0-9.]*\).*"tokens_per_s":\([0-9.]*\).*/prefill-128 \1, decode \2 tok\/s/p')"
            done
        done
    done
fi

# ---- done --------------------------------------------------------------------------------
wait "$models_pid" 2>/dev/null
emit end "" 0 "$(elapsed)" "$budget" "" "\"records\":$(($(wc -l <"$out") + 1))"
lines="$(wc -l <"$out")"
say "done: $lines records in $out"
exit 0
