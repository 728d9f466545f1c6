"""Pure-PyTorch chunked linear cross-entropy: the strategy that runs on any device, CPU included.

``ChunkedShard`` is an engine.LCEFunction shard strategy (fused_lce/shard.py's
``ShardStrategy``), on one device and in the vocab-parallel layer alike; an unfused classifier
head holds the (N, V) logits and their gradient, here they never exist at once.
``LCEOptions.chunk_by`` picks one of two ways to cut them:

``"vocab"`` (default): online softmax over vocabulary chunks. The forward walks ``vocab_chunk``
columns at a time, computing each chunk's logits into one reused buffer and folding it into a
running (max, rescaled sum of exp) per token, plus the target logit and, for label smoothing,
the row sum of logits; the engine saves only the inputs and per-token vectors. The backward walks
the same chunks, recomputes the logits, turns them into the logit gradient in place and
multiplies it out: ``d_hidden`` accumulates over chunks, each chunk owns its rows of
``d_weight``. Memory: O(N * vocab_chunk).

``"tokens"``: gradients in the forward (the token walk, fused_lce/token_walk.py, with
``ChunkedGradientChunks``): ``token_chunk`` tokens at a time with full-vocabulary logits, the
input gradients computed at once for the assumed upstream gradient; the backward scales them, or
recomputes the vocabulary way where the upstream gradient is not the assumed one (a gradient
through the returned lse, say). Memory: O(token_chunk * V) plus the stored gradients.

The logit gradient both modes form, per token with upstream loss gradient g, soft-capped logits
z (z = cap * tanh(x / cap)), p = softmax(z), V classes and target y::

    dL/dz = (g * (1 + 2 * z_loss * lse) + grad_lse) * p - g * (1 - ls) * onehot(y) - g * ls / V
    dL/dx = dL/dz * (1 - (z / cap)**2)

Precision: the matmuls run in the inputs' dtype (the logit gradient is cast down first, as an
unfused head does) with fp32 accumulators, everything elementwise and every cross-chunk
accumulation in fp32 (fp64 for fp64 inputs). The vocabulary way drops ignored tokens before any
work (a host sync, fine on this path).
"""

from __future__ import annotations

import torch

from .fp32_products import accumulate_mm, mm_into, scale_in_fp32_
from .options import LCEOptions
from .shard import (
    ForwardGradPlan,
    ShardGradRequest,
    ShardInputs,
    ShardStatistics,
    compute_dtype,
)
from .softmax_merge import merge_partials, softmax_shift
from .terms import GradCoefficients


