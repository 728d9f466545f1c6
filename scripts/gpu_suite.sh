#!/usr/bin/env bash
# The multi-GPU evidence of docs/benchmarks/vocab_parallel.md and training_step.md, in named stages, on one machine with
# 4 GPUs (the device tool's nvidia-h200-x4), from the repository root:
#
#     bash scripts/gpu_suite.sh RESULTS_DIR STAGE [STAGE ...]
#
# NGPU=8 (default 4) runs the same stages on 8 GPUs: bench adds TP=8, megatron runs
# TP8 and TP4 x PP2, max-mbs runs at TP8. NGPU=2 (nvidia-h200-x2): bench at TP 1 and 2, megatron
# and max-mbs run at TP2.
#
# Stages:
#   setup        install the carried wheels (.whl/: megatron-core, ...) and this package
#   gpu-tests    every GPU case in under 10 minutes (scripts/gpu_tests.py): the NCCL cases on
#                all GPUs beside the one-GPU cases, a file or a shard of one per GPU at a time
#   tests        NCCL correctness at TP=2 and 4 (tests/parallel/test_parallel_nccl.py, TP=2 edge
#                cases in tests/parallel/test_parallel_reliability.py) and the Megatron-LM
#                plugin tests (megatron/training from the megatron-core wheel)
#   bench        lce_train.bench_parallel: TP 1, 2, 4, SP off/on, ours (default, gemm, lean),
#                megatron's fused and unfused losses and the collectives alone, at the Gemma-2 2B
#                and Llama-3 8B shapes, without softcap (megatron-core has none)
#   pp-gemma     lce-pp-memory-balance --measure, Gemma-2 2B width, 8 layers, TP2 x PP2
#   pp-llama     the same, Llama-3 8B width, 8 layers, PP4
#   megatron     the launcher on configs/models/$CONFIG.yaml (default gemma2_like; llama3_like
#                is Llama-3's width), cce, native and native-fused (--cross-entropy-loss-fusion),
#                TP4 and TP2 x PP2 (NGPU=8: TP8 and TP4 x PP2), $STEPS steps each (default 200)
#   max-mbs      lce_train.max_micro_batch, cce, native and native-fused, TP = NGPU, sequence 4096
#
# The multi-GPU targets on 2 x H200 (nvidia-h200-x2), every stage bounded, about 25 min:
#
#     NGPU=2 bash scripts/gpu_suite.sh $OUT/s setup tests bench
#     NGPU=2 STEPS=30 LAUNCH_FLAGS="--local-attention sdpa --sequence-parallel" \
#         bash scripts/gpu_suite.sh $OUT/s megatron max-mbs              # gemma2_like
#     NGPU=2 STEPS=30 CONFIG=llama3_like LAUNCH_FLAGS="..." bash scripts/gpu_suite.sh $OUT/l megatron max-mbs
#
# LAUNCH_FLAGS adds launcher flags to the megatron and max-mbs stages (e.g. "--local-attention
# sdpa --sequence-parallel"). Each stage writes its logs under RESULTS_DIR and is bounded by `timeout`, so one stage that
# hangs costs its own limit, not the rest. DATA_PATH (a token-file prefix) switches the launcher
# runs from mock data to that file.
set -uo pipefail
results=$1; shift
mkdir -p "$results"
export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # the carried wheels (stage setup)
steps=${STEPS:-200}
ngpu=${NGPU:-4}
model=(--config "${CONFIG:-gemma2_like}")
if [[ $ngpu == 2 ]]; then
    bench_tp=(1 2); layouts=("tp2:2:1")
elif [[ $ngpu == 8 ]]; then
    # TP8 splits the key/value heads 8 ways: gemma2_like's 4 groups become 8 at every layout.
    bench_tp=(1 2 4 8); layouts=("tp8:8:1" "tp4pp2:4:2"); model+=(--num-query-groups 8)
else
    bench_tp=(1 2 4); layouts=("tp4:4:1" "tp2pp2:2:2")
fi
data=()
if [[ -n "${DATA_PATH:-}" ]]; then data=(--data-path "$DATA_PATH"); fi

