#!/usr/bin/env bash
# The op's speed before and after a change, on one GPU, from the repository root:
#
#     BASE=.base bash scripts/bench_before_after.sh RESULTS_DIR
#
# BASE is an older tree of this repository (e.g. `git archive OLD fused_lce parallel scripts
# configs setup.py | tar -x -C .base`, carried to the GPU machine). scripts/bench_lce.py runs from
# each tree in turn, ROUNDS times (default 2: base, new, base, new), so the spread between rounds
# of one tree says what is noise. Each run's output is saved as RESULTS_DIR/<tree>_<round>.log.
# A base tree that has lce_train.bench_lce_* (the providers, inputs and timers) uses the installed
# ones, this tree's, as the new run does: only the op differs.
set -uo pipefail
results=${1:?usage: BASE=.base bash scripts/bench_before_after.sh RESULTS_DIR}
base=${BASE:-.base}
mkdir -p "$results"
export PYTHONUNBUFFERED=1
models=${MODELS:-gemma2_2b llama3_8b}
providers=${PROVIDERS:-cce cce-lean cce-kept}
for round in $(seq 1 "${ROUNDS:-2}"); do
    for tree in base new; do
        dir=$([[ $tree == base ]] && echo "$base" || echo .)
        # The base tree's root goes first on the import path, so its bench imports its own op
        # rather than the installed (new) one.
        first=$([[ $tree == base ]] && (cd "$base" && pwd) || echo "")
        (cd "$dir" && PYTHONPATH="$first${first:+:}${PYTHONPATH:-}" \
            timeout "${LIMIT:-240}" python3 scripts/bench_lce.py --models $models \
            --tokens ${TOKENS:-8192} --regimes ${REGIMES:-trained} --providers $providers \
            --rep-ms "${REP_MS:-100}") > "$results/${tree}_${round}.log" 2>&1
        echo "=== $tree round $round: exit $?"
        grep -vE "^#|^$|Warning|warn" "$results/${tree}_${round}.log" | tail -n 12
    done
done
