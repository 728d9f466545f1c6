"""Products with a wider accumulator than their operands, through cuBLAS where it can: pure torch
(no Triton), shared by the Triton strategy's host drivers and the chunked path."""

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
