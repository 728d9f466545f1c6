"""One autograd Function for the loss of every impl (cce and chunked), on one weight shard, alone
(TP=1) or with its peers (TP=N).

A call holds a shard ``[vocab_start, vocab_start + local_classes)`` of the classifier; on one
device the shard is the whole weight. The caller passes a ``ShardStrategy``: the Triton kernels
(fused_lce/triton_shard.py's ``TritonShard``) or chunked PyTorch (fused_lce/chunked.py's
``ChunkedShard``); a rank that holds only vocabulary padding uses ``EmptyShard``. Either the
forward asks the strategy for the shard's per-row statistics and the backward for the shard's
gradients, or, where the strategy plans it, the forward walks token chunks and computes the
gradients at once (fused_lce/forward_grad.py; the backward then scales them or, where the
upstream gradient is not the assumed one, recomputes). Statistics are combined across ranks
through a ``ShardReducer`` and the loss is formed with ``terms``. What differs between TP=1 and
TP=N is only the reducer: ``LOCAL`` here is the identity, parallel/comm.py's ``GroupReducer``
talks to the other ranks. Nothing in this package imports torch.distributed, and this module
imports no strategy: they are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from . import faults, graphs
from .forward_grad import (
    ForwardGradPlan,
    assumed_token_grad,
    mismatch_found,
    poisoned_scale,
    upstream_scale,
    warn_recompute,
)
from .fp32_products import scale_in_fp32_
from .options import LCEOptions
from .softmax_merge import softmax_shift
from .stored_gradients import (
    main_grad_protocol,
    pad_rows,
    scale_stored_gradients,
    scaled_gradients,
    verdict_stays_on_device,
    with_main_grad,
)
from .terms import (
    GradCoefficients,
    grad_coefficients,
    loss_gradient_per_token,
    lse_and_nll,
    reduce_tokens,
    refuse_double_backward,
    refuse_function_transforms,
    token_loss,
)


class ShardReducer(Protocol):
    """What the loss needs from the other ranks holding the rest of the vocabulary."""

    world_size: int

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def gather_input(self, input: torch.Tensor) -> torch.Tensor:
        """Every token's hidden state (N, D) from this rank's ``input`` (with SP, a shard)."""
        ...

    def gathered_rows(self, input: torch.Tensor) -> int:
        """N, the rows ``gather_input`` gives, without gathering."""
        ...

    def reduce_input_grad(self, d_hidden: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of the partial input gradients, this rank's rows of it."""
        ...


class LocalReducer:
    """One device: every reduction is the identity."""

    world_size = 1

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_input(self, input: torch.Tensor) -> torch.Tensor:
        return flat_rows(input)

    def gathered_rows(self, input: torch.Tensor) -> int:
        return flat_rows(input).shape[0]

    def reduce_input_grad(self, d_hidden: torch.Tensor) -> torch.Tensor:
        return d_hidden


LOCAL = LocalReducer()


def flat_rows(input: torch.Tensor) -> torch.Tensor:
    """(..., D) as (N, D); not reshape(-1, D): with D = 0 the -1 is ambiguous."""
    n_rows = 1
    for size in input.shape[:-1]:
        n_rows *= size
    return input.reshape(n_rows, input.shape[-1])


@dataclass(frozen=True)
class ShardCall:
    """What is fixed for one call: the options, the strategy, the shard's place and how to reach
    the others."""

    opts: LCEOptions
    strategy: ShardStrategy  # the same on every rank (a rank without classes: EmptyShard)
    vocab_start: int
    local_classes: int  # real classes in this shard (rows past it are vocabulary padding)
    num_classes: int  # classes over every shard
    reducer: ShardReducer = LOCAL
    weight_grad_accumulator: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None  # "none": what the caller multiplies the losses by
    # Check the targets against [0, num_classes) on the device (fused_lce/faults.py).
    check_targets: bool = False
    caller: str = "linear_cross_entropy(impl='cce')"  # named by the double-backward refusal
    # Whether autograd records the call, read before apply: inside forward grad mode is off,
    # and needs_input_grad does not see torch.no_grad().
    grad_enabled: bool = True


@dataclass
class ShardInputs:
    """One shard's view of the call, as every shard strategy takes it."""

    hidden: torch.Tensor  # (N, D), every token
    weight: torch.Tensor  # (V_local, D), real classes only
    bias: torch.Tensor | None  # (V_local,)
    target: torch.Tensor  # (N,) global class ids
    opts: LCEOptions
    vocab_start: int
    num_classes: int


