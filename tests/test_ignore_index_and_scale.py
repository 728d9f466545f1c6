"""A non-default ``ignore_index`` with ignored tokens, and a loss whose upstream gradient is not 1,
on every path: cce (each backward) under the interpreter, chunked (both ``chunk_by``), and the
vocab-parallel layer on gloo (TP=2, both impls, with and without SP).

The two bugs these catch hid from the rest of the suite, whose problems mark ignored tokens with
the default -100 and whose scalar objectives were the loss itself:
- the valid-row mask built against -100 instead of ``ignore_index``;
- a gradient computed in the forward for an upstream gradient of 1 and not scaled by the actual
  one in the backward (the bias gradient, once).

Every case compares the loss and the gradients of input, weight and bias with
``torch.nn.functional.cross_entropy`` on float64 logits, under the same objective: ``3 * loss``
for "mean" and "sum"; for "none" either ``3 * loss.sum()`` (a multiple of the mask the cce
forward assumes, so its stored gradients are scaled) or a random weight per token (they are
recomputed). Sizes are odd, so no chunk or block divides them.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_rel
from helpers_lce import IGNORE_INDEX, make_problem
from helpers_parallel import run_on_ranks

from fused_lce import linear_cross_entropy

pytestmark = pytest.mark.filterwarnings("ignore:.*the gradients are recomputed exactly")

N, V, D = 45, 97, 24
TOL = 1e-5  # relative, fp32 against fp64
SCALE = 3.0

# (ignore_index, reduction, upstream): 7 is a class id (its tokens are ignored too), -1 is not.
CASES = [
    (7, "mean", "scaled"),
    (-1, "sum", "scaled"),
    (7, "none", "scaled"),
    (-1, "none", "random"),
]
CASE_IDS = [f"ignore{i}-{r}-{u}" for i, r, u in CASES]

# chunk sizes that split 45 tokens and 97 classes unevenly
PATHS = {
    "cce-forward": dict(impl="cce"),
    "cce-forward-chunks": dict(impl="cce", token_chunk_size=16),
    "cce-gemm": dict(impl="cce", backward="gemm"),
    "cce-tiles": dict(impl="cce", backward="tiles"),
    "chunked-vocab": dict(impl="chunked", chunk_by="vocab", vocab_chunk_size=32),
    "chunked-tokens": dict(impl="chunked", chunk_by="tokens", token_chunk_size=16),
}


def problem(ignore_index: int, seed: int, n=N):
    """A peaked problem with a bias and a fifth of the tokens marked ``ignore_index``."""
    hidden, weight, target, bias = make_problem(n, V, D, torch.float32, ignore_frac=0.2,
                                                bias=True, seed=seed)
    target = target.masked_fill(target == IGNORE_INDEX, ignore_index)
    return hidden, weight, target, bias


def objective(loss: torch.Tensor, upstream: str, seed: int) -> torch.Tensor:
    """3 * loss, or for "none" a sum weighted by 3 or by a random weight per token."""
    if upstream == "scaled":
        return SCALE * loss.sum()
    weights = 0.5 + torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed),
                               dtype=torch.float64)
    return (loss * weights.to(loss.dtype)).sum()


def fp64_oracle(hidden, weight, target, bias, ignore_index, reduction, upstream, seed):
    """(loss, {input, weight, bias} gradients) of torch's cross-entropy on fp64 logits."""
    h, w, b = (x.detach().double().requires_grad_() for x in (hidden, weight, bias))
    loss = F.cross_entropy(h @ w.t() + b, target, ignore_index=ignore_index, reduction=reduction)
    objective(loss, upstream, seed).backward()
    return loss.detach(), {"input": h.grad, "weight": w.grad, "bias": b.grad}


def check_run(loss, grads, expected_loss, expected_grads, ignored, label) -> None:
    assert_close_rel(loss, expected_loss, TOL, f"{label} loss")
    for name, grad in grads.items():
        assert grad is not None, f"{label} {name}: no gradient"
        assert_close_rel(grad, expected_grads[name], TOL, f"{label} {name} grad")
    assert not torch.count_nonzero(grads["input"][ignored]), f"{label}: ignored rows' gradient"


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("ignore_index, reduction, upstream", CASES, ids=CASE_IDS)
def test_single_device_matches_torch(path, ignore_index, reduction, upstream):
    options = PATHS[path]
    if options.get("chunk_by") == "tokens" and reduction == "none":
        pytest.skip("chunk_by='tokens' takes scalar losses only")
    seed = 11 + CASES.index((ignore_index, reduction, upstream))
    hidden, weight, target, bias = problem(ignore_index, seed)
    ignored = target == ignore_index
    assert 0 < int(ignored.sum()) < N
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    loss = linear_cross_entropy(h, w, target, b, ignore_index=ignore_index, reduction=reduction,
                                **options)
    objective(loss, upstream, seed).backward()
    expected = fp64_oracle(hidden, weight, target, bias, ignore_index, reduction, upstream, seed)
    grads = {"input": h.grad, "weight": w.grad, "bias": b.grad}
    check_run(loss, grads, *expected, ignored, path)


# ---------------------------------------------------------------------------------------------
# The vocab-parallel layer: TP=2 on gloo, every rank against its slice of the fp64 oracle
# ---------------------------------------------------------------------------------------------

S, B = 10, 3  # 30 tokens; with SP 5 positions a rank


def _parallel_case(rank: int, world: int, impl: str, sp: bool, case: tuple, seed: int) -> None:
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    ignore_index, reduction, upstream = case
    hidden, weight, target, bias = problem(ignore_index, seed, n=S * B)
    hidden, target = hidden.reshape(S, B, D), target.reshape(S, B)
    lo, hi = rank * V // world, (rank + 1) * V // world  # 48 and 49 rows
    s_lo, s_hi = (rank * S // world, (rank + 1) * S // world) if sp else (0, S)
    h = hidden[s_lo:s_hi].clone().requires_grad_()
    w = weight[lo:hi].clone().requires_grad_()
    b = bias[lo:hi].clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(
        h, w, target, b, sequence_parallel=sp, impl=impl, ignore_index=ignore_index,
        reduction=reduction)
    objective(loss, upstream, seed).backward()
    flat = (hidden.reshape(-1, D), weight, target.reshape(-1), bias)
    expected_loss, full = fp64_oracle(*flat, ignore_index, reduction, upstream, seed)
    expected = {"input": full["input"].reshape(S, B, D)[s_lo:s_hi], "weight": full["weight"][lo:hi],
                "bias": full["bias"][lo:hi]}
    grads = {"input": h.grad, "weight": w.grad, "bias": b.grad}
    check_run(loss, grads, expected_loss.reshape(loss.shape), expected,
              target[s_lo:s_hi] == ignore_index, f"tp={world} rank={rank} {impl} sp={sp} {case}")


def _parallel_suite(rank: int, world: int) -> list[str]:
    errors = []
    for impl in ("cce", "chunked"):
        for sp in (False, True):
            for seed, case in enumerate(CASES, start=31):
                try:
                    _parallel_case(rank, world, impl, sp, case, seed)
                except AssertionError as exc:
                    errors.append(str(exc))
                except Exception:
                    # The ranks may be out of step in their collectives now: stop here.
                    errors.append(f"rank={rank} {impl} sp={sp} {case} raised:\n"
                                  + traceback.format_exc())
                    return errors
    return errors


def test_vocab_parallel_matches_torch(tmp_path):
    run_on_ranks(2, _parallel_suite, out_dir=tmp_path, interpret=True)
