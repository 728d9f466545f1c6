#!/usr/bin/env bash
# Launch scripts/pretrain_gpt.py with torchrun. Settings come from the environment, every
# argument is passed through to the launcher ("$@"), e.g.
#
#   NGPU=8 CONFIG=llama3_8b ./scripts/pretrain_gpt.sh --tensor-model-parallel-size 2 \
#       --sequence-parallel --pipeline-model-parallel-size 2 --bf16 --seq-length 4096 \
#       --micro-batch-size 1 --global-batch-size 64 --cross-entropy-fusion-impl cce --mock-data
#   DRY_RUN=1 NGPU=8 CONFIG=gemma2_2b ./scripts/pretrain_gpt.sh --tensor-model-parallel-size 4
#   ./scripts/pretrain_gpt.sh                 # CPU: 2 gloo ranks, tiny config, TP=2, cce
#
# Multi-node: run the same command on every node with the same MASTER_ADDR / MASTER_PORT:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NGPU=8 ./scripts/pretrain_gpt.sh ...
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 NGPU=8 ./scripts/pretrain_gpt.sh ...
#
# which runs, on each node,
#
#   torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --rdzv-backend c10d \
#       --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT --rdzv-id $RDZV_ID scripts/pretrain_gpt.py ...
#
# Environment (defaults in brackets):
#   NGPU         processes per node [GPUs visible, or 2 on a CPU-only machine]
#   NNODES       nodes [1]; NODE_RANK this node's index [0]
#   MASTER_ADDR  rendezvous host [localhost]; MASTER_PORT [29500]; RDZV_ID job id [fused_lce]
#   LOCAL_ADDR   this node's address as the others reach it (torchrun --local-addr) [its
#                hostname]; RDZV_TIMEOUT seconds to wait for all nodes to join [600]
#   CONFIG       model shape: configs/models/<CONFIG>.yaml or a path [tiny]
#   LOG_RANK     if set, show only these local ranks' output (torchrun --local-ranks-filter);
#                the progress line comes from the first rank of the last pipeline stage
#   DRY_RUN=1    print the resolved configuration and layout for NNODES x NGPU ranks, run nothing
#   TORCHRUN     the torchrun command ["python -m torch.distributed.run"]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON=${PYTHON:-python}

if [ -z "${NGPU:-}" ]; then
    NGPU=$($PYTHON -c "import torch; print(torch.cuda.device_count() or 2)")
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-fused_lce}
CONFIG=${CONFIG:-tiny}
TORCHRUN=${TORCHRUN:-"$PYTHON -m torch.distributed.run"}

if [ $# -eq 0 ] && [ "$CONFIG" = "tiny" ]; then
    # No flags: the CPU quick start.
    set -- --tensor-model-parallel-size 2 --seq-length 64 --cross-entropy-fusion-impl cce \
        --mock-data --train-iters 20 --lr 3e-3
fi

if [ "${DRY_RUN:-0}" = "1" ]; then
    exec $PYTHON "$HERE/pretrain_gpt.py" --config "$CONFIG" --dry-run \
        --world-size $((NNODES * NGPU)) "$@"
fi

launch=(--nnodes "$NNODES" --nproc-per-node "$NGPU")
if [ "$NNODES" -gt 1 ]; then
    launch+=(--node-rank "$NODE_RANK" --rdzv-backend c10d
             --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
             --rdzv-conf "join_timeout=${RDZV_TIMEOUT:-600}")
    if [ -n "${LOCAL_ADDR:-}" ]; then
        launch+=(--local-addr "$LOCAL_ADDR")
    fi
else
    launch+=(--standalone)
fi
if [ -n "${LOG_RANK:-}" ]; then
    launch+=(--local-ranks-filter "$LOG_RANK")
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
set -x
exec $TORCHRUN "${launch[@]}" "$HERE/pretrain_gpt.py" --config "$CONFIG" "$@"
