"""The full-logits oracle is the definition in fused_lce.options, i.e. torch's cross-entropy.

``reference_linear_cross_entropy`` must equal ``F.cross_entropy(logits.float(), ...)`` on the
soft-capped logits for every reduction, ignore_index and label smoothing, and z_loss must add
exactly ``z * lse**2`` per non-ignored token. Everything else in the suite trusts it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers_lce import IGNORE_INDEX, make_problem

from fused_lce import linear_cross_entropy
from fused_lce.options import LCEOptions
from fused_lce.reference import reference_linear_cross_entropy

N, V, D = 150, 307, 70


def _logits(hidden, weight, bias, softcap):
    """Soft-capped logits in fp32 (fp64 for fp64 inputs), computed the obvious way."""
    logits = hidden @ weight.t() + (0 if bias is None else bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("ignore_index", [IGNORE_INDEX, 7])
@pytest.mark.parametrize("regime", ["peaked", "near-uniform"])
def test_reference_equals_torch_cross_entropy(
    reduction, label_smoothing, softcap, ignore_index, regime
):
    hidden, weight, target, bias = make_problem(
        N, V, D, torch.float32, regime, ignore_frac=0.2, bias=True, seed=11
    )
    # With ignore_index=7 (a real class id), class 7 and the planted -100s swap roles: 7 is
    # ignored, and the -100 tokens get class 7 (a target must be a valid class or ignored).
    if ignore_index == 7:
        target = torch.where(target == IGNORE_INDEX, torch.full_like(target, 7), target)
    opts = LCEOptions(
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        softcap=softcap,
    )
    loss, lse = reference_linear_cross_entropy(hidden, weight, target, bias, opts)

    logits = _logits(hidden, weight, bias, softcap)
    expected = F.cross_entropy(
        logits,
        target,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    assert (target == ignore_index).any() and (target != ignore_index).any()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reference_gradients_equal_torch(reduction):
    """Autograd through the oracle gives torch's gradients too (softcap, smoothing, bias)."""
    hidden, weight, target, bias = make_problem(
        N, V, D, torch.float64, "peaked", ignore_frac=0.2, bias=True, seed=12
    )
    opts = LCEOptions(reduction=reduction, label_smoothing=0.1, softcap=5.0)

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        out = fn(*leaves)
        (out if out.dim() == 0 else out.square()).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    ours, ours_grads = grads(
        lambda h, w, b: reference_linear_cross_entropy(h, w, target, b, opts)[0]
    )
    expected, expected_grads = grads(
        lambda h, w, b: F.cross_entropy(
            _logits(h, w, b, 5.0), target, reduction=reduction, label_smoothing=0.1
        )
    )
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(ours_grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_reference_num_classes_drops_padding_rows():
    hidden, weight, target, bias = make_problem(
        N, V, D, torch.float32, "peaked", ignore_frac=0.1, bias=True, seed=13, num_classes=300
    )
    opts = LCEOptions(num_classes=300)
    loss, lse = reference_linear_cross_entropy(hidden, weight, target, bias, opts)
    logits = _logits(hidden, weight[:300], bias[:300], None)
    torch.testing.assert_close(loss, F.cross_entropy(logits, target), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_z_loss_adds_z_times_lse_squared(reduction, softcap):
    """loss(z) = loss(0) + z * lse**2 on non-ignored tokens, reduced like the loss."""
    hidden, weight, target, bias = make_problem(
        N, V, D, torch.float64, "peaked", ignore_frac=0.2, bias=True, seed=14
    )
    z = 1e-3
    base = LCEOptions(reduction=reduction, softcap=softcap, label_smoothing=0.1)
    with_z = LCEOptions(reduction=reduction, softcap=softcap, label_smoothing=0.1, z_loss=z)
    loss0, _ = reference_linear_cross_entropy(hidden, weight, target, bias, base)
    loss_z, _ = reference_linear_cross_entropy(hidden, weight, target, bias, with_z)

    # By hand: lse of every row in fp64, zeroed where ignored.
    logits = hidden @ weight.t() + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    row_max = logits.max(dim=1).values
    lse = row_max + torch.log(torch.exp(logits - row_max[:, None]).sum(dim=1))
    valid = target != IGNORE_INDEX
    penalty = torch.where(valid, z * lse**2, torch.zeros_like(lse))
    if reduction == "sum":
        penalty = penalty.sum()
    elif reduction == "mean":
        penalty = penalty.sum() / valid.sum()

    assert valid.sum() < N
    torch.testing.assert_close(loss_z - loss0, penalty, rtol=1e-10, atol=1e-12)
    assert (torch.as_tensor(loss_z - loss0) > 0).any()


def test_torch_impl_is_the_reference():
    """impl="torch" flattens batch dims and zeroes the lse of ignored tokens, nothing else."""
    hidden, weight, target, bias = make_problem(
        (3, 50), V, D, torch.float32, "near-uniform", ignore_frac=0.2, bias=True, seed=15
    )
    loss, lse = linear_cross_entropy(
        hidden, weight, target, bias, impl="torch", reduction="none", return_lse=True
    )
    ref_loss, ref_lse = reference_linear_cross_entropy(
        hidden.reshape(-1, D), weight, target.reshape(-1), bias, LCEOptions(reduction="none")
    )
    valid = target != IGNORE_INDEX
    assert loss.shape == lse.shape == (3, 50)
    torch.testing.assert_close(loss, ref_loss.reshape(3, 50), rtol=0, atol=0)
    torch.testing.assert_close(lse[valid], ref_lse.reshape(3, 50)[valid], rtol=0, atol=0)
    assert torch.count_nonzero(lse[~valid]) == 0
