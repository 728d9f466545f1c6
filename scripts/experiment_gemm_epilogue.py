"""Experiment: can a Triton GEMM carry the statistics pass in its epilogue at cuBLAS speed? One GPU.

    python scripts/experiment_gemm_epilogue.py --out OUT/gemm_epilogue

The default mode's logits GEMM is cuBLAS's, and the statistics pass then reads the chunk's
logits again (scripts/profile_default.py: 1.4 ms a step at Gemma-2). A persistent Triton GEMM
over tensor descriptors that also writes, per row and column tile, the tile's max and sum-exp
would save that read, if its GEMM keeps up with cuBLAS. This times, at the default's chunk
shapes (4096 tokens): cuBLAS's logits GEMM alone and followed by the statistics pass, against the
Triton GEMM alone and with the statistics epilogue (plus the merge of its per-tile partials),
over a few tile shapes, pipeline depths and Triton's warp specialisation; and checks the logits
and the lse against torch.

``--steps ROUNDS`` times the default's whole step instead (N = two chunks: logits and their
statistics, G in place, both gradient GEMMs) with either logits GEMM, back to back as a training
step runs, alternately: the per-chunk timings above move between rounds by more than the
difference they measure.

``--lean ROUNDS`` times the lean mode's forward (``lse_forward``, which stores no logits) against
this GEMM with its statistics epilogue and no store, and cuBLAS's GEMM, at N = two chunks.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("bench_lce", HERE / "bench_lce.py")
bench_lce = importlib.util.module_from_spec(_spec)
sys.modules["bench_lce"] = bench_lce
_spec.loader.exec_module(bench_lce)

from fused_lce.kernels.logit_rows import grad_in_place, row_statistics  # noqa: E402
from fused_lce.options import LCEOptions  # noqa: E402
from fused_lce.terms import grad_coefficients  # noqa: E402


@triton.jit
def _gemm_kernel(x_desc, w_desc, z_desc, part_max_ptr, part_sum_ptr, M, N, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, STATS: tl.constexpr,
                 WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr,
                 STORE: tl.constexpr = True):
    n_pid_m = tl.cdiv(M, BLOCK_M)
    n_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * n_pid_n
    for tile in tl.range(tl.program_id(0), n_pid_m * n_pid_n, NUM_SMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        first_m = tile // per_group * GROUP_M
        group_rows = min(n_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_rows
        pid_n = (tile % per_group) // group_rows
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):
            a = x_desc.load([row0, k * BLOCK_K])
            b = w_desc.load([col0, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        z = acc.to(z_desc.dtype)
        if STORE:
            z_desc.store([row0, col0], z)
        if STATS:
            cols = col0 + tl.arange(0, BLOCK_N)
            logits = tl.where(cols[None, :] < N, z.to(tl.float32), float("-inf"))
            tile_max = tl.max(logits, axis=1)
            # exp2 of pre-scaled logits: one multiply-add and MUFU.EX2 per logit.
            scaled = (logits - tile_max[:, None]) * 1.4426950408889634
            tile_sum = tl.sum(tl.exp2(scaled), axis=1)
            rows = row0 + tl.arange(0, BLOCK_M)
            tl.store(part_max_ptr + pid_n * M + rows, tile_max, mask=rows < M)
            tl.store(part_sum_ptr + pid_n * M + rows, tile_sum, mask=rows < M)


def triton_logits(x, w, z, config, stats: bool, store: bool = True):
    block_m, block_n, block_k, stages, warps, ws, flatten = config
    m, k = x.shape
    n = w.shape[0]
    sms = (torch.cuda.get_device_properties(x.device).multi_processor_count
           if x.is_cuda else 4)
    tiles_n = triton.cdiv(n, block_n)
    part_max = part_sum = None
    if stats:
        part_max = torch.empty(tiles_n, m, device=x.device, dtype=torch.float32)
        part_sum = torch.empty(tiles_n, m, device=x.device, dtype=torch.float32)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
    z_desc = TensorDescriptor.from_tensor(z, [block_m, block_n])
    grid = (min(sms, triton.cdiv(m, block_m) * tiles_n),)
    _gemm_kernel[grid](x_desc, w_desc, z_desc, part_max, part_sum, m, n, k,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                       NUM_SMS=sms, STATS=stats, WARP_SPECIALIZE=ws, FLATTEN=flatten, STORE=store,
                       num_stages=stages, num_warps=warps)
    if not stats:
        return None
    row_max = part_max.max(dim=0).values
    return row_max + torch.log((part_sum * torch.exp(part_max - row_max)).sum(dim=0))


def cublas_logits(x, w, z, stats: bool):
    torch.mm(x, w.t(), out=z)
    if not stats:
        return None
    target = torch.full((x.shape[0],), -1, device=x.device, dtype=torch.int64)
    row_max, sum_exp, _, _ = row_statistics(z, None, target, None, False)
    return row_max + torch.log(sum_exp)


# BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, warp specialisation, flattened tile loop. Measured
# on an H100 (CHANGELOG.md): 128 x 256 x 64 in 3 stages keeps up
# with cuBLAS; 4 stages of it exceed shared memory; 128 x 128 tiles lose 8-25%; 4 warps with
# warp specialisation fail to compile in triton 3.6.
CONFIGS = [
    (128, 256, 64, 3, 8, False, False),
    (128, 256, 64, 3, 8, True, False),
    (128, 256, 64, 3, 8, False, True),
    (128, 256, 64, 3, 8, True, True),
    (256, 128, 64, 3, 8, False, False),
    (256, 128, 64, 3, 8, True, False),
]
# The whole-step proxies: the two tile loops that won the per-chunk rounds.
STEP_CONFIGS = [(128, 256, 64, 3, 8, False, False), (128, 256, 64, 3, 8, True, False)]


def step_of(x, w, target, chunk_rows: int, config):
    """The default's step, chunk by chunk: logits and their statistics (cuBLAS and the pass, or
    the Triton GEMM with ``config`` and its epilogue), G in place, the two gradient GEMMs."""
    n_rows = x.shape[0]
    buffer = torch.empty(chunk_rows, w.shape[0], device=x.device, dtype=x.dtype)
    d_hidden, d_weight = torch.empty_like(x), torch.empty_like(w)
    g = torch.full((n_rows,), 1.0 / n_rows, device=x.device)
    opts = LCEOptions()

    def step():
        for start in range(0, n_rows, chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = buffer[: x[rows].shape[0]]
            if config is None:
                lse = cublas_logits(x[rows], w, logits, True)
            else:
                lse = triton_logits(x[rows], w, logits, config, True)
            chunk_target = target[rows]
            nll = lse - logits.gather(1, chunk_target[:, None])[:, 0].float()
            coefs = grad_coefficients(g[rows], lse, nll, None, w.shape[0], opts)
            grad_in_place(logits, None, chunk_target, lse, coefs, None)
            torch.mm(logits, w, out=d_hidden[rows])
            if start == 0:
                torch.mm(logits.t(), x[rows], out=d_weight)
            else:
                d_weight.addmm_(logits.t(), x[rows])
    return step


def run_steps(n_tokens: int, n: int, k: int, rounds: int) -> list[dict]:
    """Whole-step proxies, cuBLAS and Triton alternately, ``rounds`` times each."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n_tokens, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).bfloat16()
    target = torch.randint(0, n, (n_tokens,), device="cuda", generator=gen)
    chunk_rows = n_tokens // 2
    variants = {"cuBLAS + statistics pass": None}
    variants.update({f"triton {config} + statistics epilogue": config
                     for config in STEP_CONFIGS})
    steps = {name: step_of(x, w, target, chunk_rows, config) for name, config in variants.items()}
    results = []
    for round_ in range(1, rounds + 1):
        for name, step in steps.items():
            ms = bench_lce.steps_median_ms(step)
            print(f"step N={n_tokens} V={n} D={k} round {round_}: {name}: {ms:.3f} ms",
                  flush=True)
            results.append({"shape": f"step {n_tokens}:{n}:{k}", "kernel": name, "ms": ms,
                             "round": round_})
    return results


