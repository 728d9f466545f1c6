"""The gradients from stored exponentials: the small kernels that turn the exponentials GEMM's
output E (exp_logits.py, whose module docstring gives the math) into a token chunk's gradients.
``row_scales`` gives each row's scale s_n and target gradient g_n (and the scaled rows s * E_in),
``finish_input_grad`` completes dE from cuBLAS's E @ C, and ``add_target_rows`` adds the target
columns' fp32 terms to dC (and the bias gradient).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, check_vector, round_logits, softcap_derivative, when_given
from .exp_logits import _IGNORED, _check_row_vectors, _check_rows, _out_of_range, _out_round


@triton.heuristics(when_given(HAS_SOFTCAP="softcap", WANT_SCALED="out_ptr"))
@triton.jit
def _row_scales_kernel(
    x_ptr, out_ptr, scale_ptr, target_grad_out_ptr,
    lse_ptr, offset_ptr, p_coef_ptr, target_grad_ptr, column_ptr,
    n_rows, d_model, stride_xn, stride_xd, stride_out, softcap,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    WANT_SCALED: tl.constexpr, ROUND_OUT: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_mask = rows < n_rows
    p_coef = tl.load(p_coef_ptr + rows, mask=row_mask, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    offset = tl.load(offset_ptr + rows, mask=row_mask, other=0.0)
    # A zero coefficient (an ignored or masked row) gives a zero scale whatever its statistics;
    # a row that _repair_kernel stored against its lse is the softmax itself.
    scale = tl.where(_out_of_range(lse, offset), p_coef, p_coef * tl.exp(offset - lse))
    scale = tl.where(p_coef == 0.0, 0.0, scale)
    tl.store(scale_ptr + rows, scale, mask=row_mask)
    owned = row_mask & (tl.load(column_ptr + rows, mask=row_mask, other=_IGNORED) >= 0)
    target_grad = tl.load(target_grad_ptr + rows, mask=owned, other=0.0)
    if HAS_SOFTCAP:
        # The offset is the capped target logit z = cap * tanh(x / cap).
        target_grad *= softcap_derivative(offset / softcap)
    tl.store(target_grad_out_ptr + rows, tl.where(owned, target_grad, 0.0), mask=row_mask)
    if WANT_SCALED:
        for d0 in range(0, d_model, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            both = row_mask[:, None] & (d < d_model)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xn + d[None, :] * stride_xd, mask=both,
                        other=0.0).to(tl.float32)
            scaled = round_logits(x * scale[:, None], ROUND_OUT)
            tl.store(out_ptr + rows[:, None] * stride_out + d[None, :],
                     scaled.to(out_ptr.dtype.element_ty), mask=both)


@triton.jit
def _finish_input_grad_kernel(
    grad_ptr, w_ptr, scale_ptr, target_grad_ptr, column_ptr,
    n_rows, d_model, stride_gn, stride_wv, stride_wd,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_OUT: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    both = row_mask[:, None] & (d < d_model)[None, :]
    scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    target_grad = tl.load(target_grad_ptr + rows, mask=row_mask, other=0.0)
    column = tl.load(column_ptr + rows, mask=row_mask, other=_IGNORED).to(tl.int64)
    owned = row_mask & (column >= 0)
    ptrs = grad_ptr + rows[:, None] * stride_gn + d[None, :]
    grad = tl.load(ptrs, mask=both, other=0.0).to(tl.float32) * scale[:, None]
    w = tl.load(w_ptr + tl.where(owned, column, 0)[:, None] * stride_wv + d[None, :] * stride_wd,
                mask=both & owned[:, None], other=0.0).to(tl.float32)
    grad += target_grad[:, None] * w
    tl.store(ptrs, round_logits(grad, ROUND_OUT).to(grad_ptr.dtype.element_ty), mask=both)


@triton.heuristics(when_given(HAS_WEIGHT_GRAD="grad_ptr", HAS_BIAS_GRAD="bias_grad_ptr"))
@triton.jit
def _add_target_rows_kernel(
    grad_ptr, x_ptr, bias_grad_ptr, sorted_column_ptr, order_ptr, target_grad_ptr,
    n_rows, d_model, stride_gv, stride_xn, stride_xd,
    PIECE: tl.constexpr, TAIL: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WEIGHT_GRAD: tl.constexpr, HAS_BIAS_GRAD: tl.constexpr, ROUND_OUT: tl.constexpr,
):
    # Grid (piece of PIECE sorted positions, D block). Each run of equal targets is summed by the
    # piece where it starts: its part in the piece through a same-target mask product, the rest
    # (only a piece's last run can go on) TAIL positions a step after it. Fixed order, fp32, one
    # rounding of each weight row: deterministic, and a frequent token's long run (a Zipf
    # vocabulary's first token holds about a seventh of the tokens) costs a few steps of one
    # program rather than a program per row.
    positions = tl.program_id(0) * PIECE + tl.arange(0, PIECE)
    in_range = positions < n_rows
    column = tl.load(sorted_column_ptr + positions, mask=in_range, other=-1)
    before = tl.load(sorted_column_ptr + tl.maximum(positions - 1, 0), mask=in_range, other=-1)
    starts = in_range & (column >= 0) & ((positions == 0) | (before != column))
    rows = tl.load(order_ptr + positions, mask=in_range, other=0).to(tl.int64)
    coef = tl.load(target_grad_ptr + rows, mask=in_range, other=0.0)
    same = (column[:, None] == column[None, :]).to(tl.float32)
    # The piece's last run, followed into the pieces after it.
    last = tl.max(tl.where(in_range, column, -1), axis=0)
    tail_start = tl.program_id(0) * PIECE + PIECE
    started_here = tl.sum((starts & (column == last)).to(tl.int32), axis=0) > 0
    follows = (tail_start < n_rows) & (last >= 0) & started_here
    if follows:
        follows = tl.load(sorted_column_ptr + tl.minimum(tail_start, n_rows - 1)) == last
    is_last_run = (column == last)[:, None]
    if HAS_WEIGHT_GRAD:
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = d < d_model
        x = tl.load(x_ptr + rows[:, None] * stride_xn + d[None, :] * stride_xd,
                    mask=in_range[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        sums = tl.dot(same, coef[:, None] * x, input_precision="ieee")
    coef_sums = tl.sum(same * coef[None, :], axis=1)
    tail = tl.zeros((BLOCK_D,), dtype=tl.float32)
    tail_coef = 0.0
    next_start = tail_start
    while follows:
        later = next_start + tl.arange(0, TAIL)
        in_run = (later < n_rows) & (
            tl.load(sorted_column_ptr + later, mask=later < n_rows, other=-1) == last)
        later_rows = tl.load(order_ptr + later, mask=in_run, other=0).to(tl.int64)
        later_coef = tl.load(target_grad_ptr + later_rows, mask=in_run, other=0.0)
        tail_coef += tl.sum(later_coef, axis=0)
        if HAS_WEIGHT_GRAD:
            later_x = tl.load(x_ptr + later_rows[:, None] * stride_xn + d[None, :] * stride_xd,
                              mask=in_run[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
            tail += tl.sum(later_coef[:, None] * later_x, axis=0)
        next_start += TAIL
        # A run is contiguous: it goes on only if it filled this step.
        follows = tl.sum(in_run.to(tl.int32), axis=0) == TAIL
    column = column.to(tl.int64)
    if HAS_WEIGHT_GRAD:
        sums += tl.where(is_last_run, tail[None, :], 0.0)
        ptrs = grad_ptr + column[:, None] * stride_gv + d[None, :]
        write = starts[:, None] & d_mask[None, :]
        grad = tl.load(ptrs, mask=write, other=0.0).to(tl.float32) + sums
        tl.store(ptrs, round_logits(grad, ROUND_OUT).to(grad_ptr.dtype.element_ty), mask=write)
    if HAS_BIAS_GRAD:
        if tl.program_id(1) == 0:
            coef_sums += tl.where(column == last, tail_coef, 0.0)
            bias_ptrs = bias_grad_ptr + column
            tl.store(bias_ptrs, tl.load(bias_ptrs, mask=starts, other=0.0) + coef_sums,
                     mask=starts)


def row_scales(hidden, lse, offset, p_coef, target_grad, columns, *, softcap: float | None,
               out: torch.Tensor | None = None, target_grad_out: torch.Tensor | None = None):
    """(s, g), (N,) fp32 each: s_n = p_coef exp(offset - lse), which turns a row of E into G's,
    and g_n, the target column's gradient (times the cap's derivative; 0 where this shard does
    not own the target), written into ``target_grad_out`` where given. With ``out`` (rows x D,
    unit column stride) also s * hidden, rounded to out's dtype: the weight gradient's
    right-hand operand."""
    # Check constraints.
    n_rows, d_model = hidden.shape
    _check_row_vectors(n_rows, columns, lse=lse, offset=offset, p_coef=p_coef,
                       target_grad=target_grad)
    if out is not None:
        _check_rows("out", out, n_rows, d_model)
    scale = torch.empty(n_rows, device=hidden.device, dtype=torch.float32)
    if target_grad_out is None:
        target_grad_out = torch.empty_like(scale)
    else:
        check_vector("target_grad_out", target_grad_out, n_rows, (torch.float32,))
    block_n, block_d = (16, 128) if INTERPRET else (8, 512)
    if n_rows > 0:
        _row_scales_kernel[(triton.cdiv(n_rows, block_n),)](
            hidden, out, scale, target_grad_out, lse, offset, p_coef, target_grad, columns,
            n_rows, d_model, hidden.stride(0), hidden.stride(1),
            0 if out is None else out.stride(0), softcap,
            BLOCK_N=block_n, BLOCK_D=block_d,
            ROUND_OUT=0 if out is None else _out_round(out.dtype), num_warps=4,
        )
    return scale, target_grad_out


def finish_input_grad(grad, weight, scale, target_grad, columns) -> None:
    """In place: grad = s * grad + g * w_y, where ``grad`` (rows x D, unit column stride) holds the
    chunk's E @ weight."""
    # Check constraints.
    n_rows, d_model = grad.shape
    _check_rows("grad", grad, n_rows, weight.shape[1])
    _check_row_vectors(n_rows, columns, scale=scale, target_grad=target_grad)
    block_n, block_d = (16, 128) if INTERPRET else (16, 256)
    if n_rows > 0 and d_model > 0:
        _finish_input_grad_kernel[(triton.cdiv(n_rows, block_n), triton.cdiv(d_model, block_d))](
            grad, weight, scale, target_grad, columns, n_rows, d_model, grad.stride(0),
            weight.stride(0), weight.stride(1),
            BLOCK_N=block_n, BLOCK_D=block_d, ROUND_OUT=_out_round(grad.dtype), num_warps=4,
        )


