"""Time the logit_rows kernels (row statistics; G in place) over one token chunk of logits.

    python scripts/studies/tune_logit_rows.py [--rows 4096] [--vocab 256000 128256 32064]

For each block config it prints the median time and the bandwidth it reached (bytes the kernel
must move: the statistics read each logit once, G reads and writes it), beside a plain copy of
the buffer as the machine's practical ceiling.
"""

from __future__ import annotations

import argparse

import torch
import triton
from triton.testing import do_bench

from fused_lce.kernels import logit_rows

STAT_CONFIGS = [(4, 1024, 4, 1), (4, 2048, 8, 1), (8, 1024, 8, 1), (2, 4096, 8, 1),
                (1, 4096, 4, 1), (1, 8192, 8, 1), (16, 512, 8, 1), (4, 1024, 4, 3)]
GRAD_CONFIGS = [(16, 512, 4), (16, 256, 4), (8, 1024, 8), (32, 256, 8), (4, 2048, 8),
                (16, 1024, 8)]


def tune(rows: int, vocab: int) -> None:
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    target = torch.randint(0, vocab, (rows,), device="cuda", dtype=torch.int32)
    nbytes = logits.numel() * logits.element_size()
    copy = torch.empty_like(logits)
    ms = do_bench(lambda: copy.copy_(logits), return_mode="median")
    print(f"V={vocab}: copy {ms:.3f} ms, {2 * nbytes / ms / 1e9:.2f} TB/s")
    out = torch.empty((3, rows), device="cuda", dtype=torch.float32)
    for block_n, block_v, warps, stages in STAT_CONFIGS:
        def stats(block_n=block_n, block_v=block_v, warps=warps, stages=stages):
            logit_rows._row_statistics_kernel[(triton.cdiv(rows, block_n),)](
                logits, None, target, out[0], out[1], out[2], None,
                rows, vocab, logits.stride(0), None,
                BLOCK_N=block_n, BLOCK_V=block_v, num_warps=warps, num_stages=stages)
        ms = do_bench(stats, return_mode="median")
        print(f"  stats BLOCK_N={block_n:>2} BLOCK_V={block_v:>5} warps={warps} "
              f"stages={stages}: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s")
    lse = out[0] + torch.log(out[1])
    coef = torch.full((rows,), 1.0 / rows, device="cuda")
    for block_n, block_v, warps in GRAD_CONFIGS:
        def grad(block_n=block_n, block_v=block_v, warps=warps):
            grid = (triton.cdiv(rows, block_n), triton.cdiv(vocab, block_v))
            logit_rows._grad_in_place_kernel[grid](
                logits, copy, None, target, lse, coef, coef, None,
                rows, vocab, logits.stride(0), copy.stride(0), None,
                BLOCK_N=block_n, BLOCK_V=block_v, num_warps=warps)
        ms = do_bench(grad, return_mode="median")
        print(f"  grad  BLOCK_N={block_n:>2} BLOCK_V={block_v:>5} warps={warps}: "
              f"{ms:.3f} ms, {2 * nbytes / ms / 1e9:.2f} TB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, nargs="+", default=[256000, 128256, 32064])
    args = parser.parse_args()
    for vocab in args.vocab:
        tune(args.rows, vocab)


if __name__ == "__main__":
    main()