def run_lean(m: int, n: int, k: int, rounds: int) -> list[dict]:
    """The lean mode's forward (``lse_forward``: the logits GEMM with an online softmax, nothing
    stored) against this GEMM with the statistics epilogue and no store, and cuBLAS's GEMM."""
    from triton.testing import do_bench

    from fused_lce.kernels.lse_forward import lse_forward

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).bfloat16()
    z = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    order = torch.arange(m, device="cuda", dtype=torch.int32)
    n_valid = torch.tensor(m, device="cuda", dtype=torch.int32)
    flops = 2 * m * n * k
    reference = torch.logsumexp((x @ w.t()).float(), dim=1)
    import fused_lce.kernels.lse_forward as lse_module

    target = torch.randint(0, n, (m,), device="cuda", generator=gen)
    tuned = lse_module._CONFIGS["hopper-tma"]

    def lse_with(stages: int, with_target: bool):
        def call():
            lse_module._CONFIGS["hopper-tma"] = dataclasses.replace(tuned, num_stages=stages)
            try:
                return lse_forward(x, w, None, order, n_valid,
                                   target=target if with_target else None)
            finally:
                lse_module._CONFIGS["hopper-tma"] = tuned
        return call

    timed = {
        "cuBLAS GEMM (logits stored)": lambda: torch.mm(x, w.t(), out=z),
        "lse_forward (the lean mode's forward)": lambda: lse_forward(x, w, None, order, n_valid),
        f"lse_forward, target, {tuned.num_stages} stages (as the lean mode calls it)":
            lse_with(tuned.num_stages, True),
        "lse_forward, target, 3 stages": lse_with(3, True),
        "lse_forward, no target, 3 stages": lse_with(3, False),
    }
    for config in STEP_CONFIGS:
        timed[f"triton {config} + statistics epilogue, no store"] = (
            lambda config=config: triton_logits(x, w, z, config, True, store=False))
    errors = {name: (fn().lse - reference).abs().max().item()
              for name, fn in timed.items() if name.startswith("lse_forward")}
    errors.update({name: (fn() - reference).abs().max().item()
                   for name, fn in timed.items() if name.startswith("triton")})
    results = []
    for round_ in range(1, rounds + 1):
        for name, fn in timed.items():
            ms = do_bench(fn, warmup=10, rep=200, return_mode="median")
            err = errors.get(name, float("nan"))
            print(f"lean {m}:{n}:{k} round {round_}: {name}: {ms:.3f} ms "
                  f"({flops / ms / 1e9:.0f} TFLOP/s), lse err {err:.1e}", flush=True)
            results.append({"shape": f"lean {m}:{n}:{k}", "kernel": name, "ms": ms,
                            "round": round_, "lse_err": err})
    return results


