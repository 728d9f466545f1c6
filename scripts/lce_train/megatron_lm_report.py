"""Side-by-side table of Megatron-LM ``pretrain_gpt.py`` runs, read from their logs.

    lce-megatron-lm-report RESULTS_DIR

reads every ``RESULTS_DIR/<layout>_<loss>.log`` (as scripts/megatron_lm_gpu.sh writes them) and
prints one markdown table per layout: the final ``lm loss``, the mean over the last 10
iterations, the largest ``max allocated`` any rank reported in its last memory line (with
``--log-memory-interval`` equal to the run's length that is the whole run's peak), and the
median time per iteration after the first 5. Only Megatron-LM's own log lines are used.

With ``--step`` it reads the logs of scripts/megatron_lm_step.sh instead,
``RESULTS_DIR/<layout>__<loss>[_graphs]__r<round>.log``, and prints per layout each run's median
ms per iteration over the iterations after ``--skip`` (one figure per round, their median and
range), the peak ``max allocated`` of any rank, and, for a run under full-iteration CUDA graphs,
the largest difference of its ``lm loss`` from the same loss's eager run of the same round.
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


STEP_RUNS = ("native", "cce", "native_graphs", "cce_graphs")
# Listed only where their logs are: cce with the op's own CUDA graph off (--cce-no-cuda-graphs).
OPTIONAL_STEP_RUNS = ("cce_eager", "cce_eager_graphs")


def step_tables(results: Path, skip: int) -> str:
    """The --step tables: one per layout, a row per run of STEP_RUNS and per optional run
    found."""
    logs: dict[str, dict[str, dict[int, dict]]] = {}
    for log in sorted(results.glob("*__*__r*.log")):
        layout, run, round_ = log.stem.split("__")
        logs.setdefault(layout, {}).setdefault(run, {})[int(round_[1:])] = read_log(
            log.read_text())
    tables = []
    for layout, runs in logs.items():
        rows = [f"### {layout}", "",
                "| run | ms / iteration, median per round | median | range | peak MiB (any rank) "
                "| lm loss, last iteration | largest loss difference from eager |",
                "|---|---|---|---|---|---|---|"]
        order = [*STEP_RUNS, *(run for run in OPTIONAL_STEP_RUNS if run in runs)]
        for run in order:
            rounds = runs.get(run, {})
            medians, peaks, finals, drift = [], [], [], []
            for k, parsed in sorted(rounds.items()):
                late = [t for step, t in parsed["times"].items() if step > skip]
                if late:
                    medians.append(statistics.median(late))
                peaks += [m for _, m in parsed["peak_mib"].values()]
                if parsed["losses"]:
                    finals.append(parsed["losses"][max(parsed["losses"])])
                eager = runs.get(run.removesuffix("_graphs"), {}).get(k)
                if run.endswith("_graphs") and eager and parsed["losses"]:
                    common = set(parsed["losses"]) & set(eager["losses"])
                    drift += [abs(parsed["losses"][s] - eager["losses"][s]) for s in common]
            if not medians:
                rows.append(f"| {run} | no result ({layout}__{run}__r*.log) | | | | | |")
                continue
            rows.append(
                f"| {run} | {', '.join(f'{m:.1f}' for m in medians)} | "
                f"{statistics.median(medians):.1f} | {min(medians):.1f}-{max(medians):.1f} | "
                f"{max(peaks, default=float('nan')):.0f} | "
                f"{', '.join(f'{f:.5f}' for f in finals)} | "
                f"{f'{max(drift):.2e}' if drift else '-'} |")
        tables.append("\n".join(rows))
    return "\n\n".join(tables)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="folder of <layout>_<loss>.log files")
    parser.add_argument("--step", action="store_true",
                        help="the logs of the step-time runs (the repository's "
                             "megatron_lm_step.sh)")
    parser.add_argument("--skip", type=int, default=10,
                        help="--step: iterations left out of the medians (warm-up, capture)")
    args = parser.parse_args(argv)
    if args.step:
        print(step_tables(args.results, args.skip) or f"no step logs in {args.results}")
        return
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
