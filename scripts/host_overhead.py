"""The host's cost to enqueue each piece of the bf16 walk's chunk, one at a time, with the GPU
held busy by a sleep kernel (so nothing waits on it). One GPU.

    python scripts/host_overhead.py [--rows 4096 --vocab 16032 --d-model 4096]

Prints microseconds per call (median of 7 rounds of 50 calls) for the walk's Triton launches
(with and without their tensor descriptors), its torch calls, and for reference an empty Triton
kernel and a one-element torch op. Where a small shard's step is host-bound (a TP = 8 rank:
scripts/profile_default.py's ``host_ms`` above its GPU time), this says which calls to remove.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl

from fused_lce.kernels.exp_logits import (
    add_target_rows,
    exp_logits,
    finish_input_grad,
    partial_count,
    repair_exponentials,
    row_scales,
    target_logits,
)


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def enqueue_us(fn, calls: int = 50, rounds: int = 7, sleep_cycles: int = 200_000_000) -> float:
    """Host microseconds per call of ``fn``, ``calls`` in a row behind a sleep kernel of
    ``sleep_cycles`` (the default, about 0.1 s, outlasts 50 launches), median of ``rounds``."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=16032)
    parser.add_argument("--d-model", type=int, default=4096)
    args = parser.parse_args(argv)
    n, v, d = args.rows, args.vocab, args.d_model
    dev = "cuda"
    hidden = torch.randn(n, d, device=dev).bfloat16()
    weight = (torch.randn(v, d, device=dev) / d**0.5).bfloat16()
    target = torch.randint(0, v, (n,), device=dev)
    logit, columns = target_logits(hidden, weight, None, target, vocab_start=0,
                                   ignore_index=-100, softcap=None, round_16bit=False)
    exps = torch.empty(n, v, device=dev, dtype=torch.bfloat16)
    partials = torch.empty(partial_count(n, v, hidden.device), device=dev)
    shift, sum_exp, _ = exp_logits(hidden, weight, None, columns, logit, exps,
                                   softcap=None, round_16bit=False, partials=partials)
    lse = shift + torch.log(sum_exp)
    p_coef = torch.full((n,), 1.0 / n, device=dev)
    target_grad = torch.zeros(n, device=dev)
    scaled = torch.empty_like(hidden)
    d_hidden, d_weight = torch.empty_like(hidden), torch.zeros_like(weight)
    tiny = torch.zeros(1024, device=dev)
    pieces = {
        "empty Triton kernel": lambda: _empty_kernel[(1,)](tiny, 1024, BLOCK=1024),
        "torch.add (one op)": lambda: torch.add(tiny, 1.0),
        "torch.empty": lambda: torch.empty(n, device=dev),
        "torch.mm (cuBLAS)": lambda: torch.mm(exps, weight, out=d_hidden),
        "torch.sort (N int32)": lambda: torch.sort(columns, stable=True),
        "target_logits": lambda: target_logits(hidden, weight, None, target, vocab_start=0,
                                               ignore_index=-100, softcap=None,
                                               round_16bit=False),
        "exp_logits (GEMM + row sums)": lambda: exp_logits(
            hidden, weight, None, columns, logit, exps, softcap=None, round_16bit=False,
            partials=partials),
        "exp_logits, pointers": lambda: exp_logits(
            hidden, weight, None, columns, logit, exps, softcap=None, round_16bit=False,
            partials=partials, tma=False),
        "repair_exponentials": lambda: repair_exponentials(
            hidden, weight, None, columns, logit, lse, exps, softcap=None, round_16bit=False),
        "row_scales": lambda: row_scales(hidden, lse, logit, p_coef, target_grad, columns,
                                         softcap=None, out=scaled),
        "add_target_rows (sort + kernel)": lambda: add_target_rows(d_weight, hidden,
                                                                   target_grad, columns),
        "finish_input_grad": lambda: finish_input_grad(d_hidden, weight, p_coef, target_grad,
                                                       columns),
    }
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; N={n} V={v} D={d}; host us per call")
    for name, fn in pieces.items():
        print(f"{name:>34}: {enqueue_us(fn):8.1f}", flush=True)


if __name__ == "__main__":
    main()
