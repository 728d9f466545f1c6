"""An analytic per-stage peak-memory model for pipeline-parallel training, for the loss layer as
megatron-core computes it (``native``) and as fused_lce's Cut Cross-Entropy computes it (``cce``);
``lce_train.pp_split`` balances the stages by it.

Pure Python: no torch, no torch.distributed, no megatron. Every figure is bytes on one GPU of a
pipeline stage (the stage's tensor-parallel ranks are alike). The terms and their assumptions:

Weights, gradients, optimizer (per parameter, mixed precision with Adam):
    bf16 weight 2 + fp32 main gradient 4 + fp32 main weight 4 + Adam moments 4 + 4 = 18 bytes;
    with the distributed optimizer the last three are sharded over DP: 6 + 12 / DP bytes.
    Parameters per TP rank: a layer's matrices / TP (QKV with grouped-query attention, the
    output projection, a gated MLP of three h x ffn matrices) + its two norms (replicated);
    the embedding (vocabulary padded to a multiple of 128 x TP, as Megatron does) / TP on the
    first stage; the output layer on the last stage (when tied and PP > 1, megatron-core keeps
    a copy of the embedding there, so it is counted on both) and the final norm.

Activations per layer per micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4), with s sequence, b micro-batch, h hidden,
a heads, t TP, f ffn:
    no parallelism:  s b h (34 + 5 a s / h)
    TP, no SP:       s b h (10 + 24 / t + 5 a s / (h t))
    TP + SP:         s b h (34 + 5 a s / h) / t
    The 24 of the paper is 8 (attention) + 16 (a 4h GeLU MLP: 8 + 8); for the gated (SwiGLU)
    MLP that megatron-core builds here it is 8 + 6 f / h (fc1 output 2f wide, activation output
    f wide, both bf16), which is 16 at f = 4h for GeLU's 4 f / h. Grouped-query attention's
    smaller K/V and the absence of dropout (dropout 0) are ignored: a slight overestimate.
    selective recompute drops the attention-score term. Flash attention (Transformer Engine)
    never stores the scores either, so `selective` is the right setting for it; `none` is
    megatron-core's local (unfused) attention, what the launcher runs without Transformer
    Engine. Its score term is SCORE_BYTES = 7 bytes per score, not the paper's 5: megatron-core
    runs the softmax in fp32 by default (attention_softmax_in_fp32) and keeps its fp32 output
    (4), then the dropout keeps its mask (1) and the PV matmul its bf16 input (2). Measured on
    H200 (docs/pp_memory_balance.md) with the launcher: 7.5 per score, with every other term
    as above.
    full recompute stores only each layer's input, 2 s b h (/ t with SP), and rematerialises
    one layer at a time in the backward (one layer's `selective` activations, added once).

Micro-batches in flight (megatron-core's schedules):
    1F1B: stage i (0-based) of p runs min(p - i, m) forwards before its first backward, and
        holds their activations at its peak.
    interleaved, v model chunks per rank (forward_backward_pipelining_with_interleaving):
        rank i runs warmup = (p - i - 1) * 2 + (v - 1) * p forwards, then one more in the
        steady state before its first backward: n = min(warmup + 1, m v) chunk-forwards in
        flight. Forward k runs on chunk (k // p) % v, so the held activations are
        sum over k < n of layers(chunk (k // p) % v) x one layer's activations. At v = 1 this is
        the 1F1B count; for even chunks on rank 0 it is the paper's p (1 + (p - 1) / (p v))
        stage-equivalents. Megatron needs m divisible by p for this schedule.

Backward working set: while a layer runs its backward it holds gradients the size of its
largest activations. With local attention (`none`) that is the fp32 softmax's input and output
gradients, 8 a s^2 b / t bytes; otherwise the gated MLP's fc1 output and activation gradients,
8 s b f / t (not measured). It is the peak's last term on every stage with layers, except on the
last stage while the loss's own transient is larger (the two do not coincide).

Output layer + loss on the last stage, for the one micro-batch at the loss (in 1F1B and
interleaved schedules the last stage runs a micro-batch's backward right after its forward, so
only one is at the loss at a time):
    native: megatron-core's GPTModel passes the output layer's bf16 logits [s, b, V/t] (2 bytes)
        to vocab_parallel_cross_entropy, which copies them to fp32 (4) and computes the softmax
        in that copy in place, keeping it for the backward: NATIVE_BYTES_PER_LOGIT = 6 bytes per
        logit, as measured on H200 with megatron-core 0.19.2 (6.1). With SP the sequence is
        gathered first, so the whole sequence's logits are there.
    cce: what the op's own planner (fused_lce.token_walk.plan_forward_gradients) holds. By
        default the gradients are computed in the forward: one chunk of 16-bit logits (half the
        micro-batch's tokens, at most 2 GiB), the stored input gradient (fp32 partials at
        TP > 1, else 16-bit) and the shard's weight gradient (16-bit, or fp32 past two chunks),
        from the forward to the backward. With ``cce_backward="gemm"``, or a ``scratch_mb`` that
        cannot hold 1024 tokens' logits, the recomputing backward: its scratch bound
        (``scratch_mb``, 512 MiB by default; never more than one fp32 value per local logit).
        Either way plus CCE_BYTES_PER_TOKEN = 16 bytes per token (fp32 log-sum-exp, int64
        target, fp32 loss). The pipeline studies in docs/pp_memory_balance.md were made with
        the recomputing backward (``--cce-backward gemm``).

Not modelled: the CUDA caching allocator's fragmentation and reserve, NCCL and pipeline p2p
buffers, the CUDA context, and optimizer-step transients. Measured peaks
(``torch.cuda.max_memory_allocated``) will therefore sit somewhat above these predictions.

A split is a list of transformer layers per *virtual* stage, p v of them; virtual stage k lives
on rank k % p as model chunk k // p (Megatron's order). ``lce_train.pp_split`` holds megatron's
split rules and the recommender that balances these peaks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from fused_lce.options import LCEOptions
from fused_lce.token_walk import plan_forward_gradients
from lce_train.configs import ModelConfig

GIB = 2**30
MIB = 2**20
NATIVE_BYTES_PER_LOGIT = 6
"""bf16 logits (2) + megatron's fp32 copy (4), which becomes the softmax kept for the backward."""
SCORE_BYTES = 7
"""Per attention score with local attention: fp32 softmax output (4), dropout mask (1) and the
bf16 probabilities the PV matmul keeps (2)."""
BACKWARD_SCORE_BYTES = 8
"""Per attention score in a local-attention layer's backward: fp32 gradients of the softmax."""
CCE_BYTES_PER_TOKEN = 16
"""fp32 log-sum-exp (4) + int64 target (8) + fp32 per-token loss (4)."""

