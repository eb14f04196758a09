#!/bin/sh
# run2.sh OUT RATES: fresh llama-server -np 8 and -np 4, duet-bench side by side.
OUT=$1; RATES=$2
cd /work/main
M=/work/shared/models/smollm2-135m-instruct-q4_k_m.gguf
LS=/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server
$LS -m $M -t 2 -c 16384 --port 18323 -np 8 > /tmp/gp/$OUT-np8.log 2>&1 & P1=$!
$LS -m $M -t 2 -c 16384 --port 18324 -np 4 > /tmp/gp/$OUT-np4.log 2>&1 & P2=$!
for p in 18323 18324; do for i in $(seq 60); do curl -sf http://127.0.0.1:$p/health >/dev/null && break; sleep 1; done; done
B="--random-input-len 100 --random-output-len 64 --warmup 10 --slo-ttft-ms 2000 --slo-itl-ms 200 --no-progress"
build/duet-bench --base-url http://127.0.0.1:18323 --label llama-np8 --peer llama-np4=http://127.0.0.1:18324 $B \
  --num-prompts 200 --sweep-rate $RATES --seed 31 --output-dir /tmp/gp/$OUT > /tmp/gp/$OUT.log 2>&1
echo "rc $?"
kill $P1 $P2; wait
