"""Products formed in fp32 whatever their operands' dtype (a wider accumulator, one rounding),
through cuBLAS where it can. Pure torch, no Triton: the Triton strategy, the GEMM backward's host
driver, the engine and the chunked path share them."""

from __future__ import annotations

import torch


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, never rounding the product to a's dtype on the way (acc may be fp32 with
    16-bit a and b; a 16-bit acc rounds the sum once per call)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        # cuBLAS adds a 16-bit product into an fp32 output directly (beta = 1).
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b, accumulated in fp32 and rounded once to out's dtype."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    elif out.is_cuda:
        torch.addmm(out, a, b, beta=0, out_dtype=out.dtype, out=out)
    else:
        out.copy_(a.float() @ b.float())


def accumulate_mv(acc: torch.Tensor, a: torch.Tensor, x: torch.Tensor) -> None:
    """acc += a @ x for an fp32 vector ``acc``, a 16-bit matrix ``a`` and an fp32 ``x`` (rounded
    to a's dtype for the product, which accumulates in fp32)."""
    if acc.is_cuda:
        column = acc.unsqueeze(1)
        torch.addmm(column, a, x.to(a.dtype).unsqueeze(1), out_dtype=acc.dtype, out=column)
    else:
        acc += a.float() @ x.to(a.dtype).float()


# Elements scaled at a time by ``scale_in_fp32_``: its fp32 copy stays at 16 MiB.
SCALE_SLICE = 1 << 22


def scale_in_fp32_(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``tensor *= scale`` in place, the product formed in fp32 and rounded once. ``scale`` is a
    one-element device tensor (never read by the host), fp32 or fp64. Multiplying a 16-bit tensor
    by it directly would round the scale itself to 16 bits first: in bf16 1/3 is 0.333984 (a
    0.2% bias in every entry), in fp16 2^16 is inf."""
    if tensor.dtype in (torch.float32, torch.float64):
        return tensor.mul_(scale.to(tensor.dtype))
    if not tensor.is_contiguous():
        return tensor.copy_(tensor.float() * scale)
    flat = tensor.view(-1)
    for start in range(0, flat.numel(), SCALE_SLICE):
        part = flat[start:start + SCALE_SLICE]
        part.copy_(part.float().mul_(scale))
    return tensor
