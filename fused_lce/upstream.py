"""The upstream-gradient check of the gradient-in-forward walk (fused_lce/token_walk.py).

What is assumed: the forward computes the gradients for an upstream gradient it knows up to one
scalar c. For "mean" and "sum" the upstream gradient of a scalar loss is one number. For "none"
the op assumes the per-token gradient is ``c * mask`` (``loss_mask``, default: every non-ignored
token), which is what Megatron's ``sum(losses * loss_mask)`` gives (``assumed_token_grad``).

What is checked: in the backward, that the actual upstream gradient is c times the assumed one
on every non-ignored token, and that the returned lse carries no gradient (``upstream_scale``);
the ranks' verdicts are combined on the device.

What happens on a mismatch: with ``upstream_mismatch="recompute"`` the host reads the verdict
(``mismatch_found``, one sync a backward) and the engine recomputes the exact gradients the
four-GEMM way (``warn_recompute``). By default (with a ``loss_mask``, the Megatron adapter's case)
the backward instead returns NaN gradients where it fails (``poisoned_scale``), and a later call
raises (fused_lce/faults.py): no host sync, never a silently wrong result. Without a
``loss_mask`` a "none" loss takes the recomputing backward, exact for any upstream gradient.
"""

from __future__ import annotations

import warnings

import torch


def assumed_token_grad(
    valid: torch.Tensor, n_valid: torch.Tensor, reduction: str, loss_mask: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The per-token upstream gradient the forward builds G with, (N,) in ``dtype`` (fp32; fp64
    for fp64 inputs): the gradient of the reduced loss for an upstream gradient of 1 ("mean",
    "sum"), else the mask."""
    weights = valid.to(dtype)
    if reduction == "mean":
        # Not weights / n_valid: with every token ignored that is 0 / 0 on every row.
        return torch.where(valid, 1.0 / n_valid.to(dtype), 0.0)
    if reduction == "none" and loss_mask is not None:
        return weights * loss_mask.reshape(-1).to(dtype)
    return weights


def upstream_scale(
    grad_loss: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    assumed: torch.Tensor,
    valid: torch.Tensor,
    reduction: str,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(c, mismatch): (the actual upstream gradient) = c * (what the forward assumed), unless
    ``mismatch`` (a (1,) fp32 device tensor, nonzero where it fails) says otherwise.

    c is None where the stored gradients cannot apply whatever the data: the lse carries a
    gradient. ``mismatch`` is None where nothing data-dependent is to check ("mean", "sum");
    for "none" it says whether a non-ignored token's gradient is not proportional to
    ``assumed``. Nothing here reads the device: the caller combines the ranks' verdicts and
    reads the one that results (``mismatch_found``).
    """
    if grad_lse is not None or grad_loss is None:
        return None, None
    if reduction != "none":
        return grad_loss.reshape(()).to(assumed.dtype), None
    actual = grad_loss.reshape(-1).to(assumed.dtype)
    # c from the token the assumption weighs most; with a 0/1 mask it is that token's gradient.
    # gather, not assumed[k]: indexing by a tensor reads it on the host, a device sync.
    k = assumed.abs().argmax().reshape(1)
    weighed, given = assumed.gather(0, k), actual.gather(0, k)
    c = torch.where(weighed != 0, given / weighed, torch.zeros_like(given)).reshape(())
    expected = c * assumed
    close = (actual - expected).abs() <= expected.abs() * 2.0**-20
    mismatch = (~torch.where(valid, close, True)).any().float().reshape(1)
    return c, mismatch


def mismatch_found(mismatch: torch.Tensor) -> bool:
    """The host's read of a (combined) verdict from ``upstream_scale``: one device sync."""
    return bool(mismatch.item())


def poisoned_scale(scale: torch.Tensor, fault: torch.Tensor) -> torch.Tensor:
    """``scale``, or NaN where a (combined) verdict says the call's gradients do not hold: the
    upstream mismatch of ``upstream_mismatch="nan"``, or a bad target (fused_lce/faults.py)."""
    return torch.where(fault.reshape(()) > 0, torch.full_like(scale, torch.nan), scale)


def warn_recompute(where: str) -> None:
    warnings.warn(
        f"{where}: the upstream gradient is not a multiple of the one the forward assumed (a "
        "gradient through the returned lse, or per-token loss gradients not proportional to "
        "loss_mask); the gradients are recomputed exactly, at the cost of recomputing the "
        "logits in the backward. Pass the mask your loss applies as loss_mask to avoid this.",
        stacklevel=3,
    )
