"""Pure-PyTorch chunked linear cross-entropy: the path that runs on any device, CPU included.

An unfused classifier head holds the (N, V) logits and their gradient; here they never exist at
once. ``LCEOptions.chunk_by`` picks one of two ways to cut them:

``"vocab"`` (default): online softmax over vocabulary chunks. The forward walks ``vocab_chunk``
columns at a time, computing each chunk's logits into one reused buffer and folding it into a
running (max, rescaled sum of exp) per token, plus the target logit and, for label smoothing,
the row sum of logits. It saves only the inputs and the (N,) lse. The backward walks the same
chunks, recomputes the logits, turns them into the logit gradient in place and multiplies it
out: ``d_hidden`` accumulates over chunks, each chunk owns its rows of ``d_weight``. Any
reduction works and gradients flow through the returned lse too. Memory: O(N * vocab_chunk).

``"tokens"``: gradients in the forward. The forward walks ``token_chunk`` tokens at a time with
full-vocabulary logits, and since a scalar loss is linear in its upstream gradient, computes
the input gradients for a unit upstream gradient right away; the backward only scales them.
Needs reduction "mean" or "sum", and does not propagate gradients through the returned lse
(it is marked non-differentiable). Memory: O(token_chunk * V) plus the stored gradients.

The logit gradient both modes form, per token with upstream loss gradient g, soft-capped logits
z (z = cap * tanh(x / cap)), p = softmax(z), V classes and target y::

    dL/dz = (g * (1 + 2 * z_loss * lse) + grad_lse) * p - g * (1 - ls) * onehot(y) - g * ls / V
    dL/dx = dL/dz * (1 - (z / cap)**2)

Precision: the matmuls run in the inputs' dtype (the logit gradient is cast down first, as an
unfused head does), everything elementwise and every cross-chunk accumulation in fp32 (fp64
for fp64 inputs). Ignored tokens are dropped before any work (a host sync, fine on this path):
they get loss 0, lse 0 and no gradient.
"""

from __future__ import annotations

import torch

from .engine import ShardGradRequest, ShardInputs, ShardStatistics
from .kernels.softmax_merge import merge_partials, softmax_shift
from .options import LCEOptions
from .terms import (
    GradCoefficients,
    grad_coefficients,
    refuse_double_backward,
    refuse_function_transforms,
    target_nll,
    token_loss,
)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    opts: LCEOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear + cross-entropy in chunks, with the semantics of ``fused_lce.options``.

    Inputs are assumed validated by the caller (shapes, dtypes, devices, target range).

    Args:
        hidden: (N, D) float16/bfloat16/float32/float64 activations, already flattened.
        weight: (V, D) classifier weight, same dtype; rows at or past ``opts.num_classes`` are
            padding and get zero gradient.
        target: (N,) integer class ids; ``opts.ignore_index`` marks ignored tokens.
        bias: (V,) same dtype, or None.
        opts: the call's options; ``chunk_by``, ``vocab_chunk`` and ``token_chunk`` pick the
            chunking.

    Returns:
        (loss, lse). loss: a scalar for "mean"/"sum", (N,) for "none". lse: (N,) logsumexp of
        the soft-capped logits, 0 for ignored tokens. Both fp32, or fp64 for fp64 inputs.

    Raises:
        ValueError: ``chunk_by="tokens"`` with ``reduction="none"``.
    """
    if opts.chunk_by == "tokens" and opts.reduction not in ("mean", "sum"):
        raise ValueError(
            f"chunk_by='tokens' computes gradients in the forward and needs a scalar loss: "
            f"reduction must be 'mean' or 'sum', got reduction={opts.reduction!r}"
        )
    if opts.num_classes is not None:
        # Autograd of the slice gives the padding rows their zero gradient.
        weight = weight[: opts.num_classes]
        bias = None if bias is None else bias[: opts.num_classes]
    if opts.chunk_by == "tokens":
        # Inside Function.forward grad mode is off and needs_input_grad ignores no_grad, so
        # whether to do the gradient work is decided here.
        grad_on = torch.is_grad_enabled()
        needs = tuple(grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias))
        return _TokenChunkedLCE.apply(hidden, weight, bias, target, opts, needs)
    return _VocabChunkedLCE.apply(hidden, weight, bias, target, opts)


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16/32-bit inputs, fp64 for fp64: the dtype of all elementwise math."""
    return torch.promote_types(dtype, torch.float32)


