"""The training-equivalence experiment: does pretraining from scratch with fused_lce's loss
train like megatron's own? (results and the recipe in docs/training_equivalence.md)

    lce-training-equivalence run --out out/equivalence       # the matrix, on GPUs
    lce-training-equivalence report --out out/equivalence    # plots, CSV, table
    lce-training-equivalence compact --out out/equivalence --dest runs.jsonl.gz
    lce-training-equivalence report --out docs/training_equivalence/runs.jsonl.gz
    lce-training-equivalence run --cpu-smoke --out /tmp/eq --corpora zipf

``run`` trains every (corpus, variant, seed) of configs/experiments/training_equivalence.yaml
with the installed launcher (``-m lce_train.training``, as from a wheel), one GPU per run
(``CUDA_VISIBLE_DEVICES``, ``torchrun --nproc-per-node 1`` with its own ``--master-port``), at
most one run per visible GPU at a time;
each run writes ``<out>/<corpus>_<variant>_s<seed>.jsonl`` (the launcher's ``--log-json``: one
record per step, with validation losses and probes where they ran) and a ``.log``, and
``<out>/runs.json`` records the commands, exit codes and wall times. The text corpus's token
files may be stored xz-compressed (``.bin.xz``, as in the repository's git-ignored ``.data/``);
they are unpacked once into ``--data-cache``. ``--cpu-smoke`` runs the same pipeline on the CPU
over gloo with the config's tiny ``cpu_smoke`` settings (a test does).

``report`` reads those logs (a read-only folder is fine) and writes, into ``--dest`` (default
``<out>``):

    loss_<corpus>.png    train loss (moving average) and validation loss against the step,
                         each variant's mean over seeds with a min-max band, and both
                         differences to the reference variant
    grad_error.png       the probes' relative gradient errors (input and weight) of each
                         backward against the fp32 reference, the max over runs at each step
    unseen.png           probability on tokens unseen in training, and the validation loss on
                         unseen targets
    final.csv            per corpus and variant: final train loss (mean over the last 5% of
                         steps), final validation loss, unseen measures, worst gradient errors;
                         mean, min and max over seeds

    summary.md           the markdown table and the target lines below

and prints a markdown table and one PASS/FAIL line per target of the config (the candidate's
final losses within ``loss_nats`` of the reference's, means over seeds; the default op's
gradient error at most ``grad_rel_err`` at every probe along the candidate's and the reference's
runs; INFO lines give it along the other variants' runs). ``--strict`` exits 1 on a FAIL.
"""

from __future__ import annotations

import argparse

from lce_train.equivalence_config import CHECKOUT, DEFAULT_CONFIG
from lce_train.equivalence_logs import cmd_compact
from lce_train.equivalence_report import cmd_report
from lce_train.equivalence_run import DEFAULT_BASE_PORT, cmd_run

# The command line only. Each command's work is in its module: the configuration
# (equivalence_config), run (equivalence_run), the logs and compact (equivalence_logs), report
# (equivalence_report) and its figures (equivalence_plots).


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train the matrix of runs")
    run.add_argument("--out", required=True, help="folder for the logs")
    run.add_argument("--config", default=str(DEFAULT_CONFIG))
    run.add_argument("--corpora", default=None, help="comma-separated subset (default: all)")
    run.add_argument("--variants", default=None,
                     help="comma-separated (default: the config's matrix_variants)")
    run.add_argument("--seeds", default=None, help="comma-separated (default: the config's)")
    run.add_argument("--steps", type=int, default=None, help="training steps of every run")
    run.add_argument("--set", action="append", default=[], metavar="FLAG=VALUE",
                     help="override a launcher flag of every run, e.g. --set eval-interval=50")
    run.add_argument("--jobs", type=int, default=None,
                     help="runs at a time (default: one per visible GPU; 1 with --cpu-smoke)")
    run.add_argument("--data-dir", default=str(CHECKOUT / ".data") if CHECKOUT else ".data",
                     help="folder of the text corpus's token files (default: the checkout's "
                          ".data/; installed from a wheel, .data/ in the current directory)")
    run.add_argument("--data-cache", default="/tmp/fused_lce_data",
                     help="where compressed token files are unpacked")
    run.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT,
                     help="run i rendezvouses on this port + i")
    run.add_argument("--timeout", type=float, default=None, help="kill a run after this many s")
    run.add_argument("--deadline", type=float, default=None,
                     help="after this many s start no run and kill those running (their logs "
                          "so far remain): keeps the whole matrix inside a time limit")
    run.add_argument("--cpu-smoke", action="store_true",
                     help="the config's tiny cpu_smoke settings, on the CPU over gloo")
    run.add_argument("--dry-run", action="store_true", help="print the commands only")
    run.set_defaults(func=cmd_run)
    report = sub.add_parser("report", help="plots, CSV, table and target checks from the logs")
    report.add_argument("--out", required=True,
                        help="folder of the logs (and outputs), or a file written by compact")
    report.add_argument("--config", default=str(DEFAULT_CONFIG))
    report.add_argument("--dest", default=None,
                        help="folder for the PNGs, final.csv and summary.md (default: --out)")
    report.add_argument("--strict", action="store_true", help="exit 1 if a target fails")
    report.set_defaults(func=cmd_report)
    compact = sub.add_parser("compact", help="a folder of logs -> one small file for report")
    compact.add_argument("--out", required=True, help="folder of the logs")
    compact.add_argument("--dest", required=True, help="the file to write (.jsonl.gz)")
    compact.add_argument("--config", default=str(DEFAULT_CONFIG.relative_to(CHECKOUT)
                                                 if CHECKOUT else DEFAULT_CONFIG))
    compact.set_defaults(func=cmd_compact)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
