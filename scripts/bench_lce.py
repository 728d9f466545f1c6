"""Benchmark the loss layer: time (forward, backward, both) and extra memory, ours beside peers.

    python scripts/bench_lce.py --models gemma2_2b llama3_8b phi3_5_mini --tokens 8192 \
        --regimes uniform trained --out docs/benchmarks/run

Providers (``--providers``): ours at each of its settings (``cce``, the default; ``cce-nocheck``,
as the Megatron adapter calls it; ``cce-gemm``, ``cce-lean``, ``cce-kept``, ``cce-tiles``,
``cce-two-pass``, ``cce:key=value,...`` and more), ``torch`` (eager full logits), ``torch.compile``
(the same function compiled), and, when installed, ``liger``, ``apple-cce``, ``megatron-fused`` and
the CuTe-DSL peers ``quack``, ``quack-scaled-exp``, ``liger-cute`` and ``liger-cutedsl``;
``lce_train.bench_lce_providers`` says what each one calls.
A provider that raises (out of memory, a shape it refuses) is reported and skipped. Times are
medians over windows of back-to-back calls (``looped_median``; ``--timer do_bench`` for
triton's per-call timer; the backward is forward+backward minus forward, the forward running
with autograd on); "extra memory" is the peak allocated during forward+backward above the inputs
and the gradient buffers (``lce_train.bench_lce_timing``).

Data regimes (``--regimes``, ``lce_train.bench_lce_inputs``): ``uniform``, random initialisation
(a near-uniform softmax), and ``trained``, a trained-like softmax (a Zipf(1.1) unigram prior
sharpened to a log-log slope of about -2, context noise of about one nat, an 8-nat boost of each
token's target). The script prints the softmax statistics it produced (target probability,
entries above 2^-12 per row).

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
from pathlib import Path

import torch

# Import the installed packages, not lce_train's source folder beside this file: the install
# maps the top-level configs/ in as lce_train.configs, which that folder lacks.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

from lce_train.bench_lce_inputs import (  # noqa: E402
    Case,
    fp64_reference,
    make_inputs,
    relative_errors,
    softmax_stats,
)
from lce_train.bench_lce_providers import providers  # noqa: E402
from lce_train.bench_lce_timing import gemm_ceiling, measure  # noqa: E402
from lce_train.configs import load_model_config  # noqa: E402


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
                        result = measure(fn, hidden, weight, target, args.rep_ms, args.timer)
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
