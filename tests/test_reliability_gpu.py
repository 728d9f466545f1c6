"""test_reliability.py's precision and strided-argument checks with the real kernels on a GPU.

At sizes where the GPU tile configs, vocabulary splits and the copy engine (16-byte aligned
16-bit rows on Hopper) matter. For confident tokens, 16-bit inputs are held to torch's fp32
``F.cross_entropy`` on the same (rounded) values: our kernels keep fp32 logits.

Run on a GPU machine: ``python -m pytest -q tests/test_reliability_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers_lce import compare_to_reference, make_problem
from helpers_reliability import (
    confident_problem,
    cross_entropy_run,
    precision_failures,
    upstream,
    with_strided_argument,
)

from fused_lce import linear_cross_entropy

pytestmark = pytest.mark.requires_cuda

N, V = 1000, 5003
PATHS = {
    "cce-gemm": dict(impl="cce", backward="gemm"),
    "cce-tiles": dict(impl="cce", backward="tiles"),
    "cce-kept": dict(impl="cce", backward="gemm", keep_logits=True),
    "chunked": dict(impl="chunked"),
}


# chunked rounds 16-bit logits as an unfused head does (torch's own error): fp32 only there.
_CONFIDENT_CASES = [
    pytest.param(dtype, d, path, id=f"{dtype}-{name}-{path}")
    for dtype in (torch.float32, torch.bfloat16)
    for d, name in ((257, "pointer"), (256, "aligned"))
    for path in PATHS
    if dtype == torch.float32 or path != "chunked"
]


@pytest.mark.parametrize("dtype, d, path", _CONFIDENT_CASES)
def test_confident_tokens_as_precise_as_torch(dtype, d, path):
    hidden, weight, target, bias = confident_problem(N, V, d, seed=31, bias=True)
    hidden, weight, bias = (x.to(dtype).float() for x in (hidden, weight, bias))  # rounded
    exact = cross_entropy_run(hidden, weight, target, bias, torch.float64, "none")
    fp32 = cross_entropy_run(hidden, weight, target, bias, torch.float32, "none", "cuda")
    h, w = (x.to("cuda", dtype).requires_grad_() for x in (hidden, weight))
    loss, lse = linear_cross_entropy(h, w, target.cuda(), bias.to("cuda", dtype),
                                     reduction="none", return_lse=True, **PATHS[path])
    upstream(loss).backward()
    ours = {"loss": loss, "lse": lse, "d_input": h.grad, "d_weight": w.grad}
    if dtype != torch.float32:
        # 16-bit gradients are rounded to 16 bits; only fp32 ones can match fp32's precision.
        ours["d_input"] = ours["d_weight"] = None
    failures = precision_failures(ours, exact, fp32)
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("which", ["input", "weight", "weight-column-major", "target", "bias",
                                   "input-one-row-broadcast", "bias-broadcast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_argument(dtype, which, path):
    hidden, weight, target, bias = make_problem(N, V, 256, dtype, "peaked", 0.1, bias=True,
                                                seed=32)
    hidden, weight, target, bias = (x.cuda() for x in (hidden, weight, target, bias))
    hidden, weight, target, bias = with_strided_argument(which, hidden, weight, target, bias, V)
    compare_to_reference(hidden, weight, target, bias, device="cuda", reduction="none",
                         return_lse=True, seed=32, **PATHS[path])
