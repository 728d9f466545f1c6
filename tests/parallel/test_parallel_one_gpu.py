"""The vocab-parallel layer with its real kernels, 2 and 4 ranks sharing one GPU over gloo.

NCCL refuses two ranks on one GPU, but gloo carries the all-reduces, the SP all-gather and the
reduce-scatter of CUDA tensors (through the host). Until machines of several GPUs are lent this
is how a one-GPU machine checks tensor parallelism: test_parallel_nccl.py's cases (uneven
shards, every option, SP, vocabulary padding, kept logits, the weight-gradient accumulator, the
chunked impl) and the gradient-in-forward walk with a loss mask and its exact-recompute
fallback, each rank's results against the single-device float64 reference.

Run on a GPU machine: ``python -m pytest -q tests/parallel/test_parallel_one_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers_parallel import run_cases, run_on_ranks
from test_forward_grad_parallel import vocab_shard_walk_suite
from test_parallel_nccl import B, D, S, gpu_cases

pytestmark = pytest.mark.requires_cuda


def _cases_suite(rank: int, world: int) -> list[str]:
    return run_cases(rank, world, gpu_cases(), shape=(S, B, D), device="cuda:0")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
def test_layer_on_ranks_sharing_one_gpu(world, tmp_path):
    run_on_ranks(world, _cases_suite, out_dir=tmp_path, timeout_s=600, interpret=False)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradient_walk_on_ranks_sharing_one_gpu(world, sequence_parallel, dtype, tmp_path):
    run_on_ranks(world, vocab_shard_walk_suite, sequence_parallel, "cuda:0", dtype,
                 out_dir=tmp_path, timeout_s=300, interpret=False)
