"""Problems and comparisons for the linear-cross-entropy tests.

``make_problem`` draws (hidden, weight, target, bias) in one of two regimes:

- "peaked", like a trained model: class frequencies follow a Zipf law, targets are drawn from
  them and the logits carry their log as a prior, the few most frequent classes have weight
  rows of larger norm, and each hidden state points along its target's weight row. Every row
  of logits then has a few large entries (its target, frequent classes) far above the rare
  classes' logits.
- "near-uniform", like a model at initialisation: tiny weights, logits ~ N(0, 0.02^2), so the
  softmax is close to 1/V everywhere and the gradient is spread over the whole vocabulary.

``compare_to_reference`` runs one implementation, the fp64 oracle and, for 16-bit inputs, the
``impl="torch"`` path in the same dtype (what PyTorch itself achieves), and asserts
``err(ours, fp64) <= 2 * err(torch_same_dtype, fp64) + atol`` for the loss, the returned lse
and the gradients of input, weight and bias. For fp32 and fp64 the bound is a fixed relative
error. Everything is drawn on the CPU in float64 from a seeded generator, then cast, so every
dtype and device sees the same problem.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from helpers import assert_close_rel, rel_err

from fused_lce import linear_cross_entropy
from fused_lce.options import LCEOptions
from fused_lce.reference import reference_linear_cross_entropy

IGNORE_INDEX = -100

# Relative error allowed on top of twice torch's own error in the same dtype. For fp32/fp64
# torch's error is negligible and this is the whole bound.
ATOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 1e-4,
    torch.float16: 1e-4,
}

# Options of linear_cross_entropy that the fp64 reference must also see (they change the math).
_MATH_OPTIONS = ("ignore_index", "reduction", "label_smoothing", "softcap", "z_loss", "num_classes")


def make_problem(
    n: int | tuple[int, ...],
    v: int,
    d: int,
    dtype: torch.dtype = torch.float32,
    regime: str = "peaked",
    ignore_frac: float = 0.0,
    bias: bool = False,
    seed: int = 0,
    *,
    peak: float = 1.0,
    num_classes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A fresh random problem, the same for a given seed whatever the dtype.

    Args:
        n: number of tokens, or the batch shape (e.g. (B, T)) of the target.
        v, d: vocabulary size (weight rows) and hidden size.
        dtype: dtype of hidden, weight and bias (drawn in fp64, then rounded).
        regime: "peaked" or "near-uniform" (module docstring).
        ignore_frac: fraction of tokens whose target is ``IGNORE_INDEX`` (exactly
            round(ignore_frac * N) of them, at random positions; 1.0 ignores every token).
        bias: whether to return a bias (else None).
        seed: seed of the generator.
        peak: "peaked" only: scales the alignment of each hidden state with its target's weight
            row and the log-frequency prior, so the softmax sharpens with it.
        num_classes: targets are drawn from [0, num_classes) (default: all V rows).

    Returns:
        (hidden (*n, D), weight (V, D), target (*n,) int64, bias (V,) or None), CPU tensors that
        do not require grad.
    """
    shape = (n,) if isinstance(n, int) else tuple(n)
    n_tok = math.prod(shape)
    classes = v if num_classes is None else num_classes
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=f64)

    def rand(*size):
        return torch.rand(*size, generator=gen, dtype=f64)

    if regime == "peaked":
        # Zipf-like class frequencies: targets are drawn from them, and the logits carry their
        # log as a prior (a trained head's unigram direction), so rare classes sit far below.
        rank = torch.randperm(classes, generator=gen)
        log_freq = torch.full((v,), -1.1 * math.log1p(classes), dtype=f64)
        log_freq[:classes] = -1.1 * torch.log1p(rank.to(f64))
        target = torch.multinomial(torch.softmax(log_freq[:classes], 0), n_tok, replacement=True,
                                   generator=gen)
        # Class-specific rows of norm ~1; the few most frequent classes (2%) ~2.5.
        base = randn(v, d) / math.sqrt(d)
        base[:classes][rank < max(2, classes // 50)] *= 2.5
        direction = base[target] / base[target].norm(dim=1, keepdim=True)
        u0 = randn(d)
        u0 /= u0.norm()
        weight = base + (peak * log_freq / 4.0)[:, None] * u0
        # Each hidden state points at its target's row with a confidence that varies per token
        # (target logits of ~3 to ~9 before the prior), plus the shared prior direction.
        strength = peak * (3.0 + 6.0 * rand(n_tok, 1))
        hidden = strength * direction + 4.0 * u0 + randn(n_tok, d) / math.sqrt(d)
        bias_t = 0.5 * randn(v)
    elif regime == "near-uniform":
        hidden = randn(n_tok, d)
        weight = randn(v, d) * (0.02 / math.sqrt(d))
        target = torch.randint(0, classes, (n_tok,), generator=gen)
        bias_t = 0.02 * randn(v)
    else:
        raise ValueError(f"unknown regime {regime!r}")

    n_ignored = round(ignore_frac * n_tok)
    if n_ignored:
        target[torch.randperm(n_tok, generator=gen)[:n_ignored]] = IGNORE_INDEX

    return (
        hidden.reshape(*shape, d).to(dtype),
        weight.to(dtype),
        target.reshape(shape),
        bias_t.to(dtype) if bias else None,
    )


def make_common_direction_problem(
    n: int, v: int, d: int, dtype: torch.dtype, seed: int = 0, n_targets: int = 100
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """Near-uniform softmax over a large vocabulary, with hidden states sharing one direction.

    hidden = 3 * u + small noise, weight rows = 0.01 * u + small noise: every logit is close to
    0.03, every probability close to 1 / V (below 2^-12 once V > 4096). The targets are drawn
    from the first ``n_targets`` classes, so most vocabulary tiles hold no target. The weight
    gradient of a class without tokens is ~ (mean softmax prob) * 3u: tiny per entry, but the
    same sign over the whole vocabulary, which is what a per-entry filter throws away.
    """
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    u = torch.randn(d, generator=gen, dtype=f64)
    u /= u.norm()
    hidden = 3.0 * u + 0.1 * torch.randn(n, d, generator=gen, dtype=f64) / math.sqrt(d)
    weight = 0.01 * u + 0.01 * torch.randn(v, d, generator=gen, dtype=f64) / math.sqrt(d)
    target = torch.randint(0, n_targets, (n,), generator=gen)
    return hidden.to(dtype), weight.to(dtype), target, None


# ---------------------------------------------------------------------------------------------
# Running an implementation with gradients
# ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """Loss, lse (None unless returned) and gradients of one run, all detached."""

    loss: torch.Tensor
    lse: torch.Tensor | None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def upstream_weights(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    """Fixed fp64 weights for a non-scalar output, so "none" and the lse get a random gradient."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return scale * (0.5 + torch.rand(shape, generator=gen, dtype=torch.float64))


# The upstream gradient of a scalar loss in every objective: not 1, so that a gradient left
# unscaled by it (one computed in the forward for an upstream gradient of 1) fails the test. A
# power of two: scaling a 16-bit gradient by it rounds nothing, so the bf16 bounds (twice
# torch's error, whose run folds the factor in) still hold; tests/op/test_ignore_index_and_scale.py
# scales by 3 in fp32.
SCALAR_UPSTREAM = 2.0


def _objective(loss, lse, use_lse: bool, seed: int) -> torch.Tensor:
    """A scalar that depends on every per-token loss (and the lse when ``use_lse``)."""
    if loss.dim() == 0:
        total = SCALAR_UPSTREAM * loss
    else:
        total = (loss * upstream_weights(tuple(loss.shape), seed).to(loss)).sum()
    if use_lse:
        w = upstream_weights(tuple(lse.shape), seed + 1, scale=0.1).to(lse)
        total = total + (lse * w).sum()
    return total


def _leaves(hidden, weight, bias, dtype, device):
    def leaf(x):
        if x is None:
            return None
        x = x.detach().to(device=device, dtype=dtype or x.dtype)
        return x.requires_grad_(True)

    return leaf(hidden), leaf(weight), leaf(bias)


def _collect(loss, lse, h, w, b, use_lse, seed, run_backward=True) -> Outcome:
    if run_backward:
        _objective(loss, lse, use_lse, seed).backward()
    grads = {"input": h.grad, "weight": w.grad}
    if b is not None:
        grads["bias"] = b.grad
    grads = {k: (None if g is None else g.detach()) for k, g in grads.items()}
    return Outcome(loss.detach(), None if lse is None else lse.detach(), grads)


def run_impl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    impl: str,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    return_lse: bool = False,
    use_lse: bool | None = None,
    seed: int = 0,
    run_backward: bool = True,
    **options,
) -> Outcome:
    """``linear_cross_entropy`` forward and backward on fresh leaves (cast to dtype/device).

    With ``return_lse`` the lse also enters the objective (``use_lse`` turns that off).
    """
    h, w, b = _leaves(hidden, weight, bias, dtype, device)
    t = target.to(device)
    out = linear_cross_entropy(h, w, t, b, impl=impl, return_lse=return_lse, **options)
    loss, lse = out if return_lse else (out, None)
    use_lse = return_lse if use_lse is None else use_lse
    return _collect(loss, lse, h, w, b, use_lse, seed, run_backward)


def run_reference_fp64(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    return_lse: bool = False,
    use_lse: bool | None = None,
    seed: int = 0,
    ref_device: str | torch.device = "cpu",
    **options,
) -> Outcome:
    """The oracle: ``reference_linear_cross_entropy`` on the inputs upcast to fp64, on the CPU
    (or ``ref_device``, for problems too large for a CPU in fp64).

    Only the options that change the math are passed on; the lse is zeroed for ignored tokens,
    as every implementation returns it.
    """
    opts = LCEOptions(**{k: options[k] for k in _MATH_OPTIONS if k in options})
    h, w, b = _leaves(hidden, weight, bias, torch.float64, ref_device)
    t = target.to(ref_device)
    loss, lse = reference_linear_cross_entropy(h.reshape(-1, h.shape[-1]), w, t.reshape(-1), b,
                                               opts)
    valid = t.reshape(-1) != opts.ignore_index
    lse = torch.where(valid, lse, torch.zeros_like(lse)).reshape(t.shape)
    if opts.reduction == "none":
        loss = loss.reshape(t.shape)
    use_lse = return_lse if use_lse is None else use_lse
    out = _collect(loss, lse, h, w, b, use_lse, seed)
    if not return_lse:
        out.lse = None
    return out


def tolerances(
    dtype: torch.dtype, ref: Outcome, torch_run: Outcome | None
) -> dict[str, float]:
    """Per-quantity bound: 2 * err(torch in ``dtype``, fp64) + ATOL[dtype]."""
    atol = ATOL[dtype]
    names = ["loss", *(["lse"] if ref.lse is not None else []), *ref.grads]
    if torch_run is None:
        return {name: atol for name in names}
    return {name: 2.0 * rel_err(_get(torch_run, name), _get(ref, name)) + atol for name in names}


def _get(outcome: Outcome, name: str) -> torch.Tensor:
    if name == "loss":
        return outcome.loss
    if name == "lse":
        return outcome.lse
    return outcome.grads[name]


def assert_matches(
    ours: Outcome, ref: Outcome, tols: dict[str, float], label: str = ""
) -> dict[str, float]:
    """assert_close_rel on every quantity; returns the measured relative errors."""
    errors = {}
    for name, tol in tols.items():
        actual, expected = _get(ours, name), _get(ref, name)
        assert actual is not None, f"{label} {name}: no gradient"
        assert_close_rel(actual, expected, tol, name=f"{label} {name}".strip())
        errors[name] = rel_err(actual, expected)
    return errors


def _per_token_loss_tol(hidden, weight, target, bias, kw, device, ref_device) -> float:
    """2 * torch's per-token loss error in the inputs' dtype + ATOL (forward only)."""
    math_kw = {k: v for k, v in kw.items() if k in _MATH_OPTIONS}
    math_kw["reduction"] = "none"

    def per_token(dev, dtype):
        h, w, b = (None if x is None else x.to(dev, dtype) for x in (hidden, weight, bias))
        with torch.no_grad():
            return linear_cross_entropy(h, w, target.to(dev), b, impl="torch", **math_kw)

    err = rel_err(per_token(device, hidden.dtype), per_token(ref_device, torch.float64))
    return 2.0 * err + ATOL[hidden.dtype]


def compare_to_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    impl: str,
    device: str | torch.device = "cpu",
    ref_device: str | torch.device = "cpu",
    return_lse: bool = False,
    seed: int = 0,
    baseline: bool | None = None,
    **options,
) -> tuple[Outcome, dict[str, float]]:
    """Runs ``impl`` on ``device`` and asserts it is as close to fp64 as torch in the same dtype
    (on the same device) is.

    ``baseline`` runs the ``impl="torch"`` path in the inputs' dtype for the bound (default:
    only for 16-bit inputs; fp32/fp64 use ``ATOL`` alone). The fp64 oracle runs on
    ``ref_device``. Returns (our outcome, errors).
    """
    dtype = hidden.dtype
    kw = dict(return_lse=return_lse, seed=seed, **options)
    ours = run_impl(hidden, weight, target, bias, impl=impl, device=device, **kw)
    ref = run_reference_fp64(hidden, weight, target, bias, ref_device=ref_device, **kw)
    if baseline is None:
        baseline = dtype in (torch.bfloat16, torch.float16)
    torch_run = None
    if baseline:
        base_opts = {k: v for k, v in kw.items() if k in (*_MATH_OPTIONS, "return_lse", "seed")}
        torch_run = run_impl(hidden, weight, target, bias, impl="torch", device=device, **base_opts)
    tols = tolerances(dtype, ref, torch_run)
    if torch_run is not None and ref.loss.dim() == 0:
        # A scalar loss averages per-token errors that may cancel by luck in torch's run;
        # torch's per-token error is the fair measure of what the dtype allows.
        tols["loss"] = max(
            tols["loss"],
            _per_token_loss_tol(hidden, weight, target, bias, kw, device, ref_device),
        )
    errors = assert_matches(ours, ref, tols, label=f"impl={impl} {dtype}")
    return ours, errors


def skippable_tiles(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    threshold: float,
    mode: str,
    block_n: int,
    block_v: int,
    ignore_index: int = IGNORE_INDEX,
    vocab_sort: bool = True,
) -> tuple[int, int]:
    """(tiles the cce filter may skip, all tiles), judged in fp64 as the backward walks them.

    Rows are the non-ignored tokens in order; with ``vocab_sort`` the columns are walked by
    descending column sum of logits, as the cce backward does. ``mode`` is "mass" (every row's
    softmax mass in the tile below ``threshold``) or "entry" (every entry below it); a tile
    holding a target is never skipped. No softcap or smoothing: this is for the filter tests.
    """
    valid = target.reshape(-1) != ignore_index
    h = hidden.reshape(-1, hidden.shape[-1])[valid].double()
    logits = h @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    order = torch.argsort(logits.sum(0), descending=True) if vocab_sort else None
    prob = torch.softmax(logits, dim=1)
    tgt = target.reshape(-1)[valid]
    if order is not None:
        prob = prob[:, order]
        tgt = torch.argsort(order)[tgt]
    skippable = total = 0
    for r0 in range(0, prob.shape[0], block_n):
        for c0 in range(0, prob.shape[1], block_v):
            tile = prob[r0 : r0 + block_n, c0 : c0 + block_v]
            t = tgt[r0 : r0 + block_n]
            holds_target = bool(((t >= c0) & (t < c0 + block_v)).any())
            stat = tile.max() if mode == "entry" else tile.sum(dim=1).max()
            skippable += int(bool(stat < threshold) and not holds_target)
            total += 1
    return skippable, total


def record_chunk_plans(monkeypatch) -> list[tuple[str, tuple[int, int]]]:
    """Records each cce backward's chunk plan as ("tiles" | "gemm", (rows, cols)) per chunk.

    Wraps the planners where their callers look them up, so a test can check that a buffer
    budget really produced several chunks without repeating the planners' arithmetic.
    """
    import fused_lce.backward_plan as gemm
    import fused_lce.kernels.tiles_backward as tiles

    plans: list[tuple[str, tuple[int, int]]] = []
    plan_tiles, plan_gemm = tiles.plan_chunks, gemm.plan_gemm_chunks

    def recording_tiles(*args, **kwargs):
        plan = plan_tiles(*args, **kwargs)
        plans.append(("tiles", (plan.rows_per_chunk, plan.vocab_per_chunk)))
        return plan

    def recording_gemm(*args, **kwargs):
        plan = plan_gemm(*args, **kwargs)
        plans.append(("gemm", tuple(plan)))
        return plan

    monkeypatch.setattr(tiles, "plan_chunks", recording_tiles)
    monkeypatch.setattr(gemm, "plan_gemm_chunks", recording_gemm)
    return plans
