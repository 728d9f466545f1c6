"""Pieces shared by the kernels: the logit-tile recompute, soft-capping, and launch configs.

Triton's interpreter (``TRITON_INTERPRET=1``, read when Triton is imported) runs these kernels on
CPU tensors for CI. It computes bf16 arithmetic on raw bit patterns, so every kernel upcasts its
loads to fp32 before any math when ``DOT_FP32`` is set (always under the interpreter, and for
fp32/fp64-free inputs on GPUs where exactness is asked for).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def tanh(x):
    # tl has no tanh on every backend; this form saturates cleanly at +-1 for large |x|.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def logits_tile(
    e_ptr,
    c_ptr,
    rows,
    cols,
    row_mask,
    col_mask,
    d_model,
    stride_en,
    stride_ed,
    stride_cv,
    stride_cd,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """E[rows] @ C[cols].T as a (BLOCK_N, BLOCK_V) fp32 tile; rows and cols are int64 indices."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    e_row_ptrs = e_ptr + rows[:, None] * stride_en
    c_row_ptrs = c_ptr + cols[:, None] * stride_cv
    for d0 in range(0, d_model, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < d_model
        e = tl.load(
            e_row_ptrs + offs_d[None, :] * stride_ed,
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        c = tl.load(
            c_row_ptrs + offs_d[None, :] * stride_cd,
            mask=col_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if DOT_FP32:
            e = e.to(tl.float32)
            c = c.to(tl.float32)
        acc = tl.dot(e, tl.trans(c), acc, input_precision=DOT_PRECISION)
    return acc


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_v: int
    block_d: int
    num_warps: int
    num_stages: int
    group: int = 8


def dot_settings(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_FP32, DOT_PRECISION) for inputs of ``dtype``.

    16-bit inputs go to the tensor cores as they are (fp32 accumulation). fp32 inputs use tf32
    only where torch itself would (``torch.backends.cuda.matmul.allow_tf32``), else full fp32.
    """
    if INTERPRET:
        return True, "ieee"
    if dtype in (torch.bfloat16, torch.float16):
        return False, "tf32"
    return True, "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def gpu_family(device: torch.device) -> str:
    if device.type != "cuda":
        return "interpreter"
    major, _ = torch.cuda.get_device_capability(device)
    if major == 9:
        return "hopper"
    if major >= 10:
        return "blackwell"
    return "ampere"
