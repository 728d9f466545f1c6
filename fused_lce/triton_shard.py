"""The cce impl: the Triton kernels and cuBLAS as an engine ``ShardStrategy`` (``TritonShard``).

By default the engine walks token chunks with gradients in the forward (fused_lce/token_walk.py,
which holds this strategy's plan and per-chunk state): for bf16 with ``ExpGradientChunks`` (the
exp_logits GEMM stores exponentials, cuBLAS gradients), else with ``TritonGradientChunks``
(cuBLAS logits, the logit_rows kernels, cuBLAS gradients). Where it does not walk, the forward
saves (lse, a few (N,) vectors) and the backward recomputes: ``prepare_rows`` orders the tokens,
``shard_statistics`` runs the forward kernel on one weight shard and ``shard_backward`` the
backward. ``TritonShard`` serves one device and the
vocab-parallel layer alike; nothing in this file talks to other ranks.

Per-row vectors (target, bias) reach the kernels with unit stride: the building blocks make a
strided view contiguous once (a copy of N or V elements), and the launchers check it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backward_plan import (
    filter_settings,
    keeps_logits,
    plan_gemm_backward_for,
    recomputing_backward,
    use_vocab_sort,
)
from .kernels.gemm_backward import lce_backward_gemm
from .kernels.lse_forward import KeptLogits, LSEStats, lse_forward
from .kernels.scale import scale_unless_one_
from .kernels.tiles_backward import lce_backward
from .options import LCEOptions
from .shard import ShardGradRequest, ShardInputs, ShardStatistics
from .terms import GradCoefficients
from .token_walk import (
    local_targets,
    plan_forward_gradients,
    triton_gradient_chunks,
    unit_stride,
)


@dataclass
class RowOrder:
    """Non-ignored tokens first (stable), and how many there are, both on the device."""

    order: torch.Tensor  # (N,) int32
    n_valid: torch.Tensor  # () int32
    valid: torch.Tensor  # (N,) bool


def prepare_rows(target: torch.Tensor, ignore_index: int) -> RowOrder:
    """Move ignored tokens to the end without a host sync: the kernels stop at ``n_valid``."""
    valid = target != ignore_index
    order = torch.argsort((~valid).to(torch.int8), stable=True).to(torch.int32)
    return RowOrder(order=order, n_valid=valid.sum(dtype=torch.int32), valid=valid)


def shard_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    rows: RowOrder,
    opts: LCEOptions,
    *,
    vocab_start: int = 0,
    want_col_sum: bool = False,
) -> LSEStats:
    """Max / sum-exp / target-logit (/ row-sum) statistics of this weight shard's columns.

    The target logit is 0 for tokens whose target another shard owns. The statistics hold the
    kept logits where the options ask for them (``keeps_logits``).
    """
    return lse_forward(
        hidden,
        weight,
        unit_stride(bias),
        rows.order,
        rows.n_valid,
        target=unit_stride(target),
        vocab_start=vocab_start,
        softcap=opts.softcap,
        want_row_sum=opts.label_smoothing > 0,
        want_col_sum=want_col_sum,
        round_16bit=opts.rounds_logits(hidden.dtype),
        keep_logits=keeps_logits(opts),
        tma=opts.tma_allowed,
    )


def shard_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target_local: torch.Tensor,
    rows: RowOrder,
    lse: torch.Tensor,
    coefs: GradCoefficients,
    col_sum: torch.Tensor | None,
    opts: LCEOptions,
    n_classes: int,
    needs: tuple[bool, bool, bool],
    d_hidden_dtype: torch.dtype | None = None,
    d_weight_accumulator: torch.Tensor | None = None,
    kept: KeptLogits | None = None,
):
    """(d_hidden partial, d_weight, d_bias) for this shard, against the global ``lse``.

    With ``d_weight_accumulator`` (fp32, the weight's shape) the weight gradient is added into
    it and returned as None. ``kept``: the forward's kept logits (``keeps_logits``), consumed.
    """
    bias = unit_stride(bias)
    # What both backward launchers take alike.
    operands = (hidden, weight, bias, target_local, rows.order, rows.n_valid, lse, coefs)
    shared = dict(softcap=opts.softcap, want_hidden=needs[0], want_weight=needs[1],
                  want_bias=needs[2], d_hidden_dtype=d_hidden_dtype,
                  round_16bit=opts.rounds_logits(hidden.dtype))
    if recomputing_backward(opts) == "gemm":
        plan = plan_gemm_backward_for(
            hidden, weight, bias, scratch_bytes=opts.scratch_bytes, want_hidden=needs[0],
            want_weight=needs[1], want_bias=needs[2],
            into_accumulator=d_weight_accumulator is not None, kept=kept is not None,
        )
        return lce_backward_gemm(*operands, plan=plan, d_weight_accumulator=d_weight_accumulator,
                                 kept=kept, tma=opts.tma_allowed, **shared)
    filter_code, threshold = filter_settings(opts, hidden.dtype, n_classes, hidden.device)
    vocab_order = None
    if col_sum is not None and use_vocab_sort(opts, filter_code):
        vocab_order = torch.argsort(col_sum, descending=True).to(torch.int32)
    grads = lce_backward(*operands, filter_mode=filter_code, filter_threshold=threshold,
                         vocab_order=vocab_order, deterministic=opts.deterministic,
                         scratch_bytes=opts.scratch_bytes, **shared)
    return _into_accumulator(grads, d_weight_accumulator)


def _into_accumulator(grads, d_weight_accumulator: torch.Tensor | None):
    d_hidden, d_weight, d_bias = grads
    if d_weight_accumulator is not None and d_weight is not None:
        d_weight_accumulator.add_(d_weight)
        d_weight = None
    return d_hidden, d_weight, d_bias


class TritonShard:
    """The Triton kernels on one shard: an engine ``ShardStrategy``."""

    # The token walk's plan and per-chunk state (fused_lce/token_walk.py).
    plan_forward_gradients = staticmethod(plan_forward_gradients)
    gradient_chunks = staticmethod(triton_gradient_chunks)
    scale_ = staticmethod(scale_unless_one_)

    @staticmethod
    def statistics(inputs: ShardInputs):
        opts = inputs.opts
        rows = prepare_rows(inputs.target, opts.ignore_index)
        filter_code, _ = filter_settings(opts, inputs.hidden.dtype, 1, inputs.hidden.device)
        stats = shard_statistics(
            inputs.hidden, inputs.weight, inputs.bias, inputs.target, rows, opts,
            vocab_start=inputs.vocab_start, want_col_sum=use_vocab_sort(opts, filter_code),
        )
        state = TritonShardState(rows, stats.col_sum, stats.kept)
        return state, ShardStatistics(stats.max, stats.sum_exp, stats.row_sum, stats.target_logit)

    @staticmethod
    def backward(state: TritonShardState, inputs: ShardInputs, request: ShardGradRequest):
        kept, state.kept = state.kept, None  # freed with G at the end of this backward
        target_local = local_targets(
            inputs.target, state.rows.valid, inputs.vocab_start, inputs.weight.shape[0]
        )
        return shard_backward(
            inputs.hidden, inputs.weight, inputs.bias, target_local, state.rows, request.lse,
            request.coefs, state.col_sum, inputs.opts, inputs.num_classes, request.needs,
            d_hidden_dtype=request.d_hidden_dtype,
            d_weight_accumulator=request.d_weight_accumulator, kept=kept,
        )

    @staticmethod
    def recompute_state(inputs: ShardInputs) -> TritonShardState:
        """What ``backward`` needs where the forward computed gradients (and they do not apply)."""
        return TritonShardState(prepare_rows(inputs.target, inputs.opts.ignore_index), None, None)


@dataclass
class TritonShardState:
    """What the forward leaves for the backward besides the saved tensors."""

    rows: RowOrder
    col_sum: torch.Tensor | None  # (V_local,) for vocab sorting
    kept: KeptLogits | None  # the forward's logits (keeps_logits), consumed by the backward
