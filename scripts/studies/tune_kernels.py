"""Time the Triton kernels under several tile configs on this GPU; print a table, best first.

    python scripts/studies/tune_kernels.py --model gemma2_2b --tokens 8192 [--tma 1 0]

We pin one config per GPU family in the kernel files (no autotuning at run time, for fast start-up
and reproducible results); this script is how those pins are chosen. It times the linear-log-sum-exp
forward and the logit-gradient kernel of the GEMM backward at a model's shape, beside the cuBLAS
GEMM of the same size, with the tiles read through tensor descriptors (TMA, the launchers'
``tma=True``) and through pointers (0).
"""

from __future__ import annotations

import argparse

import torch

from fused_lce.kernels import gemm_backward as grad_logits_module
from fused_lce.kernels import lse_forward as lse_module
from fused_lce.kernels.common import TileConfig
from fused_lce.options import LCEOptions
from fused_lce.terms import grad_coefficients
from fused_lce.triton_shard import prepare_rows
from lce_train.configs import load_model_config

CANDIDATES = [
    TileConfig(128, 256, 64, 8, 3),
    TileConfig(128, 256, 64, 8, 4),
    TileConfig(128, 256, 32, 8, 4),
    TileConfig(128, 128, 64, 4, 4),
    TileConfig(128, 128, 64, 8, 4),
    TileConfig(256, 128, 64, 8, 3),
    TileConfig(64, 256, 64, 4, 4),
    TileConfig(128, 128, 128, 8, 3),
    TileConfig(128, 256, 128, 8, 2),
    TileConfig(256, 128, 64, 8, 4),
]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma2_2b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab-chunk", type=int, default=16384)
    parser.add_argument("--tma", nargs="+", default=["1", "0"], choices=["1", "0"])
    parser.add_argument("--configs", type=int, nargs="+", default=None,
                        help="indices into CANDIDATES (default: all)")
    args = parser.parse_args(argv)
    candidates = [CANDIDATES[i] for i in args.configs] if args.configs else CANDIDATES
    from triton.testing import do_bench

    cfg = load_model_config(args.model)
    n, v, d = args.tokens, cfg.vocab_size, cfg.hidden_size
    torch.manual_seed(0)
    hidden = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * 0.02
    target = torch.randint(0, v, (n,), device="cuda")
    rows = prepare_rows(target, -100)
    mm_ms = do_bench(lambda: hidden @ weight.t(), rep=300, return_mode="median")
    print(f"# {torch.cuda.get_device_name()} {args.model} N={n} V={v} D={d}: "
          f"cuBLAS N·V·D mm {mm_ms:.2f} ms")

    family = "hopper"
    for tma, cand in [(t, c) for t in args.tma for c in candidates]:
        lse_module._CONFIGS[family] = lse_module._CONFIGS[f"{family}-tma"] = cand
        try:
            ms = do_bench(lambda tma=tma: lse_module.lse_forward(hidden, weight, None, rows.order,
                                                         rows.n_valid, tma=tma == "1"),
                          rep=300, return_mode="median")
            print(f"lse_forward  tma={tma} {cand}: {ms:7.2f} ms  ({mm_ms / ms:4.0%} of cuBLAS)",
                  flush=True)
        except Exception as exc:  # a config the GPU cannot run (shared memory)
            print(f"lse_forward  tma={tma} {cand}: failed ({type(exc).__name__}: {exc})"[:300])
    lse_module._CONFIGS[family] = lse_module._CONFIGS[f"{family}-tma"] = CANDIDATES[1]

    stats = lse_module.lse_forward(hidden, weight, None, rows.order, rows.n_valid)
    lse = stats.lse
    grad = torch.full((n,), 1.0 / n, device="cuda")
    coefs = grad_coefficients(grad, lse, torch.zeros_like(lse), None, v, LCEOptions())
    target_local = target.to(torch.int32)
    cols = min(args.vocab_chunk, v)
    buf = torch.empty((n, cols), device="cuda", dtype=torch.bfloat16)
    chunk_mm = do_bench(lambda: hidden @ weight[:cols].t(), rep=300, return_mode="median")
    for tma, cand in [(t, c) for t in args.tma for c in candidates]:
        grad_logits_module._CONFIGS[family] = cand

        def run(tma=tma):
            grad_logits_module.grad_logits(hidden, weight, None, rows.order, rows.n_valid,
                                           target_local, lse, coefs, buf, row_start=0,
                                           vocab_start=0, softcap=None, tma=tma == "1")
        try:
            ms = do_bench(run, rep=300, return_mode="median")
            print(f"grad_logits  tma={tma} {cand}: {ms:7.3f} ms per {cols}-column chunk "
                  f"({chunk_mm / ms:4.0%} of cuBLAS)", flush=True)
        except Exception as exc:
            print(f"grad_logits  tma={tma} {cand}: failed ({type(exc).__name__}: {exc})"[:300])


if __name__ == "__main__":
    main()
