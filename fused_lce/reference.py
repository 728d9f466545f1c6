"""The plain math with full logits: the oracle for tests and ``impl="torch"``.

It materialises the (N, V) logits and lets autograd differentiate them, so it is as memory hungry
as an unfused classifier head; its value is that it is obviously the definition in
``fused_lce.options``.
"""

from __future__ import annotations

import torch

from .options import LCEOptions
from .terms import reduce_tokens, target_nll, token_loss


def softcap_fn(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    if softcap is None:
        return logits
    return softcap * torch.tanh(logits / softcap)


def full_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, opts: LCEOptions
) -> torch.Tensor:
    """Soft-capped logits in fp32 (or the inputs' dtype if wider), restricted to real classes."""
    if opts.num_classes is not None:
        weight = weight[: opts.num_classes]
        bias = None if bias is None else bias[: opts.num_classes]
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    return softcap_fn(logits.to(compute_dtype), opts.softcap)


def per_token_loss(
    logits: torch.Tensor, target: torch.Tensor, opts: LCEOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) per token from full logits (N, V); ignored tokens give loss 0 and keep lse.

    The shift is a constant to autograd, as in torch's logsumexp: its gradient terms cancel.
    """
    valid = target != opts.ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target)).long()
    row_max = logits.detach().amax(dim=-1)
    sum_exp = torch.exp(logits - row_max.unsqueeze(-1)).sum(dim=-1)
    lse = row_max + torch.log(sum_exp)
    target_logit = logits.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
    nll = target_nll(row_max, sum_exp, target_logit)
    row_sum = logits.sum(dim=-1) if opts.label_smoothing > 0 else None
    loss = token_loss(nll, lse, row_sum, logits.shape[-1], opts)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return loss, lse


def reference_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    opts: LCEOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) with full logits. ``hidden`` (N, D), ``target`` (N,); autograd does the rest.

    Loss and lse come in fp32, or fp64 for fp64 inputs (the logits are upcast first).
    """
    logits = full_logits(hidden, weight, bias, opts)
    loss, lse = per_token_loss(logits, target, opts)
    loss = reduce_tokens(loss, (target != opts.ignore_index).sum(), opts.reduction)
    return loss, lse
