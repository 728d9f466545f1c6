"""Gradients computed in the forward: three GEMMs instead of four, exact, with a checked fallback.

An exact loss that stores no logits pays four N x V x D GEMMs: the forward's logits, their
recompute in the backward, and the two gradient GEMMs. Where the gradient reaching the loss is
known in the forward up to one scalar, the logits can become the logit gradient G at once:

    for each token chunk (rows x V_local, 16-bit logits in one reused buffer):
        z      = E_chunk @ C.T                    cuBLAS, into the buffer
        stats  = max, sum-exp, target logit       kernels/logit_rows.py, over the buffer
                 (combined across vocab shards)   the engine, through the ShardReducer
        G      = dL/dz, written over z            kernels/logit_rows.py
        dE    += G @ C,  dC += G.T @ E_chunk      cuBLAS

The backward only scales the stored gradients by that scalar. When is the gradient known up to a
scalar? For "mean" and "sum" the upstream gradient of a scalar loss is one number. For "none"
the op assumes the per-token gradient is ``c * mask`` (``loss_mask``, default: every non-ignored
token), which is what Megatron's ``sum(losses * loss_mask)`` gives; the backward checks that
assumption and, where it fails or the returned lse carries a gradient, recomputes the exact
gradients the four-GEMM way. Reading that verdict is one host sync a backward
(``upstream_mismatch="recompute"``); by default (with a ``loss_mask``, the Megatron adapter's
case) the backward instead returns NaN gradients where it fails, and a later call raises
(fused_lce/faults.py): no host sync, never a silently wrong result. Without a ``loss_mask`` a
"none" loss takes the recomputing backward, exact for any upstream gradient.

For bf16 inputs the chunk walk stores exponentials instead (kernels/exp_logits.py): the GEMM's
epilogue writes exp(z - z_y) and the row statistics, so the two passes go, and the gradient GEMMs
scale rows of their other operand and of their output. A row out of the exponentials' range (a
loss over 55 nats, a non-finite logit) is recomputed on the device, with no host read.

Memory: one chunk of logits, the stored dE (N x D, fp32 across vocab shards), the weight gradient
(its own size) and, past two token chunks, an fp32 weight-gradient accumulator (V_local x D x 4)
so that it is rounded once rather than once per chunk. ``plan_forward_gradients`` sizes it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .options import LCEOptions

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


@dataclass(frozen=True)
class ForwardGradPlan:
    """How the forward walks the tokens: ``chunk_rows`` at a time, the weight gradient summed in
    fp32 (``fp32_weight_accumulator``) or in the weight's dtype, and with ``exponentials`` the
    chunks' logits stored as exponentials offset by the target logits, which every shard needs
    before the first chunk's GEMM (kernels/exp_logits.py): across shards, one more all-reduce a
    call, of one fp32 per token.
    """

    chunk_rows: int
    fp32_weight_accumulator: bool
    exponentials: bool = False


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
