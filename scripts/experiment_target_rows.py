"""What the target columns' weight-gradient pass (``add_target_rows``) costs, by target
distribution and launch shape. One GPU.

    python scripts/experiment_target_rows.py [--rows 8192 --d-model 3072 --vocab 32064]

The pass adds g_n * hidden[n] into weight_grad[y_n] for every row, sorted by target, each run of
equal targets summed by the program where it starts. Its time depends on the longest run: a
Zipf vocabulary's first token holds about a seventh of the rows. This times the launcher and
the kernel at a few (piece, tail step, D block, warps) shapes on three target distributions:
Zipf(1.1) as scripts/bench_lce.py draws them, uniform over the vocabulary, and every row its
own target. Microseconds per call, median of 20 after a warm-up, CUDA events.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

from fused_lce.kernels.exp_logits import _add_target_rows_kernel, add_target_rows


def targets(kind: str, n_rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "zipf":
        ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
        weights = ranks.pow(-1.1)
        return torch.multinomial(weights / weights.sum(), n_rows, replacement=True,
                                 generator=gen)
    if kind == "uniform":
        return torch.randint(0, vocab, (n_rows,), generator=gen)
    return torch.randperm(vocab, generator=gen)[:n_rows]


def time_us(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=32064)
    args = parser.parse_args(argv)
    n, d, v = args.rows, args.d_model, args.vocab
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=gen).bfloat16().cuda()
    coef = torch.randn(n, generator=gen).cuda()
    weight_grad = torch.zeros(v, d, device="cuda", dtype=torch.bfloat16)
    shapes = [(32, 32, 128, 4), (32, 128, 64, 8), (32, 128, 128, 8), (64, 128, 128, 8),
              (16, 128, 256, 8)]
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}; N={n} D={d} V={v}; "
          "us per call")
    for kind in ("zipf", "uniform", "distinct"):
        columns = targets(kind, n, v, gen).to(torch.int32).cuda()
        print(distribution_row(kind, columns, weight_grad, hidden, coef, shapes), flush=True)


def distribution_row(kind, columns, weight_grad, hidden, coef, shapes) -> str:
    n, d = hidden.shape
    longest = int(torch.unique(columns, return_counts=True)[1].max())
    sorted_columns, order = torch.sort(columns, stable=True)
    launcher = time_us(lambda: add_target_rows(weight_grad, hidden, coef, columns))
    row = [f"{kind:>8} (longest run {longest:5d})", f"launcher {launcher:7.1f}"]
    for piece, tail, block_d, warps in shapes:
        def launch(piece=piece, tail=tail, block_d=block_d, warps=warps):
            _add_target_rows_kernel[(triton.cdiv(n, piece), triton.cdiv(d, block_d))](
                weight_grad, hidden, None, sorted_columns, order, coef, n, d,
                weight_grad.stride(0), hidden.stride(0), hidden.stride(1),
                PIECE=piece, TAIL=tail, BLOCK_D=block_d, ROUND_OUT=0, num_warps=warps)
        row.append(f"{piece}/{tail}/{block_d}/{warps}w {time_us(launch):7.1f}")
    return "  ".join(row)

if __name__ == "__main__":
    main()
