"""Where the time of forward+backward goes: kernels by GPU time, and the GPU's idle gaps.

    python scripts/profile_lce.py --model gemma2_2b --tokens 8192 [--scratch-mb 12] [--steps 5]
        [--check-targets] [--tma 0|1]

Runs ``--steps`` steps of ``impl="cce"`` back to back on random-init inputs under torch.profiler
and prints, per step: the wall time (CUDA events around the steps), the time at least one kernel
ran, the idle time between kernels, and the kernels with the most GPU time. The largest idle gaps
are listed with the kernels on either side, which says whether the host (launch overhead, a
sync) or the GPU is the bottleneck.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# Import the installed packages, not lce_train's source folder beside this file: the install
# maps the top-level configs/ in as lce_train.configs, which that folder lacks.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

from fused_lce import backward_plan, linear_cross_entropy  # noqa: E402
from lce_train.configs import load_model_config  # noqa: E402


def kernel_intervals(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel and memset/memcpy, sorted by start."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0:
            out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def busy_and_gaps(intervals, min_gap_us: float = 5.0):
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = None, None, ""
    for start, end, name in intervals:
        if cur_end is None:
            cur_start, cur_end, cur_name = start, end, name
            continue
        if start > cur_end:
            busy += cur_end - cur_start
            if start - cur_end >= min_gap_us:
                gaps.append((start - cur_end, cur_name, name))
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
        cur_name = name
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy, gaps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma2_2b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--scratch-mb", type=float, default=None)
    parser.add_argument("--backward", default="auto")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--check-targets", action="store_true")
    parser.add_argument("--tma", choices=["0", "1"], default=None)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--chunk-cols", type=int, default=None,
                        help="GEMM backward: columns per G chunk when every row fits "
                        "(backward_plan.MAX_CHUNK_COLS)")
    args = parser.parse_args(argv)
    tma = None if args.tma is None else args.tma == "1"
    if args.chunk_cols is not None:
        backward_plan.MAX_CHUNK_COLS = args.chunk_cols
    cfg = load_model_config(args.model)
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda") * 0.02).bfloat16()
    hidden.requires_grad_()
    weight.requires_grad_()
    target = torch.randint(0, cfg.vocab_size, (args.tokens,), device="cuda")

    def step():
        hidden.grad = None
        weight.grad = None
        loss = linear_cross_entropy(hidden, weight, target, impl="cce",
                                    scratch_mb=args.scratch_mb, backward=args.backward,
                                    check_targets=args.check_targets, tma=tma)
        loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / args.steps

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    intervals = kernel_intervals(prof)
    busy_us, gaps = busy_and_gaps(intervals)
    span_us = intervals[-1][1] - intervals[0][0]
    label = (f"{args.model} N={args.tokens} scratch_mb={args.scratch_mb} "
             f"check_targets={args.check_targets} tma={'env' if tma is None else int(tma)} "
             f"chunk_cols={backward_plan.MAX_CHUNK_COLS}")
    print(f"# {label}")
    print(f"wall {wall_ms:.2f} ms/step (events, no profiler); under the profiler: span "
          f"{span_us / 1e3 / args.steps:.2f}, GPU busy {busy_us / 1e3 / args.steps:.2f}, "
          f"idle {sum(g for g, _, _ in gaps) / 1e3 / args.steps:.2f} ms/step in "
          f"{len(gaps) / args.steps:.0f} gaps >= 5 us")

    totals: dict[str, list[float]] = {}
    for s, e, name in intervals:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += e - s
        entry[1] += 1
    for name, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{us / 1e3 / args.steps:8.2f} ms/step x{count // args.steps:<4d} {name[:80]}")
    print("largest idle gaps (us, kernel before -> kernel after):")
    for gap, before, after in sorted(gaps, reverse=True)[: args.top]:
        print(f"{gap:9.0f}  {before[:45]} -> {after[:45]}")


if __name__ == "__main__":
    main()
