"""Pieces shared by the kernels: the logit-tile recompute, soft-capping, and launch configs.

Triton's interpreter (``TRITON_INTERPRET=1``, read when Triton is imported) runs these kernels on
CPU tensors for CI. It computes bf16 arithmetic on raw bit patterns, so every kernel upcasts its
loads to fp32 before any math when ``DOT_FP32`` is set (always under the interpreter, and for
fp32/fp64-free inputs on GPUs where exactness is asked for).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def tanh(x):
    # tl has no tanh on every backend; this form saturates cleanly at +-1 for large |x|.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def fold_tile(logits, run_max, run_sum_exp):
    """Fold a (rows, cols) tile of logits into each row's online max and sum of exp(z - max).

    Returns (max, sum_exp, exp(logits - shift)). Masked entries must be -inf. The rule every
    merge follows (kernels/softmax_merge.py is its torch twin): a row that has seen no
    finite logit yet, as where a -inf bias masks whole tiles, is shifted by 0 rather than by its
    max of -inf, so its sum stays exp(-inf) = 0 instead of exp(-inf - -inf) = NaN.
    """
    new_max = tl.maximum(run_max, tl.max(logits, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    scaled = tl.exp(logits - shift[:, None])
    run_sum_exp = run_sum_exp * tl.exp(run_max - shift) + tl.sum(scaled, axis=1)
    return new_max, run_sum_exp, scaled


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


@triton.jit
def logits_tile_tma(
    e_desc,
    c_desc,
    row0,
    col0,
    d_model,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``logits_tile`` for the contiguous rows ``row0:`` and columns ``col0:``, read by TMA.

    The copy engine fills positions past the tensors' edges with zeros, so no masks are needed
    here; the caller masks the tile's rows and columns.
    """
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, d_model, BLOCK_D):
        e = e_desc.load([row0, d0])
        c = c_desc.load([col0, d0])
        if DOT_FP32:
            e = e.to(tl.float32)
            c = c.to(tl.float32)
        acc = tl.dot(e, tl.trans(c), acc, input_precision=DOT_PRECISION)
    return acc


# Launcher checks: what the kernels rely on without being able to see it. A kernel reads a
# per-row or per-column vector as ``ptr + i`` and a matrix through the strides it is given, so a
# strided vector or a mismatched shape gives wrong numbers, not an error.


def check_vector(
    name: str, tensor: torch.Tensor, length: int, dtypes: tuple[torch.dtype, ...]
) -> None:
    """Raise unless ``tensor`` is a ({length},) vector of one of ``dtypes`` with unit stride."""
    if tensor.dim() != 1 or tensor.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}, got {tensor.dtype}")
    if length > 1 and tensor.stride(0) != 1:
        raise ValueError(
            f"{name} must have unit stride (the kernel reads element i at ptr + i), got stride "
            f"{tensor.stride(0)}: pass {name}.contiguous()"
        )


def check_scalar(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise unless ``tensor`` is a one-element tensor of ``dtype`` (a device-side count)."""
    if tensor.numel() != 1 or tensor.dtype != dtype:
        raise ValueError(
            f"{name} must be a one-element {dtype} tensor, got {tensor.dtype} of shape "
            f"{tuple(tensor.shape)}"
        )


def check_operands(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Raise unless hidden (N, D), weight (V, D) and bias (V,) (unit stride) fit together.

    Strides of hidden and weight are free: the kernels take them as arguments."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden (N, D) and weight (V, D) must share D, got shapes {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(
            f"weight must have hidden's dtype and device ({hidden.dtype}, {hidden.device}), got "
            f"{weight.dtype} on {weight.device}"
        )
    if bias is not None:
        check_vector("bias", bias, weight.shape[0], (hidden.dtype,))


class RowCoefficients(Protocol):
    """The logit gradient's per-row factors as the backward kernels read them, (N,) fp32 each
    (fused_lce.terms.GradCoefficients is one; the kernels take any object with these)."""

    p_coef: torch.Tensor
    target_grad: torch.Tensor
    smooth_coef: torch.Tensor | None  # None without label smoothing


ENV_TMA = "FUSED_LCE_TMA"


def tma_from_env() -> bool:
    """``FUSED_LCE_TMA``: ``0`` selects the pointer kernels; unset or anything else allows TMA."""
    return os.environ.get(ENV_TMA, "1") != "0"


def use_tma(*tensors: torch.Tensor, enabled: bool | None = None) -> bool:
    """Whether the kernels may read these 16-bit (rows, D) tensors through tensor descriptors.

    Hopper and newer GPUs have the copy engine; the interpreter emulates it, which keeps the TMA
    kernels under CI. The descriptors need a unit last stride and 16-byte aligned rows and base.
    ``enabled=False`` selects the pointer kernels (the op passes ``LCEOptions.tma``, resolved
    once when its options are built); None reads ``FUSED_LCE_TMA`` (``0``: off), for launchers
    called directly.
    """
    if enabled is None:
        enabled = tma_from_env()
    if not enabled:
        return False
    first = tensors[0]
    if first.dtype not in (torch.bfloat16, torch.float16):
        return False
    if first.device.type == "cuda":
        if torch.cuda.get_device_capability(first.device)[0] < 9:
            return False
    elif not INTERPRET:
        return False
    return all(
        t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
        and t.shape[0] > 0
        and t.shape[1] > 0
        for t in tensors
    )


def tma_descriptor(tensor: torch.Tensor, block_rows: int, block_d: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(tensor, [block_rows, block_d])


ROUND_OFF, ROUND_BF16, ROUND_FP16 = 0, 1, 2


def round_code(dtype: torch.dtype, enabled: bool) -> int:
    """The ROUND constexpr for ``round_logits``: the 16-bit input dtype, or off."""
    if not enabled:
        return ROUND_OFF
    return {torch.bfloat16: ROUND_BF16, torch.float16: ROUND_FP16}.get(dtype, ROUND_OFF)


@triton.jit
def round_logits(x, ROUND: tl.constexpr):
    """fp32 logits rounded to the 16-bit input dtype and back, as a layer that stores them.

    bf16 rounds to nearest even on the bits, which is exact on GPUs and under the interpreter
    (whose casts truncate).
    """
    if ROUND == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    if ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


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


# cuBLAS products for the host drivers: 16-bit operands, fp32 accumulation, one rounding.
