"""Pipeline-stage memory balance with megatron's loss (``native``) and with Cut Cross-Entropy.

Predicts each pipeline stage's peak memory for a model and a layout (lce_train.pp_memory: the
terms and every assumption are in its docstring and docs/pp_memory_balance.md), recommends the
layer split that minimises the largest stage for each loss (lce_train.pp_split), and says what
cce buys at the same memory: fewer stages, a longer sequence, a larger micro-batch. Prints a
table and optionally writes a CSV and a PNG bar chart per stage (native vs cce, before and after
rebalancing):

    lce-pp-memory-balance --config llama3_8b --tensor-model-parallel-size 2 \\
        --sequence-parallel --pipeline-model-parallel-size 4 --num-microbatches 8 \\
        --seq-length 8192 --csv out/llama.csv --png out/llama.png

(the same as ``python -m lce_train.pp_memory_balance``; ``--png`` needs matplotlib,
``pip install 'fused_lce[plot]'``).

``--measure`` runs the launcher (``lce_train.training``) under torchrun for the same layout (the
split given, and the recommended one where first/last flags express it), once per loss, reads
each stage's peak memory from its ``--log-json`` records and prints predicted vs measured per
stage. It needs TP x PP x DP GPUs; ``--dry-run`` prints the torchrun commands instead of running
them.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from lce_train import pp_memory as pm
from lce_train import pp_split
from lce_train.configs import known_models, load_model_config

LOSSES = ("native", "cce")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="llama3_8b",
                   help=f"model shape: {', '.join(known_models())} or a path to a .yaml")
    p.add_argument("--num-layers", type=int, default=None,
                   help="override the config's transformer layers (e.g. a few, for --measure)")
    g = p.add_argument_group("layout (megatron's flag names)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=1,
                   help="model chunks per rank (> 1: the interleaved schedule)")
    g.add_argument("--data-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--seq-length", type=int, default=4096)
    g.add_argument("--num-microbatches", type=int, default=8,
                   help="micro-batches per step per DP rank (global batch / (micro batch x DP))")
    g.add_argument("--recompute", choices=("none", "selective", "full"), default="selective",
                   help="activation recomputation; selective also stands for flash attention")
    g.add_argument("--scratch-mb", type=float, default=None,
                   help="cce's buffer budget (fused_lce's scratch_mb; default: the op's)")
    g.add_argument("--cce-backward", choices=("auto", "gemm"), default="auto",
                   help="cce's backward: gradients in the forward (auto) or recomputed (gemm, "
                        "what docs/pp_memory_balance.md's measured section used)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="the split to start from (default: megatron's even split)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g = p.add_argument_group("output")
    g.add_argument("--memory-gib", type=float, default=None,
                   help="budget for 'what cce buys' (default: native's rebalanced peak)")
    g.add_argument("--csv", default=None, help="write the per-stage table here")
    g.add_argument("--png", default=None,
                   help="write the per-stage bar chart here (needs matplotlib: the [plot] extra)")
    g = p.add_argument_group("measured mode (GPUs)")
    g.add_argument("--measure", action="store_true",
                   help="run the launcher under torchrun and compare per stage")
    g.add_argument("--train-iters", type=int, default=3, help="steps per measured run")
    g.add_argument("--dry-run", action="store_true", help="print the measured runs' commands")
    return p


def layout_from_args(args) -> pm.Layout:
    return pm.Layout(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
        vpp=args.num_virtual_stages_per_pipeline_rank, dp=args.data_parallel_size,
        distributed_optimizer=args.use_distributed_optimizer, micro_batch=args.micro_batch_size,
        seq_length=args.seq_length, num_microbatches=args.num_microbatches,
        recompute=args.recompute, sequence_parallel=args.sequence_parallel,
        scratch_mb=args.scratch_mb, cce_backward=args.cce_backward)


def starting_split(cfg, lay: pm.Layout, args) -> list[int]:
    """The split the user gave (megatron's rules), over the p v virtual stages."""
    return pp_split.stage_layer_counts(
        cfg.num_layers, lay.pp * lay.vpp, args.decoder_first_pipeline_num_layers,
        args.decoder_last_pipeline_num_layers, args.account_for_embedding_in_pipeline_split,
        args.account_for_loss_in_pipeline_split)


def study(cfg, lay: pm.Layout, split: list[int]) -> tuple[list[dict], dict]:
    """Rows (one per loss, split and stage) and the recommendation per loss."""
    rows, recs = [], {}
    for loss in LOSSES:
        lay_l = lay.replace(loss=loss)
        recs[loss] = pp_split.recommend(cfg, lay_l)
        splits = {"given": split}
        if recs[loss] is not None:
            splits["rebalanced"] = recs[loss].split
        for name, sp in splits.items():
            for st in pm.stage_memory(cfg, lay_l, sp):
                rows.append({"loss": loss, "split": name, "stage": st.stage, "layers": st.layers,
                             "states_gib": st.states / pm.GIB,
                             "activations_gib": st.activations / pm.GIB,
                             "loss_gib": st.loss / pm.GIB, "backward_gib": st.backward / pm.GIB,
                             "total_gib": st.total / pm.GIB})
    return rows, recs


def cce_buys(cfg, lay: pm.Layout, budget: float) -> dict:
    """Fewest stages, longest sequence and largest micro-batch within ``budget``, per loss."""
    step = 128 * lay.tp
    out = {}
    for loss in LOSSES:
        lay_l = lay.replace(loss=loss)
        out[loss] = {"pp": pp_split.fewest_stages(cfg, lay_l, budget),
                     "seq_length": pp_split.largest(cfg, lay_l, "seq_length", budget, step=step),
                     "micro_batch": pp_split.largest(cfg, lay_l, "micro_batch", budget, limit=4096)}
    return out


def describe(cfg, lay: pm.Layout) -> str:
    return (f"{cfg.name}: TP{lay.tp} PP{lay.pp} VPP{lay.vpp} DP{lay.dp}"
            f"{' SP' if lay.sp else ''}{' dist-opt' if lay.distributed_optimizer else ''} "
            f"micro-batch {lay.micro_batch} x seq {lay.seq_length}, {lay.num_microbatches} "
            f"micro-batches, recompute {lay.recompute}")


def format_table(rows: list[dict]) -> str:
    head = f"{'loss':<7}{'split':<12}{'stage':>5}{'layers':>7}{'states':>9}{'activ':>9}" \
           f"{'loss':>9}{'bwd':>9}{'total':>9}  GiB"
    lines = [head]
    for r in rows:
        lines.append(f"{r['loss']:<7}{r['split']:<12}{r['stage']:>5}{r['layers']:>7}"
                     f"{r['states_gib']:>9.2f}{r['activations_gib']:>9.2f}{r['loss_gib']:>9.2f}"
                     f"{r['backward_gib']:>9.2f}"
                     f"{r['total_gib']:>9.2f}")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = sorted({(r["loss"], r["split"]) for r in rows}, key=lambda k: (LOSSES.index(k[0]),
                                                                             k[1]))
    stages = sorted({r["stage"] for r in rows})
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(stages)), 4))
    for j, key in enumerate(series):
        totals = {r["stage"]: r["total_gib"] for r in rows if (r["loss"], r["split"]) == key}
        ax.bar([s + (j - (len(series) - 1) / 2) * width for s in stages],
               [totals[s] for s in stages], width, label=f"{key[0]}, {key[1]} split")
    ax.set_xticks(stages)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("predicted peak memory (GiB)")
    ax.set_title(textwrap.fill(title, 70), fontsize=9)
    # Headroom above the tallest bar for the legend, so it hides no bar.
    ax.set_ylim(0, 1.3 * max(r["total_gib"] for r in rows))
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Measured mode
# ----------------------------------------------------------------------------------------------


