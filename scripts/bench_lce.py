"""Benchmark the loss layer: time (forward, backward, both) and extra memory, ours beside peers.

    python scripts/bench_lce.py --models gemma2_2b llama3_8b phi3_5_mini --tokens 8192 \
        --regimes uniform trained --out docs/benchmarks/run

Providers: ours (``cce``: the default, gradients computed in the forward (three GEMMs) where
the upstream gradient allows, with its target range check (one host sync); ``cce-two-pass``:
the same with the walk of 2026-11-25 (logits stored, then two passes), for before/after figures;
``cce-nocheck``: the same without the check, as the Megatron adapter calls it; ``cce-gemm``: the
recomputing GEMM backward, the default until 2026-11; ``cce-lean``: a 12 MiB buffer budget, which
keeps the total under 16 MiB with cuBLAS's temporaries; ``cce-kept``: ``recompute_logits=False``,
the forward's logits kept as 16-bit exponentials so the backward skips their recompute;
``cce-tiles``: the fused tile backward with the safe filter; ``cce-tiles-paper``: the same with the
paper's filter; ``cce-det``; ``chunked``; ``chunked-tokens``: gradients computed in the forward
over token chunks of 512 MiB of logits, three matmuls and no recompute, a candidate budget mode),
``torch`` (eager full logits), ``torch.compile`` (the same function compiled), and, when
installed, ``liger`` (liger-kernel's fused linear cross-entropy), ``apple-cce``
(cut-cross-entropy), ``megatron-fused`` (megatron-core's fused vocab-parallel cross-entropy on
bf16 logits at TP=1, what ``--cross-entropy-loss-fusion`` runs), and the CuTe-DSL peers ``quack``,
``quack-scaled-exp``, ``liger-cute`` and ``liger-cutedsl`` (``cute_peer`` says which call each is).
A provider that raises (out of memory, a shape it refuses) is reported and skipped. Times are
medians over windows of back-to-back calls (``looped_median``; ``--timer do_bench`` for
triton's per-call timer; the backward is forward+backward minus forward, the forward running
with autograd on); "extra memory" is the peak allocated during forward+backward above the inputs
and the gradient buffers.

Data regimes (``make_inputs``):
- ``uniform``: random initialisation; logits ~ N(0, 0.02^2 * D), a near-uniform softmax.
- ``trained``: a trained-like softmax: a Zipf(1.1) unigram prior sharpened to a log-log slope of
  about -2 (as measured on trained LMs) and carried by one hidden dimension, context noise of
  about one nat from random directions, and an 8-nat boost of each token's target. The script
  prints the softmax statistics it produced (target probability, entries above 2^-12 per row).

It prints a table, writes ``results.csv`` and ``time_vs_memory.png`` under ``--out``, and reports
TFLOP/s (counting 2·N·V·D per matmul: 1 forward, 3 backward for the recomputing methods) beside the
cuBLAS bf16 GEMM ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# Import the installed packages, not lce_train's source folder beside this file: the install
# maps the top-level configs/ in as lce_train.configs, which that folder lacks.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

from fused_lce import linear_cross_entropy  # noqa: E402
from fused_lce.options import LEAN_SCRATCH_MB, LCEOptions  # noqa: E402
from lce_train.configs import load_model_config  # noqa: E402

MIB = 2**20


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


def torch_loss(hidden, weight, target):
    return F.cross_entropy((hidden @ weight.t()).float(), target)


def providers(names: list[str]) -> dict:
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
            h, w, t, impl="cce", recompute_logits=False
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
    from fused_lce import forward_grad

    def loss(h, w, t):
        chosen = forward_grad.exponentials_apply
        forward_grad.exponentials_apply = lambda opts, dtype: False
        try:
            return linear_cross_entropy(h, w, t, impl="cce")
        finally:
            forward_grad.exponentials_apply = chosen

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


TIMER = "loop"


def looped_median(fn, rep_ms: int, windows: int = 5) -> float:
    """Median over ``windows`` of the mean time of back-to-back calls (CUDA events around each
    window, about ``rep_ms`` long), after two warm-up calls.

    Why not ``triton.testing.do_bench``: it times every call alone between events, after an L2
    flush, and at 40-50 ms per call takes the median of 3 calls. There our gradient-in-forward
    mode read 6-11 ms slower for fwd+bwd than for fwd alone (Gemma-2 2B, H100), while plain loops
    and the profiler showed the same 44.9 ms GPU span for both: an artefact of the timer. Back-to-
    back calls are how training runs; every provider is timed the same way.
    """
    fn()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(1, round(rep_ms / max(start.elapsed_time(end), 1e-3)))
    means = []
    for _ in range(windows):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        means.append(start.elapsed_time(end) / calls)
    return sorted(means)[len(means) // 2]


def steps_median_ms(step, steps: int = 10, windows: int = 5) -> float:
    """Median over ``windows`` of the mean time of ``steps`` back-to-back calls (CUDA events),
    after one warm-up call: ``looped_median`` with a fixed window, for scripts that compare
    whole training-like steps (scripts/profile_default.py, scripts/experiment_gemm_epilogue.py).
    """
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return sorted(times)[len(times) // 2]


def measure(fn, hidden, weight, target, rep_ms: int) -> dict:
    from triton.testing import do_bench

    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    grad_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()

    def fwd():
        return fn(h, w, target)

    def fwd_bwd():
        h.grad = None
        w.grad = None
        fn(h, w, target).backward()

    fwd_bwd()  # compile / warm up
    torch.cuda.synchronize()
    h.grad = None
    w.grad = None
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - grad_bytes

    # The backward alone is the difference: some providers (torch.compile) cannot run their
    # backward twice on one graph.
    timer = looped_median if TIMER == "loop" else (
        lambda f, rep: do_bench(f, warmup=25, rep=rep, return_mode="median"))
    t_fwd = timer(fwd, rep_ms)
    t_both = timer(fwd_bwd, rep_ms)
    loss = fn(h, w, target).item()
    h.grad = None
    w.grad = None
    return {"fwd_ms": t_fwd, "bwd_ms": t_both - t_fwd, "fwd_bwd_ms": t_both,
            "extra_mib": extra / MIB, "loss": loss}


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


def gemm_ceiling(case: Case, dtype, rep_ms: int) -> float:
    from triton.testing import do_bench

    a = torch.randn(case.n_tokens, case.hidden, device="cuda", dtype=dtype)
    b = torch.randn(case.vocab, case.hidden, device="cuda", dtype=dtype)
    ms = do_bench(lambda: a @ b.t(), warmup=25, rep=rep_ms, return_mode="median")
    return 2 * case.n_tokens * case.vocab * case.hidden / ms / 1e9


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["gemma2_2b", "llama3_8b", "phi3_5_mini"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[8192])
    parser.add_argument("--regimes", nargs="+", default=["uniform", "trained"])
    parser.add_argument("--providers", nargs="+",
                        default=["cce", "cce-nocheck", "cce-gemm", "cce-lean", "cce-kept",
                                 "torch.compile", "liger", "apple-cce", "megatron-fused"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--errors", action="store_true",
                        help="also each provider's relative error of the loss and gradients "
                        "against float64 (computed on the GPU)")
    parser.add_argument("--timer", choices=["loop", "do_bench"], default="loop",
                        help="loop: looped_median (default); do_bench: triton's, per call")
    args = parser.parse_args(argv)
    global TIMER
    TIMER = args.timer
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)

    import triton

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, timer {args.timer}")
    chosen = providers(args.providers)
    rows = []
    for model in args.models:
        cfg = load_model_config(model)
        for n_tokens in args.tokens:
            for regime in args.regimes:
                case = Case(model, n_tokens, cfg.vocab_size, cfg.hidden_size, regime)
                hidden, weight, target = make_inputs(case, dtype, "cuda")
                stats = softmax_stats(hidden, weight, target)
                ceiling = gemm_ceiling(case, dtype, args.rep_ms)
                reference = fp64_reference(hidden, weight, target) if args.errors else None
                one_mm = 2 * n_tokens * case.vocab * case.hidden / 1e9
                print(f"# {model} N={n_tokens} V={case.vocab} D={case.hidden} {regime}: "
                      + ", ".join(f"{k}={v:.4g}" for k, v in stats.items())
                      + f"; cuBLAS {ceiling:.0f} TFLOP/s ({one_mm / ceiling:.2f} ms per N·V·D mm)")
                for name, fn in chosen.items():
                    t0 = time.time()
                    try:
                        result = measure(fn, hidden, weight, target, args.rep_ms)
                    except Exception as error:  # out of memory, or a peer refusing a shape
                        print(f"{model:>12} {n_tokens:>6} {regime:>8} {name:>14}: "
                              f"{type(error).__name__}: {str(error)[:300]}", flush=True)
                        result = {"fwd_ms": math.nan, "bwd_ms": math.nan,
                                  "fwd_bwd_ms": math.nan, "extra_mib": math.nan,
                                  "loss": math.nan}
                        gc.collect()
                        torch.cuda.empty_cache()
                    result["tflops"] = 4 * one_mm / result["fwd_bwd_ms"]
                    if reference is not None and not math.isnan(result["fwd_bwd_ms"]):
                        result.update(relative_errors(fn, hidden, weight, target, reference))
                    elif reference is not None:
                        result.update(err_loss=math.nan, err_d_hidden=math.nan,
                                      err_d_weight=math.nan)
                    row = {"model": model, "tokens": n_tokens, "vocab": case.vocab,
                           "hidden": case.hidden, "regime": regime, "provider": name,
                           **result, "gemm_tflops": ceiling,
                           "mm_ms": one_mm / ceiling}
                    rows.append(row)
                    print(f"{model:>12} {n_tokens:>6} {regime:>8} {name:>14}: "
                          f"fwd {result['fwd_ms']:7.2f} ms  bwd {result['bwd_ms']:7.2f} ms  "
                          f"fwd+bwd {result['fwd_bwd_ms']:7.2f} ms  "
                          f"extra {result['extra_mib']:9.1f} MiB  loss {result['loss']:.4f}  "
                          + ("" if reference is None else
                             f"err loss {result['err_loss']:.1e} dE {result['err_d_hidden']:.1e}"
                             f" dC {result['err_d_weight']:.1e}  ")
                          + f"({time.time() - t0:.0f}s)", flush=True)
                del hidden, weight, target, reference
                torch.cuda.empty_cache()

    if args.out is not None:
        write_outputs(rows, args.out)


def write_outputs(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib missing: no plot")
        return
    groups = sorted({(r["model"], r["tokens"], r["regime"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (model, tokens, regime) in zip(axes[0], groups):
        for r in rows:
            if (r["model"], r["tokens"], r["regime"]) != (model, tokens, regime):
                continue
            ax.scatter(max(r["extra_mib"], 0.1), r["fwd_bwd_ms"], label=r["provider"])
            ax.annotate(r["provider"], (max(r["extra_mib"], 0.1), r["fwd_bwd_ms"]), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("extra memory (MiB, log)")
        ax.set_ylabel("forward+backward (ms)")
        ax.set_title(f"{model} N={tokens} {regime}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "time_vs_memory.png", dpi=120)


if __name__ == "__main__":
    main()
