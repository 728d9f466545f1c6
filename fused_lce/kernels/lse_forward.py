"""Linear-log-sum-exp forward: per-row max, sum-exp and target logit of softcap(E @ C.T + b), no
logits stored.

The grid is (row blocks, vocabulary splits). Each program walks its split of the vocabulary tile
by tile, keeps an online max and rescaled sum-exp per row in registers, and writes one partial
(max, sum-exp) per row and split; the launcher merges the splits. Splitting the vocabulary keeps
the GPU full when there are few row blocks, and the partials are what the vocab-parallel layer
combines across ranks.

The target logit is picked from the same logit tile that feeds the row's max, so where the
target holds the maximum the two are the same number and ``max - target logit`` is exactly 0:
the loss ``(max - z_y) + log sum-exp`` of a confident token keeps its precision
(fused_lce.terms). A separate dot product for the target would differ in its last bits.

Optional outputs, each behind a constexpr switch:
- ``ROW_SUM``: the sum of a row's logits, for label smoothing.
- ``COL_SUM``: per-column sums of logits over rows (atomic), whose order drives vocab sorting.
- ``KEEP``: every logit, as exp(logit - the row's running max after its tile) in 16 bits, and
  that max per row and tile (``keep_logits=True``). The exponential is in [0, 1], so 16
  bits hold it to their relative precision whatever the logit's size, and the backward turns it
  into a probability with one multiply by exp(max - lse).

Rows are read through ``row_order``: the non-ignored tokens first, ``n_valid`` of them, counted on
the device. Programs whose rows are all ignored return at once, so ignored tokens cost nothing and
no host sync is needed to remove them. On Hopper (``USE_TMA``) the tiles come through the copy
engine, which reads consecutive rows: there rows keep their order and ignored ones are masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..softmax_merge import merge_partials
from .common import (
    INTERPRET,
    TileConfig,
    check_operands,
    check_scalar,
    check_vector,
    dot_settings,
    fold_tile,
    gpu_family,
    logit_epilogue,
    logits_tile,
    logits_tile_tma,
    num_sms,
    round_code,
    tma_descriptor,
    use_tma,
    when_given,
)


@triton.jit
def _accumulate_tile(
    logits, rows, cols, row_mask, col_mask, bias_ptr, col_sum_ptr, target_logit_ptr, softcap,
    target_in_tile, row_max, row_sum_exp, row_sum,
    BLOCK_V: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ROW_SUM: tl.constexpr, COL_SUM: tl.constexpr, TARGET: tl.constexpr, ROUND: tl.constexpr,
):
    """Fold one logit tile into the rows' online max, sum-exp and (optional) sums; store the
    logit of each row whose target is a column of this tile."""
    logits, _ = logit_epilogue(
        logits, bias_ptr, cols, col_mask, softcap, HAS_BIAS, HAS_SOFTCAP, ROUND
    )
    if ROW_SUM:
        row_sum += tl.sum(tl.where(col_mask[None, :], logits, 0.0), axis=1)
    if COL_SUM:
        col_total = tl.sum(tl.where(row_mask[:, None], logits, 0.0), axis=0)
        tl.atomic_add(col_sum_ptr + cols, col_total, mask=col_mask)
    if TARGET:
        # Stored at once rather than carried through the loop, and found by 32-bit offsets:
        # the kernel is at its register limit on Hopper (ptxas: spills otherwise).
        is_target = tl.arange(0, BLOCK_V)[None, :] == target_in_tile[:, None]
        picked = tl.sum(tl.where(is_target, logits, 0.0), axis=1)
        in_tile = row_mask & (target_in_tile >= 0) & (target_in_tile < BLOCK_V)
        tl.store(target_logit_ptr + rows, picked, mask=in_tile)
    logits = tl.where(col_mask[None, :], logits, float("-inf"))
    row_max, row_sum_exp, scaled = fold_tile(logits, row_max, row_sum_exp)
    return row_max, row_sum_exp, row_sum, scaled


@triton.heuristics(
    when_given(
        # Bias and soft-capping are rare; compile them out when absent.
        HAS_BIAS="bias_ptr", HAS_SOFTCAP="softcap",
        # The optional outputs of the module docstring.
        ROW_SUM="row_sum_ptr", COL_SUM="col_sum_ptr", KEEP="keep_ptr",
        # Callers that only want the lse (benchmarks, tests of the statistics) pass no target.
        TARGET="target_ptr",
    )
)
@triton.jit
def _lse_forward_kernel(
    # pointers
    e_ptr,
    c_ptr,
    bias_ptr,
    row_order_ptr,
    n_valid_ptr,
    row_valid_ptr,
    target_ptr,
    max_ptr,
    sum_exp_ptr,
    target_logit_ptr,
    row_sum_ptr,
    col_sum_ptr,
    keep_ptr,
    keep_max_ptr,
    # sizes
    n_rows,
    n_vocab,
    d_model,
    vocab_per_split,
    vocab_start,
    # strides
    stride_en,
    stride_ed,
    stride_cv,
    stride_cd,
    stride_split,
    stride_keep,
    stride_keep_max,
    # scalars
    softcap,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ROW_SUM: tl.constexpr,
    COL_SUM: tl.constexpr,
    KEEP: tl.constexpr,
    TARGET: tl.constexpr,
    ROUND: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # With USE_TMA, e_ptr and c_ptr are tensor descriptors. The copy engine reads blocks of
    # consecutive rows, so rows are then taken in their own order and ignored ones are masked
    # (row_valid) instead of sorted away (row_order, n_valid).
    pid_n = tl.program_id(0)
    pid_split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if USE_TMA:
        in_rows = offs_n < n_rows
        row_mask = in_rows & (tl.load(row_valid_ptr + offs_n, mask=in_rows, other=0) != 0)
        rows = offs_n.to(tl.int64)
    else:
        row_mask = offs_n < tl.load(n_valid_ptr)
        rows = tl.load(row_order_ptr + offs_n, mask=row_mask, other=0).to(tl.int64)
    if tl.max(row_mask.to(tl.int32)) == 0:
        return
    # The target as a column of this weight, -1 for classes of other shards (no column).
    target = tl.full((BLOCK_N,), -1, dtype=tl.int32)
    if TARGET:
        global_target = tl.load(target_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
        local = global_target - vocab_start
        target = tl.where((local >= 0) & (local < n_vocab), local, -1).to(tl.int32)

    row_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    row_sum_exp = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)

    # Tiles with no finite logit (past the vocabulary, or masked by a -inf bias) add nothing:
    # fold_tile's rule.
    v_start = pid_split * vocab_per_split
    for v_offset in range(0, vocab_per_split, BLOCK_V):
        cols = (v_start + v_offset + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_mask = cols < n_vocab
        if USE_TMA:
            logits = logits_tile_tma(
                e_ptr, c_ptr, pid_n * BLOCK_N, v_start + v_offset, d_model,
                BLOCK_N, BLOCK_V, BLOCK_D, DOT_FP32, DOT_PRECISION,
            )
        else:
            logits = logits_tile(
                e_ptr, c_ptr, rows, cols, row_mask, col_mask, d_model,
                stride_en, stride_ed, stride_cv, stride_cd,
                BLOCK_N, BLOCK_V, BLOCK_D, DOT_FP32, DOT_PRECISION,
            )
        row_max, row_sum_exp, row_sum, scaled = _accumulate_tile(
            logits, rows, cols, row_mask, col_mask, bias_ptr, col_sum_ptr, target_logit_ptr,
            softcap, target - (v_start + v_offset), row_max, row_sum_exp, row_sum,
            BLOCK_V, HAS_BIAS, HAS_SOFTCAP, ROW_SUM, COL_SUM, TARGET, ROUND,
        )
        if KEEP:
            keep_ptrs = keep_ptr + rows[:, None] * stride_keep + cols[None, :]
            tl.store(keep_ptrs, scaled.to(keep_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & col_mask[None, :])
            # The last split may run past the vocabulary: its empty tiles have no max to keep.
            # A branch on the scalar, not a mask term: triton 3.9's interpreter widens a scalar
            # comparison joined to a mask into int32, which its store refuses ("mask has
            # unsupported dtype").
            if v_start + v_offset < n_vocab:
                tile = (v_start + v_offset) // BLOCK_V
                tl.store(keep_max_ptr + rows * stride_keep_max + tile, row_max, mask=row_mask)

    out = pid_split * stride_split + rows
    tl.store(max_ptr + out, row_max, mask=row_mask)
    tl.store(sum_exp_ptr + out, row_sum_exp, mask=row_mask)
    if ROW_SUM:
        tl.store(row_sum_ptr + out, row_sum, mask=row_mask)


# Chosen with scripts/studies/tune_kernels.py on an H100 (docs/benchmarks/single_gpu.md,
# CHANGELOG.md): the
# TMA kernel is best with four stages (82% of cuBLAS), the pointer kernel with three (71%).
_CONFIGS = {
    # Big blocks: the interpreter pays per program and per op, not per element.
    "interpreter": TileConfig(block_n=64, block_v=128, block_d=64, num_warps=4, num_stages=1),
    "hopper": TileConfig(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3),
    "hopper-tma": TileConfig(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=4),
    "blackwell": TileConfig(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3),
    "blackwell-tma": TileConfig(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3),
    "ampere": TileConfig(block_n=128, block_v=128, block_d=32, num_warps=8, num_stages=3),
}


def forward_config(device: torch.device, dtype: torch.dtype, tma: bool = False) -> TileConfig:
    family = gpu_family(device)
    cfg = _CONFIGS.get(f"{family}-tma", _CONFIGS[family]) if tma else _CONFIGS[family]
    if dtype == torch.float32 and device.type == "cuda":
        # fp32 tiles take twice the shared memory: halve the vocabulary block.
        cfg = TileConfig(cfg.block_n, cfg.block_v // 2, cfg.block_d, cfg.num_warps, cfg.num_stages)
    return cfg


@dataclass
class KeptLogits:
    """The forward's logits for a backward that does not recompute them (``KEEP``).

    ``logit[n, v] = tile_max[n, v // block_v] + log(scaled[n, v])``, for rows that are not
    ignored; ignored rows hold garbage. ``scaled`` becomes the logit gradient in place.
    """

    scaled: torch.Tensor  # (N, V), 16 bits (fp32 under the interpreter or for fp32 inputs)
    tile_max: torch.Tensor  # (N, ceil(V / block_v)) fp32
    block_v: int


@dataclass
class LSEStats:
    """Per-row statistics of one vocabulary shard; ignored rows hold max=-inf, sum_exp=0."""

    max: torch.Tensor  # (N,) fp32
    sum_exp: torch.Tensor  # (N,) fp32, sum of exp(logit - max)
    row_sum: torch.Tensor | None  # (N,) fp32, sum of logits (label smoothing)
    col_sum: torch.Tensor | None  # (V,) fp32, sum of logits over valid rows (vocab sorting)
    kept: KeptLogits | None = None
    # (N,) fp32, the target's logit from the tiles that gave ``max``; 0 where the target is not
    # a row of this weight. None when no target was given.
    target_logit: torch.Tensor | None = None

    @property
    def lse(self) -> torch.Tensor:
        return self.max + torch.log(self.sum_exp)


def lse_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    row_order: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    target: torch.Tensor | None = None,
    vocab_start: int = 0,
    softcap: float | None = None,
    want_row_sum: bool = False,
    want_col_sum: bool = False,
    round_16bit: bool = False,
    keep_logits: bool = False,
    tma: bool = True,
) -> LSEStats:
    """Max and sum-exp per row of ``softcap(hidden @ weight.T + bias)`` over this weight's rows.

    Args:
        hidden: (N, D) activations.
        weight: (V, D) classifier rows (a shard, possibly).
        bias: (V,) or None, unit stride.
        row_order: (N,) int32, the non-ignored rows first.
        n_valid: () int32 on the device, the number of non-ignored rows.
        target: (N,) int32/int64 global class ids, unit stride, or None: with it the stats hold
            each row's target logit.
        vocab_start: the global id of ``weight``'s first row (vocabulary shards).
        round_16bit: round each logit to the 16-bit input dtype before anything else
            (``LCEOptions.round_logits``).
        keep_logits: also return the logits as :class:`KeptLogits`
            (``LCEOptions.keep_logits``).
        tma: False keeps the pointer kernels (``common.use_tma``).
    """
    # Check constraints.
    check_operands(hidden, weight, bias)
    n_rows, d_model = hidden.shape
    check_vector("row_order", row_order, n_rows, (torch.int32,))
    check_scalar("n_valid", n_valid, torch.int32)
    if target is not None:
        check_vector("target", target, n_rows, (torch.int32, torch.int64))
    n_vocab = weight.shape[0]
    device = hidden.device
    tma = use_tma(hidden, weight, enabled=tma)
    cfg = forward_config(device, hidden.dtype, tma)
    dot_fp32, precision = dot_settings(hidden.dtype)

    row_blocks = triton.cdiv(n_rows, cfg.block_n)
    vocab_blocks = triton.cdiv(n_vocab, cfg.block_v)
    splits = vocab_splits(row_blocks, vocab_blocks, device)
    vocab_per_split = triton.cdiv(vocab_blocks, splits) * cfg.block_v
    splits = triton.cdiv(n_vocab, vocab_per_split)

    part_max = torch.full((splits, n_rows), float("-inf"), device=device, dtype=torch.float32)
    part_sum_exp = torch.zeros((splits, n_rows), device=device, dtype=torch.float32)
    part_row_sum = (
        torch.zeros((splits, n_rows), device=device, dtype=torch.float32) if want_row_sum else None
    )
    col_sum = torch.zeros((n_vocab,), device=device, dtype=torch.float32) if want_col_sum else None
    target_logit = (
        torch.zeros((n_rows,), device=device, dtype=torch.float32) if target is not None else None
    )
    kept = None
    if keep_logits:
        kept = KeptLogits(
            scaled=torch.empty((n_rows, n_vocab), device=device, dtype=kept_dtype(hidden)),
            tile_max=torch.empty((n_rows, max(vocab_blocks, 1)), device=device,
                                 dtype=torch.float32),
            block_v=cfg.block_v,
        )

    if n_rows > 0 and n_vocab > 0:
        grid = (row_blocks, splits)
        common = dict(
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d,
            DOT_FP32=dot_fp32, DOT_PRECISION=precision,
            ROUND=round_code(hidden.dtype, round_16bit),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        e_arg, c_arg, row_valid = hidden, weight, None
        if tma:
            e_arg = tma_descriptor(hidden, cfg.block_n, cfg.block_d)
            c_arg = tma_descriptor(weight, cfg.block_v, cfg.block_d)
            row_valid = valid_rows(row_order, n_valid)
        _lse_forward_kernel[grid](
            e_arg, c_arg, bias, row_order, n_valid, row_valid, target,
            part_max, part_sum_exp, target_logit, part_row_sum, col_sum,
            None if kept is None else kept.scaled, None if kept is None else kept.tile_max,
            n_rows, n_vocab, d_model, vocab_per_split, vocab_start,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            part_max.stride(0),
            0 if kept is None else kept.scaled.stride(0),
            0 if kept is None else kept.tile_max.stride(0),
            softcap,
            USE_TMA=tma,
            **common,
        )

    if splits == 1:
        row_max, sum_exp = part_max[0], part_sum_exp[0]
    else:
        row_max, sum_exp = merge_partials(part_max, part_sum_exp)
    row_sum = None if part_row_sum is None else part_row_sum.sum(dim=0)
    return LSEStats(row_max, sum_exp, row_sum, col_sum, kept, target_logit)


def vocab_splits(row_blocks: int, vocab_blocks: int, device: torch.device) -> int:
    """How many programs share a row block's vocabulary: enough programs for about four waves,
    without splitting below a few tiles per program (1 under the interpreter)."""
    if INTERPRET:
        return 1
    wanted = triton.cdiv(4 * num_sms(device), max(row_blocks, 1))
    return max(1, min(wanted, triton.cdiv(vocab_blocks, 4)))


def kept_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The kept exponentials' dtype: the input's, but fp32 under Triton's interpreter, which
    truncates to 16 bits instead of rounding."""
    return torch.float32 if INTERPRET else hidden.dtype


def valid_rows(row_order: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """(N,) int8, 1 where the row is not ignored: ``row_order``'s first ``n_valid`` rows."""
    positions = torch.arange(row_order.shape[0], device=row_order.device)
    valid = torch.empty(row_order.shape, device=row_order.device, dtype=torch.int8)
    return valid.scatter_(0, row_order.long(), (positions < n_valid).to(torch.int8))
