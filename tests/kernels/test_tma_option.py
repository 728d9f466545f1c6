"""``tma``: the option reaches both kernel launchers, and FUSED_LCE_TMA is read when the options
are built, not when a kernel launches."""

from __future__ import annotations

import pytest
import torch
from helpers_lce import make_problem

import fused_lce.kernels.gemm_backward as gemm_backward
import fused_lce.kernels.lse_forward as lse_forward
from fused_lce import LinearCrossEntropy, linear_cross_entropy
from fused_lce.kernels.common import use_tma
from fused_lce.options import ENV_TMA

D_ALIGNED = 72  # 16-byte rows at bf16: TMA-capable under the interpreter


def _spy(monkeypatch) -> list[tuple[str, bool]]:
    """Record what each launcher decided about tensor descriptors."""
    seen = []
    for module in (lse_forward, gemm_backward):
        def spy(*tensors, enabled=True, _name=module.__name__):
            decided = use_tma(*tensors, enabled=enabled)
            seen.append((_name.rsplit(".", 1)[1], decided))
            return decided

        monkeypatch.setattr(module, "use_tma", spy)
    return seen


def _run(op, **options):
    hidden, weight, target, _ = make_problem(64, 300, D_ALIGNED, torch.bfloat16, "peaked",
                                             seed=3)
    h = hidden.requires_grad_()
    loss = op(h, weight, target, **options)
    loss.backward()


@pytest.mark.parametrize("tma", [True, False])
def test_option_reaches_both_launchers(monkeypatch, tma):
    seen = _spy(monkeypatch)
    monkeypatch.setenv(ENV_TMA, "1" if not tma else "0")  # the option wins over the variable
    # The recomputing backward: the gradient-in-forward one reads no tiles of ours (cuBLAS).
    _run(linear_cross_entropy, impl="cce", tma=tma, backward="gemm")
    assert {name for name, _ in seen} == {"lse_forward", "gemm_backward"}
    assert all(decided == tma for _, decided in seen), seen


def test_environment_read_when_options_are_built(monkeypatch):
    monkeypatch.setenv(ENV_TMA, "0")
    module = LinearCrossEntropy(impl="cce", backward="gemm")
    monkeypatch.setenv(ENV_TMA, "1")  # too late for this module's options
    seen = _spy(monkeypatch)
    _run(module)
    assert seen and not any(decided for _, decided in seen), seen


def test_tma_must_be_a_bool():
    with pytest.raises(TypeError, match="tma must be a bool or None"):
        linear_cross_entropy(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long),
                             tma="no")
