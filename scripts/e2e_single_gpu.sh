#!/usr/bin/env bash
# Our launcher end to end on one GPU: gemma2_like (V = 256000), bf16, sequence 4096,
# `--local-attention sdpa`, cce against megatron-core's fused loss
# (`--cross-entropy-loss-fusion --cross-entropy-fusion-impl native`), same seed and data.
#
#     bash scripts/e2e_single_gpu.sh RESULTS_DIR [MICRO_BATCH] [STEPS]
#
# Writes RESULTS_DIR/e2e_{cce,fused}.jsonl (per-step loss, time, peak memory) and logs. Run the
# carried-wheel setup first (scripts/gpu_single.sh RESULTS_DIR setup).
set -uo pipefail
results=$1
mbs=${2:-2}
steps=${3:-30}
mkdir -p "$results"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
for run in cce fused; do
    if [[ $run == cce ]]; then loss=(--cross-entropy-fusion-impl cce)
    else loss=(--cross-entropy-fusion-impl native --cross-entropy-loss-fusion); fi
    timeout 200 torchrun --nproc-per-node 1 --master-port 29513 scripts/pretrain_gpt.py \
        --config gemma2_like --bf16 --seq-length 4096 --micro-batch-size "$mbs" \
        --global-batch-size $((mbs * 4)) --train-iters "$steps" --lr 3e-4 --min-lr 3e-5 \
        --lr-warmup-iters 5 --lr-decay-style cosine --log-interval 10 \
        --local-attention sdpa --log-json "$results/e2e_$run.jsonl" "${loss[@]}" \
        > "$results/e2e_$run.log" 2>&1
    echo "=== $run: exit $?"
    tail -n 4 "$results/e2e_$run.log"
done
