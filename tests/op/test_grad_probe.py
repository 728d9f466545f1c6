"""lce_train.grad_probe: the fp32 reference, each variant's gradient error, the unseen mass.

The reference is checked against autograd through fp64 full logits (with soft-capping and an
ignored token, over several token chunks); an exact path gives errors near zero; the paper's
per-entry filter on a near-uniform softmax (V=5000, every entry below 2^-12) loses a large part
of the weight gradient and the probe says so; the unseen mass equals a value worked out by hand.
The kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it on the CPU).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers_lce import make_common_direction_problem

from fused_lce.kernels.common import INTERPRET
from lce_train import grad_probe

needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                   reason="the cce kernels need CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fp64_autograd(hidden, weight, target, softcap=None, ignore_index=-100):
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    logits = h @ w.t()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index)
    return loss.detach(), *torch.autograd.grad(loss, (h, w))


def test_reference_matches_fp64_autograd_over_chunks():
    gen = torch.Generator().manual_seed(0)
    n, v, d = 37, 301, 16
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(v, d, generator=gen) * 0.3
    target = torch.randint(0, v, (n,), generator=gen)
    target[5] = -100
    ref = grad_probe.reference_gradients(hidden, weight, target, softcap=4.0, token_chunk=8)
    loss, d_input, d_weight = _fp64_autograd(hidden, weight, target, softcap=4.0)
    assert ref.loss == pytest.approx(loss.item(), rel=1e-5)
    assert grad_probe.relative_error(ref.d_input, d_input) < 1e-5
    assert grad_probe.relative_error(ref.d_weight, d_weight) < 1e-5
    assert float(ref.d_input[5].abs().max()) == 0.0  # the ignored token


def test_unseen_and_small_mass_by_hand():
    # Logits [0, ln 3, 0, 0] and [ln 4, 0, 0, 0]: softmax [1, 3, 1, 1] / 6 and [4, 1, 1, 1] / 7.
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    hidden = torch.tensor([[0.0, math.log(3.0)], [math.log(4.0), 0.0]])
    target = torch.tensor([1, 0])
    unseen = torch.tensor([False, False, True, True])
    ref = grad_probe.reference_gradients(hidden, weight, target, unseen=unseen, token_chunk=1)
    assert ref.unseen_mass == pytest.approx((2 / 6 + 2 / 7) / 2, rel=1e-6)
    assert ref.loss == pytest.approx((math.log(2.0) + math.log(7 / 4)) / 2, rel=1e-6)
    assert ref.small_mass == 0.0  # no entry below 2^-12
    record = grad_probe.probe_loss_layer(hidden, weight, target, unseen=unseen, impl="torch",
                                         variants={"torch": {}})
    assert record["unseen_mass"] == pytest.approx(13 / 42, rel=1e-6)
    assert record["unseen_ids"] == 2 and record["tokens"] == 2


@needs_kernels
def test_exact_path_has_no_error_and_paper_filter_is_caught():
    # fp32: the default (GEMM) backward is exact to fp32 rounding.
    hidden, weight, target, _ = make_common_direction_problem(64, 1000, 32, torch.float32, seed=3)
    exact = grad_probe.probe_loss_layer(hidden.to(DEVICE), weight.to(DEVICE), target.to(DEVICE),
                                        impl="cce", variants={"gemm": {"backward": "gemm"}})
    for name in ("gemm", "native"):
        assert max(exact["grad_rel_err"][name].values()) < 1e-5, exact

    # bf16, V=5000: every softmax entry is below 2^-12, yet together they are the whole
    # normalisation term of the weight gradient.
    problem = make_common_direction_problem(64, 5000, 32, torch.bfloat16, seed=4)
    hidden, weight, target = (t.to(DEVICE) for t in problem[:3])
    record = grad_probe.probe_loss_layer(hidden, weight, target, impl="cce")
    errors = record["grad_rel_err"]
    print("\nV=5000 near-uniform bf16:", errors, "small mass", record["small_mass"])
    assert record["small_mass"] > 0.95  # the paper's test skips nearly all of the softmax
    for name in ("gemm", "tiles_safe", "native"):
        assert max(errors[name].values()) < 1e-2, (name, errors)  # bf16 rounding only
    assert errors["tiles_paper"]["weight"] > 5e-2
    assert errors["tiles_paper"]["weight"] > 10 * errors["gemm"]["weight"]
