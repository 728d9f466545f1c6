"""The vocab-parallel layer on NCCL with the real kernels: one process per GPU (skipped without).

The comparisons of test_parallel.py (helpers_parallel.check_case) at a moderate size, where the
GPU tile configs and chunk plans matter: input (S, B, D) = (64, 4, 512), a vocabulary of 50000
classes (50048 rows with Megatron-style padding). Each rank draws the problem on the CPU, keeps
its shards on its GPU, and compares its loss, lse, input gradient (with SP its sequence shard)
and weight/bias gradient shard with the float64 reference on the whole weight, computed on the
CPU; 16-bit cases are held to ``2 * err(torch in the same dtype on the GPU) + atol``.

Run on a machine with 2 (or 4) GPUs: ``python -m pytest -q tests/parallel/test_parallel_nccl.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers_agreement import disagreement_suite
from helpers_parallel import case, run_cases, run_on_ranks
from test_forward_grad_parallel import nan_verdict_suite, vocab_shard_walk_suite

pytestmark = pytest.mark.requires_gpus(2)

F32, BF16 = torch.float32, torch.bfloat16
S, B, D = 64, 4, 512
V = 50000
V_PADDED = 50048  # divisible by 2, 4 and 8: every rank gets whole rows


def gpu_cases() -> list[dict]:
    """The layer's options at a moderate size (also tests/parallel/test_parallel_one_gpu.py's)."""
    return [
        case("f32-mean", "cce", V),
        case("f32-sp-everything-padding", "cce", V_PADDED, vocab_size=V, sp=True, bias=True,
             reduction="sum", label_smoothing=0.1, softcap=30.0, z_loss=1e-4, return_lse=True),
        case("f32-uniform-none-tiles", "cce", V, regime="near-uniform", reduction="none",
             backward="tiles"),
        case("bf16-mean-bias", "cce", V, dtype=BF16, bias=True),
        case("bf16-sp-none-lse-padding-softcap", "cce", V_PADDED, vocab_size=V, dtype=BF16,
             sp=True, reduction="none", return_lse=True, softcap=30.0),
        case("bf16-sp-tiles", "cce", V, dtype=BF16, sp=True, backward="tiles"),
        case("bf16-uniform-smoothing-zloss", "cce", V, dtype=BF16, regime="near-uniform",
             label_smoothing=0.1, z_loss=1e-4),
        case("bf16-sp-chunked-bias", "chunked", V, dtype=BF16, sp=True, bias=True),
        case("bf16-sp-accumulator-padding", "cce", V_PADDED, vocab_size=V, dtype=BF16, sp=True,
             accumulate=True),
        # The backward from the forward's kept logits (16-bit exponentials on the GPU).
        case("bf16-sp-kept-everything-padding", "cce", V_PADDED, vocab_size=V, dtype=BF16,
             sp=True, bias=True, reduction="sum", label_smoothing=0.1, softcap=30.0,
             z_loss=1e-4, return_lse=True, keep_logits=True),
        case("bf16-uniform-kept-accumulator", "cce", V, dtype=BF16, regime="near-uniform",
             accumulate=True, keep_logits=True),
    ]


def _suite(rank: int, world: int) -> list[str]:
    return run_cases(rank, world, gpu_cases(), shape=(S, B, D), device=f"cuda:{rank}")


@pytest.mark.parametrize(
    "world",
    [pytest.param(2, id="tp2"), pytest.param(4, id="tp4", marks=pytest.mark.requires_gpus(4)),
     pytest.param(8, id="tp8", marks=pytest.mark.requires_gpus(8))],
)
def test_matches_single_device_nccl(world, tmp_path):
    # Generous timeout: the first call of each kernel compiles it.
    run_on_ranks(world, _suite, out_dir=tmp_path, backend="nccl", timeout_s=600,
                 interpret=False)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("impl", ["cce", "chunked"])
def test_every_rank_raises_when_ranks_disagree_nccl(impl, tmp_path):
    """tests/parallel/test_rank_agreement.py's cases on NCCL: the agreement runs on a gloo group
    of the same ranks made at the first call; a regression shows as the short collective timeout."""
    # The process-group timeout leaves room for the first call's kernel compilation.
    run_on_ranks(2, disagreement_suite, "cuda", impl, out_dir=tmp_path, backend="nccl",
                 timeout_s=120, interpret=False)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [pytest.param(2, id="tp2"),
                                   pytest.param(4, id="tp4", marks=pytest.mark.requires_gpus(4))])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_gradient_walk_nccl(world, sequence_parallel, dtype, tmp_path):
    """The token walk on NCCL, in chunks of 7 rows (which cross the ranks' sequence slices
    under SP): a masked "none" loss keeps the forward's gradients, another upstream gradient
    recomputes on every rank, each against fp64."""
    run_on_ranks(world, vocab_shard_walk_suite, sequence_parallel, "cuda", dtype,
                 out_dir=tmp_path, backend="nccl", timeout_s=300, interpret=False)


@pytest.mark.timeout(400)
def test_upstream_mismatch_nan_every_rank_raises_nccl(tmp_path):
    """The Megatron adapter's settings on NCCL (bf16, ``upstream_mismatch="nan"``, agreement on
    change only): one rank's upstream gradient is not the mask's, every rank's gradients are
    NaN, and every rank raises at the same call, the second after that backward."""
    run_on_ranks(2, nan_verdict_suite, "cuda", BF16, False, out_dir=tmp_path, backend="nccl",
                 timeout_s=300, interpret=False)
