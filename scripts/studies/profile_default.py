"""Where the default mode's time goes, shape by shape: GEMMs, each pass over the logits, small
kernels, launch gaps, host time. One GPU.

    python scripts/studies/profile_default.py --out OUT/profile

For each shape and token count it prints and writes (``breakdown.csv``, ``kernels.json``):

- ``wall``: fwd+bwd ms per step, CUDA events around back-to-back steps;
- from a profiled window of three steps (torch.profiler): the GPU time per step of the cuBLAS
  GEMMs, the statistics pass, the G pass and everything else, ``gaps`` (the GPU idle between
  kernels) and that window's own wall time (clocks differ between windows: compare within one);
- ``host``: the host's ms to enqueue one step while the GPU is held busy by a sleep kernel,
  with ``check_targets=False`` (the target check is the step's one host read);
- ``gemm_only_wall``: the step's three cuBLAS GEMMs alone, chunk by chunk, under the same timer
  (the floor of any design that keeps cuBLAS's GEMMs, in the same power state);
- the same run's cuBLAS rate of each of the step's three GEMMs at the chunk's shape, alone, and
  the 3-GEMM floor at the logits GEMM's rate over all N tokens (as scripts/bench_lce.py reports);
- ``host_<shape>_<N>.txt``: a cProfile of the default's host time.

Variants: the default, the default's walk as it was on 2026-11-25 (cuBLAS logits and two passes
over them; its host time includes the target check), one chunk of every token
(``token_chunk_size=N``, the memory-for-speed end of the trade-off), and the peers of
``--peers`` (scripts/bench_lce.py's providers: torch.compile of the plain loss by default, or
e.g. ``quack`` where it is installed), each with its wall time, memory and GPU time by kernel.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from fused_lce import linear_cross_entropy
from fused_lce.options import LCEOptions
from fused_lce.token_walk import plan_forward_gradients
from lce_train.bench_lce_inputs import Case, make_inputs
from lce_train.bench_lce_providers import providers, two_pass_cce
from lce_train.bench_lce_timing import gemm_ceiling, steps_median_ms
from lce_train.configs import load_model_config

CATEGORIES = (  # (category, substrings of a kernel's name), first match wins
    ("statistics", ("_row_statistics_kernel",)),
    ("G pass", ("_grad_in_place_kernel",)),
    ("exp GEMM", ("_exp_logits_kernel",)),
    # The lean mode's Triton GEMMs (scripts/studies/lean_roofline.py).
    ("lse forward", ("_lse_forward_kernel",)),
    ("grad logits", ("_grad_logits_kernel",)),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90_")),
)


def category(kernel_name: str) -> str:
    for name, needles in CATEGORIES:
        if any(n in kernel_name for n in needles):
            return name
    return "other"


def step_fn(h, w, t, compiled=None, two_pass=False, **options):
    """One fwd+bwd step of ours (``two_pass``: with the walk of 2026-11-25), or of ``compiled``."""
    loss_fn = (two_pass_cce() if two_pass
               else lambda h, w, t: linear_cross_entropy(h, w, t, impl="cce", **options))

    def step():
        h.grad = None
        w.grad = None
        if compiled is not None:
            compiled(h, w, t).backward()
        else:
            loss_fn(h, w, t).backward()
    return step


def extra_memory_mib(step, h, w) -> float:
    """Peak MiB of one step above its inputs and their gradients."""
    step()  # compile / warm up
    h.grad = None
    w.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grad_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()
    return (torch.cuda.max_memory_allocated() - base - grad_bytes) / 2**20


def host_ms(step, repeats: int = 5) -> float:
    """Enqueue time of one step with the GPU held busy by a sleep kernel."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second at the H100's clock
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def kernel_breakdown(step, steps: int = 3) -> tuple[dict, dict, list]:
    """(ms per step by category, per kernel, the largest idle gaps) from one profiled window:
    category ``gaps`` is the GPU's idle time between the window's kernels, per step."""
    step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_category: dict = defaultdict(float)
    per_kernel: dict = defaultdict(lambda: [0.0, 0])
    spans = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = event.device_time_total / 1e3 / steps
        per_category[category(event.name)] += ms
        per_kernel[event.name][0] += ms
        per_kernel[event.name][1] += 1
        spans.append((event.time_range.start, event.time_range.end, event.name))
    spans.sort()
    gaps, reach, before = [], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > reach:
            gaps.append(((start - reach) / 1e3, before[:60], name[:60]))
        if end >= reach:
            reach, before = end, name
    per_category["gaps"] = sum(g[0] for g in gaps) / steps
    per_category["profiled wall"] = (reach - spans[0][0]) / 1e3 / steps
    kernels = {name: {"ms_per_step": v[0], "launches_per_step": v[1] / steps}
               for name, v in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])}
    return dict(per_category), kernels, sorted(gaps, reverse=True)[:8]


