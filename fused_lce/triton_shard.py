"""The cce impl: the Triton kernels and cuBLAS as an engine ``ShardStrategy`` (``TritonShard``).

By default the engine walks token chunks with gradients in the forward: for bf16 with
``ExpGradientChunks`` (the exp_logits GEMM stores exponentials, cuBLAS gradients), else with
``TritonGradientChunks`` (cuBLAS logits, the logit_rows kernels, cuBLAS gradients). Where it does
not walk, the forward saves (lse, a few (N,) vectors) and the backward recomputes:
``prepare_rows`` orders the tokens, ``shard_statistics`` runs the forward kernel on one weight
shard and ``shard_backward`` the backward. ``TritonShard`` serves one device and the
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
from .engine import ShardGradRequest, ShardInputs, ShardStatistics
from .forward_grad import ForwardGradPlan, plan_forward_gradients
from .fp32_products import accumulate_mm, accumulate_mv, mm_into
from .kernels.common import INTERPRET
from .kernels.exp_logits import exp_logits, partial_count, repair_exponentials, target_logits
from .kernels.exp_logits_grad import add_target_rows, finish_input_grad, row_scales
from .kernels.gemm_backward import lce_backward_gemm
from .kernels.logit_rows import grad_in_place, row_statistics
from .kernels.lse_forward import KeptLogits, LSEStats, lse_forward
from .kernels.scale import scale_unless_one_
from .kernels.tiles_backward import lce_backward
from .options import LCEOptions
from .terms import GradCoefficients


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


def local_targets(
    target: torch.Tensor, valid: torch.Tensor, vocab_start: int, n_local: int
) -> torch.Tensor:
    """Targets as rows of this shard's weight, -1 where another shard (or nobody) owns them."""
    local = target - vocab_start
    owned = valid & (local >= 0) & (local < n_local)
    return torch.where(owned, local, torch.full_like(local, -1)).to(torch.int32)


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
        _unit_stride(bias),
        rows.order,
        rows.n_valid,
        target=_unit_stride(target),
        vocab_start=vocab_start,
        softcap=opts.softcap,
        want_row_sum=opts.label_smoothing > 0,
        want_col_sum=want_col_sum,
        round_16bit=opts.rounds_logits(hidden.dtype),
        keep_logits=keeps_logits(opts),
        tma=opts.tma_allowed,
    )


def _unit_stride(vector: torch.Tensor | None) -> torch.Tensor | None:
    """A per-row or per-column vector as the kernels read it (``ptr + i``)."""
    return None if vector is None else vector.contiguous()


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
    bias = _unit_stride(bias)
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

    plan_forward_gradients = staticmethod(plan_forward_gradients)
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

    @staticmethod
    def gradient_chunks(inputs: ShardInputs, plan: ForwardGradPlan, needs, d_hidden_dtype):
        if plan.exponentials:
            return ExpGradientChunks(inputs, plan, needs, d_hidden_dtype)
        return TritonGradientChunks(inputs, plan, needs, d_hidden_dtype)


class _ChunkGradients:
    """What both Triton walks accumulate over the chunks, and how they hand it over: the input
    gradient's rows, the weight gradient (fp32 past two chunks) and the bias gradient (fp32)."""

    def __init__(self, inputs: ShardInputs, plan: ForwardGradPlan, needs, d_hidden_dtype):
        hidden, weight, bias = inputs.hidden, inputs.weight, inputs.bias
        self.inputs = inputs
        self.bias = _unit_stride(bias)
        self.buffer = None  # the chunk's logits (or exponentials), one chunk at a time
        device, n_rows, d_model = hidden.device, hidden.shape[0], hidden.shape[1]
        want_hidden, want_weight, want_bias = needs
        self.d_hidden = (torch.empty((n_rows, d_model), device=device, dtype=d_hidden_dtype)
                         if want_hidden else None)
        self.d_weight = None
        if want_weight:
            acc_dtype = torch.float32 if plan.fp32_weight_accumulator else weight.dtype
            self.d_weight = torch.empty(weight.shape, device=device, dtype=acc_dtype)
        self.d_bias = (torch.zeros(weight.shape[0], device=device, dtype=torch.float32)
                       if want_bias and bias is not None else None)
        self.first_chunk = True

    def finish(self):
        """(d_hidden, d_weight, d_bias) for an upstream gradient of 1; frees the buffer."""
        self.buffer = None
        d_weight = self.d_weight
        if d_weight is not None and d_weight.dtype != self.inputs.weight.dtype:
            d_weight = d_weight.to(self.inputs.weight.dtype)
        d_bias = self.d_bias
        if d_bias is not None:
            d_bias = d_bias.to(self.inputs.bias.dtype)
        return self.d_hidden, d_weight, d_bias


