"""Probes of the loss layer in training: each backward's gradient error, and unseen-token mass.

The training-equivalence experiment (docs/training_equivalence.md) asks whether pretraining with
our op trains like megatron's own loss. Beside the loss curves it looks inside the loss layer at
sampled steps: given the hidden states ``E`` (N, D) entering the output layer, its weight ``C``
(V, D) and the targets of one micro-batch, :func:`probe_loss_layer` computes

- the gradient of the mean loss w.r.t. ``E`` and ``C`` in fp32 with full logits (the reference,
  :func:`reference_gradients`, which works through the tokens in chunks so that a 256k vocabulary
  needs a few GiB), and the same gradients from each variant of our op (:data:`PROBE_VARIANTS`)
  and from logits in the training dtype with an fp32 softmax (what megatron's own losses compute,
  fused or not, the variant "native"); each as the
  relative error ``||g - g_ref|| / ||g_ref||``;
- the probability the model gives to tokens never seen in training (``unseen``), averaged over
  positions, and the mass of the softmax entries below 2^-12 (what the paper's filter may drop
  one entry at a time, however large their sum).

Everything works on detached copies: a probe changes neither the parameters, their gradients nor
any random state. The variants run through the single-device op; at tensor-parallel size 1 the
vocab-parallel layer that trains runs the same kernels with the same options.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from fused_lce import linear_cross_entropy
from fused_lce.reference import softcap_fn

PAPER_EPS = 2.0**-12
"""The CCE paper's per-entry threshold in bf16 (finfo(bfloat16).eps / 32)."""

PROBE_VARIANTS: dict[str, dict] = {
    # The default op since 2026-11: gradients computed in the forward from 16-bit logits.
    "in_forward": {"backward": "in_forward"},
    # The recomputing GEMM backward (the default before): every tile, nothing filtered.
    "gemm": {"backward": "gemm"},
    # The tile backward with the default mass-bound filter (docs/algorithm.md).
    "tiles_safe": {"backward": "tiles", "filter_eps": "safe"},
    # The tile backward with the paper's per-entry filter (2^-12 in bf16).
    "tiles_paper": {"backward": "tiles", "filter_eps": "paper"},
}


@dataclass
class Reference:
    """fp32 full-logits results of one probe; the gradients are those of the mean loss."""

    loss: float
    d_input: torch.Tensor
    """(N, D) fp32."""
    d_weight: torch.Tensor
    """(V, D) fp32."""
    unseen_mass: float | None
    """Mean over counted tokens of the softmax mass on unseen ids; None without ``unseen``."""
    small_mass: float
    """Mean over counted tokens of the mass of softmax entries below :data:`PAPER_EPS`."""


@contextlib.contextmanager
def _exact_fp32_matmul():
    """fp32 matmuls without TF32 for the reference, whatever the training run has set."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``||value - reference|| / ||reference||`` (Frobenius), computed in fp32."""
    ref = reference.float()
    return float((value.float() - ref).norm() / ref.norm().clamp_min(1e-30))


@torch.no_grad()
def reference_gradients(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                        unseen: torch.Tensor | None = None, softcap: float | None = None,
                        ignore_index: int = -100, token_chunk: int = 1024) -> Reference:
    """Loss and gradients of the mean cross-entropy with fp32 logits, ``token_chunk`` rows at a
    time (peak memory about ``3 * token_chunk * V * 4`` bytes beyond the fp32 weight copies).

    Args:
        hidden: (N, D) in any float dtype (upcast to fp32 first).
        weight: (V, D).
        target: (N,); ``ignore_index`` rows count for nothing.
        unseen: (V,) bool, the ids never seen in training, or None.
        softcap: the logit soft-capping of the loss, or None.
    """
    weight32 = weight.float()
    count = int((target != ignore_index).sum())
    scale = 1.0 / max(count, 1)
    d_input = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    d_weight = torch.zeros_like(weight32)
    unseen32 = None if unseen is None else unseen.to(torch.float32)
    loss = unseen_mass = small_mass = 0.0
    with _exact_fp32_matmul():
        for start in range(0, hidden.shape[0], token_chunk):
            rows = slice(start, start + token_chunk)
            valid = target[rows] != ignore_index
            h = hidden[rows].float()
            z = softcap_fn(h @ weight32.t(), softcap)
            y = torch.where(valid, target[rows], torch.zeros_like(target[rows]))
            target_logit = z.gather(1, y[:, None]).squeeze(1)
            lse = torch.logsumexp(z, dim=1)
            # d z / d x of softcap * tanh(x / softcap) is 1 - tanh^2 = 1 - (z / softcap)^2.
            cap_slope = None if softcap is None else 1.0 - (z / softcap) ** 2
            p = z.sub_(lse[:, None]).exp_()  # the softmax, in place of the logits
            p.mul_(valid[:, None])
            loss += float((lse - target_logit)[valid].sum())
            small_mass += float(torch.where(p < PAPER_EPS, p, 0.0).sum())
            if unseen32 is not None:
                unseen_mass += float((p @ unseen32).sum())
            grad = p  # d loss / d z = (p - onehot(y)) / count on counted rows
            grad[valid.nonzero().squeeze(1), y[valid]] -= 1.0
            grad.mul_(scale)
            if cap_slope is not None:
                grad.mul_(cap_slope)
            d_input[rows] = grad @ weight32
            d_weight.addmm_(grad.t(), h)
    return Reference(loss=loss * scale, d_input=d_input, d_weight=d_weight,
                     unseen_mass=None if unseen is None else unseen_mass * scale,
                     small_mass=small_mass * scale)


