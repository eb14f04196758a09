#!/bin/sh
cd /work/main
M=/tmp/g125/125m-q8_0.gguf
build/duet serve -m $M -t 2 --port 18331 --slo-itl-ms 200 --slo-ttft-ms 2000 > /tmp/gp/d125.log 2>&1 & P=$!
for i in $(seq 60); do curl -sf http://127.0.0.1:18331/health >/dev/null && break; sleep 1; done
B="--random-input-len 100 --random-output-len 64 --warmup 10 --slo-ttft-ms 2000 --slo-itl-ms 200 --no-progress"
build/duet-bench --base-url http://127.0.0.1:18331 --label duet $B --num-prompts 200 --sweep-rate 6,7 --seed 41 \
  --output-dir /tmp/gp/g125x > /tmp/gp/g125x.log 2>&1
echo "rc $?"
kill $P; wait