def gemm_only_step(h, w, chunk_rows: int):
    """The step's three cuBLAS GEMMs as the default issues them, chunk by chunk, and nothing else:
    the floor of any design whose GEMMs are cuBLAS's, under the same timer and power state."""
    n_rows, vocab = h.shape[0], w.shape[0]
    buffer = torch.empty(min(chunk_rows, n_rows), vocab, device=h.device, dtype=h.dtype)
    d_hidden, d_weight = torch.empty_like(h), torch.empty_like(w)

    def step():
        for start in range(0, n_rows, chunk_rows):
            x = h[start:start + chunk_rows]
            logits = buffer[: x.shape[0]]
            torch.mm(x, w.t(), out=logits)  # its values then stand in for G: real magnitudes
            torch.mm(logits, w, out=d_hidden[start:start + chunk_rows])
            if start == 0:
                torch.mm(logits.t(), x, out=d_weight)
            else:
                d_weight.addmm_(logits.t(), x)
    return step


def host_profile(step, path: Path, steps: int = 5) -> None:
    """cProfile of ``steps`` steps enqueued while the GPU sleeps: where the host's time goes."""
    import cProfile
    import io
    import pstats

    step()
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    path.write_text(text.getvalue())


def gemm_rates(rows: int, vocab: int, hidden: int, dtype) -> dict:
    """TFLOP/s of the step's three GEMMs at a chunk of ``rows`` tokens, each alone."""
    from triton.testing import do_bench

    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    w = torch.randn(vocab, hidden, device="cuda", dtype=dtype)
    g = torch.randn(rows, vocab, device="cuda", dtype=dtype)
    d_hidden = torch.empty(rows, hidden, device="cuda", dtype=dtype)
    d_weight = torch.empty(vocab, hidden, device="cuda", dtype=dtype)
    flops = 2 * rows * vocab * hidden
    timed = {
        "logits X@W.T": lambda: torch.mm(x, w.t(), out=g),
        "d_hidden G@W": lambda: torch.mm(g, w, out=d_hidden),
        "d_weight G.T@X": lambda: torch.mm(g.t(), x, out=d_weight),
        "d_weight += G.T@X": lambda: d_weight.addmm_(g.t(), x),
    }
    return {name: flops / do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e9
            for name, fn in timed.items()}


def peer_row(name: str, step, h, w, columns: dict) -> dict:
    """A peer's wall time, memory and GPU time by kernel category (its kernels under
    ``"kernels"``), in the columns of ours; what does not apply is NaN."""
    row = dict.fromkeys(columns, float("nan"))
    row["variant"] = name
    row["extra_mib"] = extra_memory_mib(step, h, w)
    row["wall_ms"] = steps_median_ms(step)
    per_category, per_kernel, _ = kernel_breakdown(step)
    for category_name, _ in CATEGORIES:
        row[f"{category_name}_ms"] = per_category.get(category_name, 0.0)
    row["other_ms"] = per_category.get("other", 0.0)
    row["gaps_ms"] = per_category["gaps"]
    row["profiled_wall_ms"] = per_category["profiled wall"]
    row["kernels"] = per_kernel
    return row


