"""Time the exponentials GEMM (fused_lce/kernels/exp_logits.py) against cuBLAS's logits GEMM over
one token chunk, for a few tile and epilogue configurations. One GPU.

    python scripts/tune_exp_logits.py [--rows 4096] [--shapes 256000:2304 128256:4096 32064:3072]

Per shape and configuration it prints the median ms of ``rounds`` interleaved rounds (the H100's
clock moves between rounds more than configurations differ), the ratio to cuBLAS's ``mm`` into
a bf16 buffer (the GEMM the two-pass walk ran, with nothing after it). The winner is what
``_CONFIGS["hopper"]`` should hold.

The last results are on docs/benchmarks/single_gpu.md. The variants it once timed besides these
(the GEMM storing plain logits, an epilogue taking every block's max, flattened tile loops, two
programs per SM) were closed (CHANGELOG.md) and left the kernel; they are in git at commit 10497e6.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from triton.testing import do_bench

from fused_lce.kernels.common import TileConfig
from fused_lce.kernels.exp_logits import ExpLogitsConfig, exp_logits

_TILE = TileConfig(128, 256, 64, 8, 3)
CONFIGS = {
    "128x256x64 s3 w8": ExpLogitsConfig(_TILE),
    "128x256x64 s3 w8 split2": ExpLogitsConfig(_TILE, split=2),
    "128x256x64 s3 w8 ws": ExpLogitsConfig(_TILE, warp_specialize=True),
    "128x256x64 s3 w8 split2 ws": ExpLogitsConfig(_TILE, split=2, warp_specialize=True),
    "128x256x64 s4 w8 split2": ExpLogitsConfig(TileConfig(128, 256, 64, 8, 4), split=2),
    "128x256x64 s4 w8 split2 ws": ExpLogitsConfig(TileConfig(128, 256, 64, 8, 4), split=2,
                                                  warp_specialize=True),
    "128x256x128 s2 w8 split2 ws": ExpLogitsConfig(TileConfig(128, 256, 128, 8, 2), split=2,
                                                   warp_specialize=True),
    "split2 ws group4": ExpLogitsConfig(_TILE, split=2, warp_specialize=True, group=4),
    "split2 ws group16": ExpLogitsConfig(_TILE, split=2, warp_specialize=True, group=16),
    "split2 ws group32": ExpLogitsConfig(_TILE, split=2, warp_specialize=True, group=32),
    "256x128x64 s3 w8": ExpLogitsConfig(TileConfig(256, 128, 64, 8, 3)),
}


def tune(rows: int, vocab: int, d_model: int, rounds: int, names: list[str]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(rows, d_model, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, d_model, device="cuda", generator=gen) / d_model**0.5).bfloat16()
    columns = torch.randint(0, vocab, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    offsets = torch.zeros(rows, device="cuda")
    out = torch.empty(rows, vocab, device="cuda", dtype=torch.bfloat16)
    timed = {"cuBLAS mm": lambda: torch.mm(hidden, weight.t(), out=out)}
    for name in names:
        config = CONFIGS[name]
        timed[name] = (lambda config=config: exp_logits(
            hidden, weight, None, columns, offsets, out, softcap=None, round_16bit=False,
            config=config))
    times: dict[str, list[float]] = {name: [] for name in timed}
    failed = {}
    for _ in range(rounds):
        for name, fn in timed.items():
            if name in failed:
                continue
            try:
                times[name].append(do_bench(fn, warmup=25, rep=100, return_mode="median"))
            except Exception as error:  # a configuration that does not compile or fit
                failed[name] = f"{type(error).__name__}: {str(error)[:100]}"
    base = statistics.median(times["cuBLAS mm"])
    flops = 2 * rows * vocab * d_model
    print(f"# chunk {rows} x {vocab} x {d_model}")
    for name, values in times.items():
        if name in failed:
            print(f"{name:>28}: failed ({failed[name]})")
            continue
        ms = statistics.median(values)
        print(f"{name:>28}: {ms:7.3f} ms  {ms / base:5.3f}x cuBLAS  "
              f"{flops / ms / 1e9:5.0f} TFLOP/s  rounds {' '.join(f'{v:.3f}' for v in values)}",
              flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--shapes", nargs="+", default=["256000:2304", "128256:4096", "32064:3072"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS),
                        help="a subset of the configurations (default: all)")
    args = parser.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for shape in args.shapes:
        vocab, d_model = (int(x) for x in shape.split(":"))
        tune(args.rows, vocab, d_model, args.rounds, args.configs or list(CONFIGS))


if __name__ == "__main__":
    main()
