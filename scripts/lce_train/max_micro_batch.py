"""The largest micro-batch that trains without running out of GPU memory, for one launcher setup.

    torchrun --nproc-per-node 4 -m lce_train.max_micro_batch --config gemma2_like --bf16 \\
        --tensor-model-parallel-size 4 --seq-length 4096 --cross-entropy-fusion-impl cce \\
        --out max_mbs_cce.json

(``torchrun --no-python --nproc-per-node 4 lce-max-micro-batch ...`` runs the same.) Besides its
own flags it takes the launcher's (``lce-pretrain-gpt --help``: model, layout, loss), except
--micro-batch-size and --train-iters, which the search sets, and builds the same model and
optimizer once. It runs one whole training step at micro-batch 1 (so the optimizer's states
exist, as in training), then forward+backward passes of one micro-batch of growing size: doubling
until one runs out of memory, then bisecting between the last size that fit and the first that did
not. Each try that fits records its peak (``torch.cuda.max_memory_allocated``). Once two sizes
fit, the peak's growth per micro-batch predicts the largest size, and the search jumps there
instead of doubling past it: a try that overshoots by far has left the later, smaller tries
failing too (an H200 x2 run in November 2026), so the search aims at one out-of-memory try near
the edge. After every try each rank reports the memory still allocated, so a try that leaves
memory behind shows in the log and the JSON. All ranks agree on each outcome through one
all-reduce on a CPU (gloo) group with a timeout: ranks that fell out of step after an
out-of-memory error end the search with an error instead of a hang or a wrong answer.

Tensor parallelism only (PP = 1): its ranks allocate alike and run out of memory at the same
allocation, before any collective that a rank could be left waiting in. Pipeline stages do not
(a stage that fails would leave its neighbour waiting in a send), so PP > 1 is refused.

On the CPU (gloo, to check a setup without GPUs) nothing runs out of memory and there is no
peak-memory counter: the search runs to --max-micro-batch and reports no memory figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
from datetime import timedelta
from pathlib import Path

import torch

from lce_train.arguments import parse_args as parse_launcher_args
from lce_train.data import training_data
from lce_train.model import forward_step, init_distributed, quiet_known_warnings
from lce_train.signatures import supported_kwargs
from lce_train.training import build_training


def build_parser() -> argparse.ArgumentParser:
    """This tool's own flags. It parses them first, so that ``--help`` is its own; whatever it
    does not know goes on to the launcher's parser."""
    parser = argparse.ArgumentParser(
        usage="%(prog)s [-h] [--max-micro-batch N] [--out OUT] LAUNCHER_FLAGS ...",
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-micro-batch", type=int, default=1024, metavar="N",
                        help="the largest size tried (default: 1024)")
    parser.add_argument("--out", type=Path, default=None, help="JSON result (reporting rank)")
    return parser


def parse_args(argv=None):
    mine, rest = build_parser().parse_known_args(argv)
    args = parse_launcher_args([*rest, "--micro-batch-size", "1", "--train-iters", "1"])
    if args.pipeline_model_parallel_size != 1:
        raise SystemExit("PP must be 1: pipeline stages do not run out of memory together, and "
                         "a stage that fails leaves its neighbour waiting in a send")
    if args.data_parallel_size != 1:
        raise SystemExit(f"run one TP group: the world size must be TP x CP, not "
                         f"{args.world_size} (data-parallel size {args.data_parallel_size})")
    if mine.max_micro_batch < 1:
        raise SystemExit("--max-micro-batch must be >= 1")
    args.max_micro_batch, args.out = mine.max_micro_batch, mine.out
    return args


def torchrun_command(args, argv=None) -> str:
    """The command that runs these flags under torchrun, one process per rank of the TP group:
    a start without torchrun says it in full, since a wheel's user has no script to read."""
    flags = shlex.join(sys.argv[1:] if argv is None else argv)
    return (f"torchrun --nproc-per-node {args.world_size} -m lce_train.max_micro_batch {flags}"
            ).rstrip()


def try_line(micro_batch: int, tokens: int, fitted: bool, peak_gib, left_gib) -> str:
    """The log line of one try. ``left_gib`` (and ``peak_gib``) is None where memory is not
    measured: on the CPU, which has no peak-memory counter, a 0.00 would be a wrong figure."""
    state = "fits" if fitted else "out of memory"
    head = f"micro-batch {micro_batch:>5} ({tokens:>8} tokens): "
    if left_gib is None:
        return head + f"{state} (peak memory not measured on the CPU)"
    if fitted:
        state += f", peak {peak_gib:.2f} GiB"
    return head + f"{state}; {left_gib:.2f} GiB allocated after"


