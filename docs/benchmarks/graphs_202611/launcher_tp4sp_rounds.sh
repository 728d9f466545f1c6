#!/usr/bin/env bash
# The launcher (scripts/pretrain_gpt.py) at TP4 + SP, gemma2_like, megatron fused and cce
# alternating, 30 steps a run, each eager and under --cuda-graph-impl full_iteration (GRAPHS,
# default "none graphs"); the median step over steps 11-30 of each run. Then the loss alone at
# scripts/megatron_lm_step.sh's shapes (4096 tokens a TP group, hidden 2048, V = 131072). On a
# 4-GPU machine (TP=2 on two: the same model at TP2 + SP) with the carried wheels
# (scripts/gpu_suite.sh, stage setup), from the root:
#
#     bash docs/benchmarks/graphs_202611/launcher_tp4sp_rounds.sh RESULTS
#     ROUNDS="3 4 5" BENCH=0 bash docs/benchmarks/graphs_202611/launcher_tp4sp_rounds.sh RESULTS
#     TP=2 BENCH=0 bash docs/benchmarks/graphs_202611/launcher_tp4sp_rounds.sh RESULTS
set -uo pipefail
R=${1:?usage: launcher_tp4sp_rounds.sh RESULTS_DIR}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
bash scripts/gpu_suite.sh "$R/setup" setup > "$R/setup.log" 2>&1 || { tail -3 "$R/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site
tp=${TP:-4}
for round in ${ROUNDS:-1 2}; do
    for impl in native-fused cce; do
        case $impl in
            native-fused) loss=(--cross-entropy-fusion-impl native --cross-entropy-loss-fusion) ;;
            *) loss=(--cross-entropy-fusion-impl cce) ;;
        esac
        for graphs in ${GRAPHS:-none graphs}; do
            name=tp${tp}sp_${impl}_r$round start=$SECONDS
            flags=()
            if [[ $graphs == graphs ]]; then
                name=tp${tp}sp_${impl}_graphs_r$round
                flags=(--cuda-graph-impl full_iteration)
            fi
            timeout 150 torchrun --nproc-per-node "$tp" --master-port 29511 \
                scripts/pretrain_gpt.py --config gemma2_like --bf16 --seq-length 4096 \
                --micro-batch-size 1 --global-batch-size 8 --train-iters 30 --lr 3e-4 \
                --min-lr 3e-5 --lr-warmup-iters 20 --lr-decay-style cosine --log-interval 10 \
                --log-json "$R/$name.jsonl" --local-attention sdpa --sequence-parallel \
                --tensor-model-parallel-size "$tp" "${loss[@]}" "${flags[@]}" > "$R/$name.log" 2>&1
            echo "=== $name exit $? after $((SECONDS - start)) s"
            grep -E "Error|Traceback|captured" "$R/$name.log" | tail -3
        done
    done
done
python3 - "$R" <<'PY'
import json, pathlib, statistics, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.jsonl")):
    records = [json.loads(line) for line in f.read_text().splitlines()]
    steps = [r["step_s"] * 1e3 for r in records if r["step"] > 10]
    peak = max(max(r["peak_gib"]) for r in records)
    print(f"{f.stem:28s} median {statistics.median(steps):7.1f} ms, min {min(steps):7.1f}, "
          f"max {max(steps):7.1f}, peak {peak:.3f} GiB, loss {records[-1]['loss']:.6f}")
PY
[[ ${BENCH:-1} == 1 ]] || exit 0
timeout 200 torchrun --nproc-per-node "$tp" -m lce_train.bench_parallel --models megatron_lm_step \
    --tokens 4096 --tp $(seq -s ' ' 2 2 "$tp") --sp off --providers ours ours-masked megatron-fused --no-softcap \
    --iters 30 --warmup 5 --out "$R/bench_step_shape.csv" 2>&1 | grep -v -i warn | tail -10
