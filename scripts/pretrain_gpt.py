#!/usr/bin/env python
"""Pretrain a GPT on megatron-core with the vocab-parallel Cut Cross-Entropy loss.

A self-contained pretraining entry for users of megatron-core without Megatron-LM: tensor,
sequence, pipeline (1F1B) and data parallelism from megatron-core, the model shape from
``configs/models/<name>.yaml``, Megatron's flag names, and the loss layer chosen with
``--cross-entropy-fusion-impl {native,te,cce,linear}``; ``cce`` and ``linear`` compute the loss
with fused_lce's vocab-parallel op and never build the logits (``fused_lce.parallel.megatron``
installs it on the model).

Single node (8 GPUs, NCCL):

    torchrun --nproc-per-node 8 scripts/pretrain_gpt.py --config llama3_8b \\
        --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 \\
        --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split \\
        --micro-batch-size 1 --global-batch-size 64 --seq-length 4096 --bf16 \\
        --cross-entropy-fusion-impl cce --mock-data --train-iters 100

Multi-node (run the same line on every node; c10d rendezvous assigns ranks):

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \\
        --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 --rdzv-id my-job \\
        scripts/pretrain_gpt.py --config llama3_8b ...

(``NNODES=2 NODE_RANK=0|1 MASTER_ADDR=... ./scripts/pretrain_gpt.sh ...`` runs that line;
tests/megatron/test_two_nodes.py runs it as two nodes on 127.0.0.1.)

CPU (gloo; megatron-core's CUDA-only calls are redirected by lce_train.megatron_cpu):

    torchrun --nproc-per-node 2 scripts/pretrain_gpt.py --config tiny \\
        --tensor-model-parallel-size 2 --cross-entropy-fusion-impl cce --mock-data --train-iters 5

``--dry-run`` prints the resolved configuration and layout and builds nothing (no torchrun
needed; ``--world-size`` says how many ranks to plan for). ``scripts/pretrain_gpt.sh`` wraps
the torchrun lines; ``lce-compare-losses`` runs ``cce`` beside ``native``. The code is
the ``lce_train`` package (flags in ``lce_train.arguments``, the loop in ``lce_train.training``).

The backend is NCCL on CUDA and gloo on the CPU. Every rank that holds the last pipeline stage
computes the loss; tensor-parallel rank 0 of data-parallel rank 0 there prints one line per step:
step, loss, learning rate, tokens/s, step time and the peak memory of every pipeline stage
(``torch.cuda.max_memory_allocated`` on GPUs, the process's peak RSS on the CPU).

Checkpoints (``--save DIR --save-interval K``, ``--load DIR``, ``--ckpt-step N``) are
megatron-core's ``dist_checkpointing`` (torch_dist backend) in Megatron-LM's layout:
``DIR/latest_checkpointed_iteration.txt`` and one sharded folder ``DIR/iter_0000010/`` per save,
holding the model and the optimizer (Adam's moments and fp32 main parameters; the distributed
optimizer's as ``fully_reshardable``) by parameter. A run saved at one TP / PP / DP layout resumes
at another (its losses continue within fp32 rounding; the vocabulary must pad to the same size,
``--make-vocab-size-divisible-by``); at the same layout the RNG states resume too and the loss
curve continues bitwise (on the CPU). The global batch size must stay the same. Missing or
partial checkpoints are refused with the file or folder named; the launcher's earlier per-rank
``rank_*.pt`` files are not read.

Data come from ``--mock-data`` (seeded synthetic token sequences) or ``--data-path``, which takes
Megatron's indexed datasets as Megatron-LM does: a prefix (``PREFIX.bin`` + ``PREFIX.idx``, from
Megatron-LM's tools/preprocess_data.py or ``lce-build-token-file``) or a blend
``"0.3 PREFIX_A 0.7 PREFIX_B"``, read by megatron-core's ``IndexedDataset`` / ``GPTDataset`` /
``BlendedDataset`` (index caches in ``--data-cache-path``, default ``cache/`` beside the data;
megatron-core's compiled ``helpers_cpp`` is needed, and the error says how to build it where it is
missing). Batches are step-addressed: step k holds global samples ``(k - 1) * global_batch``
onwards, so a resumed run sees the batches an unbroken one would, at any layout.
"""

import os
import sys

# Import the installed lce_train, not its source folder beside this file: the install maps the
# top-level configs/ in as lce_train.configs, which that folder lacks (a wheel would break).
HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

from lce_train.training import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
