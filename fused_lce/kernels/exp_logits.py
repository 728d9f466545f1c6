"""The logits GEMM that stores exponentials, and the small kernels around it: a token chunk's
softmax and gradient with no pass over stored logits.

For a chunk of rows whose target logits ``c`` are known before the GEMM:

    target_logits   c_n = z[n, y_n]: a dot product per row (0 where another shard owns y_n)
    exp_logits      E[n, v] = exp(z[n, v] - c_n) for v != y_n, 16 bits, written by the GEMM's
                    epilogue from its fp32 accumulator, with each row's max and sum-exp

Then a row's logit gradient is ``G[n] = s_n E[n]`` plus its target column, with
``s_n = p_coef_n exp(c_n - lse_n)``. The two gradient GEMMs take E as it is, with the small
kernels of exp_logits_grad.py around them:

    dE[n] = s_n (E @ C)[n] + g_n C[y_n]            row_scales, then finish_input_grad
    dC    = E.T @ (s * E_in) + sum_n g_n e_n^T     row_scales' scaled rows, then add_target_rows

so nothing reads E again to normalise it (the two passes of the logit_rows kernels). The target
column stays out of E: folded in, its gradient would be rounded to 16 bits together with 1/s_n,
which on near-uniform data doubles the weight gradient's error; here it is added in fp32.

Why the target logit as the offset: E[n, y_n] would be exactly 1, so every E <= exp(lse - c) =
exp(loss). Nothing overflows while a row's loss stays under ``MAX_LOG_OFFSET`` nats, and nothing
that matters underflows (E >= p). The statistics never depend on that range (a tile whose sums
overflow is summed again against its max); a row past it (a loss over 55 nats, a target under a
-inf bias, non-finite inputs) is stored again against its lse by
``repair_exponentials``, a launch that returns at once where no row is: no host read decides.

Target columns reach the kernels after ``target_logits`` as ``columns``: the target's row in this
weight shard, ``OTHER_SHARD`` where another shard owns it, ``IGNORED`` for ignore_index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import (
    INTERPRET,
    TileConfig,
    check_operands,
    check_vector,
    dot_settings,
    gpu_family,
    logit_epilogue,
    logits_tile,
    logits_tile_tma,
    num_sms,
    round_code,
    round_logits,
    softcap_derivative,
    tma_descriptor,
    use_tma,
    when_given,
)

OTHER_SHARD, IGNORED = -1, -2
_OTHER_SHARD, _IGNORED = tl.constexpr(OTHER_SHARD), tl.constexpr(IGNORED)  # as kernels read them
# A row whose loss (its lse less its offset) passes this many nats is recomputed against its lse:
# E then stays under exp(55), the fp32 products over V finite, and s E (s >= exp(-55) p_coef)
# inside bf16's normal range.
MAX_LOG_OFFSET = tl.constexpr(55.0)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.heuristics(when_given(HAS_BIAS="bias_ptr", HAS_SOFTCAP="softcap"))
@triton.jit
def _target_logits_kernel(
    x_ptr, w_ptr, bias_ptr, target_ptr, logit_ptr, column_ptr,
    n_rows, n_cols, d_model, stride_xn, stride_xd, stride_wv, stride_wd,
    vocab_start, ignore_index, softcap,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ROUND: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    col = target - vocab_start
    live = target != ignore_index
    owned = row_mask & live & (col >= 0) & (col < n_cols)
    column = tl.where(owned, col, tl.where(live, _OTHER_SHARD, _IGNORED))
    tl.store(column_ptr + rows, column.to(tl.int32), mask=row_mask)
    col = tl.where(owned, col, 0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for d0 in range(0, d_model, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        both = owned[:, None] & (d < d_model)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xn + d[None, :] * stride_xd, mask=both,
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + col[:, None] * stride_wv + d[None, :] * stride_wd, mask=both,
                    other=0.0).to(tl.float32)
        acc += tl.sum(x * w, axis=1)
    logit, _ = logit_epilogue(acc, bias_ptr, col, owned, softcap, HAS_BIAS, HAS_SOFTCAP, ROUND)
    tl.store(logit_ptr + rows, tl.where(owned, logit, 0.0), mask=row_mask)


@triton.jit
def _exponentials_epilogue(
    acc, rows, row_mask, row0, col0, n_cols, offset, column, bias_ptr, softcap,
    out_ptr, out_desc, stride_out,
    BLOCK_COLS: tl.constexpr, STORE: tl.constexpr, STORE_TMA: tl.constexpr,
    ROUND: tl.constexpr, ROUND_OUT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """log sum exp per row of one (rows, BLOCK_COLS) block of the GEMM's accumulator, the
    target's column left out, storing exp(logit - offset) where asked.

    The sum is exact whatever the logits: fp32 sums of positive terms lose nothing for want of a
    shift, so the terms are exp(logit - offset) themselves, and only where one of the block's
    rows overflows (a logit 88 nats over its offset) or is NaN are its sums taken again against
    max(offset, the block's max). The stored exponentials of such a row are out of range too;
    ``_repair_kernel`` stores them again.
    """
    cols = col0 + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    logits, capped = logit_epilogue(acc, bias_ptr, cols, col_mask, softcap, HAS_BIAS,
                                    HAS_SOFTCAP, ROUND)
    keep = ((row_mask & (column != _IGNORED))[:, None] & col_mask[None, :]
            & (cols[None, :] != column[:, None]))
    # exp2 of pre-scaled differences: one FMA and one MUFU.EX2 per logit.
    exps = tl.where(keep, tl.exp2(logits * _LOG2E - (offset * _LOG2E)[:, None]), 0.0)
    sums = tl.sum(exps, axis=1)
    log_sum = offset + tl.log(sums)
    if tl.min((sums < float("inf")).to(tl.int32), axis=0) == 0:
        log_sum = _shifted_log_sum(logits, keep, offset)
    if STORE:
        if HAS_SOFTCAP:
            exps *= softcap_derivative(capped)
        exps = round_logits(exps, ROUND_OUT).to(out_ptr.dtype.element_ty)
        if STORE_TMA:
            out_desc.store([row0, col0], exps)
        else:
            tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], exps,
                     mask=row_mask[:, None] & col_mask[None, :])
    return log_sum


@triton.jit
def _shifted_log_sum(logits, keep, offset):
    """log sum exp of the kept logits, the sum taken against the larger of the offset and the
    row's max: exact for any logits."""
    logits = tl.where(keep, logits, float("-inf"))
    shift = tl.maximum(offset, tl.max(logits, axis=1))
    shift = tl.where(shift == float("-inf"), 0.0, shift)  # fold_tile's rule: no -inf - -inf
    exps = tl.exp2((logits - shift[:, None]) * _LOG2E)
    return shift + tl.log(tl.sum(exps, axis=1))


@triton.heuristics(when_given(HAS_BIAS="bias_ptr", HAS_SOFTCAP="softcap"))
@triton.jit
def _exp_logits_kernel(
    x_ptr, w_ptr, x_desc, w_desc, out_ptr, out_desc,
    bias_ptr, offset_ptr, column_ptr, part_sum_ptr,
    n_rows, n_cols, d_model, stride_xn, stride_xd, stride_wv, stride_wd, stride_out,
    softcap,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    PROGRAMS: tl.constexpr, TMA: tl.constexpr, STORE: tl.constexpr, STORE_TMA: tl.constexpr,
    SPLIT: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND: tl.constexpr,
    ROUND_OUT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    # A persistent grid walks the output tiles GROUP row tiles at a time, so that the weight
    # tiles a group shares stay in L2.
    row_tiles = tl.cdiv(n_rows, BLOCK_N)
    col_tiles = tl.cdiv(n_cols, BLOCK_V)
    per_group = GROUP * col_tiles
    for tile in tl.range(tl.program_id(0), row_tiles * col_tiles, PROGRAMS,
                         warp_specialize=WARP_SPECIALIZE):
        first_row_tile = tile // per_group * GROUP
        group_rows = min(row_tiles - first_row_tile, GROUP)
        row_tile = first_row_tile + (tile % per_group) % group_rows
        col_tile = (tile % per_group) // group_rows
        row0 = row_tile * BLOCK_N
        col0 = col_tile * BLOCK_V
        rows = (row0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_mask = rows < n_rows
        if TMA:
            acc = logits_tile_tma(x_desc, w_desc, row0, col0, d_model, BLOCK_N, BLOCK_V, BLOCK_D,
                                  DOT_FP32, DOT_PRECISION)
        else:
            cols = (col0 + tl.arange(0, BLOCK_V)).to(tl.int64)
            acc = logits_tile(x_ptr, w_ptr, rows, cols, row_mask, cols < n_cols, d_model,
                              stride_xn, stride_xd, stride_wv, stride_wd, BLOCK_N, BLOCK_V,
                              BLOCK_D, DOT_FP32, DOT_PRECISION)
        offset = tl.load(offset_ptr + rows, mask=row_mask, other=0.0)
        column = tl.load(column_ptr + rows, mask=row_mask, other=_IGNORED)
        if SPLIT == 2:
            # The epilogue in two halves of the tile: half the registers live at a time.
            halves = tl.permute(tl.reshape(acc, (BLOCK_N, 2, BLOCK_V // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            log_left = _exponentials_epilogue(
                left, rows, row_mask, row0, col0, n_cols, offset, column, bias_ptr, softcap,
                out_ptr, out_desc, stride_out, BLOCK_V // 2, STORE, STORE_TMA, ROUND,
                ROUND_OUT, HAS_BIAS, HAS_SOFTCAP)
            log_right = _exponentials_epilogue(
                right, rows, row_mask, row0, col0 + BLOCK_V // 2, n_cols, offset, column,
                bias_ptr, softcap, out_ptr, out_desc, stride_out, BLOCK_V // 2, STORE,
                STORE_TMA, ROUND, ROUND_OUT, HAS_BIAS, HAS_SOFTCAP)
            log_sum = _log_add(log_left, log_right)
        else:
            log_sum = _exponentials_epilogue(
                acc, rows, row_mask, row0, col0, n_cols, offset, column, bias_ptr, softcap,
                out_ptr, out_desc, stride_out, BLOCK_V, STORE, STORE_TMA, ROUND, ROUND_OUT,
                HAS_BIAS, HAS_SOFTCAP)
        tl.store(part_sum_ptr + col_tile * n_rows + rows, log_sum, mask=row_mask)


@triton.jit
def _log_add(a, b):
    """log(exp(a) + exp(b)), -inf where both are (kernels/common.py's fold_tile rule)."""
    top = tl.maximum(a, b)
    shift = tl.where(top == float("-inf"), 0.0, top)
    return shift + tl.log(tl.exp(a - shift) + tl.exp(b - shift))


@triton.jit
def _row_sums_kernel(
    part_ptr, column_ptr, offset_ptr, max_ptr, sum_exp_ptr, target_logit_ptr, n_rows, n_parts,
    BLOCK_N: tl.constexpr, BLOCK_PARTS: tl.constexpr,
):
    # The per-tile log-sums merged with the target's own logit (the offset, where this shard
    # owns it) into a max and a sum of exp(logit - max), as the engine's statistics are: one
    # read of the log-sums, the sum rescaled as the max grows.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    column = tl.load(column_ptr + rows, mask=row_mask, other=_IGNORED)
    owned = column >= 0
    offset = tl.load(offset_ptr + rows, mask=row_mask, other=0.0)
    row_max = tl.where(owned, offset, float("-inf"))
    total = tl.where(owned, 1.0, 0.0)
    for p0 in range(0, n_parts, BLOCK_PARTS):
        parts = p0 + tl.arange(0, BLOCK_PARTS)
        block = tl.load(part_ptr + parts[:, None].to(tl.int64) * n_rows + rows[None, :],
                        mask=(parts < n_parts)[:, None] & row_mask[None, :],
                        other=float("-inf"))
        new_max = tl.maximum(row_max, tl.max(block, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        total = (total * tl.exp(row_max - shift)
                 + tl.sum(tl.exp(block - shift[None, :]), axis=0))
        row_max = new_max
    # An ignored row's placeholders: max 0, sum 1 (lse 0).
    ignored = column == _IGNORED
    tl.store(max_ptr + rows, tl.where(ignored, 0.0, row_max), mask=row_mask)
    tl.store(sum_exp_ptr + rows, tl.where(ignored, 1.0, total), mask=row_mask)
    tl.store(target_logit_ptr + rows, tl.where(owned, offset, 0.0), mask=row_mask)


@triton.jit
def _out_of_range(lse, offset):
    """Rows whose exponentials may leave their range: p <= E / exp(lse - offset) <= 1, where
    lse - offset is the loss for the target logit as the offset. NaN counts as out of range."""
    return ~(tl.abs(lse - offset) <= MAX_LOG_OFFSET)


@triton.heuristics(when_given(HAS_BIAS="bias_ptr", HAS_SOFTCAP="softcap"))
@triton.jit
def _repair_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr, lse_ptr, offset_ptr, column_ptr,
    n_rows, n_cols, d_model, stride_xn, stride_xd, stride_wv, stride_wd, stride_out, softcap,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    PROGRAMS: tl.constexpr, CHECK: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROUND: tl.constexpr, ROUND_OUT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    # Rows out of range are rare (a loss over 55 nats, non-finite logits): each program looks
    # for one in wide blocks and returns where there is none. Their tiles are recomputed and
    # stored against the lse instead, so E becomes the softmax itself (row_scales then takes the
    # lse as the offset). Through pointers: the launch that usually does nothing pays for no
    # tensor descriptors.
    any_bad = 0
    for check0 in range(0, n_rows, CHECK):
        checked = check0 + tl.arange(0, CHECK)
        in_rows = checked < n_rows
        lse = tl.load(lse_ptr + checked, mask=in_rows, other=0.0)
        offset = tl.load(offset_ptr + checked, mask=in_rows, other=0.0)
        any_bad += tl.sum((in_rows & _out_of_range(lse, offset)).to(tl.int32), axis=0)
    if any_bad == 0:
        return
    for row_tile in range(0, tl.cdiv(n_rows, BLOCK_N)):
        row0 = row_tile * BLOCK_N
        rows = (row0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_mask = rows < n_rows
        lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
        offset = tl.load(offset_ptr + rows, mask=row_mask, other=0.0)
        bad = row_mask & _out_of_range(lse, offset)
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            column = tl.load(column_ptr + rows, mask=row_mask, other=_IGNORED).to(tl.int64)
            for col_tile in range(tl.program_id(0), tl.cdiv(n_cols, BLOCK_V), PROGRAMS):
                col0 = col_tile * BLOCK_V
                cols = (col0 + tl.arange(0, BLOCK_V)).to(tl.int64)
                col_mask = cols < n_cols
                acc = logits_tile(x_ptr, w_ptr, rows, cols, row_mask, col_mask, d_model,
                                  stride_xn, stride_xd, stride_wv, stride_wd, BLOCK_N, BLOCK_V,
                                  BLOCK_D, DOT_FP32, DOT_PRECISION)
                logits, capped = logit_epilogue(acc, bias_ptr, cols, col_mask, softcap,
                                                HAS_BIAS, HAS_SOFTCAP, ROUND)
                keep = ((column != _IGNORED)[:, None] & col_mask[None, :]
                        & (cols[None, :] != column[:, None]))
                exps = tl.where(keep, tl.exp(logits - lse[:, None]), 0.0)
                if HAS_SOFTCAP:
                    exps *= softcap_derivative(capped)
                exps = round_logits(exps, ROUND_OUT).to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], exps,
                         mask=bad[:, None] & col_mask[None, :])


@dataclass(frozen=True)
class ExpLogitsConfig:
    """The GEMM's tiles and launch, and how its epilogue runs: in ``split`` parts of the tile
    (1 or 2) and in its own warps (``warp_specialize``, Hopper and newer). ``group`` row tiles
    are walked together, sharing weight tiles in L2 (None: ``_row_tile_group``'s choice)."""

    tile: TileConfig
    split: int = 1
    warp_specialize: bool = False
    group: int | None = None


def _row_tile_group(config: ExpLogitsConfig, n_cols: int) -> int:
    """Row tiles walked together. scripts/tune_exp_logits.py on an H100, two runs: 16 is 0.4-5%
    faster than 8 at 256000 and 128256 columns, 4% slower at 32064 (one run)."""
    if config.group is not None:
        return config.group
    return 16 if n_cols >= 65536 else 8


# Measured with scripts/tune_exp_logits.py on an H100 over chunks of 4096 tokens
# (docs/benchmarks/single_gpu.md): 128 x 256 x 64 tiles in 3 stages, the epilogue in
# two halves of the tile: 0.99-1.10x cuBLAS's plain GEMM, the best mean of seven variants (whole
# epilogues, 4 stages, 256 x 128, an epilogue taking every block's max); 128-deep tiles in 2
# stages were 1.27-1.43x. A variant storing plain logits ran at 1.00-1.01x cuBLAS (2026-11-27,
# commit 70bfb7c), so the rest is the exponentials' arithmetic, which Hopper's warp
# specialisation in Triton (a loading warp, the MMA and epilogue in the same warps) does not
# overlap with the next tile's MMAs. Flattened tile loops (no gain in the step) and two programs
# per SM (128 x 128 tiles, 18-31% behind cuBLAS) were closed (docs/benchmarks/single_gpu.md);
# those variants are in git, in this file and the tuner at commit 10497e6.
_CONFIGS = {
    # Big blocks: the interpreter pays per program and per op, not per element.
    "interpreter": ExpLogitsConfig(TileConfig(64, 128, 64, num_warps=4, num_stages=1), split=2),
    "hopper": ExpLogitsConfig(TileConfig(128, 256, 64, num_warps=8, num_stages=3), split=2,
                              warp_specialize=True),
    "blackwell": ExpLogitsConfig(TileConfig(128, 256, 64, num_warps=8, num_stages=3)),
    "ampere": ExpLogitsConfig(TileConfig(128, 128, 32, num_warps=8, num_stages=3)),
}


def exp_logits_config(device: torch.device) -> ExpLogitsConfig:
    return _CONFIGS[gpu_family(device)]


def partial_count(n_rows: int, n_cols: int, device: torch.device) -> int:
    """fp32 elements ``exp_logits`` needs for its per-tile sums."""
    return triton.cdiv(n_cols, exp_logits_config(device).tile.block_v) * n_rows


def _out_round(dtype: torch.dtype) -> int:
    """ROUND_OUT: the interpreter's casts to 16 bits truncate, so there the kernels round first."""
    return round_code(dtype, INTERPRET)


def _check_rows(name: str, tensor: torch.Tensor, n_rows: int, n_cols: int) -> None:
    """Raise unless ``tensor`` is an (n_rows, n_cols) matrix with unit column stride."""
    if tensor.dim() != 2 or tuple(tensor.shape) != (n_rows, n_cols) or (
            n_cols > 1 and tensor.stride(1) != 1):
        raise ValueError(f"{name} must be a ({n_rows}, {n_cols}) matrix with unit column stride, "
                         f"got shape {tuple(tensor.shape)} strides {tensor.stride()}")


def _check_row_vectors(n_rows: int, columns: torch.Tensor, **fp32: torch.Tensor) -> None:
    check_vector("columns", columns, n_rows, (torch.int32,))
    for name, vector in fp32.items():
        check_vector(name, vector, n_rows, (torch.float32,))


def target_logits(hidden, weight, bias, target, *, vocab_start: int, ignore_index: int,
                  softcap: float | None, round_16bit: bool):
    """(logit, columns), (N,) each: the target logit softcap(round(h . w_y) + b_y) in fp32 (0 where
    this shard does not own the target), and the target's column in int32 (module docstring)."""
    # Check constraints.
    check_operands(hidden, weight, bias)
    n_rows, d_model = hidden.shape
    check_vector("target", target, n_rows, (torch.int32, torch.int64))
    logit = torch.empty(n_rows, device=hidden.device, dtype=torch.float32)
    columns = torch.empty(n_rows, device=hidden.device, dtype=torch.int32)
    block_n, block_d = (16, 128) if INTERPRET else (16, 256)
    if n_rows > 0:
        _target_logits_kernel[(triton.cdiv(n_rows, block_n),)](
            hidden, weight, bias, target, logit, columns, n_rows, weight.shape[0], d_model,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            vocab_start, ignore_index, softcap,
            BLOCK_N=block_n, BLOCK_D=block_d, ROUND=round_code(hidden.dtype, round_16bit),
            num_warps=4,
        )
    return logit, columns


def exp_logits(hidden, weight, bias, columns, offset, out, *, softcap: float | None,
               round_16bit: bool, partials: torch.Tensor | None = None, tma: bool = True,
               config: ExpLogitsConfig | None = None):
    """(shift, sum_exp, target_logit), (N,) fp32 each, the statistics of z = softcap(round(h @
    w.T) + b) with the target's logit counted as ``offset`` where this shard owns it: lse =
    shift + log(sum_exp), the shift being the largest of that target logit and the column tiles'
    log-sums (-inf, with a sum of 0, where no column is finite); the target logit, 0 where another
    shard owns it. Ignored rows hold shift 0 and sum 1. With ``out`` (rows x V_local, unit column
    stride), exp(z - offset) is stored there (times the cap's derivative), zero in the target's
    column and on ignored rows.

    ``partials``: fp32 storage of at least ``partial_count`` elements for the per-tile sums,
    lent by the caller (memory idle at that moment), or None to allocate it.
    """
    # Check constraints.
    check_operands(hidden, weight, bias)
    n_rows, d_model = hidden.shape
    n_cols = weight.shape[0]
    _check_row_vectors(n_rows, columns, offset=offset)
    if out is not None:
        _check_rows("out", out, n_rows, n_cols)
    config = config or exp_logits_config(hidden.device)
    cfg = config.tile
    col_tiles = triton.cdiv(n_cols, cfg.block_v)
    if partials is None or partials.numel() < col_tiles * n_rows:
        partials = torch.empty(col_tiles * n_rows, device=hidden.device, dtype=torch.float32)
    part_sum = partials[: col_tiles * n_rows].view(col_tiles, n_rows)
    stats = torch.empty((3, n_rows), device=hidden.device, dtype=torch.float32)
    if n_rows == 0:
        return stats[0], stats[1], stats[2]
    if n_cols > 0:
        tma = use_tma(hidden, weight, enabled=tma)
        store_tma = tma and out is not None and not INTERPRET and use_tma(out)
        dot_fp32, precision = dot_settings(hidden.dtype)
        x_desc = w_desc = out_desc = None
        if tma:
            x_desc = tma_descriptor(hidden, cfg.block_n, cfg.block_d)
            w_desc = tma_descriptor(weight, cfg.block_v, cfg.block_d)
        if store_tma:
            out_desc = tma_descriptor(out, cfg.block_n, cfg.block_v // config.split)
        programs = min(triton.cdiv(n_rows, cfg.block_n) * col_tiles, num_sms(hidden.device))
        _exp_logits_kernel[(programs,)](
            hidden, weight, x_desc, w_desc, out, out_desc, bias, offset, columns, part_sum,
            n_rows, n_cols, d_model, hidden.stride(0), hidden.stride(1), weight.stride(0),
            weight.stride(1), 0 if out is None else out.stride(0), softcap,
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d,
            GROUP=_row_tile_group(config, n_cols),
            PROGRAMS=programs, TMA=tma, STORE=out is not None, STORE_TMA=store_tma,
            # Warp specialisation was measured over tensor descriptors only.
            SPLIT=config.split, WARP_SPECIALIZE=config.warp_specialize and tma,
            DOT_FP32=dot_fp32, DOT_PRECISION=precision,
            ROUND=round_code(hidden.dtype, round_16bit),
            ROUND_OUT=0 if out is None else _out_round(out.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    # Rows in blocks of 32 (128-byte reads of each part): enough programs to fill the GPU.
    block_n = 64 if INTERPRET else 32
    _row_sums_kernel[(triton.cdiv(n_rows, block_n),)](
        part_sum, columns, offset, stats[0], stats[1], stats[2], n_rows, col_tiles,
        BLOCK_N=block_n, BLOCK_PARTS=64 if INTERPRET else 32, num_warps=4,
    )
    return stats[0], stats[1], stats[2]


def repair_exponentials(hidden, weight, bias, columns, offset, lse, out, *,
                        softcap: float | None, round_16bit: bool) -> None:
    """Where a row's loss (lse - offset) passes ``MAX_LOG_OFFSET`` nats or is not finite, store
    exp(z - lse) over ``out``'s row instead (``exp_logits``' layout); a launch that returns at
    once where no row does, so no host read decides it."""
    # Check constraints.
    check_operands(hidden, weight, bias)
    n_rows, d_model = hidden.shape
    n_cols = weight.shape[0]
    _check_row_vectors(n_rows, columns, offset=offset, lse=lse)
    _check_rows("out", out, n_rows, n_cols)
    cfg = exp_logits_config(hidden.device).tile
    if n_rows == 0 or n_cols == 0:
        return
    dot_fp32, precision = dot_settings(hidden.dtype)
    programs = min(triton.cdiv(n_cols, cfg.block_v), num_sms(hidden.device))
    _repair_kernel[(programs,)](
        hidden, weight, out, bias, lse, offset, columns,
        n_rows, n_cols, d_model, hidden.stride(0), hidden.stride(1), weight.stride(0),
        weight.stride(1), out.stride(0), softcap,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, PROGRAMS=programs,
        CHECK=64 if INTERPRET else 2048, DOT_FP32=dot_fp32, DOT_PRECISION=precision,
        ROUND=round_code(hidden.dtype, round_16bit), ROUND_OUT=_out_round(out.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
