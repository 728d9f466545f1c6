#!/usr/bin/env bash
# The vocab-parallel layer's speed before and after a change, on one machine of several GPUs,
# from the repository root (after `bash scripts/gpu_suite.sh RESULTS_DIR setup`):
#
#     BASE=.base NGPU=4 bash scripts/bench_parallel_before_after.sh RESULTS_DIR
#
# BASE is an older tree of this repository (`git archive OLD fused_lce parallel | tar -x -C
# .base`). Its op is laid out as the install lays it out (parallel/ as fused_lce.parallel) in
# RESULTS_DIR/base_site, which goes first on the import path of its runs. lce_train.bench_parallel
# (this tree's, installed) then runs the base op and this tree's op in turn, ROUNDS times (default
# 2), so the spread between rounds of one tree says what is noise. The runs start in RESULTS_DIR:
# `python -m` puts the working folder first on the import path, and the repository root's
# fused_lce/ there would stand in front of the base op. MODELS, TOKENS, TP, SP, PROVIDERS (of the
# base runs; the new ones add NEW_PROVIDERS) and ITERS set the runs; each writes
# RESULTS_DIR/<tree>_<round>.csv and .log.
set -uo pipefail
results=${1:?usage: BASE=.base NGPU=4 bash scripts/bench_parallel_before_after.sh RESULTS_DIR}
base=${BASE:-.base}
mkdir -p "$results/base_site/fused_lce"
cp -r "$base/fused_lce/." "$results/base_site/fused_lce/"
cp -r "$base/parallel" "$results/base_site/fused_lce/parallel"
results=$(cd "$results" && pwd)
site=$results/base_site
export PYTHONUNBUFFERED=1
for round in $(seq 1 "${ROUNDS:-2}"); do
    for tree in base new; do
        first=$([[ $tree == base ]] && echo "$site" || echo "")
        providers=${PROVIDERS:-ours}
        [[ $tree == new ]] && providers="$providers ${NEW_PROVIDERS:-}"
        (cd "$results" && PYTHONPATH="$first${first:+:}${PYTHONPATH:-}" timeout "${LIMIT:-300}" \
            torchrun --nproc-per-node "${NGPU:-2}" --master-port 29513 -m lce_train.bench_parallel \
            --models ${MODELS:-gemma2_2b llama3_8b} --tokens ${TOKENS:-8192} --tp ${TP:-2} \
            --sp ${SP:-off on} --providers $providers --no-softcap --iters "${ITERS:-10}" \
            --warmup 3 --out "$results/${tree}_${round}.csv") > "$results/${tree}_${round}.log" 2>&1
        echo "=== $tree round $round: exit $?"
        grep -vE "Warning|warn|^\s*$" "$results/${tree}_${round}.log" | tail -n 20
    done
done