def sizes_to_try(fits, limit: int, predict=None):
    """Micro-batch sizes to try, given ``fits(size) -> bool``: growing, then bisection.

    The growing phase doubles, or, where ``predict(largest_fit) -> int | None`` expects the
    largest size that fits below the double, tries that prediction (at least one more than the
    last fit) instead. Returns (largest size that fit or 0, {size: fitted}).
    """
    tried = {}
    size, good, bad = 1, 0, None
    while bad is None:
        tried[size] = fits(size)
        if not tried[size]:
            bad = size
        elif size == limit:
            return size, tried
        else:
            good, size = size, min(2 * size, limit)
            expected = predict(good) if predict is not None else None
            if expected is not None and expected < size:
                size = max(good + 1, expected)
    while bad - good > 1:
        middle = (good + bad) // 2
        tried[middle] = fits(middle)
        if tried[middle]:
            good = middle
        else:
            bad = middle
    return good, tried


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.distributed.is_initialized() and "RANK" not in os.environ:
        raise SystemExit("lce-max-micro-batch runs under torchrun, one process per rank of one "
                         f"TP group ({args.world_size} here):\n    {torchrun_command(args, argv)}")
    from megatron.core import parallel_state

    from lce_train.megatron_cpu import enable_cpu_mode

    quiet_known_warnings()
    enable_cpu_mode()
    init_distributed(args)
    model, _, optimizer, _ = build_training(args)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    reporter = torch.distributed.get_rank() == 0
    data = training_data(args)
    dp_rank = parallel_state.get_data_parallel_rank()

    def step(micro_batch: int, update: bool) -> None:
        args.micro_batch_size, args.global_batch_size, args.num_microbatches = micro_batch, \
            micro_batch, 1
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(**supported_kwargs(
            forward_backward, forward_step_func=forward_step,
            data_iterator=data.microbatches(1, args, dp_rank, device), model=[model],
            num_microbatches=1, seq_length=args.seq_length, micro_batch_size=micro_batch,
            decoder_seq_length=args.seq_length, forward_only=False))
        if update:
            optimizer.step()

    step(1, update=True)
    # The outcome exchange goes over gloo with a timeout: after an out-of-memory error inside a
    # collective-bearing step, ranks may be out of step on the NCCL group.
    outcomes = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=120))
    capacity_gib = torch.cuda.mem_get_info()[1] / 2**30 if device.type == "cuda" else None
    # Only CUDA counts allocations; on the CPU the figures stay unset rather than read as zero.
    measured = device.type == "cuda"
    peaks, left_allocated = {}, {}
    if reporter and not measured:
        print("on the CPU nothing runs out of memory and peak memory is not measured: the "
              "search runs to --max-micro-batch", flush=True)

    def fits(micro_batch: int) -> bool:
        ok, peak = 1, 0.0
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        try:
            step(micro_batch, update=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 2**30
        except torch.OutOfMemoryError:
            ok = 0
        gc.collect()
        allocated = 0.0
        if device.type == "cuda":
            torch.cuda.empty_cache()
            allocated = torch.cuda.memory_allocated() / 2**30
        # [fits on every rank, largest peak, largest allocation left after the try]
        report = torch.tensor([1.0 - ok, peak, allocated], dtype=torch.float64)
        try:
            torch.distributed.all_reduce(report, op=torch.distributed.ReduceOp.MAX,
                                         group=outcomes)
        except RuntimeError as error:
            raise SystemExit(f"micro-batch {micro_batch}: ranks fell out of step after an "
                             f"out-of-memory error ({error}); the search stops here") from None
        fitted = report[0].item() == 0
        if measured:
            left_allocated[micro_batch] = report[2].item()
            if fitted:
                peaks[micro_batch] = report[1].item()
        if reporter:
            print(try_line(micro_batch, micro_batch * args.seq_length, fitted,
                           peaks.get(micro_batch), left_allocated.get(micro_batch)), flush=True)
        return fitted

    def predict(largest_fit: int):
        """The largest size whose peak stays under 97% of the GPU, from the last two fits."""
        fitted = sorted(size for size in peaks if size <= largest_fit)
        if capacity_gib is None or len(fitted) < 2:
            return None
        small, large = fitted[-2], fitted[-1]
        growth = (peaks[large] - peaks[small]) / (large - small)
        if growth <= 0:
            return None
        return large + int((0.97 * capacity_gib - peaks[large]) / growth)

    best, tried = sizes_to_try(fits, args.max_micro_batch, predict)
    if reporter:
        # null where memory is not measured (the CPU)
        peak_gib = {str(k): v for k, v in sorted(peaks.items())} if measured else None
        left_gib = {str(k): v for k, v in sorted(left_allocated.items())} if measured else None
        result = {"impl": args.cross_entropy_fusion_impl, "config": args.model.name,
                  "num_layers": args.model.num_layers, "tp": args.tensor_model_parallel_size,
                  "sp": args.sequence_parallel, "seq_length": args.seq_length,
                  "max_micro_batch": best, "max_tokens": best * args.seq_length,
                  "capped": best == args.max_micro_batch,
                  "tried": {str(k): v for k, v in sorted(tried.items())},
                  "peak_gib": peak_gib, "allocated_after_gib": left_gib,
                  "capacity_gib": capacity_gib}
        print(f"largest micro-batch {best} x {args.seq_length} = {best * args.seq_length} "
              f"tokens with {args.cross_entropy_fusion_impl}", flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
