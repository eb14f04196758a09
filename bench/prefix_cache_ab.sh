#!/bin/sh
# prefix_cache_ab.sh — TTFT with and without automatic prefix caching on
# chat-like traffic: every prompt is a shared random "system prompt" of
# PREFIX tokens plus its own QUESTION tokens, one request at a time, against
# `duet serve` started with and without --no-prefix-cache, interleaved
# (on, off, on, off, ...), so drift on a shared machine hits both alike.
# After each run the server's /metrics gives the prefix cache counters.
#
#   sh bench/prefix_cache_ab.sh BUILD_DIR MODEL OUT_DIR [ROUNDS] [PROMPTS]
set -eu
build=$1 model=$2 out=$3 rounds=${4:-3} n=${5:-20}
prefix=${PREFIX:-400} question=${QUESTION:-50} output=${OUTPUT:-16} threads=${THREADS:-2}
port=${PORT:-8157}
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
    for mode in on off; do
        flag=""
        [ "$mode" = off ] && flag="--no-prefix-cache"
        "$build/duet" serve -m "$model" -t "$threads" --port "$port" $flag >"$out/server-$mode-$r.log" 2>&1 &
        pid=$!
        i=0
        until curl -sf "http://127.0.0.1:$port/ready" >/dev/null 2>&1; do
            i=$((i + 1)); [ $i -gt 600 ] && { kill $pid; echo "server did not start" >&2; exit 1; }
            sleep 0.1
        done
        "$build/duet-bench" --base-url "http://127.0.0.1:$port" -m "$model" --random-prefix-len "$prefix" \
            --random-input-len "$question" --random-output-len "$output" --num-prompts "$n" --max-concurrency 1 \
            --warmup 0 --seed "$r" --no-plots --no-progress --label "cache-$mode" \
            --output-dir "$out/$mode-$r" >"$out/bench-$mode-$r.txt" 2>&1
        curl -sf "http://127.0.0.1:$port/metrics" | grep -E '^vllm:prefix_cache_(queries|hits)_total' \
            >"$out/prefix-metrics-$mode-$r.txt" || true
        kill $pid
        wait $pid || true
    done
done