def run_case(model: str, n_tokens: int, regime: str, out: Path | None,
             tp: int = 1, peers: tuple[str, ...] = ("torch.compile",)) -> tuple[list[dict], dict]:
    """One shape; ``tp`` > 1 times one tensor-parallel rank's work (its V/tp vocabulary shard,
    every token), as scripts/studies/bench_strategies.py does. ``peers``: scripts/bench_lce.py
    providers profiled beside ours (their GEMMs count under "gemm" where their names say so)."""
    cfg = load_model_config(model)
    vocab = math.ceil(cfg.vocab_size / tp)
    label = model if tp == 1 else f"{model}_tp{tp}"
    case = Case(model, n_tokens, vocab, cfg.hidden_size, regime)
    hidden, weight, target = make_inputs(case, torch.bfloat16, "cuda")
    target = target % vocab  # a shard's targets fall in its shard (the rest is the same work)
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    ceiling = gemm_ceiling(case, torch.bfloat16, 100)
    floor_ms = 3 * 2 * n_tokens * vocab * cfg.hidden_size / ceiling / 1e9
    rows, kernels = [], {}
    default_rows = plan_forward_gradients(LCEOptions(), n_tokens, vocab,
                                          cfg.hidden_size, 2, True).chunk_rows
    variants = {"default": ({}, default_rows),
                "two passes (the walk of 2026-11-25)": ({"two_pass": True}, default_rows),
                "one chunk (token_chunk_size=N)": ({"token_chunk_size": n_tokens}, n_tokens)}
    for variant, (options, chunk_rows) in variants.items():
        step = step_fn(h, w, target, **options)
        extra_mib = extra_memory_mib(step, h, w)
        wall = steps_median_ms(step)
        per_category, per_kernel, largest_gaps = kernel_breakdown(step)
        unchecked = (step if options.get("two_pass")
                     else step_fn(h, w, target, check_targets=False, **options))
        if out is not None and variant == "default":
            host_profile(unchecked, out / f"host_{label}_{n_tokens}.txt")
        gemms_only = steps_median_ms(gemm_only_step(h.detach(), w.detach(), chunk_rows))
        row = {"shape": label, "tokens": n_tokens, "regime": regime, "variant": variant,
               "chunk_rows": chunk_rows, "wall_ms": wall, "gemm_only_wall_ms": gemms_only,
               "host_ms": host_ms(unchecked), "extra_mib": extra_mib,
               "floor_ms": floor_ms, "cublas_tflops": ceiling}
        for name, _ in CATEGORIES:
            row[f"{name}_ms"] = per_category.get(name, 0.0)
        row["other_ms"] = per_category.get("other", 0.0)
        row["gaps_ms"] = per_category["gaps"]
        row["profiled_wall_ms"] = per_category["profiled wall"]
        kernels[f"{label} N={n_tokens} {variant}: largest gaps (ms, after, before)"] = largest_gaps
        rows.append(row)
        kernels[f"{label} N={n_tokens} {variant}"] = per_kernel
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)
    for name, loss_fn in providers(list(peers)).items():
        try:
            row = peer_row(name, step_fn(h, w, target, compiled=loss_fn), h, w, rows[0])
        except Exception as error:  # a peer refusing a shape
            print(f"{label} N={n_tokens} {name}: {type(error).__name__}: {str(error)[:300]}",
                  flush=True)
            continue
        row.update(shape=label, tokens=n_tokens, regime=regime, floor_ms=floor_ms,
                   cublas_tflops=ceiling)
        kernels[f"{label} N={n_tokens} {name}"] = row.pop("kernels")
        rows.append(row)
        print(f"{label} N={n_tokens} {name}: " + " ".join(
            f"{k}={row[k]:.2f}" for k in ("wall_ms", "extra_mib", "exp GEMM_ms", "gemm_ms",
                                          "other_ms", "gaps_ms")), flush=True)
    for rows_ in sorted({default_rows, n_tokens}):
        rates = gemm_rates(rows_, vocab, cfg.hidden_size, torch.bfloat16)
        kernels[f"{label} gemm TFLOP/s at {rows_} rows"] = rates
        print(f"# {label} cuBLAS TFLOP/s at {rows_} rows: "
              + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()), flush=True)
    del hidden, weight, target, h, w
    torch.cuda.empty_cache()
    return rows, kernels


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+",
                        default=["gemma2_2b:8192", "llama3_8b:8192", "phi3_5_mini:8192",
                                 "llama3_8b:4096"], help="model:tokens[:tensor-parallel ranks]")
    parser.add_argument("--regime", default="trained", choices=["uniform", "trained"])
    parser.add_argument("--peers", nargs="+", default=["torch.compile"],
                        help="scripts/bench_lce.py providers profiled beside ours, e.g. quack")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    rows, kernels = [], {}
    for spec in args.cases:
        model, tokens, *tp = spec.split(":")
        case_rows, case_kernels = run_case(model, int(tokens), args.regime, args.out,
                                           int(tp[0]) if tp else 1, tuple(args.peers))
        rows += case_rows
        kernels.update(case_kernels)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "breakdown.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        (args.out / "kernels.json").write_text(json.dumps(kernels, indent=1))


if __name__ == "__main__":
    sys.exit(main())