class ExpGradientChunks(_ChunkGradients):
    """The gradient-in-forward walk on one shard for bf16 inputs (kernels/exp_logits.py): the
    GEMM's epilogue stores a token chunk's exponentials offset by the target logits, with their
    row sums, and cuBLAS takes them as they are for both gradients, scaling rows of the other
    operand and of the output. Nothing rereads the chunk to normalise it. The target columns'
    terms of the weight and bias gradients are added once, after the last chunk: one sort and
    one launch a call, and one rounding of a 16-bit weight gradient.

    Its temporaries live in memory idle at the time: the per-tile sums, then the weight
    gradient's scaled operand, in the chunk's rows of the input gradient, which only the
    chunk's last GEMM writes. So the walk holds what the two-pass walk held: one chunk buffer.
    """

    def __init__(self, inputs: ShardInputs, plan: ForwardGradPlan, needs, d_hidden_dtype):
        super().__init__(inputs, plan, needs, d_hidden_dtype)
        hidden, weight = inputs.hidden, inputs.weight
        self.opts = inputs.opts
        # Evaluation (no gradient wanted) stores nothing: the epilogue's sums are the loss.
        self.buffer = (torch.empty((plan.chunk_rows, weight.shape[0]), device=hidden.device,
                                   dtype=hidden.dtype) if any(needs) else None)
        self.all_columns = None  # every row's target column (kernels/exp_logits.py's codes)
        self.columns = self.offsets = self.stats = None  # the current chunk's
        # Every row's target-column gradient, for the weight and bias gradients' target terms.
        self.target_grads = (torch.empty(hidden.shape[0], device=hidden.device,
                                         dtype=torch.float32)
                             if self.d_weight is not None or self.d_bias is not None else None)

    def target_logits(self) -> torch.Tensor:
        inputs, opts = self.inputs, self.opts
        logits, self.all_columns = target_logits(
            inputs.hidden, inputs.weight, self.bias, inputs.target,
            vocab_start=inputs.vocab_start, ignore_index=opts.ignore_index, softcap=opts.softcap,
            round_16bit=opts.rounds_logits(inputs.hidden.dtype),
        )
        return logits

    def compute_logits(self, rows: slice, offsets: torch.Tensor | None = None) -> None:
        """The chunk's exponentials into the buffer, against ``offsets``: the chunk's rows of
        every shard's sum of ``target_logits``."""
        inputs, opts = self.inputs, self.opts
        hidden = inputs.hidden[rows]
        self.columns, self.offsets = self.all_columns[rows], offsets
        out = None if self.buffer is None else self.buffer[: hidden.shape[0]]
        partials = self._idle(rows, torch.float32,
                              partial_count(hidden.shape[0], inputs.weight.shape[0],
                                            hidden.device))
        row_max, sum_exp, target_logit = exp_logits(
            hidden, inputs.weight, self.bias, self.columns, offsets, out, softcap=opts.softcap,
            round_16bit=opts.rounds_logits(hidden.dtype), partials=partials,
            tma=opts.tma_allowed,
        )
        self.stats = ShardStatistics(row_max, sum_exp, None, target_logit)

    def statistics(self, rows: slice) -> ShardStatistics:
        """The statistics of the chunk whose exponentials ``compute_logits`` stored; ignored
        rows get placeholders (lse and nll 0 on one shard)."""
        return self.stats

    def gradients(self, rows: slice, lse: torch.Tensor, coefs: GradCoefficients) -> None:
        """The chunk's share of every gradient, from its exponentials and per-row scales."""
        hidden, weight, opts = self.inputs.hidden[rows], self.inputs.weight, self.opts
        exps = self.buffer[: hidden.shape[0]]
        repair_exponentials(hidden, weight, self.bias, self.columns, self.offsets, lse, exps,
                            softcap=opts.softcap, round_16bit=opts.rounds_logits(hidden.dtype))
        scaled = None
        if self.d_weight is not None:
            n_rows, d_model = hidden.shape
            scaled = self._idle(rows, hidden.dtype, n_rows * d_model)
            scaled = (torch.empty_like(hidden, memory_format=torch.contiguous_format)
                      if scaled is None else scaled.view(n_rows, d_model))
        scale, target_grad = row_scales(
            hidden, lse, self.offsets, coefs.p_coef, coefs.target_grad, self.columns,
            softcap=opts.softcap, out=scaled,
            target_grad_out=None if self.target_grads is None else self.target_grads[rows])
        if self.d_weight is not None:
            # Before the input gradient's GEMM, which overwrites ``scaled``'s memory.
            if self.first_chunk:
                mm_into(self.d_weight, exps.t(), scaled)
            else:
                accumulate_mm(self.d_weight, exps.t(), scaled)
        if self.d_bias is not None:
            accumulate_mv(self.d_bias, exps.t(), scale)
        if self.d_hidden is not None:
            grad = self.d_hidden[rows]
            mm_into(grad, exps, weight)
            finish_input_grad(grad, weight, scale, target_grad, self.columns)
        self.first_chunk = False

    def finish(self):
        if self.target_grads is not None:
            add_target_rows(self.d_weight, self.inputs.hidden, self.target_grads,
                            self.all_columns, self.d_bias)
        return super().finish()

    def _idle(self, rows: slice, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        """``numel`` elements of ``dtype`` over the chunk's rows of the input gradient, or None
        where there is no such gradient or it is too small."""
        if self.d_hidden is None:
            return None
        flat = self.d_hidden[rows].reshape(-1).view(torch.uint8)
        start = -flat.data_ptr() % 16  # the GEMMs and kernels want aligned rows
        end = start + numel * dtype.itemsize
        return flat[start:end].view(dtype) if end <= flat.numel() else None


class TritonGradientChunks(_ChunkGradients):
    """The gradient-in-forward mode on one shard (fused_lce/forward_grad.py): cuBLAS writes a
    token chunk's logits into one buffer, the logit_rows kernels take their statistics and turn
    them into G in place, and cuBLAS consumes G for both gradients."""

    def __init__(self, inputs: ShardInputs, plan: ForwardGradPlan, needs, d_hidden_dtype):
        super().__init__(inputs, plan, needs, d_hidden_dtype)
        hidden, weight = inputs.hidden, inputs.weight
        self.plan = plan
        self.chunk_targets = None  # the current chunk's, as columns of this shard
        # Under Triton's interpreter (which truncates rather than rounds to 16 bits) the buffer
        # is fp32 holding torch-rounded 16-bit logits, and torch rounds G: the GPU's numerics.
        self.emulate_16bit = INTERPRET and hidden.element_size() < 4
        buffer_dtype = torch.float32 if self.emulate_16bit else hidden.dtype
        self.buffer = torch.empty((plan.chunk_rows, weight.shape[0]), device=hidden.device,
                                  dtype=buffer_dtype)

    def target_logits(self) -> torch.Tensor:
        raise NotImplementedError("this walk stores logits, not exponentials")

    def compute_logits(self, rows: slice, offsets: torch.Tensor | None = None) -> None:
        """The chunk's logits into the buffer (reads no target)."""
        hidden, weight = self.inputs.hidden[rows], self.inputs.weight
        logits = self.buffer[: hidden.shape[0]]
        if self.emulate_16bit:
            logits.copy_(hidden @ weight.t())
        else:
            torch.mm(hidden, weight.t(), out=logits)

    def statistics(self, rows: slice) -> ShardStatistics:
        """The statistics of the chunk whose logits ``compute_logits`` left in the buffer, which
        keeps them for ``gradients``."""
        inputs = self.inputs
        target = inputs.target[rows]
        self.chunk_targets = local_targets(target, target != inputs.opts.ignore_index,
                                           inputs.vocab_start, inputs.weight.shape[0])
        logits = self.buffer[: target.shape[0]]
        row_max, sum_exp, target_logit, row_sum = row_statistics(
            logits, self.bias, self.chunk_targets, inputs.opts.softcap,
            inputs.opts.label_smoothing > 0
        )
        return ShardStatistics(row_max, sum_exp, row_sum, target_logit)

    def gradients(self, rows: slice, lse: torch.Tensor, coefs: GradCoefficients) -> None:
        """G over the chunk's logits, then its share of every gradient."""
        hidden, weight = self.inputs.hidden[rows], self.inputs.weight
        logits = self.buffer[: hidden.shape[0]]
        grad = grad_in_place(logits, self.bias, self.chunk_targets, lse, coefs,
                             self.inputs.opts.softcap)
        if self.emulate_16bit:
            grad = grad.to(hidden.dtype)
        if self.d_hidden is not None:
            mm_into(self.d_hidden[rows], grad, weight)
        if self.d_weight is not None:
            if self.first_chunk:
                mm_into(self.d_weight, grad.t(), hidden)
            else:
                accumulate_mm(self.d_weight, grad.t(), hidden)
        if self.d_bias is not None:
            self.d_bias += grad.sum(dim=0, dtype=torch.float32)
        self.first_chunk = False


@dataclass
class TritonShardState:
    """What the forward leaves for the backward besides the saved tensors."""

    rows: RowOrder
    col_sum: torch.Tensor | None  # (V_local,) for vocab sorting
    kept: KeptLogits | None  # the forward's logits (keeps_logits), consumed by the backward
