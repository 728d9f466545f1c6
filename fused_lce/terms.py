"""The per-token terms every implementation shares: the loss from statistics, its reduction, and
the coefficients of the logit gradient. Pure torch on (N,) vectors; no kernels, no collectives.

For a token with log-sum-exp ``lse``, target logit ``z_y``, row sum of logits ``S`` over ``V``
classes and upstream loss gradient ``g`` (``grad_lse`` for the returned LSE):

    loss    = (1 - ls) (lse - z_y) + ls (lse - S / V) + z_loss lse^2
    dL/dz_v = p_coef p_v - tgt_coef [v == y] - smooth_coef
    p_coef  = g (1 + 2 z_loss lse) + grad_lse,  tgt_coef = g (1 - ls),  smooth_coef = g ls / V
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .options import LCEOptions


@dataclass
class GradCoefficients:
    """Per-token factors of the softmax, the target one-hot and the uniform term, (N,) each."""

    p_coef: torch.Tensor
    tgt_coef: torch.Tensor
    smooth_coef: torch.Tensor | None
    """None without label smoothing."""


def token_loss(
    lse: torch.Tensor,
    target_logit: torch.Tensor,
    row_sum: torch.Tensor | None,
    num_classes: int,
    opts: LCEOptions,
) -> torch.Tensor:
    """Per-token loss from the lse, the target logit and (label smoothing only) the row sum."""
    loss = lse - target_logit
    if opts.label_smoothing > 0:
        ls = opts.label_smoothing
        loss = (1.0 - ls) * loss + ls * (lse - row_sum / num_classes)
    if opts.z_loss > 0:
        loss = loss + opts.z_loss * lse * lse
    return loss


def grad_coefficients(
    g: torch.Tensor,
    lse: torch.Tensor,
    grad_lse: torch.Tensor | None,
    num_classes: int,
    opts: LCEOptions,
) -> GradCoefficients:
    """The logit gradient's per-token coefficients (module docstring). Zero ``g`` and
    ``grad_lse`` for tokens that must not contribute."""
    p_coef = g if opts.z_loss == 0 else g * (1.0 + 2.0 * opts.z_loss * lse)
    if grad_lse is not None:
        p_coef = p_coef + grad_lse
    tgt_coef = g * (1.0 - opts.label_smoothing)
    smooth_coef = None
    if opts.label_smoothing > 0:
        smooth_coef = g * (opts.label_smoothing / num_classes)
    return GradCoefficients(p_coef.contiguous(), tgt_coef.contiguous(), smooth_coef)


def reduce_tokens(loss: torch.Tensor, n_valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """Reduce per-token losses (ignored tokens hold 0) like torch: "mean" over n_valid tokens."""
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / n_valid


def loss_gradient_per_token(
    grad_loss: torch.Tensor, n_rows: int, n_valid: torch.Tensor, reduction: str
) -> torch.Tensor:
    """d(reduced loss)/d(token loss) times the incoming gradient, (N,) fp32."""
    grad_loss = grad_loss.float()
    if reduction == "none":
        return grad_loss.reshape(n_rows)
    if reduction == "mean":
        grad_loss = grad_loss / n_valid
    return grad_loss.expand(n_rows)
