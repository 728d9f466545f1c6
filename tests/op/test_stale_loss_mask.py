"""A loss_mask edited in place between the forward and the backward.

With ``reduction="none"`` and a ``loss_mask``, the cce forward builds the gradients for an
upstream gradient proportional to the mask, and the backward checks that the real one is. A
caller that reuses the mask's buffer for the next batch edits it before the backward runs; the
check must then compare against what the forward assumed (a copy) and find the mismatch: the
checked mode (``upstream_mismatch="recompute"``) recomputes exactly, the default returns NaN
gradients and a later call raises; neither returns gradients for a mask that no longer holds.
"""

from __future__ import annotations

import pytest
import torch
from helpers_lce import make_problem

from fused_lce import engine, faults, linear_cross_entropy
from fused_lce.kernels.common import INTERPRET

N, V, D = 45, 203, 23
# cce runs under the interpreter on CPU tensors, or on a GPU where there is one.
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


@pytest.fixture
def recomputes(monkeypatch) -> list[str]:
    """One entry per backward that fell back to the exact recompute."""
    calls = []
    monkeypatch.setattr(engine, "warn_recompute", lambda where: calls.append(where))
    return calls


def _masked_call(regime: str, seed: int, upstream_mismatch: str = "recompute"):
    """(hidden, weight, target on the CPU; h, w leaves, the mask and the per-token loss on
    DEVICE) of a cce call with reduction 'none' and a loss_mask."""
    hidden, weight, target, _ = make_problem(N, V, D, torch.float32, regime, seed=seed)
    mask = (torch.rand(N, generator=torch.Generator().manual_seed(seed)) > 0.3).float()
    h, w = (t.to(DEVICE, copy=True).requires_grad_() for t in (hidden, weight))
    mask = mask.to(DEVICE)
    loss = linear_cross_entropy(h, w, target.to(DEVICE), impl="cce", reduction="none",
                                loss_mask=mask, upstream_mismatch=upstream_mismatch)
    return (hidden, weight, target), (h, w), mask, loss


def _assert_fp64_gradients(problem, leaves, weights: torch.Tensor) -> None:
    """The leaves' gradients equal float64 torch's for sum(weights * per-token loss)."""
    hidden, weight, target = problem
    h64, w64 = (t.double().requires_grad_() for t in (hidden, weight))
    expected = torch.nn.functional.cross_entropy(h64 @ w64.T, target, reduction="none")
    (expected * weights.double().cpu()).sum().backward()
    for name, ours, exact in zip(("d_hidden", "d_weight"), (leaf.grad for leaf in leaves),
                                 (h64.grad, w64.grad)):
        err = (ours.double().cpu() - exact).norm() / exact.norm()
        assert err < 1e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("edit", ["halved", "shifted", "unchanged"])
def test_loss_with_the_edited_mask_gets_exact_gradients(edit, walks, recomputes):
    """The caller's loss multiplies by the mask as it is at the backward (edited in place): the
    forward's gradients were built for the old one, so the backward must recompute."""
    problem, leaves, mask, loss = _masked_call("peaked", seed=7)
    if edit == "halved":
        mask[: N // 2] = 0.0
    elif edit == "shifted":
        mask.copy_(mask.roll(1))
    (loss * mask).sum().backward()
    assert len(walks) == 1
    assert len(recomputes) == (0 if edit == "unchanged" else 1)
    _assert_fp64_gradients(problem, leaves, mask)


def test_by_default_the_edited_mask_gives_nan_and_a_later_error(walks, recomputes):
    problem, leaves, mask, loss = _masked_call("peaked", seed=7, upstream_mismatch="auto")
    mask[: N // 2] = 0.0
    (loss * mask).sum().backward()
    assert len(walks) == 1 and not recomputes
    assert all(leaf.grad.isnan().all() for leaf in leaves)
    with pytest.raises(RuntimeError, match="not c \\* loss_mask"):
        faults.raise_deferred_errors()


@pytest.mark.parametrize("edit", ["zeroed", "shifted"])
def test_proportional_upstream_uses_the_forward_gradients_despite_an_edit(edit, walks,
                                                                          recomputes):
    """The upstream gradient is c * (the mask at the forward): the stored gradients apply and
    are right, whatever the caller did to its buffer afterwards."""
    problem, leaves, mask, loss = _masked_call("near-uniform", seed=8)
    applied = mask.clone()
    mask.zero_() if edit == "zeroed" else mask.copy_(mask.roll(1))
    (3.0 * loss * applied).sum().backward()
    assert len(walks) == 1 and not recomputes
    _assert_fp64_gradients(problem, leaves, 3.0 * applied)
