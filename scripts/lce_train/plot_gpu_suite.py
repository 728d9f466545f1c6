"""Plots and tables for the result folders of the 4-GPU suite (run on the CPU, after the GPU run).

    lce-plot-gpu-suite parallel docs/benchmarks/vocab_parallel_h200x4_202611
    lce-plot-gpu-suite megatron docs/benchmarks/megatron_h200x4_202611
    lce-plot-gpu-suite pp-memory docs/benchmarks/pp_memory_h200x4_202611

parallel   bench_parallel.csv -> time_and_memory.png, and a markdown table on stdout
megatron   megatron_<layout>_<impl>.jsonl -> loss_curves.png, and per layout: final loss, mean
           and largest per-step loss difference, median step time, peak memory per stage
pp-memory  pp_<model>_measured.csv -> predicted_vs_measured.csv/.png: each measured stage beside
           what lce_train.pp_memory predicts now (the CSVs' own predictions are those of the model
           when the run was made)

The reports under docs/benchmarks/ keep a run's records compact: ``runs.csv`` (every benchmark
CSV of the page, with ``run`` and ``table`` columns) and ``runs.jsonl`` (one line per launcher
run with the per-step fields read here, one per micro-batch search). Where a folder has no raw
files, ``parallel`` and ``megatron`` read those instead, for ``--run`` (default: the last run).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
from pathlib import Path

from lce_train import pp_memory as pm
from lce_train.configs import load_model_config


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ----------------------------------------------------------------------------------------------
# bench_parallel.csv
# ----------------------------------------------------------------------------------------------

SHOWN = ("ours", "ours-lean", "megatron")


def compact_run(runs: list[str], run: str | None, path: Path) -> str:
    """``run``, checked against the runs of a compact file, or its last one."""
    if not runs:
        raise SystemExit(f"{path}: no runs of this kind")
    if run is None:
        return runs[-1]
    if run not in runs:
        raise SystemExit(f"{path}: no run {run!r}; runs: {', '.join(runs)}")
    return run


def parallel_rows(folder: Path, run: str | None = None) -> list[dict]:
    """bench_parallel.csv of ``folder``, else the bench_parallel rows of ``run`` in runs.csv."""
    if (folder / "bench_parallel.csv").exists():
        return read_csv(folder / "bench_parallel.csv")
    rows = [r for r in read_csv(folder / "runs.csv") if r["table"] == "bench_parallel"]
    run = compact_run(list(dict.fromkeys(r["run"] for r in rows)), run, folder / "runs.csv")
    return [{k: v for k, v in r.items() if k not in ("run", "table") and v != ""}
            for r in rows if r["run"] == run]


def parallel(folder: Path, run: str | None = None) -> None:
    rows = parallel_rows(folder, run)
    models = sorted({r["model"] for r in rows})
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        for provider in SHOWN:
            for sp, style in (("off", "-o"), ("on", "--s")):
                pts = sorted((int(r["tp"]), float(r["fwd_bwd_ms"]), float(r["extra_mib"]))
                             for r in rows if (r["model"], r["provider"]) == (model, provider)
                             and (r["sp"] == sp or r["tp"] == "1"))
                if len(pts) < 2:
                    continue
                label = f"{provider} SP {sp}"
                axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
                axes[1][col].plot([p[0] for p in pts], [p[2] for p in pts], style, label=label)
        axes[0][col].set(title=f"{model}, 8192 tokens per TP group", xlabel="TP",
                         ylabel="forward+backward ms (slowest rank)", xscale="log", yscale="log")
        axes[1][col].set(xlabel="TP", ylabel="extra memory per rank, MiB", xscale="log",
                         yscale="log")
        for ax in axes[:, col]:
            ax.set_xticks([1, 2, 4], ["1", "2", "4"])
            ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "time_and_memory.png", dpi=110)
    print(f"wrote {folder / 'time_and_memory.png'}\n")

    print("| model | TP | SP | ours ms / MiB | ours-lean ms / MiB | megatron ms / MiB | "
          "collectives ms | ours vs megatron | ours efficiency |")
    print("|---|---|---|---|---|---|---|---|---|")
    key = lambda r: (r["model"], int(r["tp"]), r["sp"])
    for model, tp, sp in sorted({key(r) for r in rows}):
        got = {r["provider"]: r for r in rows if key(r) == (model, tp, sp)}
        def cell(p, got=got):
            if p not in got:
                return "-"
            return f"{float(got[p]['fwd_bwd_ms']):.1f} / {float(got[p]['extra_mib']):.0f}"

        ours, meg = float(got["ours"]["fwd_bwd_ms"]), float(got["megatron"]["fwd_bwd_ms"])
        ratio = f"{meg / ours:.2f}x faster" if ours < meg else f"{ours / meg:.2f}x slower"
        comm = f"{float(got['collectives']['fwd_bwd_ms']):.2f}" if "collectives" in got else "-"
        print(f"| {model} | {tp} | {sp} | {cell('ours')} | {cell('ours-lean')} | "
              f"{cell('megatron')} | {comm} | {ratio} | "
              f"{float(got['ours']['efficiency_vs_tp1']):.2f} |")


# ----------------------------------------------------------------------------------------------
# launcher runs
# ----------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launcher_runs(folder: Path, run: str | None = None) -> tuple[dict, list[dict]]:
    """{(layout, impl): step records} of the launcher's megatron_<layout>_<impl>.jsonl logs, and
    the max_mbs_*.json results; from runs.jsonl (for ``run``) where the folder has no logs."""
    logs = sorted(folder.glob("megatron_*_*.jsonl"))
    if logs or not (folder / "runs.jsonl").exists():
        runs = {tuple(p.stem.split("_")[1:]): read_jsonl(p) for p in logs}
        return runs, [json.loads(p.read_text()) for p in sorted(folder.glob("max_mbs_*.json"))]
    lines = read_jsonl(folder / "runs.jsonl")
    run = compact_run(list(dict.fromkeys(x["run"] for x in lines if "records" in x)), run,
                      folder / "runs.jsonl")
    mine = sorted((x for x in lines if x["run"] == run), key=lambda x: x["name"])
    runs = {tuple(x["name"].split("_")[1:]): x["records"] for x in mine
            if x["name"].startswith("megatron_")}
    return runs, [x["result"] for x in mine if x["name"].startswith("max_mbs_")]


def megatron(folder: Path, skip: int = 10, run: str | None = None) -> None:
    runs, searches = launcher_runs(folder, run)
    layouts = sorted({k[0] for k in runs})
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(layouts), figsize=(6 * len(layouts), 7), squeeze=False,
                             sharex=True)
    print("| layout | steps | final loss cce / native | mean |Δ| per step | largest |Δ| | "
          "mean Δ last 50 | step s cce / native | peak GiB per stage cce / native |")
    print("|---|---|---|---|---|---|---|---|")
    for col, layout in enumerate(layouts):
        cce, native = runs[(layout, "cce")], runs[(layout, "native")]
        steps = [r["step"] for r in cce]
        for impl, recs in (("native", native), ("cce", cce)):
            axes[0][col].plot(steps, [r["loss"] for r in recs], label=impl, lw=1)
        diff = [a["loss"] - b["loss"] for a, b in zip(cce, native)]
        axes[1][col].plot(steps, diff, lw=1)
        axes[0][col].set(title=layout, ylabel="loss")
        axes[0][col].legend()
        axes[1][col].set(xlabel="step", ylabel="loss cce - native")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
        step_s = [statistics.median(r["step_s"] for r in recs[skip:]) for recs in (cce, native)]
        peaks = [" ".join(f"{g:.2f}" for g in recs[-1]["peak_gib"]) for recs in (cce, native)]
        tail = diff[-50:]
        print(f"| {layout} | {len(steps)} | {cce[-1]['loss']:.4f} / {native[-1]['loss']:.4f} | "
              f"{statistics.mean(abs(d) for d in diff):.4f} | {max(abs(d) for d in diff):.4f} | "
              f"{statistics.mean(tail):+.4f} | {step_s[0]:.3f} / {step_s[1]:.3f} | "
              f"{peaks[0]} / {peaks[1]} |")
    fig.tight_layout()
    fig.savefig(folder / "loss_curves.png", dpi=110)
    print(f"\nwrote {folder / 'loss_curves.png'}")
    for result in searches:
        print(f"{result['impl']}: largest micro-batch {result['max_micro_batch']} x "
              f"{result['seq_length']} = {result['max_tokens']} tokens (TP {result['tp']}, "
              f"SP {result['sp']}, {result['num_layers']} layers)")


# ----------------------------------------------------------------------------------------------
# pp_memory_balance --measure
# ----------------------------------------------------------------------------------------------

# The layouts scripts/gpu_suite.sh measures (stages pp-gemma and pp-llama).
MEASURED_LAYOUTS = {
    "gemma": ("gemma2_2b", 8, pm.Layout(tp=2, pp=2, seq_length=4096, micro_batch=2,
                                        num_microbatches=8, recompute="none")),
    "llama": ("llama3_8b", 8, pm.Layout(pp=4, seq_length=4096, micro_batch=1,
                                        num_microbatches=8, recompute="none")),
}


def pp_memory(folder: Path) -> None:
    out, labels, predicted, measured = [], [], [], []
    for name, (config, layers, lay) in MEASURED_LAYOUTS.items():
        path = folder / f"pp_{name}_measured.csv"
        if not path.exists():
            continue
        cfg = dataclasses.replace(load_model_config(config), num_layers=layers)
        rows = read_csv(path)
        for (loss, split) in dict.fromkeys((r["loss"], r["split"]) for r in rows):
            stages = [r for r in rows if (r["loss"], r["split"]) == (loss, split)]
            layer_split = [int(r["layers"]) for r in stages]
            model = pm.stage_memory(cfg, lay.replace(loss=loss), layer_split)
            for r, st in zip(stages, model):
                meas = float(r["measured_gib"])
                pred = st.total / pm.GIB
                out.append({"layout": name, "config": config, "loss": loss, "split": split,
                            "layers": layer_split, "stage": st.stage, "predicted_gib": pred,
                            "measured_gib": meas, "error": pred / meas - 1,
                            "measured_resident_gib": float(r["measured_resident_gib"]),
                            "predicted_states_gib": st.states / pm.GIB})
                labels.append(f"{name} {loss} {layer_split} s{st.stage}")
                predicted.append(pred)
                measured.append(meas)
    with open(folder / "predicted_vs_measured.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)
    print("| layout | loss | split | stage | predicted GiB | measured GiB | error |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['layout']} | {r['loss']} | {r['layers']} | {r['stage']} | "
              f"{r['predicted_gib']:.2f} | {r['measured_gib']:.2f} | {100 * r['error']:+.1f}% |")
    print(f"\nlargest error {100 * max(abs(r['error']) for r in out):.1f}%")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(out)), 5))
    x = range(len(out))
    ax.bar([i - 0.2 for i in x], predicted, 0.4, label="predicted (lce_train.pp_memory)")
    ax.bar([i + 0.2 for i in x], measured, 0.4, label="measured (max_memory_allocated)")
    ax.set_xticks(list(x), labels, rotation=75, fontsize=7)
    ax.set(ylabel="peak GiB per GPU", title="pipeline stages: predicted vs measured, 4 x H200")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "predicted_vs_measured.png", dpi=110)
    print(f"wrote {folder / 'predicted_vs_measured.png'}")


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------

# The files each report reads, raw or compact: a folder with none of them is the wrong folder (or
# one the GPU run's results were not copied into), which deserves a sentence, not a traceback.
EXPECTED = {
    "parallel": ("bench_parallel.csv", "runs.csv"),
    "megatron": ("megatron_<layout>_<impl>.jsonl", "runs.jsonl"),
    "pp-memory": tuple(f"pp_{name}_measured.csv" for name in MEASURED_LAYOUTS),
}


def missing_results(what: str, folder: Path) -> str | None:
    """Why ``folder`` has nothing for the ``what`` report to read, or None when it has."""
    if not folder.is_dir():
        return f"{folder}: no such folder (expected a folder of {what} results)"
    patterns = [name.replace("<layout>", "*").replace("<impl>", "*") for name in EXPECTED[what]]
    if any(any(folder.glob(pattern)) for pattern in patterns):
        return None
    return f"{folder}: no {what} results: expected {' or '.join(EXPECTED[what])} in it"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=tuple(EXPECTED), help="the report; it reads " + "; ".join(
        f"{what}: {' or '.join(names)}" for what, names in EXPECTED.items()))
    parser.add_argument("folder", type=Path, help="the folder of one GPU run's results")
    parser.add_argument("--run", default=None,
                        help="the run of the folder's runs.csv / runs.jsonl (default: the last)")
    args = parser.parse_args(argv)
    problem = missing_results(args.what, args.folder)
    if problem is not None:
        parser.error(problem)
    if args.what == "pp-memory":
        pp_memory(args.folder)
    else:
        {"parallel": parallel, "megatron": megatron}[args.what](args.folder, run=args.run)


if __name__ == "__main__":
    main()
