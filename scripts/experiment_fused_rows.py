"""Experiment: one kernel for the statistics and G passes over a chunk of logits, on one GPU.

    python scripts/experiment_fused_rows.py --out OUT/fused_rows

The default mode reads a chunk's logits twice and writes them once (logit_rows.py: the
statistics pass, then G in place). Where no collective sits between the two (one device), one
program can own a row: take its statistics, then read it again, last block first, while its
tail may still be in L2, and write G. This times that kernel (plain cross-entropy coefficients:
no bias, cap, smoothing or z-loss) against the two passes, at the chunk shapes the default
takes, over several grid sizes and block widths, and checks it against torch in fp32.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from fused_lce.kernels.logit_rows import grad_in_place, row_statistics
from fused_lce.options import LCEOptions
from fused_lce.terms import grad_coefficients, target_nll


@triton.jit
def _stats_then_grad_kernel(logits_ptr, target_ptr, g_ptr, lse_ptr, n_rows, n_cols, stride,
                            BLOCK_V: tl.constexpr, REVERSE: tl.constexpr):
    n_blocks = tl.cdiv(n_cols, BLOCK_V)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        base = logits_ptr + tl.cast(row, tl.int64) * stride
        run_max = float("-inf")
        run_sum = 0.0
        for b in range(0, n_blocks):
            cols = b * BLOCK_V + tl.arange(0, BLOCK_V)
            z = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(run_max, tl.max(z, axis=0))
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
            run_max = new_max
        lse = run_max + tl.log(run_sum)
        target = tl.load(target_ptr + row)
        g = tl.load(g_ptr + row)
        for i in range(0, n_blocks):
            b = n_blocks - 1 - i if REVERSE else i
            cols = b * BLOCK_V + tl.arange(0, BLOCK_V)
            mask = cols < n_cols
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            grad = g * tl.exp(z - lse) - tl.where(cols == target, g, 0.0)
            tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)
        tl.store(lse_ptr + row, lse)


def stats_then_grad(logits, target, g, programs: int, block_v: int, warps: int, reverse: bool):
    lse = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    grid = (min(programs, logits.shape[0]),)
    _stats_then_grad_kernel[grid](logits, target, g, lse, logits.shape[0], logits.shape[1],
                                  logits.stride(0), BLOCK_V=block_v, REVERSE=reverse,
                                  num_warps=warps)
    return lse


def two_passes(logits, target, g, opts):
    row_max, sum_exp, target_logit, _ = row_statistics(logits, None, target, None, False)
    lse = row_max + torch.log(sum_exp)
    nll = target_nll(row_max, sum_exp, target_logit)
    coefs = grad_coefficients(g, lse, nll, None, logits.shape[1], opts)
    grad_in_place(logits, None, target, lse, coefs, None)
    return lse


def fresh_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Trained-like rows: a few classes far above a long tail."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 2.0
    peaks = torch.randint(0, vocab, (rows, 8), device="cuda", generator=gen)
    logits.scatter_add_(1, peaks, torch.full((rows, 8), 9.0, device="cuda"))
    return logits.bfloat16()


def check(vocab: int, config) -> float:
    rows = 301
    logits = fresh_logits(rows, vocab, 1)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    g = torch.full((rows,), 1.0 / rows, device="cuda")
    z = logits.float()
    expected = torch.softmax(z, dim=1) * g[:, None]
    expected[torch.arange(rows), target] -= g
    stats_then_grad(logits, target, g, *config)
    return ((logits.float() - expected).abs().max() / expected.abs().max()).item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["4096:256000", "4096:128256",
                                                         "4096:32064", "2048:128256"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from triton.testing import do_bench

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [(sms * k, block, warps, reverse)
               for k in (1, 2, 4) for block, warps in ((4096, 8), (8192, 16))
               for reverse in (True, False)]
    opts = LCEOptions()
    results = []
    for shape in args.shapes:
        rows, vocab = map(int, shape.split(":"))
        logits = fresh_logits(rows, vocab, 0)
        target = torch.randint(0, vocab, (rows,), device="cuda")
        g = torch.full((rows,), 1.0 / rows, device="cuda")
        gb = rows * vocab * 2 / 1e9
        def two(logits=logits, target=target, g=g):
            two_passes(logits, target, g, opts)

        base = do_bench(two, warmup=10, rep=200, return_mode="median")
        print(f"{shape}: two passes {base:.3f} ms ({3 * gb / base:.2f} TB/s for 3 x {gb:.2f} GB)",
              flush=True)
        results.append({"shape": shape, "kernel": "two passes (logit_rows.py)", "ms": base,
                        "vs_two_passes": 1.0, "max_rel_err": ""})
        for config in configs:
            def one(logits=logits, target=target, g=g, config=config):
                stats_then_grad(logits, target, g, *config)

            ms = do_bench(one, warmup=10, rep=200, return_mode="median")
            err = check(vocab, config)
            programs, block, warps, reverse = config
            order = "reverse" if reverse else "forward"
            name = f"one kernel: {programs} programs, BLOCK_V {block}, {warps} warps, {order}"
            print(f"{shape}: {name}: {ms:.3f} ms ({ms / base:.2f}x), max rel err {err:.1e}",
                  flush=True)
            results.append({"shape": shape, "kernel": name, "ms": ms, "vs_two_passes": ms / base,
                            "max_rel_err": err})
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "fused_rows.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(results[0]))
            writer.writeheader()
            writer.writerows(results)


if __name__ == "__main__":
    sys.exit(main())
