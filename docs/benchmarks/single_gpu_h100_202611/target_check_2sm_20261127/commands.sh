#!/usr/bin/env bash
# Issue 26, eighth session (2026-11-27): the exact commands behind this folder's logs, each run
# by the device tool on one H100 80GB HBM3 (nvidia-h100-x1; torch 2.11.0+cu130, triton 3.6.0,
# Python 3.12), from the repository root after `python3 -m pip install -q --no-deps
# --no-build-isolation -e .`. Four machines, in order: machine A (tune_2sm.log), machine B
# (gpu_tests_parallel_one_gpu.log, then cute_profile_* on the same warm machine), machine C
# (gpu_tests.log, base_1/new_1/base_2/new_2), machine C again (new_3, base_3: same GPU UUID)
# and machine D (gpu_tests_forward_grad_full.log).
set -euo pipefail

# Machine A, code f472649 plus the 2/SM configurations of scripts/tune_exp_logits.py.
python3 scripts/tune_exp_logits.py --rounds 5 --configs "128x256x64 s3 w8 split2 ws" \
    "default plain" "128x128x64 s3 w4 1/SM" "128x128x64 s3 w4 2/SM" "128x128x64 s3 w8 2/SM" \
    "128x128x64 s3 w4 2/SM plain" "128x128x64 s2 w4 2/SM" "128x128x64 s2 w8 2/SM" \
    "128x128x64 s2 w4 2/SM split2" "128x128x64 s2 w4 2/SM ws" "128x128x64 s2 w4 2/SM plain" \
    | tee tune_2sm.log

# Machine B, same code: ranks sharing one GPU over gloo, then QuACK beside ours.
python3 -m pytest -q tests/test_parallel_one_gpu.py > gpu_tests_parallel_one_gpu.log 2>&1
bash scripts/gpu_single.sh R cute-keep          # carry .qk/cu13.part1 .qk/w
bash scripts/gpu_single.sh R cute-setup         # next call, carry .qk/cu13.part2
CASES="llama3_8b:4096 phi3_5_mini:4096" PROVIDERS="quack" BENCH_LIMIT=500 \
    bash scripts/gpu_single.sh R cute-profile   # -> cute_profile_quack.log, breakdown, kernels

# Machine C: the target check read once the forward is queued. .base holds f472649
# (git archive f472649 fused_lce parallel scripts configs setup.py pyproject.toml), the tree
# the change; the trees in turn, two rounds, then a third round new-first.
python3 -m pytest -q tests/test_forward_grad_gpu.py -k "out_of_range or never_wait" > gpu_tests.log 2>&1
B="--models phi3_5_mini llama3_8b gemma2_2b --tokens 4096 8192 --regimes trained \
   --providers cce cce-nocheck --rep-ms 200"
for r in 1 2; do
    PYTHONPATH=$PWD/.base python3 .base/scripts/bench_lce.py $B > base_$r.log 2>&1
    python3 scripts/bench_lce.py $B > new_$r.log 2>&1
done
B="--models llama3_8b gemma2_2b phi3_5_mini --tokens 4096 8192 --regimes trained \
   --providers cce cce-nocheck --rep-ms 200"
python3 scripts/bench_lce.py $B > new_3.log 2>&1
PYTHONPATH=$PWD/.base python3 .base/scripts/bench_lce.py $B > base_3.log 2>&1

# Machine D (a fourth H100), the change: the whole GPU file of the gradient-in-forward walk.
python3 -m pytest -q tests/test_forward_grad_gpu.py > gpu_tests_forward_grad_full.log 2>&1
