"""How the vocab-parallel benchmark (``lce_train.bench_parallel``) times a loss on every rank:
each iteration started together after a barrier (CUDA events on GPUs, the wall clock on the CPU),
the median per rank, then the slowest rank's time and the largest rank's extra memory; and the
``collectives`` provider: the collectives of ``ours`` alone, with its sizes and token chunks.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch
import torch.distributed as dist

from fused_lce.options import LCEOptions

MIB = 2**20


class Timer:
    """CUDA events on GPUs, the wall clock (after the barrier) on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3


def timed(fn, iters: int, timer: Timer) -> list[float]:
    """``iters`` times of ``fn`` in ms, each started together on every rank (a barrier)."""
    times = []
    for _ in range(iters):
        dist.barrier()
        timer.sync()
        times.append(timer.time_ms(fn))
    return times


def measure(loss_fn, hidden, weight, target, args, device) -> dict:
    """Median forward and forward+backward time on this rank, and its extra peak memory."""
    timer = Timer(device)
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    grad_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()

    def forward():
        return loss_fn(h, w, target)

    def forward_backward():
        h.grad = None
        w.grad = None
        loss = loss_fn(h, w, target)
        loss.backward()
        return loss

    for _ in range(args.warmup):
        forward_backward()
    timer.sync()

    extra = math.nan
    if device.type == "cuda":
        h.grad = None
        w.grad = None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward_backward()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base - grad_bytes) / MIB

    fwd = timed(forward, args.iters, timer)
    both = timed(forward_backward, args.iters, timer)
    loss = forward().item()
    h.grad = None
    w.grad = None
    return {"fwd_ms": statistics.median(fwd), "fwd_bwd_ms": statistics.median(both),
            "extra_mib": extra, "loss": loss}


def worst_over_ranks(result: dict, device: torch.device) -> dict:
    """The slowest rank's times and the largest rank's memory (NaN stays NaN)."""
    keys = ("fwd_ms", "fwd_bwd_ms", "extra_mib")
    values = torch.tensor([result[k] for k in keys], dtype=torch.float64, device=device)
    values = torch.nan_to_num(values, nan=-1.0)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    out = dict(result)
    for k, v in zip(keys, values.tolist()):
        out[k] = math.nan if v < 0 else v
    return out


def measure_collectives(n_tokens, d, v_local, dtype, group, sp, args, device) -> dict:
    """The collectives of ``ours`` (the default walk) alone, with its sizes and dtypes (the module
    docstring of parallel/vocab_parallel.py): what overlapping them with compute could save at
    most. The walk's chunks are the op's own plan for this shard."""
    from fused_lce.parallel import comm
    from fused_lce.token_walk import plan_forward_gradients

    tp = dist.get_world_size(group)
    plan = plan_forward_gradients(LCEOptions(), n_tokens, v_local, d, dtype.itemsize, True, dtype)
    hidden = torch.zeros(n_tokens // tp if sp else n_tokens, d, dtype=dtype, device=device)
    offsets = torch.zeros(n_tokens, dtype=torch.float32, device=device)
    row_max = torch.zeros(plan.chunk_rows, dtype=torch.float32, device=device)
    packed_sums = torch.zeros(2 * plan.chunk_rows, dtype=torch.float32, device=device)
    d_hidden = torch.zeros(n_tokens, d, dtype=torch.float32, device=device)
    timer = Timer(device)

    def forward():
        if sp:
            comm.all_gather_first_dim(hidden, group)
        if plan.exponentials:
            comm.all_reduce_sum_(offsets, group)
        for _ in range(0, n_tokens, plan.chunk_rows):
            comm.all_reduce_max_(row_max, group)
            comm.all_reduce_sum_(packed_sums, group)

    def forward_backward():
        forward()
        if sp:
            comm.reduce_scatter_first_dim(d_hidden, group)
        else:
            comm.all_reduce_sum_(d_hidden, group)

    for _ in range(args.warmup):
        forward_backward()
    return {"fwd_ms": statistics.median(timed(forward, args.iters, timer)),
            "fwd_bwd_ms": statistics.median(timed(forward_backward, args.iters, timer)),
            "extra_mib": math.nan, "loss": math.nan}
