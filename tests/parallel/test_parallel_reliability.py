"""The vocab-parallel layer on the edge cases of test_reliability.py (gloo, TP = 2, CPU).

Each rank holds half of the classifier (uneven: 102 and 101 rows) and runs
``vocab_parallel_linear_cross_entropy`` with impl "chunked" and "cce" (the Triton interpreter):

- strided arguments (input, weight shard, column-major weight shard, target, bias shard): loss,
  lse and gradients against the float64 reference on the whole weight;
- confident tokens: per-token losses, lse and input gradients within 10x of torch's fp32
  ``F.cross_entropy`` error against float64;
- ``create_graph=True`` raises the same clear error on every rank (nothing hangs: the check runs
  before the backward's first collective); uint8 targets with classes past 127, and D = 0.

Every test has a hard timeout, so a regression that hangs a collective fails instead. The same
suites run on NCCL with the real kernels below (``test_reliability_nccl``, two GPUs).
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err
from helpers_lce import ATOL, make_problem
from helpers_parallel import run_on_ranks
from helpers_reliability import (
    FP32_FLOOR,
    PRECISION_FACTOR,
    confident_problem,
    max_rel_err,
    with_strided_argument,
)

from fused_lce.options import LCEOptions
from fused_lce.reference import reference_linear_cross_entropy

N, V, D = 30, 203, 24
SHARDS = ((0, 102), (102, 203))
IMPLS = ("chunked", "cce")


def _device(rank: int, kind: str) -> torch.device:
    """Where this rank computes: the CPU (gloo) or its own GPU (NCCL)."""
    return torch.device("cpu") if kind == "cpu" else torch.device("cuda", rank)


def _reference(hidden, weight, target, bias, **options):
    """(per-token loss, lse, d_input, d_weight, d_bias) in float64 on the whole weight."""
    h, w = (x.double().requires_grad_() for x in (hidden, weight))
    b = None if bias is None else bias.double().requires_grad_()
    loss, lse = reference_linear_cross_entropy(h, w, target.long(), b,
                                               LCEOptions(reduction="none", **options))
    lse = torch.where(target != -100, lse, 0.0)  # as every implementation returns it
    _objective(loss, lse).backward()
    return loss.detach(), lse.detach(), h.grad, w.grad, None if b is None else b.grad


def _objective(loss, lse):
    weights = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype, device=loss.device)
    return (loss * weights).sum() + 0.1 * (lse * weights.flip(0)).sum()


def _parallel(rank, hidden, weight, target, bias, impl, device, **options):
    """The layer on this rank's shard: (loss, lse, d_input, d_weight shard, d_bias shard)."""
    lo, hi = SHARDS[rank]
    h = hidden.detach().to(device).clone().requires_grad_()
    w = weight[lo:hi].detach().to(device).clone().requires_grad_()
    b = None if bias is None else bias[lo:hi].detach().to(device).clone().requires_grad_()
    return _run_layer(h, w, target.to(device), b, impl, **options)


def _run_layer(h, w, target, b, impl, **options):
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    loss, lse = vocab_parallel_linear_cross_entropy(h, w, target, b, impl=impl,
                                                    reduction="none", return_lse=True, **options)
    _objective(loss, lse).backward()
    grads = (h.grad, w.grad, None if b is None else b.grad)
    return tuple(None if x is None else x.detach().cpu() for x in (loss, lse, *grads))


def _check(errors, label, ours, want, rank):
    lo, hi = SHARDS[rank]
    for name, got, ref in zip(("loss", "lse", "input", "weight", "bias"), ours, want):
        if ref is None:
            continue
        if name in ("weight", "bias"):
            ref = ref[lo:hi]
        if got is None or rel_err(got, ref) > ATOL[torch.float32]:
            err = "missing" if got is None else f"{rel_err(got, ref):.2e}"
            errors.append(f"{label} {name}: relative error {err} > {ATOL[torch.float32]}")


# ---------------------------------------------------------------------------------------------
# Strided arguments
# ---------------------------------------------------------------------------------------------


def _strided_suite(rank: int, world: int, kind: str = "cpu") -> list[str]:
    errors = []
    device = _device(rank, kind)
    hidden, weight, target, bias = make_problem(N, V, D, torch.float32, "peaked", 0.1,
                                                bias=True, seed=21)
    want = _reference(hidden, weight, target, bias)
    # Each shard's bias broadcast from its first entry (stride 0), and the whole it makes.
    shard_constant = torch.cat([bias[start:start + 1].expand(stop - start)
                                for start, stop in SHARDS])
    want_broadcast = _reference(hidden, weight, target, shard_constant)
    lo, hi = SHARDS[rank]
    for impl in IMPLS:
        for which in ("input", "weight", "weight-column-major", "target", "bias",
                      "bias-broadcast"):
            label = f"rank={rank} {impl} strided {which}"
            h = hidden.to(device).clone()
            w = weight[lo:hi].to(device).clone()
            b = bias[lo:hi].to(device).clone()
            t = target.to(device)
            h, w, t, b = with_strided_argument(which, h, w, t, b, V)
            try:
                ours = _run_layer(h.requires_grad_(), w.requires_grad_(), t,
                                  b.requires_grad_(), impl)
            except Exception:
                return errors + [f"{label} raised:\n{traceback.format_exc()}"]
            _check(errors, label, ours, want_broadcast if which == "bias-broadcast" else want,
                   rank)
    return errors


