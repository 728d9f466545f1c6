"""One autograd Function for the loss of every impl (cce and chunked), on one weight shard, alone
(TP=1) or with its peers (TP=N).

A call holds a shard ``[vocab_start, vocab_start + local_classes)`` of the classifier; on one
device the shard is the whole weight. The caller passes a ``ShardStrategy`` (the contract is
fused_lce/shard.py's): the Triton kernels (fused_lce/triton_shard.py's ``TritonShard``) or
chunked PyTorch (fused_lce/chunked.py's ``ChunkedShard``); a rank that holds only vocabulary
padding uses ``EmptyShard``. Either the forward asks the strategy for the shard's per-row
statistics and the backward for the shard's gradients, or, where the strategy plans it, the
forward walks token chunks and computes the gradients at once (fused_lce/token_walk.py; the
backward then scales them or, where the upstream gradient is not the assumed one
(fused_lce/upstream.py), recomputes). Statistics are combined across ranks through a
``ShardReducer`` and the loss is formed with ``terms``. What differs between TP=1 and TP=N is
only the reducer: ``LOCAL`` is the identity, parallel/comm.py's ``GroupReducer`` talks to the
other ranks. Nothing in this package imports torch.distributed, and this module imports no
strategy: they are passed in.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import faults, graphs, token_walk
from .shard import (
    EmptyShard,
    ShardCall,
    ShardGradRequest,
    ShardInputs,
    compute_dtype,
    global_statistics,
)
from .stored_gradients import (
    main_grad_protocol,
    pad_rows,
    scale_stored_gradients,
    scaled_gradients,
    verdict_stays_on_device,
    with_main_grad,
)
from .terms import (
    grad_coefficients,
    loss_gradient_per_token,
    reduce_tokens,
    refuse_double_backward,
    refuse_function_transforms,
    token_loss,
)
from .upstream import (
    assumed_token_grad,
    mismatch_found,
    poisoned_scale,
    upstream_scale,
    warn_recompute,
)


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
        n_rows = call.reducer.gathered_rows(input)
        plan = token_walk.token_walk_plan(call, n_rows, weight, input, needs)

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
        lse, nll, row_sum = token_walk.lse_nll(global_statistics(stats, call.reducer))
    elif not any(needs):
        # Evaluation walks the chunks training walks, with the same kernels, so a batch's
        # loss is the same number in both; it only skips the gradients.
        (lse, nll, row_sum), _ = token_walk.walk_token_chunks(
            strategy, inputs, call, plan, needs, input.dtype, assumed=None
        )
    else:
        # What the forward builds G with, kept for the backward's check: a copy, so a caller
        # that edits loss_mask in place after the forward is still checked against what was
        # assumed, and recomputed exactly where that no longer holds.
        assumed = assumed_token_grad(valid, n_valid, opts.reduction, loss_mask,
                                     compute_dtype(input.dtype))
        (lse, nll, row_sum), grads = token_walk.walk_token_chunks(
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


def _check_targets(target: torch.Tensor, call: ShardCall) -> torch.Tensor:
    """The call's verdict on its targets, combined across ranks, counted in the device's fault
    register: a (1,) bool tensor, true where a target lies outside [0, num_classes)."""
    extremes = faults.target_extremes(target, call.opts.ignore_index)
    if call.reducer.world_size > 1:
        extremes = call.reducer.all_reduce_max_(extremes)
    return faults.record_bad_targets(extremes, call.num_classes, call.opts.ignore_index,
                                     call.caller)
