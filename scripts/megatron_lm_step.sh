#!/usr/bin/env bash
# The user's step: Megatron-LM's own pretrain_gpt.py with --cross-entropy-fusion-impl cce beside
# megatron's native fused loss (--cross-entropy-loss-fusion --cross-entropy-fusion-impl native),
# each eager and under --cuda-graph-impl full_iteration, in alternating rounds, on 4 GPUs (one
# for tp1, two for tp2):
#
#     bash scripts/megatron_lm_step.sh RESULTS_DIR [LAYOUT ...]
#
# Layouts (default: tp4 tp2pp2): tp4 (TP4, 2 layers, hidden 2048, 4 micro-batches), tp2pp2
# (TP2 x PP2, 4 layers, 8 micro-batches), tp4_8b (TP4, Llama-3-8B width: hidden 4096, ffn 14336,
# GQA 8, V 128256, 8 layers, sequence 4096, micro-batch 1, 8 micro-batches), tp2vpp2 (tp2pp2 on
# Megatron's interleaved schedule, one layer a virtual stage, two model chunks a rank: its
# transfers do not synchronise the device, so full-iteration graphs can capture it), tp1 (tp4's
# model on one GPU, whole vocabulary: the only layout for a one-GPU machine), tp2 (tp4's model at
# TP2, for a two-GPU machine). Others:
# V 131072, sequence 2048, micro-batch 2, bf16, mock data, local transformer impl (no TE, no apex).
# ROUNDS (default 2) rounds of every run, STEPS (default 20) iterations each; the table
# (lce-megatron-lm-report --step) takes the median over iterations past SKIP (10).
# LOSSES (default "native cce") may add cce_eager: cce with --cce-no-cuda-graphs (the op's
# own graph off); GRAPHS (default "none graphs") picks eager and/or full_iteration; EXTRA adds
# flags to every run.
#
# Needs, carried beside the repository (both git-ignored), as scripts/megatron_lm_gpu.sh:
#   .mlm/  Megatron-LM's pretrain_gpt.py, gpt_builders.py, model_provider.py and
#          megatron/core/datasets/Makefile, from tag core_v0.19.0
#   .whl/  megatron_core-0.19.2-cp312-*.whl
set -uo pipefail
results=${1:?usage: bash scripts/megatron_lm_step.sh RESULTS_DIR [LAYOUT ...]}
shift
layouts=("$@")
[[ ${#layouts[@]} -gt 0 ]] || layouts=(tp4 tp2pp2)
mkdir -p "$results"
rounds=${ROUNDS:-2}
steps=${STEPS:-20}
site=/tmp/site
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}

if ! python3 -c "import megatron.training" 2> /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target $site .whl/megatron_core-*.whl || exit 1
    cp .mlm/megatron/core/datasets/Makefile "$site/megatron/core/datasets/"
    touch "$site"/megatron/core/datasets/helpers_cpp*.so
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null || exit 1
{ nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, \
'triton', triton.__version__, 'megatron-core', m.__version__)"; git rev-parse --short HEAD
} 2>&1 | tee "$results/machine.log"

common=(--position-embedding-type rope --train-iters "$steps" --lr 3e-4 --min-lr 3e-5
        --lr-warmup-iters 5 --lr-decay-style cosine --weight-decay 0.01 --clip-grad 1.0 --bf16
        --seed 1234 --tokenizer-type NullTokenizer --mock-data --eval-iters 0
        --eval-interval "$((steps + 1))" --log-interval 1 --log-memory-interval "$steps"
        --transformer-impl local --no-gradient-accumulation-fusion --no-rope-fusion
        --no-masked-softmax-fusion --no-persist-layer-norm)

layout_flags() {  # the model and parallel layout of a layout name
    case $1 in
        tp4) echo --tensor-model-parallel-size 4 --num-layers 2 --hidden-size 2048 \
                  --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 \
                  --micro-batch-size 2 --global-batch-size 8 --vocab-size 131072 ;;
        tp1|tp2) layout_flags tp4 | sed "s/--tensor-model-parallel-size 4/--tensor-model-parallel-size ${1#tp}/" ;;
        tp2pp2) echo --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
                  --num-layers 4 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
                  --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 16 \
                  --vocab-size 131072 ;;
        tp2vpp2) echo "$(layout_flags tp2pp2)" --num-layers-per-virtual-pipeline-stage 1 ;;
        tp4_8b) echo --tensor-model-parallel-size 4 --num-layers 8 --hidden-size 4096 \
                  --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention \
                  --num-query-groups 8 --swiglu --normalization RMSNorm \
                  --untie-embeddings-and-output-weights --seq-length 4096 \
                  --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 8 \
                  --vocab-size 128256 ;;
        *) echo "unknown layout $1" >&2; return 1 ;;
    esac
}

run() {  # run LAYOUT LOSS GRAPHS ROUND
    local layout=$1 loss=$2 graphs=$3 round=$4 name
    name="${layout}__${loss}${graphs:+_graphs}__r${round}"
    local flags
    flags=$(layout_flags "$layout") || exit 1
    local gpus=4
    [[ $layout == tp[12] ]] && gpus=${layout#tp}
    local cmd=(torchrun --nproc-per-node "$gpus" --master-port 29519)
    # Under full-iteration graphs the native loss runs through the plugin too: with pipeline
    # parallelism megatron-core 0.19 fails before the capture without the plugin's batch fix
    # (parallel/megatron_lm.py); --cross-entropy-fusion-impl native is otherwise untouched.
    [[ $loss == cce* || -n $graphs ]] && cmd+=(-m fused_lce.parallel.megatron_lm)
    cmd+=(.mlm/pretrain_gpt.py $flags "${common[@]}" ${EXTRA:-} --cross-entropy-loss-fusion
          --cross-entropy-fusion-impl "${loss%%_*}")
    [[ $loss == cce_eager ]] && cmd+=(--cce-no-cuda-graphs)
    [[ -n $graphs ]] && cmd+=(--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad)
    echo "=== $name: ${cmd[*]}" >> "$results/commands.log"
    local start=$SECONDS log=$results/$name.log
    # Under full-iteration graphs the processes may not exit once training is done: the run
    # ends when rank 0's last memory line is written.
    timeout "${RUN_LIMIT:-240}" "${cmd[@]}" > "$log" 2>&1 &
    local pid=$!
    while kill -0 "$pid" 2> /dev/null; do
        if grep -q "\[Rank 0\] (after $steps iterations) memory" "$log"; then
            sleep 3; pkill -P "$pid" 2> /dev/null; kill "$pid" 2> /dev/null; break
        fi
        sleep 2
    done
    wait "$pid"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$results/commands.log"
    grep -q "(after $steps iterations) memory" "$log" \
        || grep -E "Error|error|Traceback" "$log" | tail -n 8
}

for layout in "${layouts[@]}"; do
    for round in $(seq 1 "$rounds"); do
        for loss in ${LOSSES:-native cce}; do
            for graphs in ${GRAPHS:-none graphs}; do
                [[ $graphs == none ]] && graphs=""
                run "$layout" "$loss" "$graphs" "$round"
            done
        done
    done
done
lce-megatron-lm-report --step --skip "${SKIP:-10}" "$results" \
    | tee "$results/table.md"
