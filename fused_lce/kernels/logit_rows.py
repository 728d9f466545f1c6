"""Row statistics of a stored logits chunk, and the logit gradient G written over it.

The gradient-in-forward mode (fused_lce/token_walk.py) lets cuBLAS write one token chunk's raw
logits E @ C.T (rows x V_local, 16 bits) into a buffer, then runs this pair over it:

    row_statistics   max, sum of exp(z - max), the target logit (and the row sum), per row,
                     online over the row's column blocks, as the forward kernel does;
    grad_in_place    G = dL/dz from the same logits and the (global) lse, written over them.

Both apply the bias and the soft-cap to each logit as they read it, so the buffer holds only
what the GEMM wrote, and G comes from the very numbers the statistics saw. Ignored rows need no
mask: their coefficients are zero, so their G rows are exactly zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    INTERPRET,
    RowCoefficients,
    check_row_terms,
    check_vector,
    fold_tile,
    grad_from_logits,
    load_row_terms,
    logit_epilogue,
    when_given,
)


@triton.heuristics(
    when_given(HAS_BIAS="bias_ptr", HAS_SOFTCAP="softcap", WANT_ROW_SUM="row_sum_ptr")
)
@triton.jit
def _row_statistics_kernel(
    logits_ptr, bias_ptr, target_ptr,
    max_ptr, sum_exp_ptr, target_logit_ptr, row_sum_ptr,
    n_rows, n_cols, stride_row, softcap,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WANT_ROW_SUM: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
    run_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        col_mask = cols < n_cols
        in_tile = row_mask[:, None] & col_mask[None, :]
        raw = tl.load(logits_ptr + rows[:, None] * stride_row + cols[None, :], mask=in_tile,
                      other=0.0)
        # ROUND 0: the logits are already rounded to the buffer's dtype by the GEMM that wrote them.
        logits, _ = logit_epilogue(
            raw.to(tl.float32), bias_ptr, cols, col_mask, softcap, HAS_BIAS, HAS_SOFTCAP, 0
        )
        logits = tl.where(in_tile, logits, float("-inf"))
        run_max, run_sum, _ = fold_tile(logits, run_max, run_sum)
        if WANT_ROW_SUM:
            row_sum += tl.sum(tl.where(in_tile, logits, 0.0), axis=1)
    # The target logit: one load per row, not a compare per logit (it keeps the loop above at
    # the buffer's bandwidth), with the bias and cap applied as the loop applies them.
    owned = row_mask & (target >= 0) & (target < n_cols)
    target_col = tl.where(owned, target, 0)
    raw = tl.load(logits_ptr + rows * stride_row + target_col, mask=owned, other=0.0)
    target_logit, _ = logit_epilogue(
        raw.to(tl.float32), bias_ptr, target_col, owned, softcap, HAS_BIAS, HAS_SOFTCAP, 0
    )
    target_logit = tl.where(owned, target_logit, 0.0)
    tl.store(max_ptr + rows, run_max, mask=row_mask)
    tl.store(sum_exp_ptr + rows, run_sum, mask=row_mask)
    tl.store(target_logit_ptr + rows, target_logit, mask=row_mask)
    if WANT_ROW_SUM:
        tl.store(row_sum_ptr + rows, row_sum, mask=row_mask)


@triton.heuristics(
    when_given(HAS_BIAS="bias_ptr", HAS_SOFTCAP="softcap", HAS_SMOOTHING="smooth_coef_ptr")
)
@triton.jit
def _grad_in_place_kernel(
    logits_ptr, out_ptr, bias_ptr, target_ptr, lse_ptr, p_coef_ptr, target_grad_ptr,
    smooth_coef_ptr,
    n_rows, n_cols, stride_row, stride_out, softcap,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    in_tile = row_mask[:, None] & col_mask[None, :]
    raw = tl.load(logits_ptr + rows[:, None] * stride_row + cols[None, :], mask=in_tile,
                  other=0.0).to(tl.float32)
    target, lse, p_coef, target_grad, smooth_coef = load_row_terms(
        rows, row_mask, target_ptr, lse_ptr, p_coef_ptr, target_grad_ptr, smooth_coef_ptr,
        HAS_SMOOTHING,
    )
    grad, _, _ = grad_from_logits(
        raw, bias_ptr, cols, row_mask, col_mask, target, lse, p_coef, target_grad, smooth_coef,
        softcap, HAS_BIAS, HAS_SOFTCAP, HAS_SMOOTHING, 0,
    )
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
             grad.to(out_ptr.dtype.element_ty), mask=in_tile)


def _check_chunk(logits: torch.Tensor, bias: torch.Tensor | None, target_local: torch.Tensor):
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(
            f"logits must be a (rows, V) matrix with unit column stride, got shape "
            f"{tuple(logits.shape)} strides {logits.stride()}"
        )
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"logits must be fp32, fp16 or bf16, got {logits.dtype}")
    n_rows, n_cols = logits.shape
    check_vector("target_local", target_local, n_rows, (torch.int32, torch.int64))
    if bias is not None:
        check_vector("bias", bias, n_cols, (torch.float32, torch.float16, torch.bfloat16))


def _statistics_config() -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_V, num_warps): one row, wide column blocks. Measured with
    scripts/studies/tune_logit_rows.py on an H100 over 4096 x 256000 bf16 logits: 0.71 ms
    (2.97 TB/s),
    against 0.74 ms for 2 x 4096, 0.78 ms for 4 x 1024 and 1.39 ms for a copy of the buffer (which
    moves twice the bytes); over 4096 x 32064, 0.102 ms against 0.109 ms. The interpreter wants
    few, big blocks."""
    if INTERPRET:
        return 16, 1024, 4
    return 1, 8192, 8


