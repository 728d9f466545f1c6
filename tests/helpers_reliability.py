"""Problems for the reliability tests: confident tokens, and arguments that are strided views.

``confident_problem`` draws rows whose softmax is peaked at the target, as a trained model's are
on most tokens: logits of 40 to 100 with the target 10 to 24 above the rest, so per-token losses
run from about 1e-5 to 0.5. There the loss is a small difference of two numbers near the row
maximum, which is what fp32 must not lose (fused_lce.terms).

``strided`` gives a view of the same values with every stride doubled, the other half of its
storage filled with decoys, so a kernel that assumes unit strides reads the decoys.
"""

from __future__ import annotations

import math

import torch


def confident_problem(
    n: int, v: int, d: int, *, seed: int = 0, bias: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(hidden (n, d), weight (v, d), target (n,) int64, bias (v,) or None), fp32 on the CPU.

    Every weight row is a class-specific part orthogonal to a shared direction ``u`` plus ``u``;
    each hidden state is ``a u`` (a in [40, 90]: the logits' level) plus ``s`` times its target's
    part scaled to give that class's logit ``s`` more (s in [10, 24]: the confidence).
    """
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    u = torch.randn(d, generator=gen, dtype=f64)
    u /= u.norm()
    own = torch.randn(v, d, generator=gen, dtype=f64) / math.sqrt(d)
    own -= (own @ u)[:, None] * u
    weight = own + u
    target = torch.randint(0, v, (n,), generator=gen)
    toward_target = own[target] / own[target].norm(dim=1, keepdim=True) ** 2
    level = 40.0 + 50.0 * torch.rand(n, 1, generator=gen, dtype=f64)
    confidence = 10.0 + 14.0 * torch.rand(n, 1, generator=gen, dtype=f64)
    hidden = level * u + confidence * toward_target
    bias_t = 0.5 * torch.randn(v, generator=gen, dtype=f64) if bias else None
    return (
        hidden.float(),
        weight.float(),
        target,
        None if bias_t is None else bias_t.float(),
    )


def strided(x: torch.Tensor, decoy: torch.Tensor | float) -> torch.Tensor:
    """``x``'s values in a view whose strides are all doubled; the skipped storage holds
    ``decoy`` (broadcast to ``x``'s shape)."""
    storage = torch.empty((*x.shape, 2), dtype=x.dtype, device=x.device)
    storage[..., 0] = x
    storage[..., 1] = decoy
    view = storage[..., 0]
    assert view.dim() == 0 or all(s % 2 == 0 and s > 0 for s in view.stride())
    return view


def transposed(x: torch.Tensor) -> torch.Tensor:
    """A 2-D ``x`` stored column-major: the same values, strides (1, rows)."""
    return x.t().contiguous().t()
