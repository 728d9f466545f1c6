"""One training step under torch.profiler (``--profile-step``): where a step's time goes, on the
host and, on GPUs, in the kernels, per rank.

Each rank writes into ``--profile-dir``:

- ``step<S>_rank<R>.json``: the Chrome trace (chrome://tracing or https://ui.perfetto.dev);
- ``step<S>_rank<R>.txt``: the step's wall time, how long the GPU ran any kernel in it (the
  union of the kernels' intervals; the rest is idle, waiting for the host or a peer), and the
  ops that took the most host time and the most device time.

Why a whole step: a loss layer that is faster alone can still lengthen the step, by host time
spent between kernels or by a host read that drains the GPU's queue
(docs/benchmarks/training_step.md, 2026-11-27).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def start() -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    return profiler


def finish(profiler: torch.profiler.profile, out_dir: str, step: int, step_s: float) -> Path:
    """Stop ``profiler`` and write this rank's trace and summary; returns the summary's path."""
    profiler.stop()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"step{step}_rank{rank}.json"
    profiler.export_chrome_trace(str(trace))
    averages = profiler.key_averages()
    lines = [f"# step {step}, rank {rank}: {step_s * 1e3:.2f} ms of wall time under the profiler"]
    busy = kernel_busy_ms(json.loads(trace.read_text()))
    if busy is not None:
        lines.append(f"GPU busy (any kernel running): {busy:.2f} ms")
    lines += ["", "## ops by self host time",
              averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    if torch.cuda.is_available():
        lines += ["", "## ops by self device time",
                  averages.table(sort_by="self_device_time_total", row_limit=30)]
    summary = out / f"step{step}_rank{rank}.txt"
    summary.write_text("\n".join(lines) + "\n")
    return summary


def kernel_busy_ms(trace: dict) -> float | None:
    """The union of the kernels' intervals in a Chrome trace, in ms (None: no kernels)."""
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in trace.get("traceEvents", [])
             if e.get("cat") == "kernel" and "dur" in e]
    return union_ms(spans) if spans else None


def union_ms(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals in microseconds, in ms."""
    if not spans:
        return 0.0
    spans = sorted(spans)
    busy, (lo, hi) = 0.0, spans[0]
    for start_us, end_us in spans[1:]:
        if start_us > hi:
            busy += hi - lo
            lo, hi = start_us, end_us
        else:
            hi = max(hi, end_us)
    return (busy + hi - lo) / 1e3
