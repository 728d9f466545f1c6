#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py with --cross-entropy-fusion-impl cce, beside megatron-core's
# native fused loss and the unfused loss, on one GPU machine, from the repository root:
#
#     NGPU=1 bash scripts/megatron_lm_gpu.sh RESULTS_DIR
#
# Needs, carried beside the repository (both git-ignored):
#   .mlm/  Megatron-LM's pretrain_gpt.py, gpt_builders.py, model_provider.py and
#          megatron/core/datasets/Makefile, from tag core_v0.19.0
#   .whl/  megatron_core-0.19.2-cp312-*.whl (ships megatron/core and megatron/training); only
#          that wheel is installed from it. WHEEL_DIR names another folder.
#
# Steps: install the wheel and this package; per layout three runs of $STEPS iterations (default
# 30): cce through `python -m fused_lce.parallel.megatron_lm`, native fused and unfused as plain
# Megatron-LM; then (unless SKIP_TESTS=1) the Megatron-LM parser tests against the wheel's real
# megatron.training (tests/megatron/test_megatron_lm.py, tests/megatron/test_megatron_plugin.py). The table is
# printed before the tests.
# Layouts: NGPU=1 TP1; NGPU=2 TP2; NGPU=4 TP2 (2 GPUs) and TP2 x PP2. The model is 2 layers,
# hidden 2048, vocabulary $VOCAB (default 131072), sequence 2048, micro-batch 2, bf16, local
# transformer impl (no transformer-engine, no apex). lce-megatron-lm-report prints the
# table; every log stays under RESULTS_DIR.
set -uo pipefail
results=${1:?usage: NGPU=1 bash scripts/megatron_lm_gpu.sh RESULTS_DIR}
mkdir -p "$results"
ngpu=${NGPU:-1}
steps=${STEPS:-30}
vocab=${VOCAB:-131072}
site=/tmp/site
wheels=${WHEEL_DIR:-.whl}
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}

for need in .mlm/pretrain_gpt.py .mlm/gpt_builders.py .mlm/model_provider.py \
            .mlm/megatron/core/datasets/Makefile; do
    [[ -f $need ]] || { echo "missing $need (carry .mlm)"; exit 1; }
done
compgen -G "$wheels/megatron_core-*.whl" > /dev/null || {
    echo "missing $wheels/megatron_core-*.whl (carry it)"; exit 1; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target $site "$wheels"/megatron_core-*.whl || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null || exit 1
# The wheel has the compiled dataset helpers but not the Makefile that Megatron-LM's
# compile_helpers runs on rank 0: put the tag's Makefile there and leave the library newer, so
# make finds nothing to do.
datasets=$site/megatron/core/datasets
cp .mlm/megatron/core/datasets/Makefile "$datasets/"
touch "$datasets"/helpers_cpp*.so
{ nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, \
'triton', triton.__version__, 'megatron-core', m.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$results/machine.log"

step() {  # step NAME SECONDS CMD...: log to RESULTS/NAME.log, keep going on failure
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*" >> "$results/commands.log"
    local start=$SECONDS
    timeout "$limit" "$@" > "$results/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$results/commands.log"
    [[ $rc == 0 ]] || tail -n 15 "$results/$name.log"
}

model=(--num-layers 2 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
       --max-position-embeddings 2048 --position-embedding-type rope --micro-batch-size 2
       --train-iters "$steps" --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5
       --lr-decay-style cosine --weight-decay 0.01 --clip-grad 1.0 --bf16 --seed 1234
       --tokenizer-type NullTokenizer --vocab-size "$vocab" --mock-data
       --eval-iters 0 --eval-interval "$((steps + 1))" --log-interval 1
       --log-memory-interval "$steps" --transformer-impl local
       --no-gradient-accumulation-fusion --no-rope-fusion --no-masked-softmax-fusion
       --no-persist-layer-norm)

run_layout() {  # run_layout NAME NPROC TP PP
    local name=$1 nproc=$2 tp=$3 pp=$4
    local dp=$((nproc / (tp * pp)))
    local accumulation=$(( pp > 1 ? 4 : 1 ))  # PP needs several micro-batches in flight
    local layout=(--tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp"
                  --global-batch-size "$((2 * dp * accumulation))")
    local launch=(torchrun --nproc-per-node "$nproc" --master-port 29517)
    step "${name}_cce" 150 "${launch[@]}" -m fused_lce.parallel.megatron_lm .mlm/pretrain_gpt.py \
        "${model[@]}" "${layout[@]}" --cross-entropy-loss-fusion --cross-entropy-fusion-impl cce
    step "${name}_native" 150 "${launch[@]}" .mlm/pretrain_gpt.py "${model[@]}" "${layout[@]}" \
        --cross-entropy-loss-fusion --cross-entropy-fusion-impl native
    step "${name}_unfused" 150 "${launch[@]}" .mlm/pretrain_gpt.py "${model[@]}" "${layout[@]}"
}

case $ngpu in
    1) run_layout tp1 1 1 1 ;;
    2) run_layout tp2 2 2 1 ;;
    4) run_layout tp2 2 2 1; run_layout tp2pp2 4 2 2 ;;
    *) echo "NGPU must be 1, 2 or 4, got $ngpu"; exit 1 ;;
esac

lce-megatron-lm-report "$results" | tee "$results/table.md"

[[ -n ${SKIP_TESTS:-} ]] || step parser_tests "${PARSER_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider \
    tests/megatron/test_megatron_lm.py tests/megatron/test_megatron_plugin.py