def op_gradients(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                 impl: str = "auto", **options) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_input, d_weight) of our op's mean loss on fresh leaves, in the inputs' dtype."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss = linear_cross_entropy(h, w, target, impl=impl, check_targets=False, **options)
        return torch.autograd.grad(loss, (h, w))


def low_precision_logits_gradients(hidden: torch.Tensor, weight: torch.Tensor,
                                   target: torch.Tensor, *, softcap: float | None = None,
                                   ignore_index: int = -100,
                                   token_chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_input, d_weight) as megatron's own losses compute them: logits in the inputs' dtype,
    softmax in fp32, the logit gradient rounded back to the inputs' dtype (megatron's fused
    "native" loss rounds it explicitly, the unfused one through autograd); ``token_chunk`` rows at
    a time, the weight gradient summed over chunks in fp32."""
    count = max(int((target != ignore_index).sum()), 1)
    w = weight.detach().clone().requires_grad_(True)
    d_input = torch.empty_like(hidden)
    d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    with torch.enable_grad():
        for start in range(0, hidden.shape[0], token_chunk):
            rows = slice(start, start + token_chunk)
            h = hidden[rows].detach().clone().requires_grad_(True)
            logits = softcap_fn((h @ w.t()).float(), softcap)
            loss = torch.nn.functional.cross_entropy(logits, target[rows], reduction="sum",
                                                     ignore_index=ignore_index) / count
            g_h, g_w = torch.autograd.grad(loss, (h, w))
            d_input[rows] = g_h
            d_weight += g_w.float()
    return d_input, d_weight


def probe_loss_layer(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                     unseen: torch.Tensor | None = None, softcap: float | None = None,
                     impl: str = "auto", variants: dict[str, dict] | None = None,
                     token_chunk: int = 1024) -> dict:
    """The probe record of one micro-batch (see the module docstring).

    Args:
        hidden: (N, D) hidden states entering the output layer, as training saw them.
        weight: (V, D) the output weight (tied or not) used in that forward.
        target: (N,) labels.
        unseen: (V,) bool, the ids with zero count in the training data, or None.
        softcap: the loss's logit soft-capping (the variants get it too).
        impl: our op's impl for the variants: "cce" (the kernels: on CUDA, or on the CPU under
            TRITON_INTERPRET=1) or "chunked" (pure PyTorch, which has no filter).
        variants: name -> options of our op; default :data:`PROBE_VARIANTS`.

    Returns:
        {"tokens", "loss", "grad_rel_err": {name: {"input", "weight"}}, "small_mass", and with
        ``unseen`` "unseen_mass" and "unseen_ids"}; besides ``variants``, "native" is megatron's
        loss (:func:`low_precision_logits_gradients`).
    """
    variants = PROBE_VARIANTS if variants is None else variants
    hidden, weight = hidden.detach(), weight.detach()
    ref = reference_gradients(hidden, weight, target, unseen=unseen, softcap=softcap,
                              token_chunk=token_chunk)
    errors = {}
    for name, options in variants.items():
        d_input, d_weight = op_gradients(hidden, weight, target, impl=impl, softcap=softcap,
                                         **options)
        errors[name] = {"input": relative_error(d_input, ref.d_input),
                        "weight": relative_error(d_weight, ref.d_weight)}
        del d_input, d_weight
    d_input, d_weight = low_precision_logits_gradients(hidden, weight, target, softcap=softcap,
                                                       token_chunk=token_chunk)
    errors["native"] = {"input": relative_error(d_input, ref.d_input),
                             "weight": relative_error(d_weight, ref.d_weight)}
    record = {"tokens": int(target.numel()), "loss": ref.loss, "grad_rel_err": errors,
              "small_mass": ref.small_mass}
    if unseen is not None:
        record["unseen_mass"] = ref.unseen_mass
        record["unseen_ids"] = int(unseen.sum())
    if not all(math.isfinite(e) for v in errors.values() for e in v.values()):
        record["nonfinite"] = True
    return record
