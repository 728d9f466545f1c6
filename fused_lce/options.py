"""The options of one linear-cross-entropy call, validated once and passed down as one object.

Every implementation (the Triton kernels, the chunked PyTorch paths, the full-logits reference)
receives the same :class:`LCEOptions`, so the semantics are defined in one place:

    logits = softcap_fn(input @ weight.T + bias)            # (N, V), never stored by cce
    lse    = logsumexp(logits)
    loss_n = (1 - ls) * (lse - logits[target])              # cross-entropy
           + ls * (lse - mean_v logits)                      # label smoothing (torch's convention)
           + z_loss * lse**2                                 # z-loss
    loss_n = 0 where target == ignore_index

``softcap_fn(x) = softcap * tanh(x / softcap)``. "mean" divides by the number of non-ignored
tokens, as torch does (all tokens ignored gives NaN, as in torch).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields, replace
from typing import Literal

import torch

Reduction = Literal["mean", "sum", "none"]
Impl = Literal["auto", "cce", "chunked", "torch"]
ChunkBy = Literal["vocab", "tokens"]
Backward = Literal["auto", "in_forward", "gemm", "tiles"]
UpstreamMismatch = Literal["auto", "recompute", "nan"]
FilterSpec = float | Literal["safe", "paper"] | None

REDUCTIONS = ("mean", "sum", "none")
IMPLS = ("auto", "cce", "chunked", "torch")
CHUNK_BY = ("vocab", "tokens")
BACKWARDS = ("auto", "in_forward", "gemm", "tiles")
UPSTREAM_MISMATCHES = ("auto", "recompute", "nan")
# Spellings renamed in 2026-11, refused with what to pass instead: a silent rename would turn an
# old call's option into a TypeError that does not say where it went.
RENAMED_BACKWARDS = {"forward": "in_forward"}
RENAMED_OPTIONS = {"recompute_logits": "keep_logits=not recompute_logits"}

# Environment variables that size the chunked paths and the cce scratch buffers (docs/algorithm.md,
# the options table).
ENV_VOCAB_CHUNK = "FUSED_LCE_VOCAB_CHUNK"
ENV_TOKEN_CHUNK = "FUSED_LCE_TOKEN_CHUNK"
ENV_SCRATCH_MB = "FUSED_LCE_SCRATCH_MB"
ENV_TMA = "FUSED_LCE_TMA"  # "0": the pointer kernels (LCEOptions.tma)

DEFAULT_VOCAB_CHUNK = 4096
DEFAULT_TOKEN_CHUNK = 1024
DEFAULT_SCRATCH_MB = 512.0
LEAN_SCRATCH_MB = 12.0
"""The lean mode's ``scratch_mb``: the cce backward's buffers then total under 16 MiB."""


def _env_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"environment variable {name} must be a positive integer, got {raw!r}")
    return value


def _env_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"environment variable {name} must be a finite positive number, got {raw!r}"
        )
    return value


def filter_budget(dtype: torch.dtype) -> float:
    """The precision below which a gradient entry is invisible in ``dtype``: eps / 32.

    For bf16 this is 2^-12, the paper's threshold; fp16 gives 2^-15, fp32 2^-28.
    """
    return torch.finfo(dtype).eps / 32.0


@dataclass(frozen=True)
class Environment:
    """Our environment variables as they were when an ``LCEOptions`` was built ("" where unset);
    this is the one module that reads them. A value is parsed, and a bad one refused, only where
    no argument overrides it."""

    vocab_chunk: str = ""  # FUSED_LCE_VOCAB_CHUNK
    token_chunk: str = ""  # FUSED_LCE_TOKEN_CHUNK
    scratch_mb: str = ""  # FUSED_LCE_SCRATCH_MB
    tma: str = ""  # FUSED_LCE_TMA; "0" turns it off

    @classmethod
    def read(cls) -> Environment:
        return cls(*(os.environ.get(name, "") for name in
                     (ENV_VOCAB_CHUNK, ENV_TOKEN_CHUNK, ENV_SCRATCH_MB, ENV_TMA)))


@dataclass(frozen=True)
class LCEOptions:
    """Everything that changes what a linear-cross-entropy call computes or how it runs."""

    ignore_index: int = -100
    """Target value whose tokens contribute neither loss nor gradient."""
    reduction: Reduction = "mean"
    """"mean" over non-ignored tokens, "sum", or "none" (per-token loss, shape of target)."""
    label_smoothing: float = 0.0
    """Weight of the uniform distribution mixed into the target, in [0, 1]."""
    softcap: float | None = None
    """Logit soft-capping ``softcap * tanh(x / softcap)``; None disables it."""
    z_loss: float = 0.0
    """Coefficient of the ``lse**2`` penalty added per non-ignored token."""
    num_classes: int | None = None
    """Number of real classes; weight rows at or past it (vocabulary padding) are excluded.
    None means every weight row is a class."""
    backward: Backward = "auto"
    """The cce backward. "in_forward" computes the gradients in the forward, a token chunk at a
    time, from 16-bit logits that cuBLAS writes and G overwrites: three GEMMs, the backward
    only scales (fused_lce/token_walk.py; it recomputes exactly where the upstream gradient
    is not the one it assumed). "gemm" recomputes logit-gradient chunks in the backward that
    cuBLAS GEMMs consume (four GEMMs, buffers within ``scratch_mb``, no atomics); "tiles" is
    the fused tile kernel of the paper (atomics, gradient filtering, vocab sorting). "auto"
    picks in_forward, or gemm where an explicit ``scratch_mb`` cannot hold 1024 tokens' logits
    (the lean mode) or ``keep_logits=True`` (docs/algorithm.md)."""
    filter_eps: FilterSpec = "safe"
    """Gradient filtering in the tiles backward (docs/algorithm.md):
    "safe" skips a tile only if each of its rows holds less than eps * BLOCK_V / V of softmax
    mass, so a token drops at most eps = finfo.eps / 32 of its probability in total;
    "paper" (or a float) skips a tile whose softmax entries are all below eps (or the float);
    None or 0 computes every tile."""
    vocab_sort: bool = True
    """Walk the vocabulary in order of mean logit in the tiles backward, so negligible tiles
    cluster (only used when filtering is on; off under ``deterministic``)."""
    round_logits: bool = False
    """cce, recomputing backwards: round each bf16 logit ``input @ weight.T`` to bf16 before
    bias, soft-capping and the fp32 softmax, as a layer that stores its logits in bf16
    (megatron's output layer, torch's eager path) does. Off: those kernels keep exact fp32
    logits. The gradient-in-forward backward (the default) stores its logits in 16 bits, so it
    always rounds, as do the chunked and torch impls; fp32 inputs are never rounded. fp16
    logits are always rounded to fp16, on every path, in training and in evaluation alike
    (``rounds_logits``): a logit past fp16's 65504 is then inf and the loss not finite, as in
    torch, rather than finite on some paths only."""
    keep_logits: bool = False
    """cce, gemm backward: keep every logit from the forward, as exp(logit - running max) in
    16 bits (2 bytes a logit, N x V, plus an fp32 max per row and 256 columns), so the backward
    skips recomputing them: one GEMM of the four fewer, at the memory of a bf16 logits tensor,
    held from the forward to the backward. Faster where the GEMMs dominate (large D); it gives
    up the memory saving that is the point of the op. The chunked and torch impls ignore it."""
    fp32_weight_grad: bool = True
    """cce, gradient-in-forward backward: sum the weight gradient over more than two token
    chunks in an fp32 (V_local, D) accumulator, rounded once. False rounds the running sum to
    the weight's dtype after each chunk (as Liger's fused loss does, and a bf16 gradient summed
    over micro-batches): no accumulator, so a tight ``scratch_mb`` keeps the three-GEMM backward
    with chunks of at least 1024 tokens, where the accumulator would not fit."""
    upstream_mismatch: UpstreamMismatch = "auto"
    """Reduction "none": how the backward meets a per-token upstream gradient that is not the
    one the forward assumed. "auto" (default): with ``loss_mask`` the gradients are computed in
    the forward for ``c * loss_mask`` and checked as with "nan"; without it the op cannot know
    the weights, so it takes the recomputing backward, exact for any upstream gradient. "nan"
    checks on the device: where the upstream gradient is not ``c * loss_mask`` the backward
    returns NaN gradients and a later call raises (fused_lce/faults.py), with no host sync.
    "recompute" reads the ranks' verdict on the host (one device sync a backward) and then
    recomputes those gradients exactly: the checked mode, which a CUDA graph cannot capture.
    Megatron's ``sum(losses * loss_mask)`` meets the assumption; the Megatron adapter passes
    the forward's loss mask."""
    deterministic: bool = False
    """Bitwise repeatable results: no order-dependent atomics (the gemm backward is; the tiles
    backward then recomputes logits twice, once for each gradient)."""
    impl: Impl = "auto"
    """"cce" (Triton kernels), "chunked" (pure PyTorch), "torch" (full logits), or "auto"
    (cce on CUDA, chunked elsewhere)."""
    chunk_by: ChunkBy = "vocab"
    """Chunked impl: "vocab" (online softmax over vocabulary chunks, gradients recomputed in the
    backward) or "tokens" (gradients computed in the forward, token chunk by token chunk, for the
    upstream gradient assumed as cce assumes it; recomputed the vocab way where it differs)."""
    vocab_chunk_size: int | None = None
    """Vocabulary columns per chunk of the chunked impl (env FUSED_LCE_VOCAB_CHUNK, 4096)."""
    token_chunk_size: int | None = None
    """Tokens per chunk of the chunked impl (env FUSED_LCE_TOKEN_CHUNK, 1024) and, when given
    here, of the cce gradient-in-forward backward (else it plans its own)."""
    scratch_mb: float | None = None
    """Upper bound on the cce backward's buffers (fp32 accumulators, gradient or logit chunks)
    in MiB (env FUSED_LCE_SCRATCH_MB; unset: 512 for the gemm backward, and the
    gradient-in-forward backward plans its own chunk). ``LEAN_SCRATCH_MB`` (12) is the lean
    mode, under 16 MiB in all; see docs/algorithm.md."""
    tma: bool | None = None
    """cce: read 16-bit tiles through tensor descriptors (TMA) where the GPU (sm_90+) and the
    layout (16-byte aligned rows) allow; False keeps the pointer kernels (env FUSED_LCE_TMA,
    "0" for False; default True)."""

    cuda_graphs: bool = True
    """cce on a GPU, gradients in the forward: the second training call of a shape captures the
    forward as a CUDA graph and later calls replay it (fused_lce/graphs.py), so a call costs the
    host one replay instead of some 25 launches a token chunk. The graph keeps its chunk buffer
    and stored gradients between calls. False runs every call eagerly; a call inside the
    caller's own capture (Megatron's full-iteration graphs) always does."""

    environment: Environment = field(
        default_factory=Environment.read, repr=False, compare=False,
        metadata={"user": False},
    )
    """What our environment variables said when these options were built (not an argument of
    the op): a frozen options object then behaves the same for the whole run, and
    ``dataclasses.replace`` carries it over."""

    def __post_init__(self) -> None:
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {self.ignore_index!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.backward in RENAMED_BACKWARDS:
            raise ValueError(f"backward={self.backward!r} is now spelled "
                             f"backward={RENAMED_BACKWARDS[self.backward]!r}")
        if self.backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {self.backward!r}")
        if self.upstream_mismatch not in UPSTREAM_MISMATCHES:
            raise ValueError(f"upstream_mismatch must be one of {UPSTREAM_MISMATCHES}, got "
                             f"{self.upstream_mismatch!r}")
        if self.chunk_by not in CHUNK_BY:
            raise ValueError(f"chunk_by must be one of {CHUNK_BY}, got {self.chunk_by!r}")
        _check_float("label_smoothing", self.label_smoothing)
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if self.softcap is not None:
            _check_float("softcap", self.softcap)
            if not (self.softcap > 0 and math.isfinite(self.softcap)):
                raise ValueError(f"softcap must be a finite number > 0 or None, got {self.softcap}")
        _check_float("z_loss", self.z_loss)
        if not (self.z_loss >= 0 and math.isfinite(self.z_loss)):
            raise ValueError(f"z_loss must be a finite number >= 0, got {self.z_loss}")
        if self.num_classes is not None:
            if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int):
                raise TypeError(f"num_classes must be an int or None, got {self.num_classes!r}")
            if self.num_classes <= 0:
                raise ValueError(f"num_classes must be > 0, got {self.num_classes}")
        if isinstance(self.filter_eps, str):
            if self.filter_eps not in ("safe", "paper"):
                raise ValueError(
                    f"filter_eps must be 'safe', 'paper', a float >= 0 or None, "
                    f"got {self.filter_eps!r}"
                )
        elif self.filter_eps is not None:
            _check_float("filter_eps", self.filter_eps)
            if not (0.0 <= self.filter_eps < 1.0):
                raise ValueError(f"filter_eps must be in [0, 1), got {self.filter_eps}")
        for name in ("vocab_chunk_size", "token_chunk_size"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"{name} must be a positive int or None, got {value!r}")
                if value <= 0:
                    raise ValueError(f"{name} must be a positive int or None, got {value}")
        for name in ("vocab_sort", "deterministic", "round_logits", "keep_logits",
                     "fp32_weight_grad", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.keep_logits and self.backward in ("tiles", "in_forward"):
            raise ValueError(
                "keep_logits=True needs backward='gemm' or 'auto' (it keeps the logits "
                f"for the gemm backward), got backward={self.backward!r}"
            )
        if self.scratch_mb is not None:
            _check_float("scratch_mb", self.scratch_mb)
            if not (self.scratch_mb > 0 and math.isfinite(self.scratch_mb)):
                raise ValueError(f"scratch_mb must be > 0 and finite, got {self.scratch_mb}")
        if self.tma is not None and not isinstance(self.tma, bool):
            raise TypeError(f"tma must be a bool or None, got {self.tma!r}")
        if not isinstance(self.environment, Environment):
            raise TypeError(f"environment must be an options.Environment, got {self.environment!r}")
        # A bad environment variable is refused now, not at the first kernel: where an argument
        # overrides it, it is never read.
        self.vocab_chunk, self.token_chunk, self.scratch_bytes  # noqa: B018

    @property
    def vocab_chunk(self) -> int:
        if self.vocab_chunk_size is not None or not self.environment.vocab_chunk:
            return self.vocab_chunk_size or DEFAULT_VOCAB_CHUNK
        return _env_int(ENV_VOCAB_CHUNK, self.environment.vocab_chunk)

    @property
    def token_chunk(self) -> int:
        if self.token_chunk_size is not None or not self.environment.token_chunk:
            return self.token_chunk_size or DEFAULT_TOKEN_CHUNK
        return _env_int(ENV_TOKEN_CHUNK, self.environment.token_chunk)

    @property
    def scratch_bytes(self) -> int:
        mib = self.scratch_mb
        if mib is None:
            raw = self.environment.scratch_mb
            mib = _env_float(ENV_SCRATCH_MB, raw) if raw else DEFAULT_SCRATCH_MB
        return int(mib * 2**20)

    @property
    def scratch_explicit(self) -> bool:
        """Whether the budget came from ``scratch_mb`` or the environment, not the default."""
        return self.scratch_mb is not None or self.environment.scratch_mb != ""

    @property
    def token_chunk_explicit(self) -> bool:
        return self.token_chunk_size is not None

    @property
    def tma_allowed(self) -> bool:
        """``tma``, or FUSED_LCE_TMA where it is None, as read when the options were built."""
        return self.tma if self.tma is not None else self.environment.tma != "0"

    def rounds_logits(self, dtype: torch.dtype) -> bool:
        """Whether the cce kernels round each logit to ``dtype`` (16-bit inputs): where
        ``round_logits`` asks, and always for fp16, whose logits the default backward stores in
        fp16 (a logit past 65504 overflows there, as in torch): so every path, and evaluation
        too, computes the same loss from the same rounded logits."""
        return self.round_logits or dtype == torch.float16

    def filter_mode(self, dtype: torch.dtype) -> tuple[str, float]:
        """("off" | "mass" | "entry", threshold) for inputs of ``dtype``."""
        spec = self.filter_eps
        if spec is None or (not isinstance(spec, str) and spec == 0.0):
            return "off", 0.0
        if spec == "safe":
            return "mass", filter_budget(dtype)
        if spec == "paper":
            return "entry", filter_budget(dtype)
        return "entry", float(spec)


def user_fields() -> tuple[Field, ...]:
    """The fields that are options of the op (every keyword of ``linear_cross_entropy``): all but
    the environment's snapshot."""
    return tuple(f for f in fields(LCEOptions) if f.metadata.get("user", True))


def refuse_renamed(options: Mapping[str, object]) -> None:
    """Raise TypeError where ``options`` (keyword arguments) holds a renamed option, naming what
    to pass instead (``RENAMED_OPTIONS``)."""
    for old, new in RENAMED_OPTIONS.items():
        if old in options:
            raise TypeError(f"{old} was renamed: pass {new}")


def refusing_renamed(function):
    """``function``, raising ``refuse_renamed``'s TypeError for a renamed keyword instead of
    Python's "unexpected keyword argument", which would not say what replaced it."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        refuse_renamed(kwargs)
        return function(*args, **kwargs)

    return call


def without_backward_options(opts: LCEOptions, *inputs: torch.Tensor | None) -> LCEOptions:
    """``opts``, minus what only a backward uses when none will run (no grad mode, or no input
    that wants a gradient): an evaluation pass keeps no logits. It computes its statistics with
    the kernels training uses under ``opts`` (the gradient-in-forward walk, or the statistics
    kernel of the recomputing backwards), so train and eval losses are the same numbers."""
    wanted = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    if wanted or not opts.keep_logits:
        return opts
    # Kept logits feed only the gemm backward; its forward's statistics are the same kernel's.
    return replace(opts, keep_logits=False, backward="gemm")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
