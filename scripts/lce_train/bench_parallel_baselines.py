"""The losses the vocab-parallel benchmark (``lce_train.bench_parallel``) sets beside ours:
Megatron's algorithm written here with torch.distributed (``torch-logits-vp``), and megatron-core's
own unfused (``megatron``) and fused (``megatron-fused``) losses, each with the output layer's
input taken in as ColumnParallelLinear takes it (all-reduce of its gradient, or with SP the
sequence all-gather and reduce-scatter). The module docstring of ``lce_train.bench_parallel``
describes each provider; megatron-core is imported inside the functions that use it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------------------
# The baseline written with torch.distributed (Megatron's algorithm)
# ---------------------------------------------------------------------------------------------


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; the backward sums the input gradient over the TP group."""

    @staticmethod
    def forward(ctx, input, group):
        ctx.group = group
        return input

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather along the sequence (first) dimension; the backward reduce-scatters."""

    @staticmethod
    def forward(ctx, input, group):
        ctx.group = group
        size = dist.get_world_size(group)
        input = input.contiguous()
        out = input.new_empty((input.shape[0] * size, *input.shape[1:]))
        dist.all_gather_into_tensor(out, input, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


class _LogitsVocabParallelCE(torch.autograd.Function):
    """Cross-entropy of fp32 logits split over the vocabulary (Megatron's algorithm).

    forward: all-reduce MAX [N], all-reduce SUM [N] (target logit), all-reduce SUM [N]
    (sum of exponentials); saves the (N, V_local) fp32 softmax for the backward.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits.sub_(logits_max.unsqueeze(-1))  # in place, as Megatron does: logits is ours
        local = target - vocab_start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = torch.where(outside, torch.zeros_like(local), local)
        target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(outside, torch.zeros_like(target_logit), target_logit)
        dist.all_reduce(target_logit, group=group)
        softmax = logits.exp_()
        sum_exp = softmax.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = torch.log(sum_exp) - target_logit
        softmax.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax  # softmax - one_hot(target), in place
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~outside).to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def _capped_fp32_logits(hidden, weight, softcap):
    logits = (hidden @ weight.t()).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def torch_logits_vp_loss(hidden, weight, target, *, group, vocab_start, sp, softcap):
    """Mean cross-entropy over the N tokens; ``hidden`` (N or N/TP, D), ``weight`` (V/TP, D)."""
    if dist.get_world_size(group) > 1:
        if sp:
            hidden = _GatherFromSequenceParallelRegion.apply(hidden, group)
        else:
            hidden = _CopyToTensorParallelRegion.apply(hidden, group)
    logits = _capped_fp32_logits(hidden, weight, softcap)
    return _LogitsVocabParallelCE.apply(logits, target, vocab_start, group).mean()


def _megatron_input(hidden, sp: bool):
    """The output layer's input as ColumnParallelLinear takes it in."""
    from megatron.core import tensor_parallel

    if sp:
        return tensor_parallel.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=True
        )
    return tensor_parallel.copy_to_tensor_model_parallel_region(hidden)


def megatron_loss(hidden, weight, target, *, sp, softcap):
    """Megatron-core's path; its parallel state must be initialised with this TP size."""
    from megatron.core import tensor_parallel

    logits = _capped_fp32_logits(_megatron_input(hidden, sp), weight, softcap)
    return tensor_parallel.vocab_parallel_cross_entropy(logits, target).mean()


def megatron_fused_loss(hidden, weight, target, *, sp, softcap):
    """Megatron-core's fused loss on bf16 logits (``--cross-entropy-loss-fusion``)."""
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    logits = _megatron_input(hidden, sp) @ weight.t()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    group = parallel_state.get_tensor_model_parallel_group()
    # Megatron's layout: [sequence, batch, vocab shard]; one sequence of every token here.
    return fused_vocab_parallel_cross_entropy(logits.unsqueeze(1), target.unsqueeze(1),
                                              group).mean()


def megatron_available() -> bool:
    try:
        import megatron.core.parallel_state  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401
    except ImportError:
        return False
    return True


def megatron_init(tp: int) -> None:
    import inspect

    from megatron.core import parallel_state

    kwargs = {"tensor_model_parallel_size": tp}
    if "create_gloo_process_groups" in inspect.signature(
        parallel_state.initialize_model_parallel
    ).parameters:
        kwargs["create_gloo_process_groups"] = False  # not needed here
    parallel_state.initialize_model_parallel(**kwargs)


def megatron_destroy() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
