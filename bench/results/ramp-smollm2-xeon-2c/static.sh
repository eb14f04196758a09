#!/bin/sh
# The static sweep for issue 18's ramp: the controller off (--static-knobs),
# knobs max_batch_seqs x step budget share, rates around the knee.
cd /work/main
M=/work/shared/models/smollm2-135m-instruct-q4_k_m.gguf
for S in ${SHARES:-0.5 0.8 1}; do
  ./build/duet-bench --serve-cmd "./build/duet serve -m $M -t 2 --slo-ttft-ms 2000 --slo-itl-ms 200 --static-knobs --step-budget-share $S" \
    --backend cpu -m $M --sweep-max-batch-seqs ${MBS:-8,16} --sweep-rate ${RATES:-3,4,5} --num-prompts ${N:-40} \
    --random-input-len 100 --random-output-len 64 --priority-mix 0.5 --seed ${SEED:-11} \
    --slo-ttft-ms 2000 --slo-itl-ms 200 --output-dir /tmp/ramp/static-s$S${TAG:-} --no-progress --no-plots > /tmp/ramp/static-s$S${TAG:-}.log 2>&1
  echo "share $S rc $?"
done