run() {  # run NAME SECONDS CMD...: log to RESULTS/NAME.log, keep going on failure
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*" | tee -a "$results/stages.log"
    local start=$SECONDS
    timeout "$limit" "$@" > "$results/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$results/stages.log"
    tail -n 25 "$results/$name.log"
}

launcher() {  # launcher NAME NPROC FLAGS...: one scripts/pretrain_gpt.py run
    local name=$1 nproc=$2; shift 2
    run "$name" 240 torchrun --nproc-per-node "$nproc" --master-port 29511 \
        scripts/pretrain_gpt.py "${model[@]}" --bf16 --seq-length 4096 \
        --micro-batch-size 1 --global-batch-size 8 --train-iters "$steps" --lr 3e-4 \
        --min-lr 3e-5 --lr-warmup-iters 20 --lr-decay-style cosine --log-interval 20 \
        --log-json "$results/$name.jsonl" "${data[@]}" ${LAUNCH_FLAGS:-} "$@"
}

loss_flags() {  # loss_flags IMPL: the launcher flags of cce, native or native-fused
    case $1 in
    native-fused) echo "--cross-entropy-fusion-impl native --cross-entropy-loss-fusion" ;;
    *) echo "--cross-entropy-fusion-impl $1" ;;
    esac
}

for stage in "$@"; do
    case $stage in
    setup)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null || exit 1
        { nvidia-smi; nvidia-smi topo -m; python3 -c "import torch, triton; \
print(torch.__version__, triton.__version__, torch.cuda.device_count())"; } \
            > "$results/machine.log" 2>&1
        ;;
    tests)
        run tests 300 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_parallel_nccl.py \
            tests/parallel/test_parallel_reliability.py::test_reliability_nccl \
            tests/megatron/test_megatron_plugin.py
        ;;
    gpu-tests)
        # Every GPU case (requires_cuda / requires_gpus), all GPUs busy: scripts/gpu_tests.py.
        run gpu_tests 600 python3 scripts/gpu_tests.py "$results/gpu_tests" --limit 560
        ;;
    bench)
        run bench_parallel 300 torchrun --nproc-per-node "$ngpu" -m lce_train.bench_parallel \
            --models gemma2_2b llama3_8b --tokens 8192 --tp "${bench_tp[@]}" --sp off on \
            --providers ours ours-gemm ours-lean megatron-fused megatron collectives \
            --no-softcap --iters 10 --warmup 3 --out "$results/bench_parallel.csv"
        ;;
    pp-gemma)
        run pp_gemma 300 lce-pp-memory-balance --config gemma2_2b --num-layers 8 \
            --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --seq-length 4096 \
            --micro-batch-size 2 --num-microbatches 8 --recompute none --measure \
            --csv "$results/pp_gemma.csv" --png "$results/pp_gemma.png"
        ;;
    pp-llama)
        run pp_llama 300 lce-pp-memory-balance --config llama3_8b --num-layers 8 \
            --pipeline-model-parallel-size 4 --seq-length 4096 --micro-batch-size 1 \
            --num-microbatches 8 --recompute none --measure \
            --csv "$results/pp_llama.csv" --png "$results/pp_llama.png"
        ;;
    megatron)
        for impl in cce native native-fused; do
            for layout in "${layouts[@]}"; do
                IFS=: read -r name tp pp <<< "$layout"
                launcher "megatron_${name}_$impl" "$ngpu" --tensor-model-parallel-size "$tp" \
                    --pipeline-model-parallel-size "$pp" $(loss_flags "$impl")
            done
        done
        ;;
    max-mbs)
        for impl in cce native native-fused; do
            run "max_mbs_$impl" 240 torchrun --nproc-per-node "$ngpu" --master-port 29512 \
                -m lce_train.max_micro_batch "${model[@]}" --bf16 \
                --tensor-model-parallel-size "$ngpu" --seq-length 4096 \
                $(loss_flags "$impl") --out "$results/max_mbs_$impl.json" \
                ${LAUNCH_FLAGS:-}
        done
        ;;
    *)
        echo "unknown stage $stage" >&2
        exit 2
        ;;
    esac
done
