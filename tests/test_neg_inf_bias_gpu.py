"""test_neg_inf_bias.py on a GPU: bf16, the GPU's tile configs and vocabulary splits.

The issue's probe shape (512 tokens, 50000 classes, D = 256): a -inf bias on a block at the start,
in the middle or over the last quarter of the vocabulary, on every path, in training and
evaluation, against float64 torch on the same bf16-rounded values.

Run on a GPU machine: ``python -m pytest -q tests/test_neg_inf_bias_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_neg_inf_bias import PATHS as CPU_PATHS

from fused_lce import linear_cross_entropy

pytestmark = pytest.mark.requires_cuda

N, V, D = 512, 50000, 256
# test_neg_inf_bias.py's paths at the GPU's own chunk sizes.
PATHS = {name: {k: v for k, v in options.items() if not k.endswith("_chunk_size")}
         for name, options in CPU_PATHS.items() if name != "chunked-tokens"}
PATHS["chunked"] = PATHS.pop("chunked-vocab")
MASKS = {"start": slice(0, 12500), "middle": slice(20000, 30000), "last-quarter": slice(37500, V)}


def _problem(mask: slice):
    generator = torch.Generator().manual_seed(mask.start + 1)
    hidden = torch.randn(N, D, generator=generator).bfloat16()
    weight = (torch.randn(V, D, generator=generator) * 0.05).bfloat16()
    bias = (torch.randn(V, generator=generator) * 0.1).bfloat16()
    bias[mask] = float("-inf")
    allowed = torch.isfinite(bias).nonzero().squeeze(1)
    target = allowed[torch.randint(len(allowed), (N,), generator=generator)]
    return hidden, weight, bias, target


def _reference(hidden, weight, bias, target, softcap):
    inputs = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    logits = inputs[0] @ inputs[1].T + inputs[2]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, target)
    loss.backward()
    return (loss.detach(), *(t.grad for t in inputs))


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("where", list(MASKS))
@pytest.mark.parametrize("path", list(PATHS))
def test_masked_classes_on_the_gpu(path, where, softcap):
    hidden, weight, bias, target = _problem(MASKS[where])
    expected = _reference(hidden, weight, bias, target, softcap)
    for train in (True, False):
        inputs = [t.cuda().requires_grad_(train) for t in (hidden, weight, bias)]
        with torch.set_grad_enabled(train):
            loss = linear_cross_entropy(inputs[0], inputs[1], target.cuda(), inputs[2],
                                        softcap=softcap, **PATHS[path])
        assert torch.isfinite(loss), f"train={train}: loss {loss.item()}"
        assert abs(loss.item() - expected[0].item()) <= 2e-3 * abs(expected[0].item())
        if not train:
            continue
        loss.backward()
        for name, tensor, exact in zip(("d_hidden", "d_weight", "d_bias"), inputs, expected[1:]):
            grad = tensor.grad.double().cpu()
            assert torch.isfinite(grad).all(), f"{name} is not finite"
            err = ((grad - exact).norm() / exact.norm()).item()
            assert err < 2e-2, f"{name}: relative error {err:.2e}"
