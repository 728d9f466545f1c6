"""Train the same model with fused_lce's ``cce`` loss and with megatron-core's own, side by side.

    lce-compare-losses        # or: python -m lce_train.compare_losses

runs the training loop of the launcher (lce_train.training) on the tiny config with
TP=2 over gloo (two CPU processes; NCCL and one process per GPU where CUDA is present), once per
loss implementation, in one torchrun job, from the same seed and data, and prints the per-step
losses with their largest relative difference. It exits non-zero when that exceeds ``--tol``.
About 15 s on two cores.

The implementations:

    cce       fused_lce's vocab-parallel linear cross-entropy (no logits), via the megatron adapter
              (its pure-PyTorch path on a CPU, the Triton kernels on a GPU)
    cce-triton  the same with the Triton kernels forced (``--cce-impl cce``): on a CPU, run it
              under TRITON_INTERPRET=1
    native    megatron-core's fused vocab-parallel cross entropy (--cross-entropy-loss-fusion);
              note: its backward rounds the logit gradient to bf16 even in fp32 training
    unfused   megatron-core's plain vocab_parallel_cross_entropy (fp32 throughout)

Any other flag goes to the launcher, e.g. ``--sequence-parallel``, ``--bf16``, or
``--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2``. Run it under torchrun
yourself to choose the processes (``torchrun --nproc-per-node 4 -m lce_train.compare_losses``);
otherwise it starts ``--nproc`` processes on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

IMPL_FLAGS = {
    "cce": ["--cross-entropy-fusion-impl", "cce"],
    # The Triton kernels whatever the device (on a CPU: run under TRITON_INTERPRET=1).
    "cce-triton": ["--cross-entropy-fusion-impl", "cce", "--cce-impl", "cce"],
    "native": ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"],
    "unfused": ["--cross-entropy-fusion-impl", "native"],
}
VERDICT_ENV = "FUSED_LCE_COMPARE_VERDICT"
DEFAULTS = ["--config", "tiny", "--tensor-model-parallel-size", "2", "--seq-length", "32",
            "--micro-batch-size", "2", "--lr", "3e-3"]


def parse(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Other flags go to the launcher, lce-pretrain-gpt (after the defaults "
               + " ".join(DEFAULTS) + ").")
    p.add_argument("--impls", default="cce,native,unfused",
                   help="comma-separated, from " + ", ".join(IMPL_FLAGS) + "; the first is "
                        "compared with each other")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--nproc", type=int, default=2, help="processes to start (outside torchrun)")
    p.add_argument("--tol", type=float, default=1e-4, help="max relative loss difference")
    p.add_argument("--json", default=None,
                   help="write the steps, each impl's losses and gradient norms here")
    args, launcher_flags = p.parse_known_args(argv)
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = [i for i in args.impls if i not in IMPL_FLAGS]
    if bad or len(args.impls) < 2:
        p.error(f"--impls needs two or more of {list(IMPL_FLAGS)}, got {args.impls}")
    return args, launcher_flags


def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc N``: the workers do not need it, and torchrun's own parser
    (Python 3.12) rejects it as an ambiguous abbreviation even after the script name."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def relaunch(argv, nproc: int) -> int:
    """Start this module under torchrun (one node, a free port); 1 if the comparison failed.

    The verdict comes back through a file rather than the workers' exit codes, so a loss
    mismatch reads as a table with FAIL, not as a crashed torchrun job.
    """
    with tempfile.TemporaryDirectory() as tmp:
        verdict = Path(tmp) / "verdict"
        # The workers import this module from the installed package, as a wheel user's would.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "lce_train.compare_losses", *argv]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   **{VERDICT_ENV: str(verdict)})
        code = subprocess.call(cmd, env=env)
        if code == 0 and verdict.exists():
            code = int(verdict.read_text())
    return code


def table(steps: list[int], losses: dict[str, list[float]], tol: float) -> tuple[str, float]:
    impls = list(losses)
    ref, others = impls[0], impls[1:]
    head = f"{'step':>5}  " + "  ".join(f"{i:>12}" for i in impls) + "  " + \
        "  ".join(f"{'rel ' + ref + '-' + o:>16}" for o in others)
    lines = [head, "-" * len(head)]
    worst = 0.0
    for k, step in enumerate(steps):
        row = [losses[i][k] for i in impls]
        rels = [abs(row[0] - losses[o][k]) / max(abs(losses[o][k]), 1e-30) for o in others]
        worst = max(worst, *rels)
        lines.append(f"{step:>5}  " + "  ".join(f"{v:>12.6f}" for v in row) + "  " +
                     "  ".join(f"{r:>16.2e}" for r in rels))
    verdict = "OK" if worst <= tol else "FAIL"
    lines.append(f"max relative difference {worst:.2e} (tolerance {tol:.0e}): {verdict}")
    return "\n".join(lines), worst


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, launcher_flags = parse(argv)
    if "RANK" not in os.environ:
        return relaunch(_without_nproc(argv), args.nproc)

    import torch

    from lce_train.arguments import describe, parse_args
    from lce_train.training import train

    losses: dict[str, list[float]] = {}
    grad_norms: dict[str, list[float]] = {}  # of all parameters' gradients, before clipping
    steps: list[int] = []
    captured_at: dict[str, int] = {}  # under --cuda-graph-impl full_iteration
    plan = None
    for impl in args.impls:
        flags = DEFAULTS + ["--train-iters", str(args.steps)] + launcher_flags + IMPL_FLAGS[impl]
        run_args = parse_args(flags)
        plan = plan or run_args
        history = train(run_args, log=lambda *a, **k: None)
        if history:
            losses[impl] = [r["loss"] for r in history]
            grad_norms[impl] = [r["grad_norm"] for r in history]
            steps = [r["step"] for r in history]
            for record in history:
                if record.get("cuda_graph") == "captured":
                    captured_at[impl] = record["step"]
    status = 0
    if losses:  # the reporting rank: last pipeline stage, TP rank 0, DP rank 0
        print(describe(plan).split("\n")[0])
        print(f"parallel    TP {plan.tensor_model_parallel_size} x PP "
              f"{plan.pipeline_model_parallel_size} x DP {plan.data_parallel_size}"
              f"{', SP' if plan.sequence_parallel else ''}, {plan.distributed_backend}, "
              f"{'bf16' if plan.bf16 else 'fp32'}, {args.steps} steps\n")
        text, worst = table(steps, losses, args.tol)
        print(text)
        for impl, step in captured_at.items():
            print(f"cuda graph  {impl}: captured at step {step}, replayed after")
        if args.json:
            Path(args.json).write_text(json.dumps({"steps": steps, "losses": losses,
                                                   "grad_norms": grad_norms,
                                                   "max_rel_diff": worst}))
        status = int(worst > args.tol)
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([status], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    torch.distributed.destroy_process_group()
    status = int(flag.item())
    if VERDICT_ENV in os.environ:  # started by relaunch(): report there, exit cleanly here
        if int(os.environ["RANK"]) == 0:
            Path(os.environ[VERDICT_ENV]).write_text(str(status))
        return 0
    return status


if __name__ == "__main__":
    sys.exit(main())
