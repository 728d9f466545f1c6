#!/usr/bin/env bash
# The TP overlap variants side by side (2026-11-27, call 2), run from the repository root after
# `gpu_suite.sh R setup` with the experiment patch applied and .base holding 5eff19e:
#     bash call2_variants.sh R 1
set -uo pipefail
r=$1; round=$2
mkdir -p $r/base_site/fused_lce
[[ -d $r/base_site/fused_lce/parallel ]] || { cp -r .base/fused_lce/. $r/base_site/fused_lce/; cp -r .base/parallel $r/base_site/fused_lce/parallel; }
site=$(cd $r/base_site && pwd)
export PYTHONUNBUFFERED=1
go() {  # name env...
    local name=$1; shift
    env "$@" timeout 200 torchrun --nproc-per-node 4 --master-port 29513 scripts/bench_parallel.py \
        --models gemma2_2b llama3_8b --tokens 8192 --tp 2 4 --sp off on --providers ours \
        --no-softcap --iters ${ITERS:-20} --warmup 3 --out $r/${name}_$round.csv > $r/${name}_$round.log 2>&1
    echo "=== $name $round exit $?"; grep -E "^ +(gemma|llama).* ours " $r/${name}_$round.log | tail -8
}
go base PYTHONPATH=$site:$PYTHONPATH
go serial FUSED_LCE_TP_OVERLAP=serial
go dw FUSED_LCE_TP_OVERLAP=dw
go all FUSED_LCE_TP_OVERLAP=all
go dw1 FUSED_LCE_TP_OVERLAP=dw CUDA_DEVICE_MAX_CONNECTIONS=1
