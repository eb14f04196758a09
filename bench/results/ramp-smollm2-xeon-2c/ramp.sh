#!/bin/sh
# One 10-minute ramp, 20% -> 150% -> 20% of capacity (C = 5.2 req/s: the best
# static setting's served rate at offered 8), plateaus of 60 s at each end and the top.
cd /work/main
M=/work/shared/models/smollm2-135m-instruct-q4_k_m.gguf
NAME=$1; shift
./build/duet-bench --serve-cmd "./build/duet serve -m $M -t 2 --slo-ttft-ms 2000 --slo-itl-ms 200 $*" \
  --backend cpu -m $M --max-batch-seqs 16 --rate-profile 0:1.04,60:1.04,270:7.8,330:7.8,540:1.04,600:1.04 \
  --timeline 30 --random-input-len 100 --random-output-len 64 --priority-mix 0.5 --seed 21 \
  --slo-ttft-ms 2000 --slo-itl-ms 200 --output-dir /tmp/ramp/$NAME --save-detailed --no-progress > /tmp/ramp/$NAME.log 2>&1
echo "$NAME rc $?"
