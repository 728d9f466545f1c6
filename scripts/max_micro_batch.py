#!/usr/bin/env python
"""The largest micro-batch that trains without running out of GPU memory, for one launcher setup.

    torchrun --nproc-per-node 4 scripts/max_micro_batch.py --config gemma2_like --bf16 \
        --tensor-model-parallel-size 4 --seq-length 4096 --cross-entropy-fusion-impl cce \
        --out max_mbs_cce.json

Takes scripts/pretrain_gpt.py's flags (model, layout, loss) and builds the same model and
optimizer once. It runs one whole training step at micro-batch 1 (so the optimizer's states
exist, as in training), then forward+backward passes of one micro-batch of growing size: doubling
until one runs out of memory, then bisecting between the last size that fit and the first that did
not. Each try that fits records its peak (``torch.cuda.max_memory_allocated``). All ranks agree on
each outcome through one all-reduce, so they try the same sizes.

Tensor parallelism only (PP = 1): its ranks allocate alike and run out of memory at the same
allocation, before any collective that a rank could be left waiting in. Pipeline stages do not
(a stage that fails would leave its neighbour waiting in a send), so PP > 1 is refused.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pretrain_gpt  # noqa: E402


def parse_args(argv=None):
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--max-micro-batch", type=int, default=1024,
                     help="the largest size tried (default: 1024)")
    own.add_argument("--out", type=Path, default=None, help="JSON result (reporting rank)")
    mine, rest = own.parse_known_args(argv)
    args = pretrain_gpt.parse_args([*rest, "--micro-batch-size", "1", "--train-iters", "1"])
    if args.pipeline_model_parallel_size != 1:
        raise SystemExit("max_micro_batch.py: PP must be 1 (see the module docstring)")
    if args.data_parallel_size != 1:
        raise SystemExit("max_micro_batch.py: run one TP group (world size = TP x CP)")
    if mine.max_micro_batch < 1:
        raise SystemExit("--max-micro-batch must be >= 1")
    args.max_micro_batch, args.out = mine.max_micro_batch, mine.out
    return args


def sizes_to_try(fits, limit: int):
    """Micro-batch sizes to try, given ``fits(size) -> bool``: doubling, then bisection.

    Returns (largest size that fit or 0, {size: fitted}).
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

    from fused_lce.parallel.megatron_cpu import enable_cpu_mode

    pretrain_gpt._quiet_known_warnings()
    enable_cpu_mode()
    pretrain_gpt.init_distributed(args)
    model, _, optimizer, _ = pretrain_gpt.build_training(args)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    reporter = torch.distributed.get_rank() == 0
    data = pretrain_gpt.TokenWindows(args.seq_length, args.model.vocab_size, args.seed,
                                     args.data_path)
    dp_rank = parallel_state.get_data_parallel_rank()

    def step(micro_batch: int, update: bool) -> None:
        args.micro_batch_size, args.global_batch_size, args.num_microbatches = micro_batch, \
            micro_batch, 1
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(**pretrain_gpt._supported_kwargs(
            forward_backward, forward_step_func=pretrain_gpt._forward_step,
            data_iterator=data.microbatches(1, args, dp_rank, device), model=[model],
            num_microbatches=1, seq_length=args.seq_length, micro_batch_size=micro_batch,
            decoder_seq_length=args.seq_length, forward_only=False))
        if update:
            optimizer.step()

    step(1, update=True)
    peaks = {}

    def fits(micro_batch: int) -> bool:
        ok = 1
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        try:
            step(micro_batch, update=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
                peaks[micro_batch] = torch.cuda.max_memory_allocated() / 2**30
        except torch.OutOfMemoryError:
            ok = 0
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        flag = torch.tensor([ok], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        if reporter:
            state = f"fits, peak {peaks.get(micro_batch, float('nan')):.2f} GiB" if flag.item() \
                else "out of memory"
            print(f"micro-batch {micro_batch:>5} ({micro_batch * args.seq_length:>8} tokens): "
                  f"{state}", flush=True)
        return bool(flag.item())

    best, tried = sizes_to_try(fits, args.max_micro_batch)
    if reporter:
        result = {"impl": args.cross_entropy_fusion_impl, "config": args.model.name,
                  "num_layers": args.model.num_layers, "tp": args.tensor_model_parallel_size,
                  "sp": args.sequence_parallel, "seq_length": args.seq_length,
                  "max_micro_batch": best, "max_tokens": best * args.seq_length,
                  "capped": best == args.max_micro_batch,
                  "tried": {str(k): v for k, v in sorted(tried.items())},
                  "peak_gib": {str(k): v for k, v in sorted(peaks.items())}}
        print(f"largest micro-batch {best} x {args.seq_length} = {best * args.seq_length} "
              f"tokens with {args.cross_entropy_fusion_impl}", flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