def run_shape(m: int, n: int, k: int) -> list[dict]:
    from triton.testing import do_bench

    shape = f"{m}:{n}:{k}"
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).bfloat16()
    z = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * n * k
    expected_z = x @ w.t()
    reference = torch.logsumexp(expected_z.float(), dim=1)
    results = []
    for stats in (False, True):
        def cublas(stats=stats):
            cublas_logits(x, w, z, stats)

        base = do_bench(cublas, warmup=10, rep=200, return_mode="median")
        name = "cuBLAS" + (" + statistics pass" if stats else "")
        print(f"{shape} {name}: {base:.3f} ms ({flops / base / 1e9:.0f} TFLOP/s)", flush=True)
        results.append({"shape": shape, "kernel": name, "ms": base,
                        "tflops": flops / base / 1e9, "vs_cublas": 1.0, "z_err": 0.0,
                        "lse_err": ""})
        for config in CONFIGS:
            def ours(config=config, stats=stats):
                return triton_logits(x, w, z, config, stats)

            try:
                lse = ours()
                z_err = (z.float() - expected_z.float()).abs().max().item()
                lse_err = (lse - reference).abs().max().item() if stats else float("nan")
                ms = do_bench(ours, warmup=10, rep=200, return_mode="median")
            except Exception as exc:  # noqa: BLE001  (a config this triton cannot build)
                print(f"{shape} {config} stats={stats}: {type(exc).__name__}: {exc}"[:300])
                continue
            name = f"triton {config}" + (" + statistics epilogue" if stats else "")
            print(f"{shape} {name}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s, "
                  f"{ms / base:.3f}x cuBLAS), z err {z_err:.1e}, lse err {lse_err:.1e}",
                  flush=True)
            results.append({"shape": shape, "kernel": name, "ms": ms,
                            "tflops": flops / ms / 1e9, "vs_cublas": ms / base,
                            "z_err": z_err, "lse_err": lse_err})
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+",
                        default=["4096:256000:2304", "4096:128256:4096", "4096:32064:3072"])
    parser.add_argument("--steps", type=int, default=0, metavar="ROUNDS",
                        help="time whole-step proxies at N = 2 x each shape's rows instead, "
                             "ROUNDS rounds of each variant alternately")
    parser.add_argument("--lean", type=int, default=0, metavar="ROUNDS",
                        help="time the lean mode's forward against this GEMM's statistics "
                             "epilogue without the store, at N = 2 x each shape's rows")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results = []
    for shape in args.shapes:
        m, n, k = map(int, shape.split(":"))
        if args.lean:
            results += run_lean(2 * m, n, k, args.lean)
        elif args.steps:
            results += run_steps(2 * m, n, k, args.steps)
        else:
            results += run_shape(m, n, k)
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "lean.csv" if args.lean else "steps.csv" if args.steps else "gemm_epilogue.csv"
        with open(args.out / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(results[0]))
            writer.writeheader()
            writer.writerows(results)


if __name__ == "__main__":
    sys.exit(main())