def launcher_command(args, lay: pm.Layout, loss: str, split: list[int], log_json: str
                     ) -> list[str]:
    """torchrun of the launcher (the installed lce_train) for one loss and a first/last-flag
    split."""
    if lay.vpp != 1 or lay.recompute == "full":
        raise SystemExit("--measure: the launcher has no virtual stages and no full "
                         "recomputation")
    world = lay.tp * lay.pp * lay.dp
    cmd = ["torchrun", "--nproc-per-node", str(world), "-m", "lce_train.training",
           "--config", args.config, "--num-layers", str(sum(split)), "--bf16", "--mock-data",
           "--tensor-model-parallel-size", str(lay.tp),
           "--pipeline-model-parallel-size", str(lay.pp),
           "--micro-batch-size", str(lay.micro_batch), "--seq-length", str(lay.seq_length),
           "--global-batch-size", str(lay.micro_batch * lay.dp * lay.num_microbatches),
           "--train-iters", str(args.train_iters), "--cross-entropy-fusion-impl", loss,
           "--log-json", log_json]
    if lay.sp:
        cmd.append("--sequence-parallel")
    if lay.distributed_optimizer:
        cmd.append("--use-distributed-optimizer")
    if lay.pp > 1 and split != pp_split.stage_layer_counts(sum(split), lay.pp):
        cmd += ["--decoder-first-pipeline-num-layers", str(split[0]),
                "--decoder-last-pipeline-num-layers", str(split[-1])]
    return cmd


def parse_peaks(log_text: str, key: str = "peak_gib") -> list[float]:
    """Per-stage GiB from the launcher's --log-json records: the max over the steps of ``key``
    (``peak_gib``, or ``resident_gib``: what is allocated when a step starts)."""
    records = [json.loads(line) for line in log_text.splitlines() if line.strip()]
    if not records:
        raise ValueError("no records in the launcher's log")
    return [max(r[key][i] for r in records) for i in range(len(records[0][key]))]


