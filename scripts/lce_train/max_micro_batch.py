"""The largest micro-batch that trains without running out of GPU memory, for one launcher setup.

    torchrun --nproc-per-node 4 scripts/max_micro_batch.py --config gemma2_like --bf16 \
        --tensor-model-parallel-size 4 --seq-length 4096 --cross-entropy-fusion-impl cce \
        --out max_mbs_cce.json

Takes scripts/pretrain_gpt.py's flags (model, layout, loss) and builds the same model and
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
"""

from __future__ import annotations

import argparse
import gc
import json
from datetime import timedelta
from pathlib import Path

import torch

from lce_train.arguments import parse_args as parse_launcher_args
from lce_train.data import training_data
from lce_train.model import forward_step, init_distributed, quiet_known_warnings
from lce_train.signatures import supported_kwargs
from lce_train.training import build_training


def parse_args(argv=None):
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--max-micro-batch", type=int, default=1024,
                     help="the largest size tried (default: 1024)")
    own.add_argument("--out", type=Path, default=None, help="JSON result (reporting rank)")
    mine, rest = own.parse_known_args(argv)
    args = parse_launcher_args([*rest, "--micro-batch-size", "1", "--train-iters", "1"])
    if args.pipeline_model_parallel_size != 1:
        raise SystemExit("max_micro_batch.py: PP must be 1 (see the module docstring)")
    if args.data_parallel_size != 1:
        raise SystemExit("max_micro_batch.py: run one TP group (world size = TP x CP)")
    if mine.max_micro_batch < 1:
        raise SystemExit("--max-micro-batch must be >= 1")
    args.max_micro_batch, args.out = mine.max_micro_batch, mine.out
    return args


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
    peaks, left_allocated = {}, {}

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
        left_allocated[micro_batch] = report[2].item()
        if fitted:
            peaks[micro_batch] = report[1].item()
        if reporter:
            state = f"fits, peak {peaks[micro_batch]:.2f} GiB" if fitted else "out of memory"
            print(f"micro-batch {micro_batch:>5} ({micro_batch * args.seq_length:>8} tokens): "
                  f"{state}; {left_allocated[micro_batch]:.2f} GiB allocated after", flush=True)
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
        result = {"impl": args.cross_entropy_fusion_impl, "config": args.model.name,
                  "num_layers": args.model.num_layers, "tp": args.tensor_model_parallel_size,
                  "sp": args.sequence_parallel, "seq_length": args.seq_length,
                  "max_micro_batch": best, "max_tokens": best * args.seq_length,
                  "capped": best == args.max_micro_batch,
                  "tried": {str(k): v for k, v in sorted(tried.items())},
                  "peak_gib": {str(k): v for k, v in sorted(peaks.items())},
                  "allocated_after_gib": {str(k): v for k, v in sorted(left_allocated.items())},
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