def row_statistics(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    target_local: torch.Tensor,
    softcap: float | None,
    want_row_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(max, sum_exp, target_logit, row_sum or None), (rows,) fp32, of softcap(logits + bias).

    ``target_local``: the target's column in this chunk, or -1 (the target logit is then 0).
    """
    # Check constraints.
    _check_chunk(logits, bias, target_local)
    n_rows, n_cols = logits.shape
    out = torch.empty((4 if want_row_sum else 3, n_rows), dtype=torch.float32,
                      device=logits.device)
    row_sum = out[3] if want_row_sum else None
    block_n, block_v, warps = _statistics_config()
    if n_rows > 0:
        _row_statistics_kernel[(triton.cdiv(n_rows, block_n),)](
            logits, bias, target_local, out[0], out[1], out[2], row_sum,
            n_rows, n_cols, logits.stride(0), softcap,
            BLOCK_N=block_n, BLOCK_V=block_v, num_warps=warps,
        )
    return out[0], out[1], out[2], row_sum


def grad_in_place(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    target_local: torch.Tensor,
    lse: torch.Tensor,
    coefs: RowCoefficients,
    softcap: float | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """G = dL/dz of softcap(logits + bias) against ``lse``, written over ``logits`` (or ``out``,
    of the same shape) and returned. Each element is read before its own G is written, so the
    same storage serves both."""
    # Check constraints.
    _check_chunk(logits, bias, target_local)
    n_rows, n_cols = logits.shape
    out = logits if out is None else out
    if out.shape != logits.shape or (n_cols > 1 and out.stride(1) != 1):
        raise ValueError(
            f"out must have logits' shape {tuple(logits.shape)} and unit column stride, got "
            f"{tuple(out.shape)} strides {out.stride()}"
        )
    check_row_terms(n_rows, target_local, lse, coefs)
    # Any tile of 8K elements streams at the copy's rate on an H100 (tune_logit_rows.py).
    block_n, block_v = (16, 256) if INTERPRET else (16, 512)
    if n_rows > 0 and n_cols > 0:
        grid = (triton.cdiv(n_rows, block_n), triton.cdiv(n_cols, block_v))
        _grad_in_place_kernel[grid](
            logits, out, bias, target_local, lse, coefs.p_coef, coefs.target_grad,
            coefs.smooth_coef, n_rows, n_cols, logits.stride(0), out.stride(0), softcap,
            BLOCK_N=block_n, BLOCK_V=block_v, num_warps=4,
        )
    return out