def add_target_rows(weight_grad, hidden, target_grad, columns, bias_grad=None) -> None:
    """In place: weight_grad[y_n] += g_n * hidden[n] for the rows whose target this shard owns,
    summed in fp32 in a fixed order and rounded once per weight row; the sums of g_n likewise
    into ``bias_grad`` (fp32). Either gradient may be None."""
    # Check constraints.
    n_rows, d_model = hidden.shape
    _check_row_vectors(n_rows, columns, target_grad=target_grad)
    if weight_grad is not None and (weight_grad.dim() != 2 or weight_grad.shape[1] != d_model
                                    or weight_grad.stride(1) != 1):
        raise ValueError(f"weight_grad must be a (V, {d_model}) matrix with unit column stride, "
                         f"got shape {tuple(weight_grad.shape)}")
    if bias_grad is not None:
        check_vector("bias_grad", bias_grad, bias_grad.shape[0], (torch.float32,))
    if n_rows == 0 or (weight_grad is None and bias_grad is None):
        return
    sorted_columns, order = torch.sort(columns, stable=True)
    # scripts/experiment_target_rows.py (in git at 7fc94ef) on an H100 (8192 rows,
    # D = 3072): 32-row pieces and tail
    # steps over 128 columns in 4 warps, 108-171 us, beat wider tail steps (128 rows over 64 or
    # 128 columns in 8 warps, 133-185 us) on every target distribution: the pass is bound by
    # its many programs' gathers, not by the longest run.
    piece, tail, block_d = (32, 64, 256) if INTERPRET else (32, 32, 128)
    d_blocks = 1 if weight_grad is None else triton.cdiv(d_model, block_d)
    _add_target_rows_kernel[(triton.cdiv(n_rows, piece), d_blocks)](
        weight_grad, hidden, bias_grad, sorted_columns, order, target_grad,
        n_rows, d_model, 0 if weight_grad is None else weight_grad.stride(0),
        hidden.stride(0), hidden.stride(1), PIECE=piece, TAIL=tail, BLOCK_D=block_d,
        ROUND_OUT=0 if weight_grad is None else _out_round(weight_grad.dtype), num_warps=4,
    )
