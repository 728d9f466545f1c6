"""The problems the single-GPU benchmark (scripts/bench_lce.py) and the studies beside it time:
a model shape at N tokens in one of two data regimes, and the float64 oracle they are held to.

Data regimes (``make_inputs``):
- ``uniform``: random initialisation; logits ~ N(0, 0.02^2 * D), a near-uniform softmax.
- ``trained``: a trained-like softmax: a Zipf(1.1) unigram prior sharpened to a log-log slope of
  about -2 (as measured on trained LMs) and carried by one hidden dimension, context noise of
  about one nat from random directions, and an 8-nat boost of each token's target.
  ``softmax_stats`` says what a draw produced (target probability, entries above 2^-12 per row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Case:
    model: str
    n_tokens: int
    vocab: int
    hidden: int
    regime: str


def make_inputs(case: Case, dtype: torch.dtype, device: str, seed: int = 0):
    """(hidden (N, D), weight (V, D), target (N,)) for a data regime; see the module docstring."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, v, d = case.n_tokens, case.vocab, case.hidden
    # Zipf class frequencies: targets are drawn from them in both regimes.
    ranks = torch.arange(1, v + 1, dtype=torch.float64)
    unigram = ranks.pow(-1.1)
    unigram /= unigram.sum()
    target = torch.multinomial(unigram, n, replacement=True, generator=g)
    if case.regime == "uniform":
        hidden = torch.randn(n, d, generator=g)
        weight = torch.randn(v, d, generator=g) * 0.02
    elif case.regime == "trained":
        weight = torch.randn(v, d, generator=g) / math.sqrt(d)
        hidden = torch.randn(n, d, generator=g)
        # One hidden dimension carries the log-unigram prior, sharpened to the rank-probability
        # slope of trained LMs (about -2 in log-log: below 2^-12 by rank ~50).
        weight[:, 0] = 2.0 * (unigram.log() - unigram.log().mean()).float() / 4.0
        hidden[:, 0] = 4.0
        # Boost the target: its logit gains about 8 nats over the context noise.
        direction = weight[target, 1:]
        hidden[:, 1:] += 8.0 * direction / direction.norm(dim=1, keepdim=True) ** 2
    else:
        raise ValueError(f"unknown regime {case.regime!r}")
    return (
        hidden.to(device=device, dtype=dtype),
        weight.to(device=device, dtype=dtype),
        target.to(device),
    )


def softmax_stats(hidden, weight, target, rows: int = 256) -> dict:
    logits = (hidden[:rows].float() @ weight.float().t()).float()
    prob = torch.softmax(logits, dim=-1)
    return {
        "target_prob": prob.gather(1, target[:rows, None]).mean().item(),
        "above_2^-12_per_row": (prob > 2**-12).sum(dim=1).float().mean().item(),
        "max_prob": prob.max(dim=1).values.mean().item(),
    }


def fp64_reference(hidden, weight, target, rows: int = 1024):
    """(loss, d_hidden, d_weight) of the mean cross-entropy in float64 on the GPU, token chunk by
    token chunk (the logits of one chunk at a time)."""
    h, w = hidden.double(), weight.double()
    n = h.shape[0]
    loss = torch.zeros((), dtype=torch.float64, device=h.device)
    d_h = torch.empty_like(h)
    d_w = torch.zeros_like(w)
    for start in range(0, n, rows):
        logits = h[start:start + rows] @ w.t()
        t = target[start:start + rows]
        lse = torch.logsumexp(logits, dim=1)
        loss += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
        grad = torch.softmax(logits, dim=1)
        grad[torch.arange(len(t), device=t.device), t] -= 1
        grad /= n
        d_h[start:start + rows] = grad @ w
        d_w += grad.t() @ h[start:start + rows]
    return loss / n, d_h, d_w


def relative_errors(fn, hidden, weight, target, reference) -> dict:
    """Norm-wise relative error of the loss and both gradients against ``reference``."""
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    loss = fn(h, w, target)
    loss.backward()

    def rel(x, ref):
        return ((x.double() - ref).norm() / ref.norm()).item()

    ref_loss, ref_h, ref_w = reference
    return {"err_loss": rel(loss.detach(), ref_loss), "err_d_hidden": rel(h.grad, ref_h),
            "err_d_weight": rel(w.grad, ref_w)}