Recompute = Literal["none", "selective", "full"]
Loss = Literal["native", "cce"]


@dataclass(frozen=True)
class Layout:
    """A parallel layout and training shape, with Megatron's meanings."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    """Model chunks per pipeline rank (interleaved schedule when > 1)."""
    dp: int = 1
    distributed_optimizer: bool = False
    micro_batch: int = 1
    seq_length: int = 4096
    num_microbatches: int = 1
    """Micro-batches per step on each DP rank (global batch / (micro batch x DP))."""
    recompute: Recompute = "selective"
    sequence_parallel: bool = False
    loss: Loss = "native"
    scratch_mb: float | None = None
    """cce's buffer budget in MiB (fused_lce's ``scratch_mb``; None: the op's default)."""
    cce_backward: str = "auto"
    """cce's backward (fused_lce's ``backward``): "auto" (gradients in the forward where they
    fit) or "gemm" (the recomputing backward)."""
    vocab_divisible_by: int = 128

    def __post_init__(self) -> None:
        for field in ("tp", "pp", "vpp", "dp", "micro_batch", "seq_length", "num_microbatches",
                      "vocab_divisible_by"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, got {self.recompute!r}")
        if self.loss not in ("native", "cce"):
            raise ValueError(f"loss must be native or cce, got {self.loss!r}")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("virtual pipeline stages need pp > 1")
        if self.scratch_mb is not None and not self.scratch_mb > 0:
            raise ValueError(f"scratch_mb must be > 0 or None, got {self.scratch_mb}")
        if self.cce_backward not in ("auto", "gemm"):
            raise ValueError(f"cce_backward must be auto or gemm, got {self.cce_backward!r}")

    @property
    def sp(self) -> bool:
        """Sequence parallelism is on only with TP > 1 (megatron turns it off at TP = 1)."""
        return self.sequence_parallel and self.tp > 1

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class StageMemory:
    """One pipeline rank's predicted peak, in bytes, by term."""

    stage: int
    layers: int
    states: float
    """Weights, gradients and optimizer states."""
    activations: float
    loss: float
    """The output layer + loss transient (last stage only)."""
    backward: float
    """One layer's backward working set (stages with layers)."""

    @property
    def total(self) -> float:
        return self.states + self.activations + max(self.loss, self.backward)


# ----------------------------------------------------------------------------------------------
# The terms
# ----------------------------------------------------------------------------------------------


def padded_vocab(cfg: ModelConfig, lay: Layout) -> int:
    multiple = lay.vocab_divisible_by * lay.tp
    return -(-cfg.vocab_size // multiple) * multiple


def layer_params(cfg: ModelConfig, tp: int) -> float:
    """One transformer layer's parameters on one TP rank."""
    h, d = cfg.hidden_size, cfg.kv_channels
    attn = h * d * (cfg.num_attention_heads + 2 * cfg.num_query_groups) \
        + cfg.num_attention_heads * d * h
    mlp = 3 * h * cfg.ffn_hidden_size
    return (attn + mlp) / tp + 2 * h


def bytes_per_param(lay: Layout) -> float:
    return 6 + 12 / lay.dp if lay.distributed_optimizer else 18


def layer_activation_bytes(cfg: ModelConfig, lay: Layout, recompute: Recompute | None = None
                           ) -> float:
    """Activations one layer stores for one micro-batch (Korthikanti et al. 2022)."""
    recompute = recompute or lay.recompute
    s, b, h, t = lay.seq_length, lay.micro_batch, cfg.hidden_size, lay.tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if lay.sp else 1)
    replicated = 10
    sharded = 8 + 6 * cfg.ffn_hidden_size / h
    scores = SCORE_BYTES * cfg.num_attention_heads * s / h if recompute == "none" else 0
    if lay.sp:
        return sbh * (replicated + sharded + scores) / t
    return sbh * (replicated + (sharded + scores) / t)


def layer_backward_bytes(cfg: ModelConfig, lay: Layout) -> float:
    """The working set of one layer's backward (the module docstring)."""
    s, b, t = lay.seq_length, lay.micro_batch, lay.tp
    if lay.recompute == "none":
        return BACKWARD_SCORE_BYTES * cfg.num_attention_heads * s * s * b / t
    return 8 * s * b * cfg.ffn_hidden_size / t


def inflight_chunks(lay: Layout, rank: int) -> list[int]:
    """Model chunk of each forward whose activations rank ``rank`` holds at its peak."""
    p, v, m = lay.pp, lay.vpp, lay.num_microbatches
    warmup = p - rank - 1 if v == 1 else (p - rank - 1) * 2 + (v - 1) * p
    n = min(warmup + 1, m * v)
    return [(k // p) % v for k in range(n)]


def loss_bytes(cfg: ModelConfig, lay: Layout) -> float:
    """The output layer + loss transient for the one micro-batch at the loss."""
    tokens = lay.seq_length * lay.micro_batch
    if lay.loss == "native":
        return tokens * padded_vocab(cfg, lay) / lay.tp * NATIVE_BYTES_PER_LOGIT
    vocab = padded_vocab(cfg, lay) // lay.tp
    opts = LCEOptions(scratch_mb=lay.scratch_mb, backward=lay.cce_backward)
    plan = plan_forward_gradients(opts, tokens, vocab, cfg.hidden_size, 2, True)
    if plan is None:
        scratch = min(opts.scratch_bytes, tokens * vocab * 4)
        return scratch + tokens * CCE_BYTES_PER_TOKEN
    held = plan.chunk_rows * vocab * 2
    held += tokens * cfg.hidden_size * (4 if lay.tp > 1 else 2)
    held += vocab * cfg.hidden_size * (4 if plan.fp32_weight_accumulator else 2)
    return held + tokens * CCE_BYTES_PER_TOKEN


def rank_memory(cfg: ModelConfig, lay: Layout, rank: int, chunks: list[int]) -> StageMemory:
    """Pipeline rank ``rank``'s predicted peak when its v model chunks hold ``chunks`` layers."""
    p = lay.pp
    embedding = padded_vocab(cfg, lay) * cfg.hidden_size / lay.tp
    params = layer_params(cfg, lay.tp) * sum(chunks)
    if rank == 0:
        params += embedding
    if rank == p - 1:
        params += cfg.hidden_size
        if not cfg.tie_embeddings or p > 1:
            params += embedding
    acts = layer_activation_bytes(cfg, lay) * sum(chunks[c] for c in inflight_chunks(lay, rank))
    if lay.recompute == "full" and sum(chunks):
        acts += layer_activation_bytes(cfg, lay, "selective")
    loss = loss_bytes(cfg, lay) if rank == p - 1 else 0.0
    backward = layer_backward_bytes(cfg, lay) if sum(chunks) else 0.0
    return StageMemory(rank, sum(chunks), params * bytes_per_param(lay), acts, loss, backward)


def stage_memory(cfg: ModelConfig, lay: Layout, split: list[int]) -> list[StageMemory]:
    """Each pipeline rank's predicted peak for a split over the p v virtual stages."""
    p, v = lay.pp, lay.vpp
    if len(split) != p * v or sum(split) != cfg.num_layers or min(split) < 0:
        raise ValueError(f"split {split} must give {cfg.num_layers} layers to {p * v} "
                         "virtual stages")
    return [rank_memory(cfg, lay, r, [split[c * p + r] for c in range(v)]) for r in range(p)]


def peak(cfg: ModelConfig, lay: Layout, split: list[int]) -> float:
    return max(s.total for s in stage_memory(cfg, lay, split))
