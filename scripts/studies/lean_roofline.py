"""The lean mode's distance to its roofline: each of its GEMMs' rate against cuBLAS's at the
same shape, and what the mode would take with its Triton GEMMs at cuBLAS's rate. One GPU.

    python scripts/studies/lean_roofline.py [--cases gemma2_2b:8192 llama3_8b:8192 phi3_5_mini:8192]

The lean mode (``scratch_mb=12``, under 16 MiB) stores no logits, so it computes them twice:
the forward's Triton GEMM with the log-sum-exp in its epilogue (``_lse_forward_kernel``), and
the backward's Triton GEMM that recomputes a chunk of logits and writes their gradient
(``_grad_logits_kernel``), then two cuBLAS GEMMs per chunk for the input and weight gradients.
Four N x V x D GEMMs where the default mode runs three.

For each case it prints: the lean step's and torch.compile's fwd+bwd ms (back-to-back steps,
CUDA events); from one profiled window, each GEMM family's GPU ms per step and TFLOP/s
(2 N V D each) beside cuBLAS's rate for the logits GEMM at N rows; the four-GEMM floor at
cuBLAS's rate; and the lean step with its two Triton GEMMs replaced by that rate (the rest
unchanged), as a multiple of torch.compile.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("profile_default", HERE / "profile_default.py")
profile_default = importlib.util.module_from_spec(_spec)
sys.modules["profile_default"] = profile_default
_spec.loader.exec_module(profile_default)

from fused_lce.options import LEAN_SCRATCH_MB  # noqa: E402
from lce_train.bench_lce_inputs import Case, make_inputs  # noqa: E402
from lce_train.bench_lce_providers import torch_loss  # noqa: E402
from lce_train.bench_lce_timing import gemm_ceiling, steps_median_ms  # noqa: E402
from lce_train.configs import load_model_config  # noqa: E402

FAMILIES = (  # (label, profile_default's category, GEMMs it counts)
    ("forward Triton GEMM (lse)", "lse forward", 1),
    ("backward Triton GEMM (recompute + G)", "grad logits", 1),
    ("cuBLAS (dX, dW)", "gemm", 2),
)


def run_case(model: str, n_tokens: int) -> dict:
    cfg = load_model_config(model)
    case = Case(model, n_tokens, cfg.vocab_size, cfg.hidden_size, "trained")
    hidden, weight, target = make_inputs(case, torch.bfloat16, "cuda")
    h = hidden.requires_grad_()
    w = weight.requires_grad_()
    lean = profile_default.step_fn(h, w, target, scratch_mb=LEAN_SCRATCH_MB)
    lean_mib = profile_default.extra_memory_mib(lean, h, w)
    lean_ms = steps_median_ms(lean)
    compiled = profile_default.step_fn(h, w, target,
                                       compiled=torch.compile(torch_loss))
    compiled(), compiled()
    compile_ms = steps_median_ms(compiled)
    per_category, _, _ = profile_default.kernel_breakdown(lean)
    rate = gemm_ceiling(case, torch.bfloat16, 100)  # TFLOP/s of cuBLAS's mm
    gemm_tflop = 2 * n_tokens * cfg.vocab_size * cfg.hidden_size / 1e12
    cublas_ms = gemm_tflop / rate * 1e3
    triton_ms = sum(per_category.get(category, 0.0) for _, category, _ in FAMILIES[:2])
    row = {"case": f"{model}:{n_tokens}", "lean_ms": lean_ms, "lean_mib": lean_mib,
           "torch.compile_ms": compile_ms, "lean / torch.compile": lean_ms / compile_ms,
           "cuBLAS TFLOP/s": rate, "four-GEMM floor ms": 4 * cublas_ms,
           "floor / torch.compile": 4 * cublas_ms / compile_ms}
    for label, category, gemms in FAMILIES:
        ms = per_category.get(category, 0.0)
        row[f"{label} ms"] = ms
        row[f"{label} TFLOP/s"] = gemms * gemm_tflop / (ms / 1e3) if ms else math.nan
    row["other ms"] = per_category.get("other", 0.0)
    at_cublas = lean_ms - triton_ms + 2 * cublas_ms
    row["lean with cuBLAS-rate Triton GEMMs ms"] = at_cublas
    row["that / torch.compile"] = at_cublas / compile_ms
    del hidden, weight, target, h, w
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+",
                        default=["gemma2_2b:8192", "llama3_8b:8192", "phi3_5_mini:8192"])
    args = parser.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for spec in args.cases:
        model, tokens = spec.split(":")
        row = run_case(model, int(tokens))
        print("\n## " + row.pop("case"))
        for key, value in row.items():
            print(f"{key:<48} {value:9.3f}" if isinstance(value, float) else f"{key} {value}",
                  flush=True)


if __name__ == "__main__":
    main()
