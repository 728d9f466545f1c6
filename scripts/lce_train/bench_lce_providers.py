"""The losses the single-GPU benchmark (scripts/bench_lce.py) and the studies beside it compare,
by name: ours at each setting and the peers, each a function ``(hidden, weight, target) -> loss``.

Ours (``cce``: the default, gradients computed in the forward (three GEMMs) where the upstream
gradient allows, with its target range check (one host sync); ``cce-two-pass``: the same with the
walk of 2026-11-25 (logits stored, then two passes), for before/after figures; ``cce-nocheck``:
the same without the check, as the Megatron adapter calls it; ``cce-gemm``: the recomputing GEMM
backward, the default until 2026-11; ``cce-lean``: a 12 MiB buffer budget, which keeps the total
under 16 MiB with cuBLAS's temporaries; ``cce-kept``: ``keep_logits=True``, the forward's
logits kept as 16-bit exponentials so the backward skips their recompute; ``cce-tiles``: the
fused tile backward with the safe filter; ``cce-tiles-paper``: the same with the paper's filter;
``cce-det``; ``cce:key=value,...``: any options (``custom_cce``); ``chunked``;
``chunked-tokens``: gradients computed in the forward over token chunks of 512 MiB of logits,
three matmuls and no recompute, a candidate budget mode), ``torch`` (eager full logits),
``torch.compile`` (the same function compiled), and, when installed, ``liger`` (liger-kernel's
fused linear cross-entropy), ``apple-cce`` (cut-cross-entropy), ``megatron-fused`` (megatron-core's
fused vocab-parallel cross-entropy on bf16 logits at TP=1, what ``--cross-entropy-loss-fusion``
runs), and the CuTe-DSL peers ``quack``, ``quack-scaled-exp``, ``liger-cute`` and
``liger-cutedsl`` (``cute_peer`` says which call each is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fused_lce import linear_cross_entropy
from fused_lce.options import LEAN_SCRATCH_MB, LCEOptions


def torch_loss(hidden, weight, target):
    return F.cross_entropy((hidden @ weight.t()).float(), target)


def providers(names: list[str]) -> dict:
    """``{name: loss function}`` for the providers of ``names`` that this machine has, in that
    order; the missing ones are named in one printed line."""
    table = {
        "cce": lambda h, w, t: linear_cross_entropy(h, w, t, impl="cce"),
        # As the Megatron adapter calls it: no target range check, so no host sync.
        "cce-nocheck": lambda h, w, t: linear_cross_entropy(h, w, t, impl="cce",
                                                            check_targets=False),
        "cce-gemm": lambda h, w, t: linear_cross_entropy(h, w, t, impl="cce", backward="gemm"),
        "cce-lean": lambda h, w, t: linear_cross_entropy(
            h, w, t, impl="cce", scratch_mb=LEAN_SCRATCH_MB
        ),
        "cce-kept": lambda h, w, t: linear_cross_entropy(
            h, w, t, impl="cce", keep_logits=True
        ),
        # Liger's memory: its chunk at Phi-3.5's shape is 1024 tokens (64 MiB of logits), and it
        # sums the weight gradient in bf16 over the chunks; this is ours on those terms.
        "cce-liger-budget": lambda h, w, t: linear_cross_entropy(
            h, w, t, impl="cce", scratch_mb=64, fp32_weight_grad=False
        ),
        "cce-tiles": lambda h, w, t: linear_cross_entropy(h, w, t, impl="cce", backward="tiles"),
        "cce-tiles-paper": lambda h, w, t: linear_cross_entropy(
            h, w, t, impl="cce", backward="tiles", filter_eps="paper"
        ),
        "cce-det": lambda h, w, t: linear_cross_entropy(h, w, t, impl="cce", deterministic=True),
        "chunked": lambda h, w, t: linear_cross_entropy(h, w, t, impl="chunked"),
        # Gradients in the forward (three matmuls, no recompute), token chunks sized so one
        # chunk's logits (bf16 from the matmul, fp32 for the math: 6 bytes each) fill 512 MiB.
        "chunked-tokens": lambda h, w, t: linear_cross_entropy(
            h, w, t, impl="chunked", chunk_by="tokens",
            token_chunk_size=max(1, (512 << 20) // (6 * w.shape[0]))
        ),
        "torch": torch_loss,
        "torch.compile": torch.compile(torch_loss),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        table["liger"] = lambda h, w, t: liger(w, h, t)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as apple_lce

        table["apple-cce"] = lambda h, w, t: apple_lce(h, w, t)
    except ImportError:
        pass
    if "cce-two-pass" in names:
        table["cce-two-pass"] = two_pass_cce()
    if "megatron-fused" in names:
        fused = megatron_fused_loss()
        if fused is not None:
            table["megatron-fused"] = fused
    for name in names:
        if name.startswith("cce:"):
            table[name] = custom_cce(name)
        elif name.startswith(("quack", "liger-cute")):
            peer = cute_peer(name)
            if peer is not None:
                table[name] = peer
    missing = [n for n in names if n not in table]
    if missing:
        print(f"# not available, skipped: {', '.join(missing)}")
    return {n: table[n] for n in names if n in table}


def two_pass_cce():
    """Ours as it was until 2026-11-27: the walk stores the chunk's logits (cuBLAS), and two passes
    turn them into statistics and G in place (kernels/logit_rows.py); for before/after figures
    measured side by side. The forward's plan picks the walk, so only the call is wrapped."""
    from fused_lce import token_walk

    def loss(h, w, t):
        chosen = token_walk.exponentials_apply
        token_walk.exponentials_apply = lambda opts, dtype: False
        try:
            return linear_cross_entropy(h, w, t, impl="cce")
        finally:
            token_walk.exponentials_apply = chosen

    return loss


