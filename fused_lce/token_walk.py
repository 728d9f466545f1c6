"""The token walk: gradients computed in the forward, three GEMMs instead of four, exact, with a
checked fallback. The default path of ``linear_cross_entropy`` reads top to bottom here: the plan,
the chunk loop, then the Triton strategy's per-chunk state.

An exact loss that stores no logits pays four N x V x D GEMMs: the forward's logits, their
recompute in the backward, and the two gradient GEMMs. Where the gradient reaching the loss is
known in the forward up to one scalar, the logits can become the logit gradient G at once:

    for each token chunk (rows x V_local, 16-bit logits in one reused buffer):
        z      = E_chunk @ C.T                    cuBLAS, into the buffer
        stats  = max, sum-exp, target logit       kernels/logit_rows.py, over the buffer
                 (combined across vocab shards)   global_statistics, through the ShardReducer
        G      = dL/dz, written over z            kernels/logit_rows.py
        dE    += G @ C,  dC += G.T @ E_chunk      cuBLAS

The backward only scales the stored gradients by that scalar. When is the gradient known up to a
scalar? For "mean" and "sum" the upstream gradient of a scalar loss is one number. For "none"
the op assumes the per-token gradient is ``c * mask`` (``loss_mask``, default: every non-ignored
token), which is what Megatron's ``sum(losses * loss_mask)`` gives; the backward checks that
assumption and, where it fails, recomputes exactly or returns NaN gradients
(fused_lce/upstream.py). Without a ``loss_mask`` a "none" loss takes the recomputing backward,
exact for any upstream gradient.

For bf16 inputs the chunk walk stores exponentials instead (kernels/exp_logits.py): the GEMM's
epilogue writes exp(z - z_y) and the row statistics, so the two passes go, and the gradient GEMMs
scale rows of their other operand and of their output. A row out of the exponentials' range (a
loss over 55 nats, a non-finite logit) is recomputed on the device, with no host read.

Memory: one chunk of logits, the stored dE (N x D, fp32 across vocab shards), the weight gradient
(its own size) and, past two token chunks, an fp32 weight-gradient accumulator (V_local x D x 4)
so that it is rounded once rather than once per chunk. ``plan_forward_gradients`` sizes it.

The loop is every strategy's: the Triton one (``ExpGradientChunks``, ``TritonGradientChunks``
below), chunked PyTorch (fused_lce/chunked.py, ``chunk_by="tokens"``) and a rank holding only
vocabulary padding (fused_lce/shard.py's ``EmptyShard``), which must take part in the same
collectives per chunk. So this module loads no kernel when imported: Triton is optional
(setup.py), and without it the chunked strategy walks from here.
"""

from __future__ import annotations

import torch

from .fp32_products import accumulate_mm, accumulate_mv, mm_into
from .options import LCEOptions
from .shard import (
    ForwardGradPlan,
    GradientChunks,
    ShardCall,
    ShardInputs,
    ShardStatistics,
    global_statistics,
)
from .terms import GradCoefficients, grad_coefficients, lse_and_nll

# ---------------------------------------------------------------------------------------------
# The plan: how many tokens a chunk takes, and how the weight gradient sums
# ---------------------------------------------------------------------------------------------


# The default chunk holds at most half the tokens' logits (torch.compile holds all of them) and at
# most this many bytes, so memory stops growing with N. At Gemma-2's V = 256000, 2 GiB is 4194
# tokens of bf16 logits; at N = 8192 two chunks of 4096.
DEFAULT_CHUNK_BYTES = 2 * 2**30
# Below this many rows the chunk GEMMs stop filling an H100 (a 1024 x V x D GEMM runs at ~80% of
# a 4096-row one): a tighter budget then takes the recompute backward instead.
MIN_CHUNK_ROWS = 1024
# With more token chunks than this, the weight gradient accumulates in fp32 (V x D x 4 bytes);
# up to it, in its own dtype (one extra rounding, as for a second micro-batch). With
# fp32_weight_grad=False always in its own dtype, one rounding a chunk.
MAX_CHUNKS_WITHOUT_FP32_ACCUMULATOR = 2
# Chunks are whole multiples of this many rows (the GEMMs' tile height, twice over).
TILE_ROWS = 256


