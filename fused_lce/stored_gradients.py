"""The backward of the gradient-in-forward walk: the stored gradients scaled by the upstream
gradient, on the device.

The forward (fused_lce/token_walk.py) computed the gradients for an assumed upstream gradient;
the backward checks the actual one against it (fused_lce/upstream.py's ``upstream_scale``),
combines the ranks' verdicts, and scales the stored gradients by its scalar, or by NaN where the
check or the target check failed. Nothing here reads the device: a replayed forward's backward
captures this work as a CUDA graph (fused_lce/graphs.py). Where the verdict must be read on the
host (``upstream_mismatch="recompute"``) the engine reads it and recomputes instead.
"""

from __future__ import annotations

import torch

from . import faults
from .options import LCEOptions
from .upstream import poisoned_scale, upstream_scale


def verdict_stays_on_device(opts: LCEOptions) -> bool:
    """Whether the backward of stored gradients reads nothing on the host: a scalar loss, or a
    per-token one whose upstream check poisons rather than recomputes."""
    return opts.reduction != "none" or opts.upstream_mismatch != "recompute"


def scale_stored_gradients(call, strategy, grads, assumed, fault, target, grad_loss,
                            like_input, weight, bias, needs):
    """The forward's gradients for the actual upstream gradient, on the device only (what a
    replayed forward's backward graph captures): NaN where the upstream gradient is not a
    multiple of the assumed one on any rank (counted in the fault register) or the targets
    were bad."""
    valid = target != call.opts.ignore_index
    scale, mismatch = upstream_scale(grad_loss, None, assumed, valid, call.opts.reduction)
    if mismatch is not None:
        if call.reducer.world_size > 1:
            mismatch = call.reducer.all_reduce_max_(mismatch)
        scale = poisoned_scale(scale, mismatch)
        faults.record_mismatch(mismatch)
    if fault is not None:
        scale = poisoned_scale(scale, fault)
    return scaled_gradients(call, strategy, grads, scale, like_input, weight, bias, needs)


def scaled_gradients(call, strategy, grads, scale, like_input, weight, bias, needs):
    """The forward's gradients times the upstream ``scale`` (a device scalar, read by the kernels,
    never by the host), as the recompute path returns them, the input's in ``like_input``'s
    (dtype, shape); with a weight-gradient accumulator the weight's goes into it and its slot
    is None (``with_main_grad`` fills it)."""
    d_hidden, d_shard_w, d_shard_b = grads
    d_input = None
    if needs[0]:
        d_hidden = strategy.scale_(d_hidden, scale)
        d_input = call.reducer.reduce_input_grad(d_hidden).to(like_input[0]).reshape(like_input[1])
    d_weight = None
    accumulator = call.weight_grad_accumulator
    if needs[1] and accumulator is None:
        d_weight = pad_rows(strategy.scale_(d_shard_w, scale), weight)
    elif needs[1]:
        accumulator[: call.local_classes].addcmul_(d_shard_w, scale)
    d_bias = None
    if needs[2] and bias is not None:
        d_bias = pad_rows(strategy.scale_(d_shard_b, scale), bias)
    return d_input, d_weight, d_bias


def with_main_grad(ctx, grads, weight, needs):
    """``grads`` with the weight's gradient of Megatron's accumulator protocol, where the
    gradient went into an accumulator (host work, outside any graph)."""
    d_input, d_weight, d_bias = grads
    if needs[1] and ctx.call.weight_grad_accumulator is not None:
        d_weight = main_grad_protocol(ctx.weight_param, weight)
    return d_input, d_weight, d_bias


def main_grad_protocol(weight_param, weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's gradient once it went into the accumulator."""
    if hasattr(weight_param, "grad_added_to_main_grad"):
        # Megatron's protocol (tensor_parallel/layers.py): the real gradient is in main_grad
        # already; a dummy one lets its gradient hooks run, the flag tells them to skip it.
        weight_param.grad_added_to_main_grad = True
        return torch.empty_like(weight)
    return None


def pad_rows(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The shard's gradient with zero rows for vocabulary padding past the real classes."""
    if grad is not None and grad.shape[0] == like.shape[0]:
        return grad.to(like.dtype)
    out = torch.zeros_like(like)
    if grad is not None:
        out[: grad.shape[0]] = grad
    return out
