#!/usr/bin/env bash
# The single-GPU evidence of docs/benchmarks/single_gpu.md, in named stages, on one H100 or
# H200 (the device tool's nvidia-h100-x1 / nvidia-h200), from the repository root:
#
#     bash scripts/gpu_single.sh RESULTS_DIR STAGE [STAGE ...]
#
# Stages:
#   setup     install the carried wheels (.whl/: liger-kernel, cut-cross-entropy) and this package
#   quick     scripts/gpu_quick_check.py: every option group against fp64, TMA and pointer kernels
#   tune      scripts/studies/tune_kernels.py at the Gemma-2 2B shape, TMA on and off
#   profile   scripts/profile_lce.py: GPU busy and idle time per step, Gemma and Llama shapes
#   tests     tests/op/test_cce_at_scale.py (the kernels against fp64 at moderate and large
#             sizes) and the CUDA cases of tests/op/test_reliability.py (confident tokens, strided
#             arguments)
#   bench     scripts/bench_lce.py: ours and the peers, three shapes, N = 8192, both regimes
#   bench-n   the same at N = 2048 and 65536 (ours, torch.compile, and the peers that fit)
#   exp-tests the bf16 walk's GPU tests (kernels/exp_logits.py): one GPU, and 2 and 4 ranks
#             sharing it over gloo (about 4 minutes)
#   exp-bench its GEMM against cuBLAS, the host's cost per call (scripts/bench_host.py), and the
#             step's profile at three widths and one TP = 8 rank
#             (scripts/studies/profile_default.py; about 8 minutes)
#   cute-keep  keep the first half of the packed cutlass-dsl compiler (.qk/cu13.part1) and the
#             wheels (.qk/w: quack-kernels, nvidia-cutlass-dsl 4.7.1, ...) for the next call on
#             the same warm machine (the device tool carries 64 MiB a call)
#   cute-setup join the compiler with .qk/cu13.part2, install it all, and key QuACK's compile
#             cache by identity where its keyer refuses a value (scripts/pack_cute_peers.py
#             makes .qk/ and says why)
#   cute-bench MODELS=... REP_MS=...: ours, torch.compile and the CuTe peers at N = 4096 and
#             8192 (REP_MS 100 fits QuACK's compiles into a call; 400 times steadier)
#   cute-profile ours and the CuTe peers kernel by kernel (studies/profile_default.py --peers),
#             N = 4096
#
# Each stage logs under RESULTS_DIR and is bounded by `timeout`.
set -uo pipefail
results=$1; shift
mkdir -p "$results"
export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# A --target install does not run nvidia-cutlass-dsl's .pth, which puts this on the path.
export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages

run() {  # run NAME SECONDS CMD...: log to RESULTS/NAME.log, keep going on failure
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*" | tee -a "$results/stages.log"
    local start=$SECONDS
    timeout "$limit" "$@" > "$results/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$results/stages.log"
    tail -n 40 "$results/$name.log"
}

for stage in "$@"; do
    case $stage in
    setup)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null || exit 1
        { nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } \
            > "$results/machine.log" 2>&1
        ;;
    quick)
        run quick 120 python3 scripts/gpu_quick_check.py
        ;;
    tune)
        run tune 200 python3 scripts/studies/tune_kernels.py --model gemma2_2b --tokens 8192 \
            --configs ${TUNE_CONFIGS:-0 1 2 4 8 9}
        ;;
    profile)
        for model in gemma2_2b llama3_8b; do
            for flags in "" "--tma 0" "--check-targets" "--chunk-cols 16384" "--scratch-mb 12"; do
                run "profile_${model}${flags// /_}" 90 python3 scripts/profile_lce.py \
                    --model "$model" --steps 5 $flags
            done
        done
        ;;
    tests)
        run tests 420 python3 -m pytest -q -x -p no:cacheprovider tests/op/test_cce_at_scale.py \
            ${TEST_ARGS:-}
        run tests_reliability 300 python3 -m pytest -q -p no:cacheprovider \
            tests/op/test_reliability.py -m requires_cuda
        ;;
    bench)
        run bench 420 python3 scripts/bench_lce.py --models gemma2_2b llama3_8b phi3_5_mini \
            --tokens 8192 --regimes uniform trained \
            --providers ${PROVIDERS:-cce cce-nocheck cce-gemm cce-lean cce-kept torch.compile \
                liger apple-cce megatron-fused} \
            --rep-ms 150 --out "$results/bench"
        ;;
    bench-n)
        run bench_n 420 python3 scripts/bench_lce.py --models gemma2_2b llama3_8b phi3_5_mini \
            --tokens 2048 65536 --regimes uniform trained \
            --providers ${PROVIDERS:-cce-nocheck cce-lean torch.compile} --rep-ms 150 \
            --out "$results/bench_n"
        ;;
    exp-tests)
        run exp_tests 300 python3 -m pytest -q -x -p no:cacheprovider \
            tests/op/test_forward_grad.py tests/op/test_neg_inf_bias.py -m requires_cuda
        run exp_tests_parallel 200 python3 -m pytest -q -x -p no:cacheprovider \
            tests/parallel/test_parallel_one_gpu.py -k "gradient_walk and bf16"
        ;;
    exp-bench)
        run exp_tune 200 python3 scripts/tune_exp_logits.py --rounds 3
        run exp_host 120 python3 scripts/bench_host.py
        run exp_profile 420 python3 scripts/studies/profile_default.py --cases gemma2_2b:8192 \
            llama3_8b:8192 phi3_5_mini:8192 llama3_8b:8192:8 --out "$results/exp_profile"
        ;;
    cute-keep)
        mkdir -p /tmp/qk && cp -r .qk/cu13.part1 .qk/w /tmp/qk/ || exit 1
        ;;
    cute-setup)
        [ -f /tmp/qk/cu13.part1 ] || { echo "cute-setup: no cute-keep on this machine"; exit 1; }
        # Wheels first: --upgrade replaces whole folders, and the compiler joins them after.
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site /tmp/qk/w/*.whl || exit 1
        cat /tmp/qk/cu13.part1 .qk/cu13.part2 | xz -d | tar xf - -C /tmp/site || exit 1
        python3 scripts/pack_cute_peers.py --patch-quack /tmp/site || exit 1
        python3 -c "import cutlass, quack.linear_cross_entropy; print('cute peers import')" \
            > "$results/cute_setup.log" 2>&1
        tail -n 5 "$results/cute_setup.log"
        ;;
    cute-bench)
        for model in ${MODELS:-llama3_8b gemma2_2b phi3_5_mini}; do
            run "cute_bench_$model" ${BENCH_LIMIT:-560} python3 scripts/bench_lce.py \
                --models "$model" --tokens 4096 8192 --regimes ${REGIMES:-uniform trained} \
                --providers ${PROVIDERS:-cce quack quack-scaled-exp liger-cute torch.compile \
                    cce:token_chunk_size=8192 liger-cutedsl} \
                --rep-ms ${REP_MS:-100} ${BENCH_ARGS:-} --out "$results/cute_bench_$model"
        done
        ;;
    cute-profile)
        run cute_profile ${BENCH_LIMIT:-560} python3 scripts/studies/profile_default.py \
            --cases ${CASES:-gemma2_2b:4096 llama3_8b:4096 phi3_5_mini:4096} \
            --peers ${PROVIDERS:-torch.compile quack liger-cute} --out "$results/cute_profile"
        ;;
    *) echo "unknown stage $stage"; exit 2 ;;
    esac
done
