"""Fused backward: recompute logit tiles on chip, form the logit gradient, filter, accumulate.

For a tile of rows n and vocabulary columns v the logit gradient is

    G[n, v] = (p_coef[n] * softmax[n, v] - smooth_coef[n]) * softcap'(n, v)    (v != target[n])
    G[n, y] = (target_grad[n] - smooth_coef[n]) * softcap'(n, y)

with per-row coefficients prepared by the caller (loss scale, z-loss, label smoothing, the LSE's
own gradient; fused_lce.terms). The target's entry comes whole from the caller, who forms it from
the token's loss so that ``1 - p_y`` keeps its precision for confident tokens. Then
dE[n] += G @ C[v], dC[v] += G.T @ E[n], dbias[v] += sum_n G.

Gradient filtering (docs/algorithm.md) skips a tile before the two products when its softmax
entries are negligible: ``FILTER == 1`` (the paper) when every entry is below a threshold,
``FILTER == 2`` (our default) when every row's softmax mass in the tile is below
``eps * BLOCK_V / V``, so that no token loses more than eps of its probability mass overall. A
tile that holds a target is never skipped.

Three ways to accumulate (``MODE``):
- 0: one program per tile; dE and dC go to fp32 scratch through atomics (fastest, order-dependent).
- 1: one program per row block walks the vocabulary and owns its dE rows (deterministic).
- 2: one program per vocabulary block walks the rows and owns its dC rows and dbias (deterministic).

The launcher walks the problem in token chunks and vocabulary chunks so that the fp32 scratch
stays within ``scratch_bytes``; with vocab sorting the columns are visited in ``vocab_order``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import (
    RowCoefficients,
    TileConfig,
    check_operands,
    check_row_vectors,
    check_vector,
    dot_settings,
    gpu_family,
    grad_from_logits,
    load_row_terms,
    logits_tile,
    round_code,
    when_given,
)

FILTER_OFF, FILTER_ENTRY, FILTER_MASS = 0, 1, 2
MODE_TILES, MODE_OWN_ROWS, MODE_OWN_COLS = 0, 1, 2


@triton.jit
def _grad_tile(
    e_ptr, c_ptr, bias_ptr, rows, cols, row_mask, col_mask,
    target, lse, p_coef, target_grad, smooth_coef,
    d_model, stride_en, stride_ed, stride_cv, stride_cd,
    softcap, filter_threshold,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    FILTER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROUND: tl.constexpr,
):
    """(G tile in fp32, whether the filter skips it) for rows x cols."""
    logits = logits_tile(
        e_ptr, c_ptr, rows, cols, row_mask, col_mask, d_model,
        stride_en, stride_ed, stride_cv, stride_cd,
        BLOCK_N, BLOCK_V, BLOCK_D, DOT_FP32, DOT_PRECISION,
    )
    grad, prob, is_target = grad_from_logits(
        logits, bias_ptr, cols, row_mask, col_mask, target, lse, p_coef, target_grad, smooth_coef,
        softcap, HAS_BIAS, HAS_SOFTCAP, HAS_SMOOTHING, ROUND,
    )
    negligible = filter_threshold < 0.0  # never: FILTER == 0 computes every tile
    if FILTER == 1:
        no_target = tl.max(is_target.to(tl.int32)) == 0
        negligible = (tl.max(prob) < filter_threshold) & no_target
    if FILTER == 2:
        no_target = tl.max(is_target.to(tl.int32)) == 0
        negligible = (tl.max(tl.sum(prob, axis=1)) < filter_threshold) & no_target
    return grad, negligible


@triton.jit
def _vocab_block(vocab_order_ptr, vocab_start, vocab_in_chunk, pid_v,
                 BLOCK_V: tl.constexpr, SORTED: tl.constexpr):
    """(positions, their mask, weight rows) of the chunk's vocabulary block ``pid_v``: the
    positions walk the chunk, the rows are where ``vocab_order`` sends them (with SORTED)."""
    pos_v = vocab_start + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = pos_v < vocab_start + vocab_in_chunk
    if SORTED:
        cols = tl.load(vocab_order_ptr + pos_v, mask=col_mask, other=0).to(tl.int64)
    else:
        cols = pos_v.to(tl.int64)
    return pos_v, col_mask, cols


@triton.jit
def _add_product(
    grad, src_ptr, src_rows, src_mask, stride_src, stride_src_d,
    out_ptr, out_rows, out_mask, stride_out, d_model,
    BLOCK_D: tl.constexpr, TRANSPOSE: tl.constexpr, ATOMIC: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out[out_rows] += G @ src[src_rows] (with TRANSPOSE, G.T @ src[src_rows]) in fp32 scratch,
    BLOCK_D columns at a time: through atomics (ATOMIC: other programs add to the same rows) or
    as the rows' only writer."""
    for d0 in range(0, d_model, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < d_model
        src = tl.load(
            src_ptr + src_rows[:, None] * stride_src + offs_d[None, :] * stride_src_d,
            mask=src_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if DOT_FP32:
            src = src.to(tl.float32)
        if TRANSPOSE:
            product = tl.dot(tl.trans(grad), src, input_precision=DOT_PRECISION)
        else:
            product = tl.dot(grad, src, input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + out_rows[:, None] * stride_out + offs_d[None, :]
        mask = out_mask[:, None] & d_mask[None, :]
        if ATOMIC:
            tl.atomic_add(out_ptrs, product, mask=mask)
        else:
            product += tl.load(out_ptrs, mask=mask, other=0.0)
            tl.store(out_ptrs, product, mask=mask)


@triton.heuristics(
    when_given(
        HAS_BIAS="bias_ptr", HAS_SOFTCAP="softcap", HAS_SMOOTHING="smooth_coef_ptr",
        # Vocab sorting: the chunk's columns are visited in vocab_order.
        SORTED="vocab_order_ptr",
        # The deterministic modes write dE (MODE 1) and dC, dbias (MODE 2) in separate launches.
        WANT_DE="de_ptr", WANT_DC="dc_ptr", WANT_DBIAS="dbias_ptr",
    )
)
@triton.jit
def _backward_kernel(
    # pointers
    e_ptr,
    c_ptr,
    bias_ptr,
    row_order_ptr,
    n_valid_ptr,
    target_ptr,
    lse_ptr,
    p_coef_ptr,
    target_grad_ptr,
    smooth_coef_ptr,
    vocab_order_ptr,
    de_ptr,
    dc_ptr,
    dbias_ptr,
    # sizes
    row_start,
    rows_in_chunk,
    vocab_start,
    vocab_in_chunk,
    d_model,
    # strides
    stride_en,
    stride_ed,
    stride_cv,
    stride_cd,
    stride_de,
    stride_dc,
    # scalars
    softcap,
    filter_threshold,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    MODE: tl.constexpr,
    FILTER: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    SORTED: tl.constexpr,
    WANT_DE: tl.constexpr,
    WANT_DC: tl.constexpr,
    WANT_DBIAS: tl.constexpr,
    ROUND: tl.constexpr,
):
    pid = tl.program_id(0)
    n_valid = tl.load(n_valid_ptr)
    num_n = tl.cdiv(rows_in_chunk, BLOCK_N)
    num_v = tl.cdiv(vocab_in_chunk, BLOCK_V)
    if MODE == 0:
        # Grouped order: GROUP row blocks share each weight tile while it is in L2.
        in_group = GROUP * num_v
        first_n = (pid // in_group) * GROUP
        group_size = tl.minimum(num_n - first_n, GROUP)
        pid_n = first_n + (pid % in_group) % group_size
        pid_v = (pid % in_group) // group_size
        n_first, n_count, v_first, v_count = pid_n, 1, pid_v, 1
    elif MODE == 1:
        n_first, n_count, v_first, v_count = pid, 1, 0, num_v
    else:
        n_first, n_count, v_first, v_count = 0, num_n, pid, 1
    out_dtype = e_ptr.dtype.element_ty

    if MODE == 2:
        pos_v = vocab_start + v_first * BLOCK_V + tl.arange(0, BLOCK_V)
        col_mask = pos_v < vocab_start + vocab_in_chunk
        dbias_acc = tl.zeros((BLOCK_V,), dtype=tl.float32)

    for n_step in range(0, n_count):
        pid_n = n_first + n_step
        pos_n = row_start + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = (pos_n < row_start + rows_in_chunk) & (pos_n < n_valid)
        # Row blocks past the last non-ignored token hold no work.
        block_has_rows = row_start + pid_n * BLOCK_N < n_valid
        rows = tl.load(row_order_ptr + pos_n, mask=row_mask, other=0).to(tl.int64)
        target, lse, p_coef, target_grad, smooth_coef = load_row_terms(
            rows, row_mask, target_ptr, lse_ptr, p_coef_ptr, target_grad_ptr, smooth_coef_ptr,
            HAS_SMOOTHING,
        )

        for v_step in range(0, v_count):
            pos_v, col_mask, cols = _vocab_block(
                vocab_order_ptr, vocab_start, vocab_in_chunk, v_first + v_step, BLOCK_V, SORTED
            )
            grad, negligible = _grad_tile(
                e_ptr, c_ptr, bias_ptr, rows, cols, row_mask, col_mask,
                target, lse, p_coef, target_grad, smooth_coef,
                d_model, stride_en, stride_ed, stride_cv, stride_cd,
                softcap, filter_threshold,
                BLOCK_N, BLOCK_V, BLOCK_D,
                FILTER, HAS_BIAS, HAS_SOFTCAP, HAS_SMOOTHING, DOT_FP32, DOT_PRECISION, ROUND,
            )
            if (negligible == 0) & block_has_rows:
                if DOT_FP32:
                    grad_mm = grad
                else:
                    grad_mm = grad.to(out_dtype)
                local_n = (pos_n - row_start).to(tl.int64)
                local_v = (pos_v - vocab_start).to(tl.int64)
                if WANT_DE and MODE != 2:
                    # dE[rows] += G @ C[cols]
                    _add_product(
                        grad_mm, c_ptr, cols, col_mask, stride_cv, stride_cd,
                        de_ptr, local_n, row_mask, stride_de, d_model,
                        BLOCK_D, False, MODE == 0, DOT_FP32, DOT_PRECISION,
                    )
                if WANT_DC and MODE != 1:
                    # dC[cols] += G.T @ E[rows]
                    _add_product(
                        grad_mm, e_ptr, rows, row_mask, stride_en, stride_ed,
                        dc_ptr, local_v, col_mask, stride_dc, d_model,
                        BLOCK_D, True, MODE == 0, DOT_FP32, DOT_PRECISION,
                    )
                if WANT_DBIAS:
                    if MODE == 0:
                        tl.atomic_add(dbias_ptr + cols, tl.sum(grad, axis=0), mask=col_mask)
                    elif MODE == 2:
                        dbias_acc += tl.sum(grad, axis=0)

    if MODE == 2:
        if WANT_DBIAS:
            pos_v, col_mask, cols = _vocab_block(
                vocab_order_ptr, vocab_start, vocab_in_chunk, v_first, BLOCK_V, SORTED
            )
            dbias_acc += tl.load(dbias_ptr + cols, mask=col_mask, other=0.0)
            tl.store(dbias_ptr + cols, dbias_acc, mask=col_mask)


_CONFIGS = {
    "interpreter": TileConfig(block_n=64, block_v=128, block_d=64, num_warps=4, num_stages=1),
    "hopper": TileConfig(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3),
    "blackwell": TileConfig(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3),
    "ampere": TileConfig(block_n=64, block_v=128, block_d=32, num_warps=4, num_stages=3),
}


def backward_config(device: torch.device) -> TileConfig:
    return _CONFIGS[gpu_family(device)]


@dataclass
class TilesChunkPlan:
    """How the rows and vocabulary are cut so the fp32 scratch fits the budget."""

    rows_per_chunk: int
    vocab_per_chunk: int


def plan_chunks(
    n_rows: int, n_vocab: int, d_model: int, scratch_bytes: int, cfg: TileConfig
) -> TilesChunkPlan:
    """Token and vocabulary chunk sizes whose fp32 scratch (rows + cols) x D fits the budget.

    Rows get half the budget first: one token chunk covering every row keeps the weight gradient
    accumulated in fp32 from start to end. At least one block of each is always allowed.
    """
    row_bytes = max(d_model, 1) * 4  # D = 0 (logits of bias alone) still takes one row a token
    half = scratch_bytes // 2
    rows = max(cfg.block_n, (half // row_bytes) // cfg.block_n * cfg.block_n)
    rows = min(rows, triton.cdiv(max(n_rows, 1), cfg.block_n) * cfg.block_n)
    left = max(scratch_bytes - rows * row_bytes, 0)
    cols = max(cfg.block_v, (left // row_bytes) // cfg.block_v * cfg.block_v)
    cols = min(cols, triton.cdiv(max(n_vocab, 1), cfg.block_v) * cfg.block_v)
    return TilesChunkPlan(rows_per_chunk=rows, vocab_per_chunk=cols)


def lce_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target_local: torch.Tensor,
    row_order: torch.Tensor,
    n_valid: torch.Tensor,
    lse: torch.Tensor,
    coefs: RowCoefficients,
    *,
    softcap: float | None,
    filter_mode: int,
    filter_threshold: float,
    vocab_order: torch.Tensor | None,
    deterministic: bool,
    scratch_bytes: int,
    want_hidden: bool = True,
    want_weight: bool = True,
    want_bias: bool = True,
    d_hidden_dtype: torch.dtype | None = None,
    round_16bit: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(d_hidden, d_weight, d_bias) in the inputs' dtypes (d_hidden: ``d_hidden_dtype`` if
    given), accumulated in fp32.

    Args:
        hidden: (N, D); weight: (V, D); bias: (V,) or None.
        target_local: (N,) int, the target's row in ``weight`` or -1 if not one of them.
        row_order, n_valid: non-ignored rows first, and how many (device scalar).
        lse: (N,) fp32 log-sum-exp over the whole vocabulary (every shard).
        vocab_order: (V,) int permutation to walk the vocabulary in, or None.
    """
    # Check constraints.
    check_operands(hidden, weight, bias)
    check_row_vectors(hidden.shape[0], target_local, row_order, n_valid, lse, coefs)
    if vocab_order is not None:
        check_vector("vocab_order", vocab_order, weight.shape[0], (torch.int32, torch.int64))
    n_rows, d_model = hidden.shape
    n_vocab = weight.shape[0]
    device = hidden.device
    cfg = backward_config(device)
    dot_fp32, precision = dot_settings(hidden.dtype)
    want_bias = want_bias and bias is not None

    d_hidden_dtype = d_hidden_dtype or hidden.dtype
    d_hidden = torch.empty_like(hidden, dtype=d_hidden_dtype) if want_hidden else None
    d_weight = torch.empty_like(weight) if want_weight else None
    d_bias_acc = torch.zeros((n_vocab,), device=device, dtype=torch.float32) if want_bias else None
    if n_rows == 0 or n_vocab == 0:
        if d_hidden is not None:
            d_hidden.zero_()
        if d_weight is not None:
            d_weight.zero_()
        d_bias = None if d_bias_acc is None else d_bias_acc.to(bias.dtype)
        return d_hidden, d_weight, d_bias

    plan = plan_chunks(n_rows, n_vocab, d_model, scratch_bytes, cfg)
    de_scratch = (
        torch.empty((plan.rows_per_chunk, d_model), device=device, dtype=torch.float32)
        if want_hidden
        else None
    )
    dc_scratch = (
        torch.empty((plan.vocab_per_chunk, d_model), device=device, dtype=torch.float32)
        if want_weight
        else None
    )

    common = dict(
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, GROUP=cfg.group,
        FILTER=filter_mode, DOT_FP32=dot_fp32, DOT_PRECISION=precision,
        ROUND=round_code(hidden.dtype, round_16bit),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

    def launch(mode, grid, row_start, rows, vocab_start, cols, de, dc, dbias):
        _backward_kernel[grid](
            hidden, weight, bias, row_order, n_valid, target_local, lse,
            coefs.p_coef, coefs.target_grad, coefs.smooth_coef, vocab_order,
            de, dc, dbias,
            row_start, rows, vocab_start, cols, d_model,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            d_model, d_model,
            softcap, filter_threshold,
            MODE=mode, **common,
        )

    for row_start in range(0, n_rows, plan.rows_per_chunk):
        rows = min(plan.rows_per_chunk, n_rows - row_start)
        first_token_chunk = row_start == 0
        if de_scratch is not None:
            de_scratch.zero_()
        for vocab_start in range(0, n_vocab, plan.vocab_per_chunk):
            cols = min(plan.vocab_per_chunk, n_vocab - vocab_start)
            if dc_scratch is not None:
                dc_scratch.zero_()
            num_n = triton.cdiv(rows, cfg.block_n)
            num_v = triton.cdiv(cols, cfg.block_v)
            if deterministic:
                if de_scratch is not None:
                    launch(MODE_OWN_ROWS, (num_n,), row_start, rows, vocab_start, cols,
                           de_scratch, None, None)
                if dc_scratch is not None or d_bias_acc is not None:
                    launch(MODE_OWN_COLS, (num_v,), row_start, rows, vocab_start, cols,
                           None, dc_scratch, d_bias_acc)
            else:
                launch(MODE_TILES, (num_n * num_v,), row_start, rows, vocab_start, cols,
                       de_scratch, dc_scratch, d_bias_acc)
            if d_weight is not None:
                _flush_weight_chunk(
                    d_weight, dc_scratch[:cols], vocab_order, vocab_start, first_token_chunk
                )
        if d_hidden is not None:
            # Positions past n_valid hold ignored rows: their scratch stayed zero.
            positions = row_order[row_start : row_start + rows].long()
            d_hidden.index_copy_(0, positions, de_scratch[:rows].to(d_hidden_dtype))

    d_bias = None if d_bias_acc is None else d_bias_acc.to(bias.dtype)
    return d_hidden, d_weight, d_bias


def _flush_weight_chunk(
    d_weight: torch.Tensor,
    chunk: torch.Tensor,
    vocab_order: torch.Tensor | None,
    vocab_start: int,
    first_token_chunk: bool,
) -> None:
    """Write (first token chunk) or add (later ones, in fp32) a vocabulary chunk of dC."""
    n = chunk.shape[0]
    if vocab_order is None:
        dest = d_weight[vocab_start : vocab_start + n]
        if first_token_chunk:
            dest.copy_(chunk)
        else:
            dest.copy_(dest.float() + chunk)
        return
    index = vocab_order[vocab_start : vocab_start + n].long()
    if first_token_chunk:
        d_weight.index_copy_(0, index, chunk.to(d_weight.dtype))
    else:
        d_weight.index_copy_(0, index, (d_weight.index_select(0, index).float() + chunk).to(
            d_weight.dtype
        ))
