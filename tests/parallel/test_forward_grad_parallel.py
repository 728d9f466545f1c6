"""The gradient-in-forward backward across vocabulary shards, on gloo with the kernels under the
Triton interpreter: every rank walks the same token chunks (one statistics all-reduce each), the
Megatron-style masked "none" loss keeps the forward's gradients, an unexpected upstream gradient
recomputes on every rank together, and each rank's gradients match the single-device fp64 ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers_lce import make_problem
from helpers_parallel import run_on_ranks

from fused_lce import engine, linear_cross_entropy, token_walk
from fused_lce.parallel import vocab_parallel_linear_cross_entropy

N, V, D = 36, 97, 16  # V = 97 over 2, 3 or 4 ranks: uneven shards; N splits for SP


def _problem(dtype):
    hidden, weight, target, _ = make_problem(N, V, D, dtype, "peaked", ignore_frac=0.2, seed=9)
    mask = (torch.arange(N) % 4 != 0).float()
    return hidden, weight, target, mask


def _reference(hidden, weight, target, mask, upstream):
    """fp64 gradients of sum(upstream * loss) on one device."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    loss = linear_cross_entropy(h, w, target, impl="torch", reduction="none")
    (loss * upstream.double()).sum().backward()
    return h.grad, w.grad


# Tolerance against fp64 (max-abs error over the max): fp32's, and bf16's, whose walk stores
# exponentials offset by the target logit that every shard takes from the one that owns it.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def vocab_shard_walk_suite(rank: int, world: int, sequence_parallel: bool,
                           device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[str]:
    """The walk on ``device`` (tests/parallel/test_parallel_one_gpu.py runs it with every rank
    on one GPU; "cuda": each rank on its own, tests/parallel/test_parallel_nccl.py), against fp64
    on the CPU."""
    if device == "cuda":
        device = f"cuda:{rank}"
    errors = []
    walks, recomputes = [], []
    original = token_walk.walk_token_chunks
    token_walk.walk_token_chunks = lambda *a: walks.append(a[3]) or original(*a)
    engine.warn_recompute = lambda where: recomputes.append(where)
    hidden, weight, target, mask = _problem(dtype)
    bounds = [V * r // world for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    rows = N // world
    cases = {
        "masked": 0.5 * mask,  # what Megatron's loss function sends back
        "random": torch.linspace(0.2, 1.7, N),  # must recompute, on every rank
    }
    for name, upstream in cases.items():
        walks.clear()
        recomputes.clear()
        h = hidden.clone()
        if sequence_parallel:
            h = h[rank * rows:(rank + 1) * rows]
        h = h.to(device).requires_grad_()
        w = weight[lo:hi].to(device).requires_grad_()
        loss = vocab_parallel_linear_cross_entropy(
            h, w, target.to(device), reduction="none", sequence_parallel=sequence_parallel,
            loss_mask=mask.to(device), token_chunk_size=7, impl="cce",
            upstream_mismatch="recompute",
        )
        (loss * upstream.to(device)).sum().backward()
        ref_h, ref_w = _reference(hidden, weight, target, mask, upstream)
        if sequence_parallel:
            ref_h = ref_h[rank * rows:(rank + 1) * rows]
        expected_recomputes = 1 if name == "random" else 0
        if (len(walks) != 1 or len(recomputes) != expected_recomputes
                or walks[0].exponentials != (dtype == torch.bfloat16)):
            errors.append(f"tp={world} rank={rank} {name}: walks {walks}, recomputes {recomputes}")
        for label, ours, ref in (("input", h.grad, ref_h), ("weight", w.grad, ref_w[lo:hi])):
            err = ((ours.double().cpu() - ref).abs().max() / ref.abs().max()).item()
            if not err < TOLERANCE[dtype]:
                errors.append(f"tp={world} rank={rank} {name} {label}: rel err {err:.2e}")
    dist.barrier()
    return errors


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_vocab_shards_walk_together_and_match_fp64(world, sequence_parallel, tmp_path):
    run_on_ranks(world, vocab_shard_walk_suite, sequence_parallel, out_dir=tmp_path, timeout_s=90,
                 interpret=True)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_bf16_shards_share_the_target_logits_and_match_fp64(world, sequence_parallel, tmp_path):
    run_on_ranks(world, vocab_shard_walk_suite, sequence_parallel, "cpu", torch.bfloat16,
                 out_dir=tmp_path, timeout_s=90, interpret=True)


def _shard_partials(hidden, weight, target, bounds):
    """fp64 d(sum loss)/d(hidden) through each shard's logits alone (the others held fixed):
    what each rank's walk sums into the input gradient."""
    partials = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        h = hidden.double().requires_grad_()
        logits = h @ weight.double().t()
        own = torch.zeros(logits.shape[1], dtype=torch.bool)
        own[lo:hi] = True
        logits = torch.where(own, logits, logits.detach())
        torch.nn.functional.cross_entropy(logits, target, reduction="sum").backward()
        partials.append(h.grad)
    return partials


def unequal_upstream_suite(rank: int, world: int, sequence_parallel: bool) -> list[str]:
    """Each rank scales its loss by its own factor: the input gradient is what each rank's own
    scale of its own partial sums to (as megatron's backward all-reduces the ranks' partials),
    with no recompute. A walk that summed the partials over the ranks in the forward, before
    the scales are known, would hold for one common scale only (docs/benchmarks/
    vocab_parallel.md, 2026-11-27)."""
    errors, recomputes = [], []
    engine.warn_recompute = lambda where: recomputes.append(where)
    hidden, weight, target, _ = _problem(torch.float32)
    bounds = [V * r // world for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    rows = N // world
    h = hidden[rank * rows:(rank + 1) * rows] if sequence_parallel else hidden
    h = h.clone().requires_grad_()
    w = weight[lo:hi].clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(
        h, w, target, reduction="sum", sequence_parallel=sequence_parallel, token_chunk_size=7,
        impl="cce",
    )
    (loss * (rank + 1)).backward()
    partials = _shard_partials(hidden, weight, target, bounds)
    ref_h = sum((r + 1) * partial for r, partial in enumerate(partials))
    if sequence_parallel:
        ref_h = ref_h[rank * rows:(rank + 1) * rows]
    w64 = weight.double().requires_grad_()
    torch.nn.functional.cross_entropy(hidden.double() @ w64.t(), target, reduction="sum").backward()
    ref_w = (rank + 1) * w64.grad[lo:hi]
    if recomputes:
        errors.append(f"tp={world} rank={rank}: recomputes {recomputes}, expected none")
    for label, ours, ref in (("input", h.grad, ref_h), ("weight", w.grad, ref_w)):
        err = ((ours.double() - ref).abs().max() / ref.abs().max()).item()
        if not err < TOLERANCE[torch.float32]:
            errors.append(f"tp={world} rank={rank} {label}: rel err {err:.2e}")
    dist.barrier()
    return errors


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_ranks_with_their_own_upstream_scale(world, sequence_parallel, tmp_path):
    run_on_ranks(world, unequal_upstream_suite, sequence_parallel, out_dir=tmp_path, timeout_s=90,
                 interpret=True)


def nan_verdict_suite(rank: int, world: int, device: str = "cpu",
                      dtype: torch.dtype = torch.float32,
                      agree_every_call: bool = True) -> list[str]:
    """``upstream_mismatch="nan"`` across ranks: one rank's upstream gradient is not the mask's,
    so every rank's gradients are NaN (the verdicts are combined on the device, never read in
    the backward) and, once the caller has synchronised (on the CPU: at once), every rank's
    next call raises, together; the call after it runs. On ``device`` ("cuda": each rank on its
    own GPU), with the Megatron adapter's ``agree_every_call=False`` where asked."""
    if device == "cuda":
        device = f"cuda:{rank}"
    errors = []
    hidden, weight, target, mask = (x.to(device) for x in _problem(dtype))
    bounds = [V * r // world for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    h = hidden.clone().requires_grad_()
    w = weight[lo:hi].clone().requires_grad_()
    options = dict(reduction="none", loss_mask=mask, token_chunk_size=7, impl="cce",
                   upstream_mismatch="nan", agree_every_call=agree_every_call)
    loss = vocab_parallel_linear_cross_entropy(h, w, target, **options)
    upstream = (torch.linspace(0.2, 1.7, N, device=device) if rank == world - 1
                else 0.5 * mask)
    (loss * upstream).sum().backward()
    if not (h.grad.isnan().all() and w.grad.isnan().all()):
        errors.append(f"tp={world} rank={rank}: gradients not NaN")
    if device != "cpu":
        torch.cuda.synchronize()  # as a step's optimizer or loss logging does
    try:
        vocab_parallel_linear_cross_entropy(hidden, weight[lo:hi], target, **options)
        errors.append(f"tp={world} rank={rank}: the next call did not raise")
    except RuntimeError as err:
        if "upstream_mismatch='recompute'" not in str(err):
            errors.append(f"tp={world} rank={rank}: {err}")
    loss = vocab_parallel_linear_cross_entropy(hidden, weight[lo:hi], target, **options)
    if not loss.isfinite().all():
        errors.append(f"tp={world} rank={rank}: the call after the error is not finite")
    dist.barrier()
    return errors


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("agree_every_call", [True, False], ids=["agree-always", "agree-on-change"])
def test_upstream_mismatch_nan_poisons_every_rank_and_every_rank_raises(world, agree_every_call,
                                                                         tmp_path):
    run_on_ranks(world, nan_verdict_suite, "cpu", torch.float32, agree_every_call,
                 out_dir=tmp_path, timeout_s=90, interpret=True)
