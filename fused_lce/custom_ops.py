"""The op and the vocab-parallel layer as ``torch.library`` custom ops, for torch.compile: what
their registrations share (fused_lce/api.py, parallel/vocab_parallel.py). Each forward op runs
the eager call without autograd; its backward op runs the call again with autograd and returns
the gradients of what the compiled graph sends back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

# A custom op's kernel runs with autograd's dispatch keys excluded, which would keep the views
# and slices the op makes of its leaves out of the graph: the backward op puts them back while it
# differentiates the eager op (autocast's stay excluded).
_AUTOGRAD_KEYS = tuple(getattr(torch._C.DispatchKey, name) for name in (
    "AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"))


@contextlib.contextmanager
def autograd_inside_an_op():
    excluded = [torch._C._dispatch_tls_is_dispatch_key_excluded(key) for key in _AUTOGRAD_KEYS]
    for key in _AUTOGRAD_KEYS:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        for key, was in zip(_AUTOGRAD_KEYS, excluded):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was)


def rerun_gradients(call: Callable, grad_loss, grad_lse, input, weight, bias, needs):
    """(d_input, d_weight, d_bias) of ``call(input, weight, bias) -> (loss, lse)`` run again with
    autograd against the given upstream gradients; zeros where a gradient is not wanted, and
    d_bias an empty tensor without a bias (an op's outputs cannot be None)."""
    operands = (input, weight, bias if bias is not None else input.new_empty(0))
    leaves = [x.detach().requires_grad_(need) for x, need in zip(operands, needs)]
    with autograd_inside_an_op(), torch.enable_grad():
        outputs = call(leaves[0], leaves[1], leaves[2] if bias is not None else None)
    given = [(out, grad) for out, grad in zip(outputs, (grad_loss, grad_lse)) if grad is not None]
    wanted = [leaf for leaf, need in zip(leaves, needs) if need]
    found = iter(torch.autograd.grad([o for o, _ in given], wanted, [g for _, g in given],
                                     allow_unused=True) if given and wanted else ())
    grads = [next(found) if need else None for need in needs]
    return tuple(torch.zeros_like(x) if grad is None else grad
                 for x, grad in zip(operands, grads))


def fake_loss(input, target, reduction: str):
    """What a loss op returns, as shapes: (loss, lse), the loss of ``target``'s shape or a
    scalar, both at least fp32."""
    dtype = torch.promote_types(input.dtype, torch.float32)
    reduced = target.shape if reduction == "none" else ()
    return input.new_empty(reduced, dtype=dtype), input.new_empty(target.shape, dtype=dtype)


def fake_gradients(input, weight, bias):
    """What ``rerun_gradients`` returns, as shapes."""
    return (torch.empty_like(input), torch.empty_like(weight),
            input.new_empty(0) if bias is None else torch.empty_like(bias))


def register_loss_autograd(loss_op, backward_op, trailing: int) -> None:
    """``backward_op`` as the autograd of ``loss_op``, whose inputs are (input, weight, target,
    bias, loss_mask, words, *numbers) and then ``trailing`` more the backward does not take."""

    def setup_context(ctx, inputs, output):
        input, weight, target, bias, loss_mask, words, *rest = inputs
        ctx.save_for_backward(input, weight, target, bias, loss_mask)
        ctx.words, ctx.numbers = words, rest[: len(rest) - trailing]
        # An unused lse sends None, not zeros: a gradient through it would make the op
        # recompute.
        ctx.set_materialize_grads(False)

    def gradients(ctx, grad_loss, grad_lse):
        input, weight, target, bias, loss_mask = ctx.saved_tensors
        wants = ctx.needs_input_grad
        needs = [wants[0], wants[1], bias is not None and wants[3]]
        d_input, d_weight, d_bias = backward_op(grad_loss, grad_lse, input, weight, target, bias,
                                                loss_mask, needs, ctx.words, *ctx.numbers)
        return (d_input if needs[0] else None, d_weight if needs[1] else None, None,
                d_bias if needs[2] else None) + (None,) * (2 + len(ctx.numbers) + trailing)

    loss_op.register_autograd(gradients, setup_context=setup_context)