@dataclass
class ShardGradRequest:
    """What the backward asks of a shard: gradients against the global lse."""

    lse: torch.Tensor  # (N,) fp32, global
    coefs: GradCoefficients
    needs: tuple[bool, bool, bool]  # (hidden, weight, bias)
    d_hidden_dtype: torch.dtype  # fp32 when partials are summed across ranks
    d_weight_accumulator: torch.Tensor | None  # fp32, the shard's rows; gradient added into it


class ShardStatistics(NamedTuple):
    """Per-row statistics of one shard, (N,) fp32; ignored rows hold max=-inf, sum_exp=0."""

    row_max: torch.Tensor
    sum_exp: torch.Tensor  # sum of exp(logit - row_max)
    row_sum: torch.Tensor | None  # sum of logits (label smoothing)
    target_logit: torch.Tensor  # 0 where another shard owns the target


class GradientChunks(Protocol):
    """One call's walk over token chunks with gradients in the forward: (with
    ``ForwardGradPlan.exponentials``) ``target_logits`` once, then per chunk ``compute_logits``,
    ``statistics`` and (with the global lse) ``gradients``; ``finish`` once at the end. It keeps
    the chunk's logits between the calls."""

    def target_logits(self) -> torch.Tensor:
        """Every row's target logit, 0 where another shard owns the target (summed across shards
        into ``compute_logits``' offsets)."""
        ...

    def compute_logits(self, rows: slice, offsets: torch.Tensor | None = None) -> None: ...

    def statistics(self, rows: slice) -> ShardStatistics: ...

    def gradients(self, rows: slice, lse: torch.Tensor, coefs: GradCoefficients) -> None: ...

    def finish(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(d_hidden, d_weight, d_bias) for the assumed upstream gradient, None where not
        needed."""
        ...


class ShardStrategy(Protocol):
    """How one shard's statistics and gradients are computed: every strategy implements all of
    it, and the engine calls nothing else."""

    def plan_forward_gradients(self, opts: LCEOptions, n_rows: int, weight_rows: int,
                               d_model: int, elem_bytes: int, wants_weight_grad: bool,
                               dtype: torch.dtype | None = None) -> ForwardGradPlan | None:
        """The token walk's plan, or None for statistics now and gradients in the backward."""
        ...

    def statistics(self, inputs: ShardInputs) -> tuple[Any, ShardStatistics]:
        """(state for ``backward``, the shard's statistics)."""
        ...

    def backward(self, state: Any, inputs: ShardInputs, request: ShardGradRequest):
        """(d_hidden partial, d_weight, d_bias) of the shard against the global lse."""
        ...

    def recompute_state(self, inputs: ShardInputs) -> Any:
        """What ``backward`` needs where the forward walked instead of taking statistics."""
        ...

    def gradient_chunks(self, inputs: ShardInputs, plan: ForwardGradPlan, needs,
                        d_hidden_dtype: torch.dtype) -> GradientChunks: ...

    def scale_(self, tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``tensor *= scale`` in place, ``scale`` a one-element device tensor (never read by the
        host)."""
        ...


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16/32-bit inputs, fp64 for fp64: the dtype of every per-token vector."""
    return torch.promote_types(dtype, torch.float32)


def _empty_statistics(inputs: ShardInputs, n_rows: int) -> ShardStatistics:
    """What ``n_rows`` rows see of a shard without classes: max -inf, nothing to add."""
    zeros = torch.zeros((n_rows,), dtype=torch.float32, device=inputs.hidden.device)
    row_sum = zeros if inputs.opts.label_smoothing > 0 else None
    return ShardStatistics(torch.full_like(zeros, float("-inf")), zeros, row_sum, zeros)


class EmptyShard:
    """A shard with no real classes (only vocabulary padding): it adds nothing, but takes part
    in every collective like the others, following the plan of the group's strategy."""

    @staticmethod
    def plan_forward_gradients(opts, n_rows, weight_rows, d_model, elem_bytes, wants_weight_grad,
                               dtype=None):
        return None  # never asked: the engine plans with the group's strategy (ShardCall)

    scale_ = staticmethod(scale_in_fp32_)

    @staticmethod
    def statistics(inputs: ShardInputs):
        return None, _empty_statistics(inputs, inputs.hidden.shape[0])

    @staticmethod
    def backward(state, inputs: ShardInputs, request: ShardGradRequest):
        hidden, weight, bias = inputs.hidden, inputs.weight, inputs.bias
        d_hidden = torch.zeros(hidden.shape, dtype=request.d_hidden_dtype, device=hidden.device)
        d_weight = (None if request.d_weight_accumulator is not None
                    else weight.new_zeros(weight.shape))
        d_bias = None if bias is None else bias.new_zeros(bias.shape)
        return d_hidden, d_weight, d_bias

    @staticmethod
    def recompute_state(inputs: ShardInputs):
        return None

    @staticmethod
    def gradient_chunks(inputs: ShardInputs, plan: ForwardGradPlan, needs, d_hidden_dtype):
        return EmptyGradientChunks(inputs, needs, d_hidden_dtype)


class EmptyGradientChunks:
    """The empty shard in the gradient-in-forward walk: no statistics, zero gradients."""

    def __init__(self, inputs: ShardInputs, needs, d_hidden_dtype):
        self.inputs, self.needs, self.d_hidden_dtype = inputs, needs, d_hidden_dtype

    def target_logits(self) -> torch.Tensor:
        hidden = self.inputs.hidden
        return torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)

    def compute_logits(self, rows: slice, offsets: torch.Tensor | None = None) -> None:
        pass

    def statistics(self, rows: slice) -> ShardStatistics:
        return _empty_statistics(self.inputs, self._rows(rows))

    def _rows(self, rows: slice) -> int:
        return len(range(*rows.indices(self.inputs.hidden.shape[0])))

    def gradients(self, rows: slice, lse, coefs) -> None:
        pass

    def finish(self):
        request = ShardGradRequest(None, None, self.needs, self.d_hidden_dtype, None)
        d_hidden, d_weight, d_bias = EmptyShard.backward(None, self.inputs, request)
        return (d_hidden if self.needs[0] else None, d_weight if self.needs[1] else None,
                d_bias if self.needs[2] else None)


def global_statistics(stats: ShardStatistics, reducer) -> ShardStatistics:
    """The statistics over every shard: one MAX for the shift, one SUM for what adds up."""
    if reducer.world_size == 1:
        return stats
    # softmax_merge.merge_partials across ranks: the MAX collective, then softmax_shift's rule.
    shift = softmax_shift(reducer.all_reduce_max_(stats.row_max.clone()))
    packed = [stats.sum_exp * torch.exp(stats.row_max - shift), stats.target_logit]
    if stats.row_sum is not None:
        packed.append(stats.row_sum)
    packed = reducer.all_reduce_sum_(torch.stack(packed).float())
    row_sum = packed[2] if stats.row_sum is not None else None
    return ShardStatistics(shift, packed[0], row_sum, packed[1])


def _shard_inputs(hidden, weight, bias, target, call: ShardCall) -> ShardInputs:
    local = call.local_classes
    return ShardInputs(
        hidden=hidden,
        weight=weight[:local],
        bias=None if bias is None else bias[:local],
        target=target,
        opts=call.opts,
        vocab_start=call.vocab_start,
        num_classes=call.num_classes,
    )


class LCEFunction(torch.autograd.Function):
    """(loss, lse) of ``input`` (..., D) against this rank's weight shard (V_rows, D).

    Inputs are validated by the caller; ``target`` holds int32 or int64 global class ids.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, target, call: ShardCall):
        flat_target = target.reshape(-1)
        strategy = call.strategy if call.local_classes > 0 else EmptyShard
        needs = tuple(call.grad_enabled and need for need in ctx.needs_input_grad[:3])
        plan = _token_walk_plan(call, call.reducer.gathered_rows(input), weight, input, needs)

        def forward_values(input, target, loss_mask):
            return _forward_values(input, weight, bias, target, loss_mask, call, strategy, plan,
                                   needs)

        ctx.lease = None
        replayed = None
        if plan is not None and any(needs) and graphs.applies(input.device, call.opts.cuda_graphs):
            # The training walk, captured once per key and replayed (fused_lce/graphs.py).
            walk = graphs.captured_walk(_graph_key(call, input, weight, bias, flat_target, needs))
            replayed = walk.run((input, flat_target, call.loss_mask), forward_values)
        if replayed is None:
            values = forward_values(input, flat_target, call.loss_mask)
            loss, lse = values.loss, values.lse
        else:
            values, ctx.lease = replayed
            loss, lse = values.loss.clone(), values.lse.clone()  # the next replay rewrites them
        if values.fault is not None:
            # Reads only the register's host copy: on the CPU this call's own verdict.
            faults.raise_found(loss.device)
        ctx.fault, ctx.state = values.fault, values.state
        ctx.assumed, ctx.forward_grads = values.assumed, values.grads
        ctx.save_for_backward(input, weight, bias, flat_target, values.lse, values.nll,
                              values.n_valid)
        ctx.strategy, ctx.call, ctx.device_type = strategy, call, input.device.type
        ctx.weight_param = weight if call.weight_grad_accumulator is not None else None
        ctx.set_materialize_grads(False)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        # A backward called under autocast must not recast the op's own products.
        device_type = ctx.device_type
        try:
            if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
                with torch.autocast(device_type, enabled=False):
                    return LCEFunction._backward(ctx, grad_loss, grad_lse)
            return LCEFunction._backward(ctx, grad_loss, grad_lse)
        finally:
            # A replayed forward's slot: every read of it is queued by now.
            if ctx.lease is not None:
                ctx.lease.release()

    @staticmethod
    def _backward(ctx, grad_loss, grad_lse):
        call: ShardCall = ctx.call
        refuse_double_backward(call.caller)
        refuse_function_transforms(call.caller, grad_loss, grad_lse)
        input, weight, bias, target, lse, nll, n_valid = ctx.saved_tensors
        opts = call.opts
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        if grad_loss is None and grad_lse is None:
            return None, None, None, None, None
        if ctx.forward_grads is not None:
            grads, ctx.forward_grads = ctx.forward_grads, None
            if grad_lse is None and grad_loss is not None and verdict_stays_on_device(opts):
                # Only what the backward graph reads: a capture must not keep the call alive.
                strategy, assumed, fault = ctx.strategy, ctx.assumed, ctx.fault
                like_input = (input.dtype, input.shape)

                def scaled(grad_loss, target=target):
                    return scale_stored_gradients(call, strategy, grads, assumed, fault, target,
                                                  grad_loss, like_input, weight, bias, needs)

                out = None
                if ctx.lease is not None:
                    # A replayed forward: its backward replays too, reading the slot's static
                    # target (fused_lce/graphs.py).
                    slot = ctx.lease.slot
                    key = (graphs.tensor_key(grad_loss), needs,
                           graphs.tensor_key(call.weight_grad_accumulator, address=True))
                    out = slot.backward(key, (grad_loss,),
                                        lambda grad_loss: scaled(grad_loss, slot.static[1]))
                if out is None:
                    out = scaled(grad_loss)
                return (*with_main_grad(ctx, out, weight, needs), None, None)
            valid = target != opts.ignore_index
            scale, mismatch = upstream_scale(grad_loss, grad_lse, ctx.assumed, valid,
                                             opts.reduction)
            if mismatch is not None:
                # Every rank must take the same path (the two differ in their collectives): the
                # ranks' verdicts are combined on the device, then read once (one host sync).
                if call.reducer.world_size > 1:
                    mismatch = call.reducer.all_reduce_max_(mismatch)
                if mismatch_found(mismatch):
                    scale = None
            if scale is not None and ctx.fault is not None:
                scale = poisoned_scale(scale, ctx.fault)
            if scale is not None:
                out = scaled_gradients(call, ctx.strategy, grads, scale,
                                        (input.dtype, input.shape), weight, bias, needs)
                return (*with_main_grad(ctx, out, weight, needs), None, None)
            warn_recompute(call.caller)
            del grads
        valid = target != opts.ignore_index
        hidden = call.reducer.gather_input(input)
        n_rows = hidden.shape[0]
        zero = torch.zeros_like(lse)
        g = zero
        if grad_loss is not None:
            g = loss_gradient_per_token(grad_loss, n_rows, n_valid, opts.reduction, lse.dtype)
        g = torch.where(valid, g, zero)
        if ctx.fault is not None:
            g = torch.where(ctx.fault.reshape(()), torch.nan, g)
        if grad_lse is not None:
            grad_lse = torch.where(valid, grad_lse.reshape(n_rows).to(lse.dtype), zero)
        coefs = grad_coefficients(g, lse, nll, grad_lse, call.num_classes, opts)

        inputs = _shard_inputs(hidden, weight, bias, target, call)
        state = ctx.state if ctx.state is not None else ctx.strategy.recompute_state(inputs)
        accumulator = call.weight_grad_accumulator
        shard_acc = (None if accumulator is None or not needs[1]
                     else accumulator[: call.local_classes])
        request = ShardGradRequest(lse, coefs, needs, _partial_dtype(call, input), shard_acc)
        d_hidden, d_shard_w, d_shard_b = ctx.strategy.backward(state, inputs, request)
        del hidden, inputs  # under SP a gathered copy: free it before the reduce-scatter

        d_input = None
        if needs[0]:
            d_input = call.reducer.reduce_input_grad(d_hidden)
            d_input = d_input.to(input.dtype).reshape(input.shape)
        d_weight = None
        if needs[1] and accumulator is None:
            d_weight = pad_rows(d_shard_w, weight)
        elif needs[1]:
            d_weight = main_grad_protocol(ctx.weight_param, weight)
        d_bias = pad_rows(d_shard_b, bias) if needs[2] and bias is not None else None
        return d_input, d_weight, d_bias, None, None


class ForwardValues(NamedTuple):
    """What a forward computes on the device: the loss and lse it returns, what its backward
    reads, and (training walk) the gradients for the upstream gradient it assumed."""

    loss: torch.Tensor
    lse: torch.Tensor
    nll: torch.Tensor
    n_valid: torch.Tensor
    fault: torch.Tensor | None  # the target check's verdict, (1,) bool
    assumed: torch.Tensor | None  # the per-token upstream gradient the gradients are for
    grads: tuple | None  # (d_hidden, d_weight, d_bias)
    state: Any  # the strategy's, for a backward that recomputes


def _forward_values(input, weight, bias, target, loss_mask, call: ShardCall, strategy, plan,
                    needs) -> ForwardValues:
    """The forward's device work, host reads excluded: what fused_lce/graphs.py captures."""
    opts = call.opts
    hidden = call.reducer.gather_input(input)
    inputs = _shard_inputs(hidden, weight, bias, target, call)
    valid = target != opts.ignore_index
    n_valid = valid.sum()
    fault = _check_targets(target, call) if call.check_targets else None
    state = assumed = grads = None
    if plan is None:
        state, stats = strategy.statistics(inputs)
        lse, nll, row_sum = _lse_nll(global_statistics(stats, call.reducer))
    elif not any(needs):
        # Evaluation walks the chunks training walks, with the same kernels, so a batch's
        # loss is the same number in both; it only skips the gradients.
        (lse, nll, row_sum), _ = _walk_token_chunks(
            strategy, inputs, call, plan, needs, input.dtype, assumed=None
        )
    else:
        # What the forward builds G with, kept for the backward's check: a copy, so a caller
        # that edits loss_mask in place after the forward is still checked against what was
        # assumed, and recomputed exactly where that no longer holds.
        assumed = assumed_token_grad(valid, n_valid, opts.reduction, loss_mask,
                                     compute_dtype(input.dtype))
        (lse, nll, row_sum), grads = _walk_token_chunks(
            strategy, inputs, call, plan, needs, _partial_dtype(call, input), assumed
        )
    loss = token_loss(nll, lse, row_sum, call.num_classes, opts)
    zero = torch.zeros_like(loss)
    loss = torch.where(valid, loss, zero)
    lse = torch.where(valid, lse, zero)
    nll = torch.where(valid, nll, zero)
    loss = reduce_tokens(loss, n_valid, opts.reduction)
    if fault is not None:
        loss = torch.where(fault.reshape(()), torch.nan, loss)
    return ForwardValues(loss, lse, nll, n_valid, fault, assumed, grads, state)


def _graph_key(call: ShardCall, input, weight, bias, target, needs) -> tuple:
    """Everything a captured training forward fixes (fused_lce/graphs.py): a call that differs
    in any of it is another graph."""
    reducer = call.reducer
    return (
        input.device,
        torch.cuda.current_stream(input.device).cuda_stream if input.is_cuda else None,
        call.opts, call.strategy, call.vocab_start, call.local_classes, call.num_classes,
        id(getattr(reducer, "group", None)), reducer.world_size,
        getattr(reducer, "sequence_parallel", False), call.check_targets, call.caller, needs,
        graphs.tensor_key(call.loss_mask), graphs.tensor_key(input), graphs.tensor_key(target),
        graphs.tensor_key(weight, address=True), graphs.tensor_key(bias, address=True),
    )


def _partial_dtype(call: ShardCall, input: torch.Tensor) -> torch.dtype:
    """Partial input gradients are summed across ranks in fp32 (fp64 for fp64 inputs); alone, a
    rank's is the answer."""
    return compute_dtype(input.dtype) if call.reducer.world_size > 1 else input.dtype


def _token_walk_plan(call: ShardCall, n_rows: int, weight, input, needs
                     ) -> ForwardGradPlan | None:
    """The gradient-in-forward plan, where the strategy has one: training walks it computing
    gradients, evaluation (no gradient wanted) computing only the statistics. Decided by the
    group's strategy from what every rank shares (the padded shard's rows), so every rank walks
    the same chunks, a rank of vocabulary padding too."""
    opts = call.opts
    if opts.reduction == "none" and call.loss_mask is None and opts.upstream_mismatch == "auto":
        return None  # no mask to assume: the recomputing backward is exact for any upstream
    # Evaluation plans as training with every gradient wanted, so it walks the same chunks.
    wants_weight_grad = needs[1] or not any(needs)
    return call.strategy.plan_forward_gradients(
        call.opts, n_rows, weight.shape[0], input.shape[-1], input.element_size(),
        wants_weight_grad, input.dtype,
    )


def _lse_nll(stats: ShardStatistics, out: tuple | None = None):
    """(lse, nll, row_sum) per token from the global statistics, into ``out``'s three vectors
    where given (row_sum's may be None)."""
    lse, nll = lse_and_nll(stats.row_max, stats.sum_exp, stats.target_logit,
                           None if out is None else out[:2])
    row_sum = stats.row_sum
    if out is not None and row_sum is not None:
        row_sum = out[2].copy_(row_sum)
    return lse, nll, row_sum


def _walk_token_chunks(strategy, inputs: ShardInputs, call: ShardCall, plan, needs,
                       d_hidden_dtype, assumed):
    """((lse, nll, row_sum), (d_hidden, d_weight, d_bias) for the per-token upstream gradient
    ``assumed``), token chunk by token chunk: fused_lce/forward_grad.py. With ``assumed`` None
    (evaluation) only the statistics. Per token it keeps only lse, nll and the row sum: under a
    tight budget the chunk buffer and these are its memory."""
    n_rows = inputs.hidden.shape[0]
    opts = call.opts
    chunks = strategy.gradient_chunks(inputs, plan, needs, d_hidden_dtype)
    # Every chunk's offsets in one launch and one collective, ahead of the walk.
    offsets = (call.reducer.all_reduce_sum_(chunks.target_logits()) if plan.exponentials
               else None)
    kept = None
    for start in range(0, n_rows, plan.chunk_rows):
        rows = slice(start, min(n_rows, start + plan.chunk_rows))
        chunks.compute_logits(rows, None if offsets is None else offsets[rows])
        stats = global_statistics(chunks.statistics(rows), call.reducer)
        if kept is None:
            kept = tuple(None if x is None else x.new_empty(n_rows)
                         for x in (stats.sum_exp, stats.sum_exp, stats.row_sum))
        lse, nll, row_sum = _lse_nll(stats, tuple(None if x is None else x[rows] for x in kept))
        if assumed is not None:
            coefs = grad_coefficients(assumed[rows], lse, nll, None, call.num_classes, opts)
            chunks.gradients(rows, lse, coefs)
    return kept, chunks.finish()


def _check_targets(target: torch.Tensor, call: ShardCall) -> torch.Tensor:
    """The call's verdict on its targets, combined across ranks, counted in the device's fault
    register: a (1,) bool tensor, true where a target lies outside [0, num_classes)."""
    extremes = faults.target_extremes(target, call.opts.ignore_index)
    if call.reducer.world_size > 1:
        extremes = call.reducer.all_reduce_max_(extremes)
    return faults.record_bad_targets(extremes, call.num_classes, call.opts.ignore_index,
                                     call.caller)
