"""Indexed dot: the target logit softcap(E[i] . C[target[i]] + b[target[i]]) per row.

One program handles a block of rows and walks the hidden dimension; it reads one weight row per
token and never forms a logit row. Rows whose target is not a column of this weight (ignored
tokens, or targets owned by another vocabulary shard) get 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, round_code, round_logits, tanh


@triton.heuristics(
    {
        "HAS_BIAS": lambda args: args["bias_ptr"] is not None,
        "HAS_SOFTCAP": lambda args: args["softcap"] is not None,
    }
)
@triton.jit
def _indexed_dot_kernel(
    # pointers
    e_ptr,
    c_ptr,
    bias_ptr,
    target_ptr,
    out_ptr,
    # sizes
    n_rows,
    n_vocab,
    d_model,
    vocab_start,
    # strides
    stride_en,
    stride_ed,
    stride_cv,
    stride_cd,
    # scalars
    softcap,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ROUND: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    in_rows = offs_n < n_rows
    target = tl.load(target_ptr + offs_n, mask=in_rows, other=-1).to(tl.int64) - vocab_start
    owned = in_rows & (target >= 0) & (target < n_vocab)
    target = tl.where(owned, target, 0)

    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for d0 in range(0, d_model, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = owned[:, None] & (offs_d[None, :] < d_model)
        e_ptrs = e_ptr + offs_n[:, None] * stride_en + offs_d[None, :] * stride_ed
        c_ptrs = c_ptr + target[:, None] * stride_cv + offs_d[None, :] * stride_cd
        e = tl.load(e_ptrs, mask=mask, other=0.0)
        c = tl.load(c_ptrs, mask=mask, other=0.0)
        acc += tl.sum(e.to(tl.float32) * c.to(tl.float32), axis=1)
    acc = round_logits(acc, ROUND)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + target, mask=owned, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        acc = softcap * tanh(acc / softcap)
    tl.store(out_ptr + offs_n, tl.where(owned, acc, 0.0), mask=in_rows)


def indexed_dot(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    softcap: float | None = None,
    vocab_start: int = 0,
    round_16bit: bool = False,
) -> torch.Tensor:
    """(N,) fp32 target logits; 0 where ``target - vocab_start`` is not a row of ``weight``.

    Args:
        hidden: (N, D); weight: (V, D); bias: (V,) or None; target: (N,) global class ids.
        vocab_start: the global id of ``weight``'s first row (vocabulary shards).
    """
    n_rows, d_model = hidden.shape
    out = torch.empty((n_rows,), device=hidden.device, dtype=torch.float32)
    if n_rows == 0:
        return out
    block_n, block_d = (64, 128) if INTERPRET else (32, 128)
    grid = (triton.cdiv(n_rows, block_n),)
    _indexed_dot_kernel[grid](
        hidden, weight, bias, target, out,
        n_rows, weight.shape[0], d_model, vocab_start,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        softcap,
        BLOCK_N=block_n, BLOCK_D=block_d, ROUND=round_code(hidden.dtype, round_16bit),
        num_warps=4,
    )
    return out