def _valid_rows(target: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """Indices (N_valid,) of non-ignored tokens, or None when none is ignored (no copy needed)."""
    valid = target != ignore_index
    if bool(valid.all()):
        return None
    return valid.nonzero().squeeze(1)


def _take(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


def _put(values: torch.Tensor, rows: torch.Tensor | None, n: int) -> torch.Tensor:
    """Scatter per-valid-token ``values`` (N_valid, ...) back to (n, ...), zeros elsewhere."""
    if rows is None:
        return values
    out = values.new_zeros((n, *values.shape[1:]))
    return out.index_copy_(0, rows, values)


def _row_slice(x: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if x is None else x[start:stop]


class _LogitScratch:
    """Reused storage for one chunk of logits, so the chunk loops allocate nothing big per step.

    The matmul writes into ``mm`` in the inputs' dtype. For 16-bit inputs the fp32 math runs on
    a copy in ``up``; for fp32/fp64 inputs it runs in place on ``mm``. Views are taken from the
    front of flat storage so a ragged last chunk is still a contiguous ``out=`` target.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.mm = torch.empty(numel, dtype=dtype, device=device)
        compute = _compute_dtype(dtype)
        self.up = None if compute == dtype else torch.empty(numel, dtype=compute, device=device)

    def logits(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """Soft-capped logits (rows, cols) in the compute dtype, for hidden (rows, D), weight
        (cols, D) and bias (cols,). The result lives in this scratch until the next call."""
        rows, cols = hidden.shape[0], weight.shape[0]
        raw = self.mm[: rows * cols].view(rows, cols)
        torch.matmul(hidden, weight.t(), out=raw)
        z = raw if self.up is None else self.up[: rows * cols].view(rows, cols).copy_(raw)
        if bias is not None:
            z.add_(bias)
        if softcap is not None:
            z.div_(softcap).tanh_().mul_(softcap)
        return z

    def lowered(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (from :meth:`logits`, then overwritten) cast to the inputs' dtype for the
        matmuls. Reuses ``mm``, whose raw logits are no longer needed."""
        if self.up is None:
            return grad
        return self.mm[: grad.numel()].view_as(grad).copy_(grad)


def _local_target(
    target: torch.Tensor, start: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each token's target inside the chunk [start, start + width).

    Returns:
        (local, hit): local (rows, 1) clamped into the chunk so it is always a valid index;
        hit (rows,) whether the target really lies in the chunk.
    """
    local = target.long() - start
    hit = (local >= 0) & (local < width)
    return local.clamp(0, width - 1).unsqueeze(1), hit


def _logit_grad_(
    z: torch.Tensor,
    lse: torch.Tensor,
    coefs: GradCoefficients,
    local: torch.Tensor,
    hit: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """Overwrite a chunk of soft-capped logits with the loss gradient w.r.t. the raw logits.

    Args:
        z: (rows, cols) soft-capped logits of the chunk, compute dtype; overwritten.
        lse: (rows,) the tokens' full-vocabulary lse.
        coefs: from :func:`fused_lce.terms.grad_coefficients`.
        local: (rows, 1) target column within the chunk, from :func:`_local_target`.
        hit: (rows,) whether the target is in the chunk; None means always.
        softcap: the soft-capping constant, or None.

    Returns:
        ``z``, now holding dL/dx (rows, cols).
    """
    p_coef, smooth_coef = coefs.p_coef, coefs.smooth_coef
    # tanh' recovered from the capped value itself; taken before z turns into probabilities.
    slope = None if softcap is None else 1.0 - (z / softcap).square_()
    grad = z.sub_(lse.unsqueeze(1)).exp_().mul_(p_coef.unsqueeze(1))
    # The target's entry is replaced whole (fused_lce.terms: it keeps 1 - p_y precise). Rows
    # whose target is elsewhere write back their own value at the clamped column: no branch,
    # no host sync.
    at_target = coefs.target_grad.to(grad.dtype)
    if hit is not None:
        at_target = torch.where(hit, at_target, grad.gather(1, local).squeeze(1))
    grad.scatter_(1, local, at_target.unsqueeze(1))
    if smooth_coef is not None:
        grad.sub_(smooth_coef.unsqueeze(1))
    if slope is not None:
        grad.mul_(slope)
    return grad


def _accumulate_mm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, with acc wider than a and b for 16-bit inputs (no mixed-dtype addmm)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(torch.mm(a, b))


def _zeros_where_needed(
    tensors: tuple[torch.Tensor | None, ...], needs: tuple[bool, ...]
) -> tuple[torch.Tensor | None, ...]:
    """Explicit zero gradients rather than None, so every input that asked gets a ``.grad``."""
    return tuple(torch.zeros_like(t) if need else None for t, need in zip(tensors, needs))


def _reduce(loss: torch.Tensor, rows: torch.Tensor | None, n: int, reduction: str) -> torch.Tensor:
    """Reduce the per-valid-token ``loss`` (N_valid,) like torch: "mean" of 0 tokens is NaN."""
    if reduction == "none":
        return _put(loss, rows, n)
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / loss.shape[0]


# ---------------------------------------------------------------------------------------------
# chunk_by="vocab": online softmax forward, recomputing backward
# ---------------------------------------------------------------------------------------------


def _fold_into_lse_(z: torch.Tensor, run_max: torch.Tensor, run_sum: torch.Tensor) -> None:
    """Fold a chunk z (rows, cols) into the running max and sum of exp(z - max); overwrites z."""
    chunk_max = z.amax(dim=1)
    chunk_sum = z.sub_(softmax_shift(chunk_max).unsqueeze(1)).exp_().sum(dim=1)
    new_max, new_sum = merge_partials(torch.stack((run_max, chunk_max)),
                                      torch.stack((run_sum, chunk_sum)))
    run_max.copy_(new_max)
    run_sum.copy_(new_sum)


def vocab_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    opts: LCEOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(max, sum of exp(z - max), row sum or None, target logit) per row over ``weight``'s classes.

    The statistics a vocabulary shard contributes; the target logit is 0 where the target is
    not one of ``weight``'s rows (``target`` outside [0, V), e.g. -1 for another shard's class).

    Args:
        hidden: (rows, D); weight: (V, D); bias: (V,) or None; target: (rows,).
    """
    rows, num_classes = hidden.shape[0], weight.shape[0]
    chunk = min(opts.vocab_chunk, num_classes)
    compute = _compute_dtype(hidden.dtype)
    scratch = _LogitScratch(rows * chunk, hidden.dtype, hidden.device)

    def stat(fill: float) -> torch.Tensor:
        return torch.full((rows,), fill, dtype=compute, device=hidden.device)

    run_max, run_sum, target_logit = stat(float("-inf")), stat(0.0), stat(0.0)
    row_sum = stat(0.0) if opts.label_smoothing > 0 else None
    for start in range(0, num_classes, chunk):
        stop = min(start + chunk, num_classes)
        z = scratch.logits(hidden, weight[start:stop], _row_slice(bias, start, stop), opts.softcap)
        local, hit = _local_target(target, start, stop - start)
        target_logit = torch.where(hit, z.gather(1, local).squeeze(1), target_logit)
        if row_sum is not None:
            row_sum.add_(z.sum(dim=1))
        _fold_into_lse_(z, run_max, run_sum)
    return run_max, run_sum, row_sum, target_logit


def _vocab_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    opts: LCEOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (loss, lse, nll), each (rows,), for non-ignored tokens only.

    Args:
        hidden: (rows, D); weight: (V, D); bias: (V,) or None; target: (rows,) in [0, V).
    """
    run_max, run_sum, row_sum, target_logit = vocab_statistics(hidden, weight, bias, target, opts)
    lse = run_max + run_sum.log()
    nll = target_nll(run_max, run_sum, target_logit)
    return token_loss(nll, lse, row_sum, weight.shape[0], opts), lse, nll


def vocab_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    coefs: GradCoefficients,
    opts: LCEOptions,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients for the given rows, recomputing the logits chunk by chunk.

    ``lse`` is over every class (every shard's), so on a vocabulary shard this gives the shard's
    own d_weight and its partial d_hidden; ``target`` outside [0, V) adds no one-hot term.

    Args:
        hidden: (rows, D); weight: (V, D); bias: (V,) or None; target: (rows,); lse: (rows,).
        coefs: per-token coefficients from :func:`fused_lce.terms.grad_coefficients`.
        opts: the call's options.
        needs: whether hidden, weight, bias need a gradient.

    Returns:
        (d_hidden (rows, D) in the compute dtype, d_weight (V, D) in weight's dtype,
        d_bias (V,) in the compute dtype), None where not needed.
    """
    rows, num_classes = hidden.shape[0], weight.shape[0]
    chunk = min(opts.vocab_chunk, num_classes)
    compute = _compute_dtype(hidden.dtype)
    scratch = _LogitScratch(rows * chunk, hidden.dtype, hidden.device)
    need_h, need_w, need_b = needs
    d_hidden = hidden.new_zeros(hidden.shape, dtype=compute) if need_h else None
    d_weight = weight.new_empty(weight.shape) if need_w else None
    d_bias = weight.new_empty(num_classes, dtype=compute) if need_b else None
    for start in range(0, num_classes, chunk):
        stop = min(start + chunk, num_classes)
        w_chunk = weight[start:stop]
        z = scratch.logits(hidden, w_chunk, _row_slice(bias, start, stop), opts.softcap)
        local, hit = _local_target(target, start, stop - start)
        grad = _logit_grad_(z, lse, coefs, local, hit, opts.softcap)
        if need_b:
            torch.sum(grad, dim=0, out=d_bias[start:stop])
        grad = scratch.lowered(grad)
        if need_h:
            _accumulate_mm_(d_hidden, grad, w_chunk)
        if need_w:
            # The chunk's rows of d_weight see every token in one matmul: no accumulator needed.
            torch.mm(grad.t(), hidden, out=d_weight[start:stop])
    return d_hidden, d_weight, d_bias


def _upstream_token_grad(
    grad_loss: torch.Tensor | None,
    rows: torch.Tensor | None,
    n_valid: int,
    reduction: str,
    like: torch.Tensor,
) -> torch.Tensor:
    """Upstream gradient g (N_valid,) of each non-ignored token's loss, in ``like``'s dtype."""
    if grad_loss is None:
        return like.new_zeros(n_valid)
    grad_loss = grad_loss.to(like.dtype)
    if reduction == "none":
        return _take(grad_loss, rows)
    if reduction == "mean":
        grad_loss = grad_loss / n_valid
    return grad_loss.expand(n_valid)


class _VocabChunkedLCE(torch.autograd.Function):
    """(loss, lse) by online softmax over vocabulary chunks; the backward recomputes logits."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        opts: LCEOptions,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        compute = _compute_dtype(hidden.dtype)
        rows = _valid_rows(target, opts.ignore_index)
        n_valid = n if rows is None else rows.numel()
        if n_valid > 0:
            loss, lse, nll = _vocab_forward(
                _take(hidden, rows), weight, bias, _take(target, rows), opts
            )
        else:
            loss = lse = nll = hidden.new_zeros(0, dtype=compute)
        ctx.save_for_backward(hidden, weight, bias, target, lse, nll, rows)
        ctx.opts = opts
        # Unused outputs arrive as None instead of zero tensors: skip their work.
        ctx.set_materialize_grads(False)
        return _reduce(loss, rows, n, opts.reduction), _put(lse, rows, n)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor | None, grad_lse: torch.Tensor | None):
        refuse_double_backward("linear_cross_entropy(impl='chunked')")
        refuse_function_transforms("linear_cross_entropy(impl='chunked')", grad_loss, grad_lse)
        hidden, weight, bias, target, lse, nll, rows = ctx.saved_tensors
        opts: LCEOptions = ctx.opts
        needs = tuple(ctx.needs_input_grad[:3])
        n_valid = lse.shape[0]
        if n_valid == 0 or (grad_loss is None and grad_lse is None):
            return (*_zeros_where_needed((hidden, weight, bias), needs), None, None)
        g = _upstream_token_grad(grad_loss, rows, n_valid, opts.reduction, lse)
        grad_lse = None if grad_lse is None else _take(grad_lse.to(lse.dtype), rows)
        coefs = grad_coefficients(g, lse, nll, grad_lse, weight.shape[0], opts)
        d_hidden, d_weight, d_bias = vocab_backward(
            _take(hidden, rows), weight, bias, _take(target, rows), lse, coefs, opts, needs
        )
        if d_hidden is not None:
            d_hidden = _put(d_hidden.to(hidden.dtype), rows, hidden.shape[0])
        if d_bias is not None:
            d_bias = d_bias.to(bias.dtype)
        return d_hidden, d_weight, d_bias, None, None


# ---------------------------------------------------------------------------------------------
# chunk_by="tokens": gradients computed in the forward
# ---------------------------------------------------------------------------------------------


def _token_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    scale: float,
    opts: LCEOptions,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """Summed loss, per-token lse and the input gradients of ``scale * summed loss``.

    Args:
        hidden: (rows, D) non-ignored tokens; weight: (V, D); bias: (V,) or None;
            target: (rows,) in [0, V).
        scale: d(reduced loss)/d(token loss): 1 for "sum", 1 / rows for "mean".
        opts: the call's options.
        needs: whether hidden, weight, bias need a gradient.

    Returns:
        (loss_sum (), lse (rows,), (d_hidden (rows, D), d_weight (V, D), d_bias (V,))): losses
        in the compute dtype, gradients in the inputs' dtype, None where not needed.
    """
    rows, num_classes = hidden.shape[0], weight.shape[0]
    chunk = min(opts.token_chunk, rows)
    compute = _compute_dtype(hidden.dtype)
    scratch = _LogitScratch(chunk * num_classes, hidden.dtype, hidden.device)
    need_h, need_w, need_b = needs
    d_hidden = hidden.new_empty(hidden.shape) if need_h else None
    d_weight = weight.new_zeros(weight.shape, dtype=compute) if need_w else None
    d_bias = weight.new_zeros(num_classes, dtype=compute) if need_b else None
    loss_sum = hidden.new_zeros((), dtype=compute)
    lse = hidden.new_empty(rows, dtype=compute)
    for start in range(0, rows, chunk):
        stop = min(start + chunk, rows)
        h_chunk, local = hidden[start:stop], target[start:stop].long().unsqueeze(1)
        z = scratch.logits(h_chunk, weight, bias, opts.softcap)
        row_max = z.amax(dim=1)
        sum_exp = torch.exp(z - row_max.unsqueeze(1)).sum(dim=1)
        lse_chunk = row_max + sum_exp.log()
        lse[start:stop] = lse_chunk
        row_sum = z.sum(dim=1) if opts.label_smoothing > 0 else None
        nll = target_nll(row_max, sum_exp, z.gather(1, local).squeeze(1))
        loss_sum += token_loss(nll, lse_chunk, row_sum, num_classes, opts).sum()
        if not any(needs):
            continue
        g = lse_chunk.new_full(lse_chunk.shape, scale)
        coefs = grad_coefficients(g, lse_chunk, nll, None, num_classes, opts)
        grad = _logit_grad_(z, lse_chunk, coefs, local, None, opts.softcap)
        if need_b:
            d_bias.add_(grad.sum(dim=0))
        grad = scratch.lowered(grad)
        if need_h:
            # A token chunk's rows of d_hidden see the whole vocabulary in one matmul.
            torch.mm(grad, weight, out=d_hidden[start:stop])
        if need_w:
            _accumulate_mm_(d_weight, grad.t(), h_chunk)
    if d_weight is not None:
        d_weight = d_weight.to(weight.dtype)
    if d_bias is not None:
        d_bias = d_bias.to(bias.dtype)
    return loss_sum, lse, (d_hidden, d_weight, d_bias)


class _TokenChunkedLCE(torch.autograd.Function):
    """Scalar loss with gradients computed in the forward, token chunk by token chunk.

    The backward scales the stored gradients by the scalar upstream gradient. The returned lse
    is marked non-differentiable: this mode does not propagate gradients through it.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        opts: LCEOptions,
        needs: tuple[bool, bool, bool],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        compute = _compute_dtype(hidden.dtype)
        rows = _valid_rows(target, opts.ignore_index)
        n_valid = n if rows is None else rows.numel()
        if n_valid == 0:
            loss_sum = hidden.new_zeros((), dtype=compute)
            lse = hidden.new_zeros(0, dtype=compute)
            d_hidden, d_weight, d_bias = _zeros_where_needed((hidden, weight, bias), needs)
        else:
            scale = 1.0 / n_valid if opts.reduction == "mean" else 1.0
            loss_sum, lse, (d_hidden, d_weight, d_bias) = _token_chunks(
                _take(hidden, rows), weight, bias, _take(target, rows), scale, opts, needs
            )
            if d_hidden is not None:
                d_hidden = _put(d_hidden, rows, n)
        ctx.save_for_backward(d_hidden, d_weight, d_bias)
        # "mean" of no tokens is 0 / 0 = NaN, as in torch.
        loss = loss_sum if opts.reduction == "sum" else loss_sum / n_valid
        lse = _put(lse, rows, n)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_lse: torch.Tensor | None):
        refuse_double_backward("linear_cross_entropy(impl='chunked', chunk_by='tokens')")
        d_hidden, d_weight, d_bias = ctx.saved_tensors
        # None only for inputs that asked for no gradient.
        scaled = tuple(None if d is None else d * grad_loss for d in (d_hidden, d_weight, d_bias))
        return (*scaled, None, None, None)


class ChunkedShard:
    """The vocabulary chunks on one shard: an engine.LCEFunction shard strategy (the vocab-
    parallel layer's chunked impl; the single-device chunked path keeps its own Functions)."""

    @staticmethod
    def statistics(inputs: ShardInputs):
        hidden, weight, target = inputs.hidden, inputs.weight, inputs.target
        valid = (target != inputs.opts.ignore_index).nonzero().squeeze(1)
        local = target.index_select(0, valid) - inputs.vocab_start
        local = torch.where((local >= 0) & (local < weight.shape[0]), local, -1)
        stats = vocab_statistics(hidden.index_select(0, valid), weight, inputs.bias, local,
                                 inputs.opts)
        n = hidden.shape[0]
        fills = (float("-inf"), 0.0, 0.0, 0.0)
        full = []
        for value, fill in zip(stats, fills):
            if value is None:
                full.append(None)
                continue
            out = torch.full((n,), fill, dtype=value.dtype, device=value.device)
            full.append(out.index_copy_(0, valid, value))
        return (valid, local), ShardStatistics(*full)

    @staticmethod
    def backward(state, inputs: ShardInputs, request: ShardGradRequest):
        valid, local = state
        hidden, bias, needs = inputs.hidden, inputs.bias, request.needs
        pick = lambda t: None if t is None else t.index_select(0, valid)  # noqa: E731
        coefs = request.coefs
        coefs = GradCoefficients(
            pick(coefs.p_coef), pick(coefs.target_grad), pick(coefs.smooth_coef)
        )
        d_rows, d_weight, d_bias = vocab_backward(
            hidden.index_select(0, valid), inputs.weight, bias, local, pick(request.lse), coefs,
            inputs.opts, (True, needs[1], needs[2]),
        )
        partial_dtype = request.d_hidden_dtype
        d_hidden = torch.zeros(hidden.shape, dtype=partial_dtype, device=hidden.device)
        d_hidden.index_copy_(0, valid, d_rows.to(partial_dtype))
        if d_bias is not None:
            d_bias = d_bias.to(bias.dtype)
        accumulator = request.d_weight_accumulator
        if accumulator is not None and d_weight is not None:
            accumulator.add_(d_weight)
            d_weight = None
        return d_hidden, d_weight, d_bias