def custom_cce(name: str):
    """``cce:key=value,...``: ours with those options (ints, floats, 0/1 for bools), e.g.
    ``cce:token_chunk_size=960,fp32_weight_grad=0``."""
    options = {}
    for item in name.split(":", 1)[1].split(","):
        key, value = item.split("=")
        default = LCEOptions.__dataclass_fields__[key].default
        options[key] = bool(int(value)) if isinstance(default, bool) else (
            float(value) if "." in value else int(value))
    return lambda h, w, t: linear_cross_entropy(h, w, t, impl="cce", **options)


def cute_peer(name: str):
    """The peers written in the CuTe DSL (they need nvidia-cutlass-dsl; None where it or the peer
    does not import). Each is called as its own docs show, at its defaults unless named:

    - ``quack``: Dao-AILab QuACK's ``chunked_linear_cross_entropy`` with ``use_scaled_exp=False``,
      its base pipeline (per chunk of tokens: one GEMM into bf16 logits, one CE kernel that
      overwrites them with their gradient, the dX and dW GEMMs); ``quack-scaled-exp``: its
      epilogue-fused pipeline (``use_scaled_exp=True``: exponentials with power-of-two offsets
      stored by the logits GEMM's epilogue and rescaled as the dX / dW GEMMs load them; SM90,
      V % 128 == 0). ``@CHUNK`` sets ``chunk_size`` (QuACK's default 4096), e.g. ``quack@8192``.
    - ``liger-cute``: Liger's SM90 fused linear cross-entropy in the CuTe DSL
      (``liger_fused_linear_cross_entropy_sm90``: one logits GEMM for all tokens, a CE kernel
      that overwrites them with dZ, dX in the forward and dW in the backward; V % 256 == 0,
      N % 128 == 0). Liger's public ``LigerFusedLinearCrossEntropyLoss`` does not select it.
    - ``liger-cutedsl``: Liger's chunked FLCE with its dispatcher's CuTe CE kernel inside
      (``ce_impl="nvidia-cutedsl"``), what its backend registry ranks first on Hopper.
    """
    base, _, chunk = name.partition("@")
    try:
        if base in ("quack", "quack-scaled-exp"):
            from quack.linear_cross_entropy import chunked_linear_cross_entropy

            chunk_size = int(chunk) if chunk else 4096
            scaled = base == "quack-scaled-exp"
            return lambda h, w, t: chunked_linear_cross_entropy(
                h, w, t, chunk_size=chunk_size, use_scaled_exp=scaled)
        if base == "liger-cute":
            from liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90 import (
                liger_fused_linear_cross_entropy_sm90,
            )

            return lambda h, w, t: liger_fused_linear_cross_entropy_sm90(h, w, t)
        if base == "liger-cutedsl":
            from liger_kernel.ops.fused_linear_cross_entropy import (
                LigerFusedLinearCrossEntropyFunction,
            )

            # Positional, as its forward takes them: bias, ce_weight, ignore_index, z-loss scale,
            # smoothing, reduction, softcap, return_z_loss, accum_dtype, token scaling, accuracy,
            # predicted tokens, ce_impl, ce_mode.
            return lambda h, w, t: LigerFusedLinearCrossEntropyFunction.apply(
                h, w, t, None, None, -100, 0.0, 0.0, "mean", None, False, None, False, False,
                False, "nvidia-cutedsl", None)[0]
    except Exception as error:  # a half-installed DSL fails in many ways; report, go on
        print(f"# {name}: {type(error).__name__}: {error}")
        return None
    raise ValueError(f"unknown CuTe peer {name!r}")


def megatron_fused_loss():
    """What megatron-core runs with ``--cross-entropy-loss-fusion`` (impl "native") at TP=1:
    bf16 logits from the output layer's matmul, then ``fused_vocab_parallel_cross_entropy``."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    except ImportError:
        return None
    if not dist.is_initialized():
        import os

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    group = parallel_state.get_tensor_model_parallel_group()

    def loss(h, w, t):
        logits = (h @ w.t()).unsqueeze(1)  # [s, b=1, V], the layer's dtype
        return fused_vocab_parallel_cross_entropy(logits, t.unsqueeze(1), group).mean()

    return loss
