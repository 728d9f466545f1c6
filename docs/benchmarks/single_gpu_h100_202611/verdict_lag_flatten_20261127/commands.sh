# What ran on the device machines on 2026-11-27 (seventh session), in order, from the repository
# root; $OUT is the call's output folder. Each call began with
#   python3 -m pip install -q --no-deps --no-build-isolation -e .
#
# Machine P (H100), at 7ecc10d plus the cProfile option of scripts/host_breakdown.py:
#   python3 scripts/host_breakdown.py --cases phi3_5_mini:4096 gemma2_2b:4096:4 llama3_8b:8192:8 \
#       --cprofile 4 --parallel                                     # host_cprofile_before.log
# Machine 0 (H100), at 15432cd's op:
#   python3 -m pytest -q tests/test_forward_grad_gpu.py              # gpu_tests_forward_grad.log
#   python3 -c "import sys; sys.path.insert(0, 'tests'); from fused_lce import forward_grad; \
#       forward_grad.VERDICT_LAG_CALLS = 1; import pytest; \
#       sys.exit(pytest.main(['-q', 'tests/test_forward_grad_gpu.py', '-k', 'never_wait']))"
#                                                                   # mutation_lag1.log
#   python3 scripts/bench_verdict_lag.py                             # bench_verdict_lag.log
# 2 x H200, at 15432cd's op:
#   python3 -m pytest -q -p no:cacheprovider tests/test_parallel_gpu.py   # parallel_gpu_tests_h200x2.log
#
# Machine 1 (H100): the tuning (tune_flatten_r3.log, flatten_check.log, tune_flatten_r7.log),
# then three trees in turn: .base = 7ecc10d (git archive), . = flattened + warp-specialised,
# .alt = flattened only (machine1_*.log).
# --- tuning call ---
# set -x
# python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null
# timeout 400 python3 scripts/tune_exp_logits.py --rounds 3 --configs "128x256x64 s3 w8 split2 ws" "default plain" "split2 flatten" "split2 ws flatten" "s4 split2 flatten" "split2 flatten plain" 2>&1 | tee $OUT/tune_flatten.log
# timeout 120 python3 - <<'PY' 2>&1 | tee $OUT/flatten_check.log
# import torch
# from fused_lce.kernels.exp_logits import exp_logits, exp_logits_config
# import dataclasses
# for rows, v, d in ((4096 - 77, 32064, 3072), (1000, 256000 - 5, 2304)):
#     g = torch.Generator(device="cuda").manual_seed(1)
#     h = torch.randn(rows, d, device="cuda", generator=g).bfloat16()
#     w = (torch.randn(v, d, device="cuda", generator=g) / d**0.5).bfloat16()
#     cols = torch.randint(0, v, (rows,), device="cuda", generator=g, dtype=torch.int32)
#     off = torch.randn(rows, device="cuda", generator=g)
#     base = exp_logits_config(h.device)
#     res = []
#     for cfg in (base, dataclasses.replace(base, flatten=True), dataclasses.replace(base, flatten=True, warp_specialize=False)):
#         out = torch.empty(rows, v, device="cuda", dtype=torch.bfloat16)
#         stats = exp_logits(h, w, None, cols, off, out, softcap=None, round_16bit=False, config=cfg)
#         res.append((out, stats))
#     for out, stats in res[1:]:
#         print(rows, v, d, "exps equal:", torch.equal(out, res[0][0]), "stats max diff:",
#               max((a - b).abs().max().item() for a, b in zip(stats, res[0][1])))
# PY
# --- three trees ---
# export PYTHONUNBUFFERED=1
# for round in 1 2; do
#   for tree in base new alt; do
#     case $tree in base) dir=.base;; new) dir=.;; alt) dir=.alt;; esac
#     first=$([[ $tree == new ]] && echo "" || (cd $dir && pwd))
#     (cd $dir && PYTHONPATH="$first" timeout 200 python3 scripts/bench_lce.py --models gemma2_2b llama3_8b phi3_5_mini \
#       --tokens 4096 8192 --regimes trained --providers cce --rep-ms 200) > $OUT/ab_${tree}_${round}.log 2>&1
#     echo "== $tree $round rc=$?"; grep -E "cce:" $OUT/ab_${tree}_${round}.log | awk '{print $1, $2, $11, $12}'
#   done
# done
#
# Machine 2 (H100): the tests and two trees in turn: .base = 15432cd, . = flattened from 65536
# columns, warp-specialised below (not kept) (machine2_*.log, gpu_tests_machine2.log).
# export PYTHONUNBUFFERED=1
# python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null
# timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_forward_grad_gpu.py tests/test_neg_inf_bias_gpu.py tests/test_exp_logits.py 2>&1 | tail -3 | tee $OUT/gpu_tests_final.log
# for round in 1 2 3; do
#   for tree in base new; do
#     case $tree in base) dir=.base;; new) dir=.;; esac
#     first=$([[ $tree == new ]] && echo "" || (cd $dir && pwd))
#     (cd $dir && PYTHONPATH="$first" timeout 150 python3 scripts/bench_lce.py --models gemma2_2b llama3_8b phi3_5_mini \
#       --tokens 4096 8192 --regimes trained --providers cce --rep-ms 200) > $OUT/final_${tree}_${round}.log 2>&1
#     echo "== $tree $round rc=$?"; grep -E "cce:" $OUT/final_${tree}_${round}.log | awk '{print $1, $2, $12}' | tr '\n' ' '; echo
#   done
# done