def launcher_recompute(lay: pm.Layout) -> pm.Layout:
    """The layout as the launcher runs it: without transformer-engine its layers are megatron's
    local ones, whose attention stores its scores (no recomputation: ``none``)."""
    if importlib.util.find_spec("transformer_engine") is None and lay.recompute != "none":
        print(f"note: predicting the measured runs with --recompute none (was {lay.recompute}): "
              "the launcher's local attention keeps its scores", flush=True)
        return lay.replace(recompute="none")
    return lay


def measure(args, cfg, lay: pm.Layout, split: list[int], recs: dict) -> list[dict]:
    rows = []
    lay = launcher_recompute(lay)
    for loss in LOSSES:
        lay_l = lay.replace(loss=loss)
        splits = {"given": split}
        rec = recs.get(loss)
        if rec is not None and rec.flags is not None and rec.split != split:
            splits["rebalanced"] = rec.split
        for name, sp in splits.items():
            with tempfile.TemporaryDirectory() as tmp:
                log_json = str(Path(tmp) / "log.jsonl")
                cmd = launcher_command(args, lay, loss, sp, log_json)
                print("$ " + shlex.join(cmd), flush=True)
                if args.dry_run:
                    continue
                # torchrun's own module under this interpreter: a torchrun on PATH may be
                # another environment's, or absent where the venv is not activated.
                subprocess.run([sys.executable, "-m", "torch.distributed.run", *cmd[1:]],
                               check=True)
                log_text = Path(log_json).read_text()
            measured, resident = parse_peaks(log_text), parse_peaks(log_text, "resident_gib")
            for st, meas, res in zip(pm.stage_memory(cfg, lay_l, sp), measured, resident):
                rows.append({"loss": loss, "split": name, "stage": st.stage, "layers": st.layers,
                             "predicted_gib": st.total / pm.GIB, "measured_gib": meas,
                             "ratio": meas / (st.total / pm.GIB),
                             "predicted_states_gib": st.states / pm.GIB,
                             "measured_resident_gib": res,
                             "predicted_activations_gib": st.activations / pm.GIB,
                             "predicted_loss_gib": st.loss / pm.GIB,
                             "predicted_backward_gib": st.backward / pm.GIB})
    return rows


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.png and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--png needs matplotlib: pip install 'fused_lce[plot]'")
    cfg = load_model_config(args.config)
    if args.num_layers is not None:
        if args.num_layers < 1:
            raise SystemExit("--num-layers must be >= 1")
        cfg = dataclasses.replace(cfg, num_layers=args.num_layers)
    try:
        lay = layout_from_args(args)
        split = starting_split(cfg, lay, args)
    except ValueError as err:
        raise SystemExit(f"layout: {err}") from None
    rows, recs = study(cfg, lay, split)
    title = describe(cfg, lay)
    print(title + "  (predicted; lce_train.pp_memory)")
    print(format_table(rows))
    print()
    for loss, rec in recs.items():
        if rec is None:
            print(f"{loss:<7}no split with a layer on every stage")
            continue
        given = pm.peak(cfg, lay.replace(loss=loss), split)
        how = rec.flags if rec.flags else f"--pipeline-model-parallel-layout '{rec.layout}'"
        print(f"{loss:<7}largest stage {given / pm.GIB:.2f} GiB with {split}; rebalanced "
              f"{rec.split}: {rec.peak / pm.GIB:.2f} GiB  ({how or 'no flags needed'})")
    if recs["native"] is not None:
        budget = args.memory_gib * pm.GIB if args.memory_gib else recs["native"].peak
        buys = cce_buys(cfg, lay, budget)
        print(f"\nwithin {budget / pm.GIB:.2f} GiB per GPU (rebalanced splits):")
        for key, what in (("pp", "fewest pipeline stages"), ("seq_length", "longest sequence"),
                          ("micro_batch", "largest micro-batch")):
            print(f"  {what:<24} native {buys['native'][key]!s:>8}   cce {buys['cce'][key]!s:>8}")
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}")
    if args.png:
        plot(rows, title, args.png)
        print(f"wrote {args.png}")
    if args.measure:
        measured = measure(args, cfg, lay, split, recs)
        if measured:
            print(f"\n{'loss':<7}{'split':<12}{'stage':>5}{'layers':>7}{'predicted':>11}"
                  f"{'measured':>10}{'ratio':>7}  GiB")
            for r in measured:
                print(f"{r['loss']:<7}{r['split']:<12}{r['stage']:>5}{r['layers']:>7}"
                      f"{r['predicted_gib']:>11.2f}{r['measured_gib']:>10.2f}{r['ratio']:>7.2f}")
            if args.csv:
                path = str(Path(args.csv).with_suffix("")) + "_measured.csv"
                write_csv(measured, path)
                print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