@pytest.mark.timeout(300)
def test_strided_arguments(tmp_path):
    run_on_ranks(2, _strided_suite, out_dir=tmp_path, timeout_s=60, interpret=True)


# ---------------------------------------------------------------------------------------------
# Confident tokens
# ---------------------------------------------------------------------------------------------


def _torch_errors(hidden, weight, target, bias, want, device):
    """torch's fp32 F.cross_entropy relative errors: (per-token loss, lse, input-gradient row)."""
    h, w = (x.to(device).clone().requires_grad_() for x in (hidden, weight))
    logits = h @ w.t() + bias.to(device)
    loss = F.cross_entropy(logits, target.to(device), reduction="none")
    lse = torch.logsumexp(logits, 1)
    _objective(loss, lse).backward()
    return [max_rel_err(loss, want[0]), max_rel_err(lse, want[1]), max_rel_err(h.grad, want[2])]


def _precision_suite(rank: int, world: int, kind: str = "cpu") -> list[str]:
    errors = []
    device = _device(rank, kind)
    hidden, weight, target, bias = confident_problem(N, V, D, seed=22, bias=True)
    want = _reference(hidden, weight, target, bias)
    if not (want[0].min() < 1e-4 and want[0].max() > 1e-2):
        return [f"not the intended problem: losses {want[0].min():.2e} to {want[0].max():.2e}"]
    base = _torch_errors(hidden, weight, target, bias, want, device)
    for impl in IMPLS:
        try:
            ours = _parallel(rank, hidden, weight, target, bias, impl, device)
        except Exception:
            return errors + [f"rank={rank} {impl} raised:\n{traceback.format_exc()}"]
        for name, got, ref, torch_err in zip(("loss", "lse", "input"), ours, want, base):
            err = max_rel_err(got, ref)
            if not err <= PRECISION_FACTOR * torch_err + FP32_FLOOR:
                errors.append(f"rank={rank} {impl} {name}: relative error {err:.2e}, "
                              f"torch fp32 {torch_err:.2e}")
    return errors


@pytest.mark.timeout(300)
def test_confident_tokens_as_precise_as_torch(tmp_path):
    run_on_ranks(2, _precision_suite, out_dir=tmp_path, timeout_s=60, interpret=True)


# ---------------------------------------------------------------------------------------------
# Second order, uint8 targets, D = 0
# ---------------------------------------------------------------------------------------------


def _edge_suite(rank: int, world: int, kind: str = "cpu") -> list[str]:
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    errors = []
    device = _device(rank, kind)
    lo, hi = SHARDS[rank]
    hidden, weight, target, bias = make_problem(N, V, D, torch.float32, seed=23, bias=True)
    target[0], target[1] = 156, 180
    for impl in IMPLS:
        label = f"rank={rank} {impl}"
        h = hidden.to(device).clone().requires_grad_()
        loss = vocab_parallel_linear_cross_entropy(h, weight[lo:hi].to(device), target.to(device),
                                                   impl=impl)
        try:
            torch.autograd.grad(loss, h, create_graph=True)
            errors.append(f"{label}: create_graph=True gave no error")
        except RuntimeError as exc:
            if "second-order gradients are not supported" not in str(exc):
                errors.append(f"{label}: create_graph=True: {str(exc)[:200]}")

        want = _reference(hidden, weight, target, bias)
        got = _parallel(rank, hidden, weight, target.to(torch.uint8), bias, impl, device)
        _check(errors, f"{label} uint8 target", got, want, rank)

        empty_h, empty_w = torch.zeros(N, 0), torch.zeros(V, 0)
        want = _reference(empty_h, empty_w, target, bias)
        try:
            got = _parallel(rank, empty_h, empty_w, target, bias, impl, device)
        except Exception:
            return errors + [f"{label} D=0 raised:\n{traceback.format_exc()}"]
        _check(errors, f"{label} D=0", got, want, rank)
    return errors


@pytest.mark.timeout(300)
def test_second_order_uint8_targets_and_empty_hidden(tmp_path):
    run_on_ranks(2, _edge_suite, out_dir=tmp_path, timeout_s=60, interpret=True)


# ---------------------------------------------------------------------------------------------
# The suites above on NCCL with the real kernels, one process per GPU. On a machine with 2 GPUs:
# ``python -m pytest -q tests/parallel/test_parallel_reliability.py -m requires_gpus``.
# ---------------------------------------------------------------------------------------------


@pytest.mark.requires_gpus(2)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("suite", [_strided_suite, _precision_suite, _edge_suite],
                         ids=["strided", "confident-tokens", "second-order-uint8-empty"])
def test_reliability_nccl(suite, tmp_path):
    # Generous timeout: the first call of each kernel compiles it.
    run_on_ranks(2, suite, "cuda", out_dir=tmp_path, backend="nccl", timeout_s=600,
                 interpret=False)
