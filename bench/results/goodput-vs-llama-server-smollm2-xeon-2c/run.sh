#!/bin/sh
# run.sh OUT RATES NP...: fresh duet serve and llama-server -np N for each N, then duet-bench side by side.
OUT=$1; RATES=$2; shift 2
cd /work/main
M=/work/shared/models/smollm2-135m-instruct-q4_k_m.gguf
LS=/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server
build/duet serve -m $M -t 2 --port 18321 --slo-itl-ms 200 --slo-ttft-ms 2000 > /tmp/gp/$OUT-duet.log 2>&1 &
PIDS=$!
PEERS=""; port=18322
for np in "$@"; do
  $LS -m $M -t 2 -c 16384 --port $port -np $np > /tmp/gp/$OUT-np$np.log 2>&1 &
  PIDS="$PIDS $!"; PEERS="$PEERS --peer llama-np$np=http://127.0.0.1:$port"; port=$((port+1))
done
for p in 18321 $(seq 18322 $((port-1))); do
  for i in $(seq 60); do curl -sf http://127.0.0.1:$p/health >/dev/null && break; sleep 1; done
done
B="--random-input-len 100 --random-output-len 64 --warmup 10 --slo-ttft-ms 2000 --slo-itl-ms 200 --no-progress"
build/duet-bench --base-url http://127.0.0.1:18321 --label duet $PEERS $B --num-prompts 200 --sweep-rate $RATES \
  --seed 31 --output-dir /tmp/gp/$OUT > /tmp/gp/$OUT.log 2>&1
echo "rc $?"
kill $PIDS; wait