def token_walk_plan(call: ShardCall, n_rows: int, weight, input, needs
                    ) -> ForwardGradPlan | None:
    """The gradient-in-forward plan, where the strategy has one: training walks it computing
    gradients, evaluation (no gradient wanted) computing only the statistics. Decided by the
    group's strategy from what every rank shares (the padded shard's rows), so every rank walks
    the same chunks, a rank of vocabulary padding too."""
    opts = call.opts
    if opts.reduction == "none" and call.loss_mask is None and opts.upstream_mismatch == "auto":
        return None  # no mask to assume: the recomputing backward is exact for any upstream
    # Evaluation plans as training with every gradient wanted, so it walks the same chunks.
    wants_weight_grad = needs[1] or not any(needs)
    return call.strategy.plan_forward_gradients(
        call.opts, n_rows, weight.shape[0], input.shape[-1], input.element_size(),
        wants_weight_grad, input.dtype,
    )


def plan_forward_gradients(
    opts: LCEOptions,
    n_rows: int,
    weight_rows: int,
    d_model: int,
    elem_bytes: int,
    wants_weight_grad: bool,
    dtype: torch.dtype | None = None,
) -> ForwardGradPlan | None:
    """The plan, or None where the recompute backward must run instead.

    ``weight_rows`` counts the shard's rows with vocabulary padding, equal on every rank, so
    every rank walks the same chunks (each chunk is a collective). An explicit
    ``token_chunk_size`` fixes the chunk; an explicit ``scratch_mb`` bounds the chunk and the
    accumulator, and below ``MIN_CHUNK_ROWS`` rows of it the recompute backward (whose buffers
    fit any budget) runs.
    """
    if opts.backward not in ("auto", "in_forward") or opts.keep_logits or n_rows == 0:
        return None
    if opts.backward == "auto" and dtype == torch.float16:
        # fp16 ends at 2^-24: a gradient formed for an upstream gradient of 1 (a mean's 1/N
        # times a softmax entry, or d_hidden ~ |w| / N) lands below it where torch's, scaled by
        # GradScaler's 2^16 before its cast, does not. The recomputing backward knows the scale.
        return None
    row_bytes = max(weight_rows, 1) * elem_bytes
    if opts.token_chunk_explicit:
        rows = min(opts.token_chunk, n_rows)
    else:
        half = -(-n_rows // 2 // TILE_ROWS) * TILE_ROWS
        cap = DEFAULT_CHUNK_BYTES // row_bytes // TILE_ROWS * TILE_ROWS
        rows = max(min(n_rows, max(MIN_CHUNK_ROWS, half), cap), min(n_rows, MIN_CHUNK_ROWS))
    accumulates = wants_weight_grad and opts.fp32_weight_grad
    if opts.scratch_explicit and not opts.token_chunk_explicit:
        rows = min(rows, _tile_rows(opts.scratch_bytes // row_bytes))
        if accumulates and _chunks(n_rows, rows) > MAX_CHUNKS_WITHOUT_FP32_ACCUMULATOR:
            # Past two chunks the fp32 accumulator comes out of the same budget.
            left = max(opts.scratch_bytes - weight_rows * d_model * 4, 0)
            rows = min(rows, _tile_rows(left // row_bytes))
        if rows < min(n_rows, MIN_CHUNK_ROWS):
            if opts.backward == "in_forward":
                raise ValueError(
                    f"backward='in_forward' needs at least {min(n_rows, MIN_CHUNK_ROWS)} tokens of "
                    f"logits ({weight_rows} columns) within scratch_mb={opts.scratch_mb}: raise "
                    "scratch_mb or use backward='auto'"
                )
            return None
    accumulate = accumulates and _chunks(n_rows, rows) > MAX_CHUNKS_WITHOUT_FP32_ACCUMULATOR
    return ForwardGradPlan(chunk_rows=rows, fp32_weight_accumulator=accumulate,
                           exponentials=exponentials_apply(opts, dtype))


def exponentials_apply(opts: LCEOptions, dtype: torch.dtype | None) -> bool:
    """Whether the Triton walk stores exponentials (kernels/exp_logits.py) rather than logits
    that two passes then normalise: for bf16 inputs (fp16's range ends at exp(11)) without label
    smoothing (its uniform term is no row scale of the exponentials)."""
    return dtype == torch.bfloat16 and opts.label_smoothing == 0


def _tile_rows(rows: int) -> int:
    """``rows`` down to whole GEMM tiles (where there is one)."""
    return rows // TILE_ROWS * TILE_ROWS if rows >= TILE_ROWS else rows


def _chunks(n_rows: int, rows: int) -> int:
    return -(-n_rows // max(rows, 1))


# ---------------------------------------------------------------------------------------------
# The loop: one chunk at a time, every strategy alike
# ---------------------------------------------------------------------------------------------


def walk_token_chunks(strategy, inputs: ShardInputs, call: ShardCall, plan, needs,
                      d_hidden_dtype, assumed):
    """((lse, nll, row_sum), (d_hidden, d_weight, d_bias) for the per-token upstream gradient
    ``assumed``), token chunk by token chunk (module docstring). With ``assumed`` None
    (evaluation) only the statistics. Per token it keeps only lse, nll and the row sum: under a
    tight budget the chunk buffer and these are its memory."""
    n_rows = inputs.hidden.shape[0]
    opts = call.opts
    chunks = strategy.gradient_chunks(inputs, plan, needs, d_hidden_dtype)
    # Every chunk's offsets in one launch and one collective, ahead of the walk.
    offsets = (call.reducer.all_reduce_sum_(chunks.target_logits()) if plan.exponentials
               else None)
    kept = None
    for start in range(0, n_rows, plan.chunk_rows):
        rows = slice(start, min(n_rows, start + plan.chunk_rows))
        chunks.compute_logits(rows, None if offsets is None else offsets[rows])
        stats = global_statistics(chunks.statistics(rows), call.reducer)
        if kept is None:
            kept = tuple(None if x is None else x.new_empty(n_rows)
                         for x in (stats.sum_exp, stats.sum_exp, stats.row_sum))
        lse, nll, row_sum = lse_nll(stats, tuple(None if x is None else x[rows] for x in kept))
        if assumed is not None:
            coefs = grad_coefficients(assumed[rows], lse, nll, None, call.num_classes, opts)
            chunks.gradients(rows, lse, coefs)
    return kept, chunks.finish()


def lse_nll(stats: ShardStatistics, out: tuple | None = None):
    """(lse, nll, row_sum) per token from the global statistics, into ``out``'s three vectors
    where given (row_sum's may be None)."""
    lse, nll = lse_and_nll(stats.row_max, stats.sum_exp, stats.target_logit,
                           None if out is None else out[:2])
    row_sum = stats.row_sum
    if out is not None and row_sum is not None:
        row_sum = out[2].copy_(row_sum)
    return lse, nll, row_sum


# ---------------------------------------------------------------------------------------------
# The Triton strategy's per-chunk state
# ---------------------------------------------------------------------------------------------
# Each method imports the kernels it launches: importing this module must load no Triton (the
# chunked strategy walks with the loop above where Triton is not installed, and importing
# fused_lce loads no kernel), and TritonShard, their one user, is only imported where Triton is.


def triton_gradient_chunks(inputs: ShardInputs, plan: ForwardGradPlan, needs,
                           d_hidden_dtype) -> GradientChunks:
    """The Triton strategy's chunk state for ``plan`` (``TritonShard.gradient_chunks``)."""
    if plan.exponentials:
        return ExpGradientChunks(inputs, plan, needs, d_hidden_dtype)
    return TritonGradientChunks(inputs, plan, needs, d_hidden_dtype)


class _ChunkGradients:
    """What both Triton walks accumulate over the chunks, and how they hand it over: the input
    gradient's rows, the weight gradient (fp32 past two chunks) and the bias gradient (fp32)."""

    def __init__(self, inputs: ShardInputs, plan: ForwardGradPlan, needs, d_hidden_dtype):
        hidden, weight, bias = inputs.hidden, inputs.weight, inputs.bias
        self.inputs = inputs
        self.bias = unit_stride(bias)
        self.buffer = None  # the chunk's logits (or exponentials), one chunk at a time
        device, n_rows, d_model = hidden.device, hidden.shape[0], hidden.shape[1]
        want_hidden, want_weight, want_bias = needs
        self.d_hidden = (torch.empty((n_rows, d_model), device=device, dtype=d_hidden_dtype)
                         if want_hidden else None)
        self.d_weight = None
        if want_weight:
            acc_dtype = torch.float32 if plan.fp32_weight_accumulator else weight.dtype
            self.d_weight = torch.empty(weight.shape, device=device, dtype=acc_dtype)
        self.d_bias = (torch.zeros(weight.shape[0], device=device, dtype=torch.float32)
                       if want_bias and bias is not None else None)
        self.first_chunk = True

    def _add_weight_grad(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """d_weight += a @ b; the first chunk writes, so d_weight starts uninitialised."""
        if self.first_chunk:
            mm_into(self.d_weight, a, b)
        else:
            accumulate_mm(self.d_weight, a, b)

    def finish(self):
        """(d_hidden, d_weight, d_bias) for an upstream gradient of 1; frees the buffer."""
        self.buffer = None
        d_weight = self.d_weight
        if d_weight is not None and d_weight.dtype != self.inputs.weight.dtype:
            d_weight = d_weight.to(self.inputs.weight.dtype)
        d_bias = self.d_bias
        if d_bias is not None:
            d_bias = d_bias.to(self.inputs.bias.dtype)
        return self.d_hidden, d_weight, d_bias


class ExpGradientChunks(_ChunkGradients):
    """The gradient-in-forward walk on one shard for bf16 inputs (kernels/exp_logits.py): the
    GEMM's epilogue stores a token chunk's exponentials offset by the target logits, with their
    row sums, and cuBLAS takes them as they are for both gradients, scaling rows of the other
    operand and of the output. Nothing rereads the chunk to normalise it. The target columns'
    terms of the weight and bias gradients are added once, after the last chunk: one sort and
    one launch a call, and one rounding of a 16-bit weight gradient.

    Its temporaries live in memory idle at the time: the per-tile sums, then the weight
    gradient's scaled operand, in the chunk's rows of the input gradient, which only the
    chunk's last GEMM writes. So the walk holds what the two-pass walk held: one chunk buffer.
    """

    def __init__(self, inputs: ShardInputs, plan: ForwardGradPlan, needs, d_hidden_dtype):
        super().__init__(inputs, plan, needs, d_hidden_dtype)
        hidden, weight = inputs.hidden, inputs.weight
        self.opts = inputs.opts
        # Evaluation (no gradient wanted) stores nothing: the epilogue's sums are the loss.
        self.buffer = (torch.empty((plan.chunk_rows, weight.shape[0]), device=hidden.device,
                                   dtype=hidden.dtype) if any(needs) else None)
        self.all_columns = None  # every row's target column (kernels/exp_logits.py's codes)
        self.columns = self.offsets = self.stats = None  # the current chunk's
        # Every row's target-column gradient, for the weight and bias gradients' target terms.
        self.target_grads = (torch.empty(hidden.shape[0], device=hidden.device,
                                         dtype=torch.float32)
                             if self.d_weight is not None or self.d_bias is not None else None)

    def target_logits(self) -> torch.Tensor:
        from .kernels import exp_logits

        inputs, opts = self.inputs, self.opts
        logits, self.all_columns = exp_logits.target_logits(
            inputs.hidden, inputs.weight, self.bias, inputs.target,
            vocab_start=inputs.vocab_start, ignore_index=opts.ignore_index, softcap=opts.softcap,
            round_16bit=opts.rounds_logits(inputs.hidden.dtype),
        )
        return logits

    def compute_logits(self, rows: slice, offsets: torch.Tensor | None = None) -> None:
        """The chunk's exponentials into the buffer, against ``offsets``: the chunk's rows of
        every shard's sum of ``target_logits``."""
        from .kernels.exp_logits import exp_logits, partial_count

        inputs, opts = self.inputs, self.opts
        hidden = inputs.hidden[rows]
        self.columns, self.offsets = self.all_columns[rows], offsets
        out = None if self.buffer is None else self.buffer[: hidden.shape[0]]
        partials = self._idle(rows, torch.float32,
                              partial_count(hidden.shape[0], inputs.weight.shape[0],
                                            hidden.device))
        row_max, sum_exp, target_logit = exp_logits(
            hidden, inputs.weight, self.bias, self.columns, offsets, out, softcap=opts.softcap,
            round_16bit=opts.rounds_logits(hidden.dtype), partials=partials,
            tma=opts.tma_allowed,
        )
        self.stats = ShardStatistics(row_max, sum_exp, None, target_logit)

    def statistics(self, rows: slice) -> ShardStatistics:
        """The statistics of the chunk whose exponentials ``compute_logits`` stored; ignored
        rows get placeholders (lse and nll 0 on one shard)."""
        return self.stats

    def gradients(self, rows: slice, lse: torch.Tensor, coefs: GradCoefficients) -> None:
        """The chunk's share of every gradient, from its exponentials and per-row scales."""
        from .kernels.exp_logits import repair_exponentials
        from .kernels.exp_logits_grad import finish_input_grad, row_scales

        hidden, weight, opts = self.inputs.hidden[rows], self.inputs.weight, self.opts
        exps = self.buffer[: hidden.shape[0]]
        repair_exponentials(hidden, weight, self.bias, self.columns, self.offsets, lse, exps,
                            softcap=opts.softcap, round_16bit=opts.rounds_logits(hidden.dtype))
        scaled = None
        if self.d_weight is not None:
            n_rows, d_model = hidden.shape
            scaled = self._idle(rows, hidden.dtype, n_rows * d_model)
            scaled = (torch.empty_like(hidden, memory_format=torch.contiguous_format)
                      if scaled is None else scaled.view(n_rows, d_model))
        scale, target_grad = row_scales(
            hidden, lse, self.offsets, coefs.p_coef, coefs.target_grad, self.columns,
            softcap=opts.softcap, out=scaled,
            target_grad_out=None if self.target_grads is None else self.target_grads[rows])
        if self.d_weight is not None:
            # Before the input gradient's GEMM, which overwrites ``scaled``'s memory.
            self._add_weight_grad(exps.t(), scaled)
        if self.d_bias is not None:
            accumulate_mv(self.d_bias, exps.t(), scale)
        if self.d_hidden is not None:
            grad = self.d_hidden[rows]
            mm_into(grad, exps, weight)
            finish_input_grad(grad, weight, scale, target_grad, self.columns)
        self.first_chunk = False

    def finish(self):
        from .kernels.exp_logits_grad import add_target_rows

        if self.target_grads is not None:
            add_target_rows(self.d_weight, self.inputs.hidden, self.target_grads,
                            self.all_columns, self.d_bias)
        return super().finish()

    def _idle(self, rows: slice, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        """``numel`` elements of ``dtype`` over the chunk's rows of the input gradient, or None
        where there is no such gradient or it is too small."""
        if self.d_hidden is None:
            return None
        flat = self.d_hidden[rows].reshape(-1).view(torch.uint8)
        start = -flat.data_ptr() % 16  # the GEMMs and kernels want aligned rows
        end = start + numel * dtype.itemsize
        return flat[start:end].view(dtype) if end <= flat.numel() else None


class TritonGradientChunks(_ChunkGradients):
    """The gradient-in-forward walk on one shard for 16- and 32-bit inputs: cuBLAS writes a
    token chunk's logits into one buffer, the logit_rows kernels take their statistics and turn
    them into G in place, and cuBLAS consumes G for both gradients."""

    def __init__(self, inputs: ShardInputs, plan: ForwardGradPlan, needs, d_hidden_dtype):
        from .kernels.common import INTERPRET

        super().__init__(inputs, plan, needs, d_hidden_dtype)
        hidden, weight = inputs.hidden, inputs.weight
        self.plan = plan
        self.chunk_targets = None  # the current chunk's, as columns of this shard
        # Under Triton's interpreter (which truncates rather than rounds to 16 bits) the buffer
        # is fp32 holding torch-rounded 16-bit logits, and torch rounds G: the GPU's numerics.
        self.emulate_16bit = INTERPRET and hidden.element_size() < 4
        buffer_dtype = torch.float32 if self.emulate_16bit else hidden.dtype
        self.buffer = torch.empty((plan.chunk_rows, weight.shape[0]), device=hidden.device,
                                  dtype=buffer_dtype)

    def target_logits(self) -> torch.Tensor:
        raise NotImplementedError("this walk stores logits, not exponentials")

    def compute_logits(self, rows: slice, offsets: torch.Tensor | None = None) -> None:
        """The chunk's logits into the buffer (reads no target)."""
        hidden, weight = self.inputs.hidden[rows], self.inputs.weight
        logits = self.buffer[: hidden.shape[0]]
        if self.emulate_16bit:
            logits.copy_(hidden @ weight.t())
        else:
            torch.mm(hidden, weight.t(), out=logits)

    def statistics(self, rows: slice) -> ShardStatistics:
        """The statistics of the chunk whose logits ``compute_logits`` left in the buffer, which
        keeps them for ``gradients``."""
        from .kernels.logit_rows import row_statistics

        inputs = self.inputs
        target = inputs.target[rows]
        self.chunk_targets = local_targets(target, target != inputs.opts.ignore_index,
                                           inputs.vocab_start, inputs.weight.shape[0])
        logits = self.buffer[: target.shape[0]]
        row_max, sum_exp, target_logit, row_sum = row_statistics(
            logits, self.bias, self.chunk_targets, inputs.opts.softcap,
            inputs.opts.label_smoothing > 0
        )
        return ShardStatistics(row_max, sum_exp, row_sum, target_logit)

    def gradients(self, rows: slice, lse: torch.Tensor, coefs: GradCoefficients) -> None:
        """G over the chunk's logits, then its share of every gradient."""
        from .kernels.logit_rows import grad_in_place

        hidden, weight = self.inputs.hidden[rows], self.inputs.weight
        logits = self.buffer[: hidden.shape[0]]
        grad = grad_in_place(logits, self.bias, self.chunk_targets, lse, coefs,
                             self.inputs.opts.softcap)
        if self.emulate_16bit:
            grad = grad.to(hidden.dtype)
        if self.d_hidden is not None:
            mm_into(self.d_hidden[rows], grad, weight)
        if self.d_weight is not None:
            self._add_weight_grad(grad.t(), hidden)
        if self.d_bias is not None:
            self.d_bias += grad.sum(dim=0, dtype=torch.float32)
        self.first_chunk = False


def local_targets(
    target: torch.Tensor, valid: torch.Tensor, vocab_start: int, n_local: int
) -> torch.Tensor:
    """Targets as rows of this shard's weight, -1 where another shard (or nobody) owns them: for
    the walk's kernels and the recomputing backward's (fused_lce/triton_shard.py) alike."""
    local = target - vocab_start
    owned = valid & (local >= 0) & (local < n_local)
    return torch.where(owned, local, torch.full_like(local, -1)).to(torch.int32)


def unit_stride(vector: torch.Tensor | None) -> torch.Tensor | None:
    """A per-row or per-column vector as the kernels read it (``ptr + i``)."""
    return None if vector is None else vector.contiguous()
