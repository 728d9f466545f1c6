#!/usr/bin/env bash
# The TP4 training step of the launcher, traced, for megatron's fused loss and for cce with
# parts of its per-call host work switched off:
#   bash step_ablation.sh RESULTS [STEPS] [VARIANT...]
# VARIANT: fused | cce | cce-recompute (--cce-upstream-mismatch recompute: the backward reads
#          its verdict on the host) | cce-gemm (--cce-backward gemm) | and, with the experiment
#          hooks of the first call (experiment_hooks.patch): cce-trust (no read of the
#          backward's verdict), cce-trust-cached (and the agreement's table cached), cce-cached;
#          base-cce (BASE, default .base: an older tree, `git archive OLD fused_lce parallel
#          scripts configs | tar -x -C .base`, run with its own launcher and op).
# A variant named twice runs twice (its files get a suffix): interleave them, as
#   bash step_ablation.sh R 50 fused base-cce cce fused base-cce cce
# EXTRA adds launcher flags to every run (e.g. EXTRA="--num-layers 16").
set -uo pipefail
results=$1; steps=${2:-40}; shift 2
variants=("$@"); [[ ${#variants[@]} -gt 0 ]] || variants=(fused cce cce-trust cce-trust-cached)
here=$(dirname "$0")
mkdir -p "$results"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS-1}
profile_step=$((steps - 5))
base=${BASE:-.base}
if [[ -d $base ]]; then
    mkdir -p "$results/base_site/fused_lce"
    cp -r "$base/fused_lce/." "$results/base_site/fused_lce/"
    cp -r "$base/parallel" "$results/base_site/fused_lce/parallel"
fi
declare -A seen
for v in "${variants[@]}"; do
    seen[$v]=$(( ${seen[$v]:-0} + 1 ))
    run=$v; [[ ${seen[$v]} -gt 1 ]] && run=${v}_${seen[$v]}
    env_set=(); flags=(--cross-entropy-fusion-impl cce); launcher=scripts/pretrain_gpt.py
    case $v in
    base-cce) env_set=(PYTHONPATH=$(cd "$results/base_site" && pwd):$PYTHONPATH)
              launcher=$base/scripts/pretrain_gpt.py ;;
    fused) flags=(--cross-entropy-fusion-impl native --cross-entropy-loss-fusion) ;;
    cce) ;;
    cce-trust) env_set=(FUSED_LCE_EXP_TRUST_UPSTREAM=1) ;;
    cce-trust-cached) env_set=(FUSED_LCE_EXP_TRUST_UPSTREAM=1 FUSED_LCE_EXP_CACHE_AGREEMENT=1) ;;
    cce-cached) env_set=(FUSED_LCE_EXP_CACHE_AGREEMENT=1) ;;
    cce-recompute) flags+=(--cce-upstream-mismatch recompute) ;;
    cce-gemm) flags+=(--cce-backward gemm) ;;
    esac
    echo "=== $run ${env_set[*]} ${flags[*]}"
    start=$SECONDS
    env "${env_set[@]}" timeout 300 torchrun --nproc-per-node 4 --master-port 29511 \
        "$launcher" --config gemma2_like --bf16 --seq-length 4096 \
        --micro-batch-size 1 --global-batch-size 8 --train-iters "$steps" --lr 3e-4 \
        --min-lr 3e-5 --lr-warmup-iters 20 --lr-decay-style cosine --log-interval 10 \
        --local-attention sdpa --sequence-parallel --tensor-model-parallel-size 4 \
        --profile-step "$profile_step" --profile-dir "$results/prof_$run" \
        --log-json "$results/$run.jsonl" "${flags[@]}" ${EXTRA:-} > "$results/$run.log" 2>&1
    echo "=== $run: exit $? after $((SECONDS - start)) s"
    grep -E "^step" "$results/$run.log" | tail -4
    python3 - "$results/$run.jsonl" <<'PY'
import json, statistics, sys
r = [json.loads(l) for l in open(sys.argv[1])]
t = [x["step_s"] for x in r[1:] if not x.get("profiled")]
q = statistics.quantiles(t, n=4)
print(f"steps 2..: median {statistics.median(t):.4f} s, quartiles {q[0]:.4f}-{q[2]:.4f}, "
      f"min {min(t):.4f}, n {len(t)}, peak GiB {r[-1]['peak_gib']}")
PY
    python3 "$here/trace_summary.py" "$results/prof_$run"/step*_rank0.json
done
