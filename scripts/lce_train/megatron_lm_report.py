"""Side-by-side table of Megatron-LM ``pretrain_gpt.py`` runs, read from their logs.

    python scripts/megatron_lm_report.py RESULTS_DIR

reads every ``RESULTS_DIR/<layout>_<loss>.log`` (as scripts/megatron_lm_gpu.sh writes them) and
prints one markdown table per layout: the final ``lm loss``, the mean over the last 10
iterations, the largest ``max allocated`` any rank reported in its last memory line (with
``--log-memory-interval`` equal to the run's length that is the whole run's peak), and the
median time per iteration after the first 5. Only Megatron-LM's own log lines are used.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

LOSSES = ("cce", "native", "unfused")
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|")
_LM_LOSS = re.compile(r"\| lm loss: ([0-9.eE+-]+) \|")
_ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
_MEMORY = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\).*?"
                     r"\| max allocated: ([0-9.]+)")


def read_log(text: str) -> dict:
    """Per-iteration loss and time, and each rank's last max-allocated (MiB), from one log."""
    losses, times, peak = {}, {}, {}
    for line in text.splitlines():
        it = _ITERATION.search(line)
        if it:
            step = int(it.group(1))
            loss = _LM_LOSS.search(line)
            if loss:
                losses[step] = float(loss.group(1))
            elapsed = _ELAPSED.search(line)
            if elapsed:
                times[step] = float(elapsed.group(1))
        memory = _MEMORY.search(line)
        if memory:
            peak[int(memory.group(1))] = (int(memory.group(2)), float(memory.group(3)))
    return {"losses": losses, "times": times, "peak_mib": peak}


def summarize(run: dict) -> dict | None:
    losses = run["losses"]
    if not losses:
        return None
    steps = sorted(losses)
    last = steps[-1]
    late_times = [t for s, t in sorted(run["times"].items()) if s > 5] or list(
        run["times"].values())
    return {
        "steps": last,
        "final": losses[last],
        "last10": statistics.fmean(losses[s] for s in steps[-10:]),
        "peak_gib": max((m for _, m in run["peak_mib"].values()), default=float("nan")) / 1024,
        "ms": statistics.median(late_times) if late_times else float("nan"),
    }


def table(layout: str, runs: dict[str, dict | None]) -> str:
    rows = [f"### {layout}", "",
            "| loss | iterations | final lm loss | mean of last 10 | vs unfused | "
            "max allocated (GiB) | ms / iteration (median) |",
            "|---|---|---|---|---|---|---|"]
    base = runs.get("unfused")
    for loss in LOSSES:
        s = runs.get(loss)
        if s is None:
            rows.append(f"| {loss} | no result (see {layout}_{loss}.log) | | | | | |")
            continue
        delta = f"{s['last10'] - base['last10']:+.5f}" if base else "n/a"
        rows.append(f"| {loss} | {s['steps']} | {s['final']:.5f} | {s['last10']:.5f} | {delta} | "
                    f"{s['peak_gib']:.2f} | {s['ms']:.1f} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="folder of <layout>_<loss>.log files")
    args = parser.parse_args(argv)
    layouts: dict[str, dict] = {}
    for log in sorted(args.results.glob("*.log")):
        layout, _, loss = log.stem.rpartition("_")
        if loss in LOSSES and layout:
            layouts.setdefault(layout, {})[loss] = summarize(read_log(log.read_text()))
    if not layouts:
        sys.exit(f"no <layout>_<loss>.log files in {args.results}")
    print("\n\n".join(table(layout, runs) for layout, runs in layouts.items()))


if __name__ == "__main__":
    main()
