"""The per-token terms every implementation shares: the loss from statistics, its reduction, the
coefficients of the logit gradient, and the backwards' refusal of second-order use and of
torch.func transforms. Pure torch on (N,) vectors; no kernels, no collectives.

For a token with row maximum ``m``, shifted sum ``s = sum_v exp(z_v - m)``, ``lse = m + log s``,
target logit ``z_y``, row sum of logits ``S`` over ``V`` classes and upstream loss gradient ``g``
(``grad_lse`` for the returned LSE):

    nll     = (m - z_y) + log s                              (= lse - z_y = -log p_y)
    loss    = (1 - ls) nll + ls (lse - S / V) + z_loss lse^2
    dL/dz_v = p_coef p_v - smooth_coef                       (v != y)
    dL/dz_y = target_grad - smooth_coef
    p_coef  = g (1 + 2 z_loss lse) + grad_lse,  smooth_coef = g ls / V
    target_grad = p_coef p_y - g (1 - ls) = (g (ls + 2 z_loss lse) + grad_lse) - p_coef (1 - p_y)

Why ``nll`` is not formed as ``lse - z_y``: for a confident token both sit near the row maximum,
so their difference keeps only its last bits (fp32's spacing at 60 is 4e-6, against a loss of
1e-5). ``m - z_y`` is exact where the target holds the maximum (both come from the same logit),
and ``log s`` is small and precise: torch and megatron form the loss this way. For the same
reason the target's gradient uses ``1 - p_y = -expm1(-nll)`` rather than ``1 - exp(z_y - lse)``.
The statistics must therefore take ``m`` and ``z_y`` from one computation of the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .options import LCEOptions


@dataclass
class GradCoefficients:
    """Per-token factors of the logit gradient, (N,) each: the softmax's, the target column's
    whole gradient and the uniform term."""

    p_coef: torch.Tensor
    target_grad: torch.Tensor
    smooth_coef: torch.Tensor | None
    """None without label smoothing."""


def target_nll(
    row_max: torch.Tensor, sum_exp: torch.Tensor, target_logit: torch.Tensor
) -> torch.Tensor:
    """``-log p_y = (m - z_y) + log sum exp(z - m)`` per token (module docstring: why this form).

    ``row_max`` and ``target_logit`` must come from the same computation of the logits."""
    return lse_and_nll(row_max, sum_exp, target_logit)[1]


def lse_and_nll(
    row_max: torch.Tensor, sum_exp: torch.Tensor, target_logit: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, ``target_nll``) per token, one log for both, written into ``out`` where given (the
    token walk's slices of its per-token results: no copy after)."""
    log_sum = torch.log(sum_exp)
    if out is None:  # out of place: the reference impl differentiates through this
        return row_max + log_sum, (row_max - target_logit) + log_sum
    lse = torch.add(row_max, log_sum, out=out[0])
    return lse, torch.sub(row_max, target_logit, out=out[1]).add_(log_sum)


def token_loss(
    nll: torch.Tensor,
    lse: torch.Tensor,
    row_sum: torch.Tensor | None,
    num_classes: int,
    opts: LCEOptions,
) -> torch.Tensor:
    """Per-token loss from ``target_nll``, the lse and (label smoothing only) the row sum."""
    loss = nll
    if opts.label_smoothing > 0:
        ls = opts.label_smoothing
        loss = (1.0 - ls) * loss + ls * (lse - row_sum / num_classes)
    if opts.z_loss > 0:
        loss = loss + opts.z_loss * lse * lse
    return loss


def grad_coefficients(
    g: torch.Tensor,
    lse: torch.Tensor,
    nll: torch.Tensor,
    grad_lse: torch.Tensor | None,
    num_classes: int,
    opts: LCEOptions,
) -> GradCoefficients:
    """The logit gradient's per-token coefficients (module docstring). Zero ``g`` and
    ``grad_lse`` for tokens that must not contribute, and give them a finite ``lse`` and
    ``nll`` (0)."""
    excess = g * opts.label_smoothing if opts.label_smoothing > 0 else None
    p_coef = g
    if opts.z_loss > 0:
        z_term = g * (2.0 * opts.z_loss * lse)
        p_coef = g + z_term
        excess = z_term if excess is None else excess + z_term
    if grad_lse is not None:
        p_coef = p_coef + grad_lse
        excess = grad_lse if excess is None else excess + grad_lse
    target_grad = p_coef * torch.expm1(-nll)
    if excess is not None:
        target_grad = excess + target_grad
    smooth_coef = None
    if opts.label_smoothing > 0:
        smooth_coef = (g * (opts.label_smoothing / num_classes)).contiguous()
    return GradCoefficients(p_coef.contiguous(), target_grad.contiguous(), smooth_coef)


def reduce_tokens(loss: torch.Tensor, n_valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """Reduce per-token losses (ignored tokens hold 0) like torch: "mean" over n_valid tokens."""
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / n_valid


def loss_gradient_per_token(
    grad_loss: torch.Tensor, n_rows: int, n_valid: torch.Tensor, reduction: str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """d(reduced loss)/d(token loss) times the incoming gradient, (N,) in ``dtype``."""
    grad_loss = grad_loss.to(dtype)
    if reduction == "none":
        return grad_loss.reshape(n_rows)
    if reduction == "mean":
        grad_loss = grad_loss / n_valid
    return grad_loss.expand(n_rows)


def refuse_double_backward(where: str) -> None:
    """Raise if this backward is being recorded for a further derivative (``create_graph=True``).

    The backward passes form the gradient by hand (kernels, or torch under no_grad), so their
    result has no graph; without this check it would come back as a silent constant."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"second-order gradients are not supported by {where}: its backward was called "
            "with create_graph=True (or under torch.autograd.grad(..., create_graph=True)). "
            "Use impl='torch' for higher-order derivatives."
        )


def refuse_function_transforms(where: str, *tensors: torch.Tensor | None) -> None:
    """Raise if a tensor comes from a ``torch.func`` transform (vmap, grad, jacrev, jvp, ...) or
    is a batch of upstream gradients (``torch.autograd.grad(..., is_grads_batched=True)``).

    The kernels read raw storage and the autograd Functions define no vmap rule, so such a call
    would otherwise stop deep inside with an internal error ("Cannot access storage of
    BatchedTensorImpl", "Batching rule not implemented for aten::item")."""
    if any(t is not None and _is_transformed(t) for t in tensors):
        raise RuntimeError(
            f"{where} does not support torch.func transforms (vmap, grad, jacrev, jvp, ...) "
            "nor batched gradients (torch.autograd.grad(..., is_grads_batched=True)): its "
            "kernels and backward work on plain tensors. Use impl='torch' for these."
        )


def _functorch_probes() -> tuple:
    """torch's predicates for a transform's wrapper (vmap, grad, ...) and for the batched
    tensors of ``is_grads_batched``, where this torch has them (private API: none, no check)."""
    functorch = getattr(torch._C, "_functorch", None)
    names = ("is_functorch_wrapped_tensor", "is_legacy_batchedtensor")
    return tuple(probe for probe in (getattr(functorch, name, None) for name in names) if probe)


_TRANSFORM_PROBES = _functorch_probes()


def _is_transformed(tensor: torch.Tensor) -> bool:
    return any(probe(tensor) for probe in _TRANSFORM_PROBES)