def _row_slice(x: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if x is None else x[start:stop]


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


class _LogitScratch:
    """Reused storage for one chunk of logits, so the chunk loops allocate nothing big per step.

    The matmul writes into ``mm`` in the inputs' dtype. For 16-bit inputs the fp32 math runs on
    a copy in ``up``; for fp32/fp64 inputs it runs in place on ``mm``. Views are taken from the
    front of flat storage so a ragged last chunk is still a contiguous ``out=`` target.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.mm = torch.empty(numel, dtype=dtype, device=device)
        compute = compute_dtype(dtype)
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


# ---------------------------------------------------------------------------------------------
# Vocabulary chunks
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
    compute = compute_dtype(hidden.dtype)
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
    compute = compute_dtype(hidden.dtype)
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
            accumulate_mm(d_hidden, grad, w_chunk)
        if need_w:
            # The chunk's rows of d_weight see every token in one matmul: no accumulator needed.
            torch.mm(grad.t(), hidden, out=d_weight[start:stop])
    return d_hidden, d_weight, d_bias


# ---------------------------------------------------------------------------------------------
# The strategy
# ---------------------------------------------------------------------------------------------


class ChunkedShard:
    """Chunked PyTorch on one shard: an engine ``ShardStrategy`` (module docstring)."""

    @staticmethod
    def plan_forward_gradients(opts: LCEOptions, n_rows: int, weight_rows: int, d_model: int,
                               elem_bytes: int, wants_weight_grad: bool,
                               dtype: torch.dtype | None = None) -> ForwardGradPlan | None:
        """Token chunks walk with gradients in the forward (``chunk_by="tokens"``), summing the
        weight gradient in fp32; vocabulary chunks take statistics now, gradients later."""
        if opts.chunk_by != "tokens" or n_rows == 0:
            return None
        return ForwardGradPlan(chunk_rows=min(opts.token_chunk, n_rows),
                               fp32_weight_accumulator=True)

    scale_ = staticmethod(scale_in_fp32_)

    @staticmethod
    def recompute_state(inputs: ShardInputs) -> torch.Tensor:
        """Every row's target as a column of this shard (-1: another shard's, or ignored).
        Ignored rows are computed too, and then dropped: gathering the others would size a
        tensor by a device value, a host sync."""
        target, n_local = inputs.target, inputs.weight.shape[0]
        local = target - inputs.vocab_start
        owned = (target != inputs.opts.ignore_index) & (local >= 0) & (local < n_local)
        return torch.where(owned, local, -1)

    @staticmethod
    def statistics(inputs: ShardInputs):
        local = ChunkedShard.recompute_state(inputs)
        stats = vocab_statistics(inputs.hidden, inputs.weight, inputs.bias, local, inputs.opts)
        valid = inputs.target != inputs.opts.ignore_index
        fills = (float("-inf"), 0.0, 0.0, 0.0)
        full = [None if value is None else torch.where(valid, value, fill)
                for value, fill in zip(stats, fills)]
        return local, ShardStatistics(*full)

    @staticmethod
    def backward(local, inputs: ShardInputs, request: ShardGradRequest):
        hidden, bias, needs = inputs.hidden, inputs.bias, request.needs
        # An ignored row's coefficients are 0; an lse of +inf also makes its softmax 0 (its
        # saved lse is 0, and exp(logit - 0) may overflow into inf * 0).
        valid = inputs.target != inputs.opts.ignore_index
        lse = torch.where(valid, request.lse, float("inf"))
        d_rows, d_weight, d_bias = vocab_backward(
            hidden, inputs.weight, bias, local, lse, request.coefs, inputs.opts,
            (True, needs[1], needs[2]),
        )
        d_hidden = d_rows.to(request.d_hidden_dtype)
        if d_bias is not None:
            d_bias = d_bias.to(bias.dtype)
        accumulator = request.d_weight_accumulator
        if accumulator is not None and d_weight is not None:
            accumulator.add_(d_weight)
            d_weight = None
        return d_hidden, d_weight, d_bias

    @staticmethod
    def gradient_chunks(inputs: ShardInputs, plan: ForwardGradPlan, needs, d_hidden_dtype):
        return ChunkedGradientChunks(inputs, plan, needs, d_hidden_dtype)


class ChunkedGradientChunks:
    """The token walk of ``chunk_by="tokens"`` on one shard (a ``GradientChunks``):
    a chunk's soft-capped logits in the compute dtype, its statistics, then G in their place."""

    def __init__(self, inputs: ShardInputs, plan: ForwardGradPlan, needs, d_hidden_dtype):
        hidden, weight, bias = inputs.hidden, inputs.weight, inputs.bias
        self.inputs = inputs
        self.scratch = _LogitScratch(plan.chunk_rows * weight.shape[0], hidden.dtype,
                                     hidden.device)
        self.logits = self.local = self.hit = None  # the current chunk's
        compute = compute_dtype(hidden.dtype)
        want_hidden, want_weight, want_bias = needs
        self.d_hidden = (hidden.new_empty(hidden.shape, dtype=d_hidden_dtype) if want_hidden
                         else None)
        self.d_weight = weight.new_zeros(weight.shape, dtype=compute) if want_weight else None
        self.d_bias = (weight.new_zeros(weight.shape[0], dtype=compute)
                       if want_bias and bias is not None else None)

    def target_logits(self) -> torch.Tensor:
        raise NotImplementedError("the chunked walk stores logits, not exponentials")

    def compute_logits(self, rows: slice, offsets: torch.Tensor | None = None) -> None:
        inputs = self.inputs
        self.logits = self.scratch.logits(inputs.hidden[rows], inputs.weight, inputs.bias,
                                          inputs.opts.softcap)

    def statistics(self, rows: slice) -> ShardStatistics:
        inputs, z = self.inputs, self.logits
        self.local, self.hit = _local_target(inputs.target[rows] - inputs.vocab_start, 0,
                                             z.shape[1])
        row_max = z.amax(dim=1)
        sum_exp = torch.exp(z - softmax_shift(row_max).unsqueeze(1)).sum(dim=1)
        target_logit = torch.where(self.hit, z.gather(1, self.local).squeeze(1), 0.0)
        row_sum = z.sum(dim=1) if inputs.opts.label_smoothing > 0 else None
        return ShardStatistics(row_max, sum_exp, row_sum, target_logit)

    def gradients(self, rows: slice, lse: torch.Tensor, coefs: GradCoefficients) -> None:
        hidden, weight = self.inputs.hidden[rows], self.inputs.weight
        grad = _logit_grad_(self.logits, lse, coefs, self.local, self.hit,
                            self.inputs.opts.softcap)
        if self.d_bias is not None:
            self.d_bias += grad.sum(dim=0)
        grad = self.scratch.lowered(grad)
        if self.d_hidden is not None:
            # A token chunk's rows of d_hidden see the whole vocabulary in one matmul.
            mm_into(self.d_hidden[rows], grad, weight)
        if self.d_weight is not None:
            accumulate_mm(self.d_weight, grad.t(), hidden)

    def finish(self):
        self.scratch = self.logits = None
        weight, bias = self.inputs.weight, self.inputs.bias
        d_weight = None if self.d_weight is None else self.d_weight.to(weight.dtype)
        d_bias = None if self.d_bias is None else self.d_bias.to(bias.dtype)
        return self.d_hidden, d_weight, d_bias
