"""Logit-gradient chunks for the GEMM backward: G for (token chunk x vocabulary chunk), in bf16.

The fused tile backward (tiles_backward.py) sends dE and dC through atomics, one add per tile and
hidden element; when little can be filtered (a near-uniform softmax, early in pretraining) those
atomics dominate. This path instead writes G for a bounded chunk into a reused buffer and lets
two GEMMs consume it, with no atomics at all:

    dE[chunk rows] += G @ C[chunk cols]      (fp32 accumulation across vocabulary chunks)
    dC[chunk cols]  = G.T @ E[chunk rows]    (one GEMM over every row when the chunk holds all)

The kernel recomputes the logit tile as the fused backward does and forms G with the same
``grad_from_logits`` (common.py), so the two paths share their math; on Hopper it reads its
tiles through the copy engine (TMA). Rows past the last non-ignored token get G = 0. Which
strategy a call takes (kept logits, buffers borrowed from the weight gradient's storage, or token
chunks of what size) is planned on the host by fused_lce/backward_plan.py; ``lce_backward_gemm``
follows its plan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp32_products import accumulate_mm
from .common import (
    INTERPRET,
    TileConfig,
    check_operands,
    check_row_terms,
    check_row_vectors,
    check_vector,
    dot_settings,
    gpu_family,
    grad_from_logits,
    grad_from_prob,
    load_row_terms,
    logits_tile,
    logits_tile_tma,
    round_code,
    softcap_derivative,
    tma_descriptor,
    use_tma,
    when_given,
)
from .lse_forward import KeptLogits, valid_rows


@triton.heuristics(
    when_given(HAS_BIAS="bias_ptr", HAS_SOFTCAP="softcap", HAS_SMOOTHING="smooth_coef_ptr")
)
@triton.jit
def _grad_logits_kernel(
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
    g_ptr,
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
    stride_gn,
    # scalars
    softcap,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    USE_TMA: tl.constexpr,
    ROUND: tl.constexpr,
):
    # With USE_TMA, e_ptr and c_ptr are tensor descriptors of the hidden chunk and the weight.
    pid = tl.program_id(0)
    num_n = tl.cdiv(rows_in_chunk, BLOCK_N)
    num_v = tl.cdiv(vocab_in_chunk, BLOCK_V)
    in_group = GROUP * num_v
    first_n = (pid // in_group) * GROUP
    group_size = tl.minimum(num_n - first_n, GROUP)
    pid_n = first_n + (pid % in_group) % group_size
    pid_v = (pid % in_group) // group_size

    n_valid = tl.load(n_valid_ptr)
    local_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_chunk = local_n < rows_in_chunk
    row_mask = in_chunk & (row_start + local_n < n_valid)
    local_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = local_v < vocab_in_chunk
    g_ptrs = g_ptr + local_n.to(tl.int64)[:, None] * stride_gn + local_v[None, :]
    out_mask = in_chunk[:, None] & col_mask[None, :]
    out_dtype = g_ptr.dtype.element_ty

    if row_start + pid_n * BLOCK_N >= n_valid:
        tl.store(g_ptrs, tl.zeros((BLOCK_N, BLOCK_V), dtype=out_dtype), mask=out_mask)
        return

    rows = tl.load(row_order_ptr + row_start + local_n, mask=row_mask, other=0).to(tl.int64)
    target, lse, p_coef, target_grad, smooth_coef = load_row_terms(
        rows, row_mask, target_ptr, lse_ptr, p_coef_ptr, target_grad_ptr, smooth_coef_ptr,
        HAS_SMOOTHING,
    )
    cols = (vocab_start + local_v).to(tl.int64)
    # The hidden chunk is already gathered in row order: it is read by position, not by row id.
    if USE_TMA:
        logits = logits_tile_tma(
            e_ptr, c_ptr, pid_n * BLOCK_N, vocab_start + pid_v * BLOCK_V, d_model,
            BLOCK_N, BLOCK_V, BLOCK_D, DOT_FP32, DOT_PRECISION,
        )
    else:
        logits = logits_tile(
            e_ptr, c_ptr, local_n.to(tl.int64), cols, row_mask, col_mask, d_model,
            stride_en, stride_ed, stride_cv, stride_cd,
            BLOCK_N, BLOCK_V, BLOCK_D, DOT_FP32, DOT_PRECISION,
        )
    grad, _, _ = grad_from_logits(
        logits, bias_ptr, cols, row_mask, col_mask, target, lse, p_coef, target_grad, smooth_coef,
        softcap, HAS_BIAS, HAS_SOFTCAP, HAS_SMOOTHING, ROUND,
    )
    tl.store(g_ptrs, grad.to(out_dtype), mask=out_mask)


@triton.heuristics(when_given(HAS_SOFTCAP="softcap", HAS_SMOOTHING="smooth_coef_ptr"))
@triton.jit
def _grad_from_kept_kernel(
    scaled_ptr,
    tile_max_ptr,
    row_valid_ptr,
    target_ptr,
    lse_ptr,
    p_coef_ptr,
    target_grad_ptr,
    smooth_coef_ptr,
    n_rows,
    n_vocab,
    stride_scaled,
    stride_tile_max,
    softcap,
    KEPT_BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
):
    """G in place of the kept exponentials: ``grad_from_prob``, with the probability read as
    scaled * exp(tile max - lse) instead of recomputed."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    in_rows = rows < n_rows
    col_mask = cols < n_vocab
    row_mask = in_rows & (tl.load(row_valid_ptr + rows, mask=in_rows, other=0) != 0)
    in_tile = row_mask[:, None] & col_mask[None, :]
    # Ignored rows were never written: their garbage is masked out, and G there is 0.
    scaled = tl.load(scaled_ptr + rows[:, None] * stride_scaled + cols[None, :],
                     mask=in_tile, other=0.0).to(tl.float32)
    tile_max = tl.load(tile_max_ptr + rows[:, None] * stride_tile_max
                       + cols[None, :] // KEPT_BLOCK_V, mask=in_tile, other=0.0)
    target, lse, p_coef, target_grad, smooth_coef = load_row_terms(
        rows, row_mask, target_ptr, lse_ptr, p_coef_ptr, target_grad_ptr, smooth_coef_ptr,
        HAS_SMOOTHING,
    )
    prob = tl.where(in_tile, scaled * tl.exp(tile_max - lse[:, None]), 0.0)
    grad, _ = grad_from_prob(
        prob, cols, in_tile, target, p_coef, target_grad, smooth_coef, HAS_SMOOTHING
    )
    if HAS_SOFTCAP:
        # The capped logit, back from its exponential. The floor is an fp32 normal: Triton types
        # a literal below that range (1e-38) as fp64, which made this branch fp64 math with
        # register spills (Gemma-2 2B on an H200: 108 ms against 68). A floored exponential is
        # a logit 69 below its row's max, where the softmax term is nothing anyway.
        logit = tile_max + tl.log(tl.maximum(scaled, 1e-30))
        capped = tl.where(in_tile, tl.minimum(tl.maximum(logit / softcap, -1.0), 1.0), 0.0)
        grad *= softcap_derivative(capped)
    out = scaled_ptr + rows[:, None] * stride_scaled + cols[None, :]
    tl.store(out, grad.to(scaled_ptr.dtype.element_ty), mask=in_rows[:, None] & col_mask[None, :])


def grad_from_kept(kept, row_valid, target_local, lse, coefs, softcap) -> torch.Tensor:
    """Turn ``kept.scaled`` (N, V) into the logit gradient G in place and return it."""
    n_rows, n_vocab = kept.scaled.shape
    # Check constraints.
    if kept.scaled.stride(1) != 1 or kept.tile_max.stride(1) != 1:
        raise ValueError("kept logits must have unit column stride")
    check_vector("row_valid", row_valid, n_rows, (torch.int8,))
    check_row_terms(n_rows, target_local, lse, coefs)
    block_n, block_v = (64, 128) if INTERPRET else (32, 256)
    grid = (triton.cdiv(n_rows, block_n), triton.cdiv(n_vocab, block_v))
    if n_rows > 0 and n_vocab > 0:
        _grad_from_kept_kernel[grid](
            kept.scaled, kept.tile_max, row_valid, target_local, lse,
            coefs.p_coef, coefs.target_grad, coefs.smooth_coef,
            n_rows, n_vocab, kept.scaled.stride(0), kept.tile_max.stride(0), softcap,
            KEPT_BLOCK_V=kept.block_v, BLOCK_N=block_n, BLOCK_V=block_v, num_warps=4,
        )
    return kept.scaled


# Chosen with scripts/studies/tune_kernels.py on an H100 (docs/benchmarks/single_gpu.md,
# CHANGELOG.md).
_CONFIGS = {
    "interpreter": TileConfig(block_n=64, block_v=128, block_d=64, num_warps=4, num_stages=1),
    "hopper": TileConfig(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=4),
    "blackwell": TileConfig(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3),
    "ampere": TileConfig(block_n=128, block_v=128, block_d=32, num_warps=8, num_stages=3),
}


def grad_logits_config(device: torch.device, dtype: torch.dtype) -> TileConfig:
    cfg = _CONFIGS[gpu_family(device)]
    if dtype == torch.float32 and device.type == "cuda":
        cfg = TileConfig(cfg.block_n, 128, 32, cfg.num_warps, cfg.num_stages)
    return cfg


def grad_logits(
    hidden_chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    row_order: torch.Tensor,
    n_valid: torch.Tensor,
    target_local: torch.Tensor,
    lse: torch.Tensor,
    coefs,
    out: torch.Tensor,
    *,
    row_start: int,
    vocab_start: int,
    softcap: float | None,
    round_16bit: bool = False,
    tma: bool = True,
) -> torch.Tensor:
    """Fill ``out`` (rows, cols) with G for the chunk's rows and ``weight[vocab_start:]`` columns.

    Args:
        hidden_chunk: (rows, D) hidden states of positions ``row_start:`` of ``row_order``.
        out: (rows, cols) view of the reused buffer, unit column stride.
    """
    # Check constraints.
    check_operands(hidden_chunk, weight, bias)
    check_row_vectors(row_order.shape[0], target_local, row_order, n_valid, lse, coefs)
    rows, cols = out.shape
    if rows != hidden_chunk.shape[0] or vocab_start + cols > weight.shape[0] or (
        cols > 1 and out.stride(1) != 1
    ):
        raise ValueError(
            f"out must be (rows of hidden_chunk, columns within weight) with unit column stride, "
            f"got shape {tuple(out.shape)} strides {out.stride()} for hidden_chunk "
            f"{tuple(hidden_chunk.shape)}, weight {tuple(weight.shape)}, vocab_start {vocab_start}"
        )
    cfg = grad_logits_config(hidden_chunk.device, hidden_chunk.dtype)
    dot_fp32, precision = dot_settings(hidden_chunk.dtype)
    grid = (triton.cdiv(rows, cfg.block_n) * triton.cdiv(cols, cfg.block_v),)
    tma = use_tma(hidden_chunk, weight, enabled=tma)
    e_arg, c_arg = hidden_chunk, weight
    if tma:
        e_arg = tma_descriptor(hidden_chunk, cfg.block_n, cfg.block_d)
        c_arg = tma_descriptor(weight, cfg.block_v, cfg.block_d)
    _grad_logits_kernel[grid](
        e_arg, c_arg, bias, row_order, n_valid, target_local, lse,
        coefs.p_coef, coefs.target_grad, coefs.smooth_coef, out,
        row_start, rows, vocab_start, cols, hidden_chunk.shape[1],
        hidden_chunk.stride(0), hidden_chunk.stride(1), weight.stride(0), weight.stride(1),
        out.stride(0),
        softcap,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, GROUP=cfg.group,
        DOT_FP32=dot_fp32, DOT_PRECISION=precision, USE_TMA=tma,
        ROUND=round_code(hidden_chunk.dtype, round_16bit),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def lce_backward_gemm(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target_local: torch.Tensor,
    row_order: torch.Tensor,
    n_valid: torch.Tensor,
    lse: torch.Tensor,
    coefs,
    *,
    softcap: float | None,
    plan,
    want_hidden: bool = True,
    want_weight: bool = True,
    want_bias: bool = True,
    d_hidden_dtype: torch.dtype | None = None,
    d_weight_accumulator: torch.Tensor | None = None,
    round_16bit: bool = False,
    kept: KeptLogits | None = None,
    tma: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(d_hidden, d_weight, d_bias) through G chunks and GEMMs; deterministic, no filtering.

    ``plan`` (a fused_lce.backward_plan.GemmBackwardPlan, made for these arguments by
    ``plan_gemm_backward_for``) names the strategy: "kept" forms G in the storage of ``kept``
    (the forward's logits, ``keep_logits=True``), all of it at once, and recomputes no
    logit (``_backward_from_kept``); "borrowed" keeps the buffers inside d_weight
    (``_backward_in_weight_buffer``); "token_chunks" walks chunks of the planned size
    (``_backward_in_token_chunks``).

    Other arguments as for ``tiles_backward.lce_backward``; ``tma`` as for ``lse_forward``;
    ``d_hidden_dtype`` (default: hidden's) lets a vocabulary shard hand its partial d_hidden to
    the all-reduce in fp32. With
    ``d_weight_accumulator`` (an fp32 (V, D) buffer, e.g. Megatron's ``main_grad``) the weight
    gradient is added into it by the GEMMs themselves and d_weight is returned as None.
    """
    # Check constraints.
    check_operands(hidden, weight, bias)
    check_row_vectors(hidden.shape[0], target_local, row_order, n_valid, lse, coefs)
    if d_weight_accumulator is not None and (
        d_weight_accumulator.shape != weight.shape or d_weight_accumulator.dtype != torch.float32
    ):
        raise ValueError(
            f"d_weight_accumulator must be fp32 of weight's shape {tuple(weight.shape)}, got "
            f"{d_weight_accumulator.dtype} {tuple(d_weight_accumulator.shape)}"
        )
    n_rows, n_vocab = hidden.shape[0], weight.shape[0]
    want_bias = want_bias and bias is not None
    d_hidden_dtype = d_hidden_dtype or hidden.dtype
    d_hidden = torch.empty_like(hidden, dtype=d_hidden_dtype) if want_hidden else None
    into_accumulator = want_weight and d_weight_accumulator is not None
    d_weight = torch.empty_like(weight) if want_weight and not into_accumulator else None
    d_bias = (
        torch.zeros((n_vocab,), device=hidden.device, dtype=torch.float32) if want_bias else None
    )
    if n_rows == 0 or n_vocab == 0:
        for grad in (d_hidden, d_weight):
            if grad is not None:
                grad.zero_()
        return d_hidden, d_weight, None if d_bias is None else d_bias.to(bias.dtype)

    _check_plan(plan, kept, d_hidden, d_weight)
    if plan.kind == "kept":
        _backward_from_kept(
            hidden, weight, target_local, row_order, n_valid, lse, coefs, softcap, kept,
            d_hidden, d_weight, d_bias, d_weight_accumulator,
        )
    elif plan.kind == "borrowed":
        _backward_in_weight_buffer(
            hidden, weight, bias, target_local, lse, coefs, softcap, plan.layout,
            d_hidden, d_weight, d_bias, round_16bit, tma,
        )
    else:
        _backward_in_token_chunks(
            hidden, weight, bias, target_local, row_order, n_valid, lse, coefs, softcap,
            plan.chunk_rows, plan.chunk_cols, d_hidden, d_weight, d_bias,
            d_weight_accumulator if into_accumulator else None, round_16bit, tma,
        )
    return d_hidden, d_weight, None if d_bias is None else d_bias.to(bias.dtype)


def _check_plan(plan, kept, d_hidden, d_weight) -> None:
    """Raise unless the plan's strategy can run on these buffers."""
    if plan.kind not in ("kept", "borrowed", "token_chunks"):
        raise ValueError(f"a call with rows and columns needs a plan that computes, got {plan}")
    if (plan.kind == "kept") != (kept is not None):
        raise ValueError(
            f"kept logits go with a 'kept' plan and only with it, got a {plan.kind!r} plan "
            f"{'with' if kept is not None else 'without'} them"
        )
    if plan.kind == "borrowed" and (
        d_hidden is None or d_weight is None or not d_weight.is_contiguous()
    ):
        raise ValueError(
            "a 'borrowed' plan needs d_hidden and a contiguous d_weight of its own (no "
            "d_weight_accumulator) to lend its storage"
        )


def _backward_in_token_chunks(
    hidden, weight, bias, target_local, row_order, n_valid, lse, coefs, softcap,
    chunk_rows, chunk_cols, d_hidden, d_weight, d_bias, d_weight_accumulator, round_16bit, tma,
):
    """The GEMM backward with its buffers from the budget: G chunks of (chunk_rows,
    chunk_cols), an fp32 dE accumulator and the gathered hidden rows of one token chunk.

    The token chunks walk positions of ``row_order`` (non-ignored rows first); G rows of ignored
    tokens are zero, so they add nothing. With ``d_weight_accumulator`` the weight gradient is
    added into it in fp32; d_weight, where given, is written (the first token chunk) and then
    accumulated in its own dtype.
    """
    n_rows, d_model = hidden.shape
    n_vocab = weight.shape[0]
    # Triton's interpreter truncates fp32 -> bf16 instead of rounding: there the kernel writes
    # fp32 and torch rounds, so CPU runs see the GPU's numerics.
    round_in_torch = INTERPRET and hidden.element_size() < 4
    g_buffer = torch.empty(
        (chunk_rows, chunk_cols),
        device=hidden.device,
        dtype=torch.float32 if round_in_torch else hidden.dtype,
    )
    d_hidden_acc = (
        torch.empty((chunk_rows, d_model), device=hidden.device, dtype=torch.float32)
        if d_hidden is not None
        else None
    )
    # One buffer for every token chunk's gathered rows: `x = hidden.index_select(...)` in the
    # loop would hold two chunks at once while the new one is built (measured: +140-155 MiB
    # over a 512 MiB budget at N = 65536 on an H100).
    hidden_rows = torch.empty((chunk_rows, d_model), device=hidden.device, dtype=hidden.dtype)
    for row_start in range(0, n_rows, chunk_rows):
        rows = min(chunk_rows, n_rows - row_start)
        positions = row_order[row_start : row_start + rows].long()
        hidden_chunk = torch.index_select(hidden, 0, positions, out=hidden_rows[:rows])
        if d_hidden_acc is not None:
            d_hidden_acc[:rows].zero_()
        for vocab_start in range(0, n_vocab, chunk_cols):
            cols = min(chunk_cols, n_vocab - vocab_start)
            g = grad_logits(
                hidden_chunk, weight, bias, row_order, n_valid, target_local, lse, coefs,
                g_buffer[:rows, :cols], row_start=row_start, vocab_start=vocab_start,
                softcap=softcap, round_16bit=round_16bit, tma=tma,
            )
            if round_in_torch:
                g = g.to(hidden.dtype)
            weight_chunk = weight[vocab_start : vocab_start + cols]
            if d_hidden_acc is not None:
                accumulate_mm(d_hidden_acc[:rows], g, weight_chunk)
            if d_weight_accumulator is not None:
                accumulate_mm(
                    d_weight_accumulator[vocab_start : vocab_start + cols], g.t(), hidden_chunk
                )
            if d_weight is not None:
                dest = d_weight[vocab_start : vocab_start + cols]
                if row_start == 0:
                    torch.mm(g.t(), hidden_chunk, out=dest)
                else:
                    dest.addmm_(g.t(), hidden_chunk)
            if d_bias is not None:
                d_bias[vocab_start : vocab_start + cols] += g.sum(dim=0, dtype=torch.float32)
        if d_hidden is not None:
            staged = d_hidden_acc[:rows]
            if d_hidden.dtype != staged.dtype:
                # The gathered hidden rows are no longer needed: reuse them to stage the cast.
                staged = hidden_chunk.copy_(staged)
            d_hidden.index_copy_(0, positions, staged)


def _backward_in_weight_buffer(
    hidden, weight, bias, target_local, lse, coefs, softcap, layout,
    d_hidden, d_weight, d_bias, round_16bit, tma,
):
    """The GEMM backward with its G chunk and fp32 dE accumulator inside ``d_weight``.

    The weight gradient is (V, D) and written one vocabulary chunk at a time, so until the end
    most of it is free. With the layout's rows [0, free_from) as scratch:

    1. columns [free_from, V): G, dE += G @ C, dC = G.T @ E written in place;
    2. columns [0, free_from): G, dE += G @ C only; dE is then complete and stored;
    3. columns [g_rows, free_from) (the accumulator's rows, now free): G again, dC in place;
    4. columns [0, g_rows) (the G chunk's own rows): G again through a small buffer, dC.

    Rows are taken in their own order, ignored ones included (their coefficients are zero and
    their lse +inf, so their G rows are exactly 0): E and dE need no gathered copy. The price is
    a second logit pass over ``free_from`` columns; the gain is a budget of a few MiB with dC
    from one GEMM over every row, never rounded in between. ``layout`` is a
    fused_lce.backward_plan.WeightBufferLayout.
    """
    n_rows, d_model = hidden.shape
    n_vocab = weight.shape[0]
    device = hidden.device
    cols = layout.chunk_cols
    flat = d_weight.view(-1)
    g_buffer = flat[: n_rows * cols].view(n_rows, cols)
    acc_start = layout.g_rows * d_model
    acc = flat[acc_start : acc_start + n_rows * d_model * 4 // d_weight.element_size()]
    acc = acc.view(torch.float32).view(n_rows, d_model)
    small = torch.empty((n_rows, layout.small_cols), device=device, dtype=weight.dtype)
    every_row = torch.arange(n_rows, device=device, dtype=torch.int32)
    n_all = torch.full((), n_rows, device=device, dtype=torch.int32)
    # Where p_coef is 0 the softmax term drops out; an lse of +inf makes it exactly 0 rather
    # than 0 * exp(logit - 0), which overflows for ignored rows.
    lse_all = torch.where(coefs.p_coef != 0, lse, torch.full_like(lse, float("inf")))

    def g_chunk(buffer, start, width):
        out = buffer[:, :width]
        target = out
        if INTERPRET and out.element_size() < 4:
            target = torch.empty(out.shape, device=device, dtype=torch.float32)
        grad_logits(
            hidden, weight, bias, every_row, n_all, target_local, lse_all, coefs, target,
            row_start=0, vocab_start=start, softcap=softcap, round_16bit=round_16bit,
            tma=tma,
        )
        if target is not out:
            out.copy_(target)
        return out

    def spans(start, stop, width):
        return [(s, min(width, stop - s)) for s in range(start, stop, width)]

    # 1 and 2: every column feeds dE; columns past the scratch also get dC and dbias now.
    acc.zero_()
    for start, width in spans(layout.free_from, n_vocab, cols) + spans(0, layout.free_from, cols):
        g = g_chunk(g_buffer, start, width)
        accumulate_mm(acc, g, weight[start : start + width])
        if start >= layout.free_from:
            torch.mm(g.t(), hidden, out=d_weight[start : start + width])
        if d_bias is not None:
            d_bias[start : start + width] += g.sum(dim=0, dtype=torch.float32)
    d_hidden.copy_(acc)
    # 3: the accumulator's rows, G still in its chunk.
    for start, width in spans(layout.g_rows, layout.free_from, cols):
        g = g_chunk(g_buffer, start, width)
        torch.mm(g.t(), hidden, out=d_weight[start : start + width])
    # 4: the chunk's own rows, through ever narrower halves of the chunk, each of which fits
    # below the columns it serves; `small` takes the rest.
    top = layout.g_rows
    for bottom, width in layout.halved_chunks:
        half = flat[: n_rows * width].view(n_rows, width)
        for start, span in spans(bottom, top, width):
            g = g_chunk(half, start, span)
            torch.mm(g.t(), hidden, out=d_weight[start : start + span])
        top = bottom
    for start, span in spans(0, top, layout.small_cols):
        g = g_chunk(small, start, span)
        torch.mm(g.t(), hidden, out=d_weight[start : start + span])


def _backward_from_kept(
    hidden, weight, target_local, row_order, n_valid, lse, coefs, softcap, kept,
    d_hidden, d_weight, d_bias, d_weight_accumulator,
):
    """Three passes instead of four: G from the kept logits, then one GEMM for each gradient.

    G covers every row in its own order (ignored rows are zero) and every column, so dE and dC
    are single GEMMs that accumulate in fp32 inside cuBLAS and round once.
    """
    row_valid = valid_rows(row_order, n_valid)
    g = grad_from_kept(kept, row_valid, target_local, lse, coefs, softcap)
    kept.scaled = None  # G now owns the storage; nothing reads it as logits again
    if g.dtype != hidden.dtype:
        g = g.to(hidden.dtype)  # the interpreter's fp32 G, rounded by torch as the GPU would
    if d_hidden is not None:
        if d_hidden.dtype == hidden.dtype:
            torch.mm(g, weight, out=d_hidden)
        else:
            d_hidden.zero_()
            accumulate_mm(d_hidden, g, weight)
    if d_weight_accumulator is not None:
        accumulate_mm(d_weight_accumulator, g.t(), hidden)
    elif d_weight is not None:
        torch.mm(g.t(), hidden, out=d_weight)
    if d_bias is not None:
        d_bias += g.sum(dim=0, dtype=torch.float32)
