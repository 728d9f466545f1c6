"""Pieces shared by the kernels: the logit-tile recompute, the logit epilogue (bias, rounding,
soft-capping), the logit gradient's formula, launcher checks and launch configs.

Triton's interpreter (``TRITON_INTERPRET=1``, read when Triton is imported) runs these kernels on
CPU tensors for CI. It computes bf16 arithmetic on raw bit patterns, so every kernel upcasts its
loads to fp32 before any math when ``DOT_FP32`` is set (always under the interpreter, and for
fp32/fp64-free inputs on GPUs where exactness is asked for).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def when_given(**flags: str) -> dict[str, Callable[[dict[str, Any]], bool]]:
    """``triton.heuristics`` rules that set each constexpr flag to whether its kernel argument was
    passed: ``when_given(HAS_BIAS="bias_ptr")`` compiles the bias out of a call without one.

    Bias, soft-capping and label smoothing are rare, so every kernel that knows them compiles
    them out when absent (HAS_BIAS, HAS_SOFTCAP, HAS_SMOOTHING)."""

    def rule(name: str) -> Callable[[dict[str, Any]], bool]:
        return lambda args: args[name] is not None

    return {flag: rule(name) for flag, name in flags.items()}


@triton.jit
def tanh(x):
    # tl has no tanh on every backend; this form saturates cleanly at +-1 for large |x|.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def fold_tile(logits, run_max, run_sum_exp):
    """Fold a (rows, cols) tile of logits into each row's online max and sum of exp(z - max).

    Returns (max, sum_exp, exp(logits - shift)). Masked entries must be -inf. The rule every
    merge follows (fused_lce/softmax_merge.py is its torch twin): a row that has seen no
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


def check_row_terms(
    n_rows: int, target_local: torch.Tensor, lse: torch.Tensor, coefs: RowCoefficients
) -> None:
    """What ``load_row_terms`` reads: (N,) unit-stride vectors, the target int, the rest fp32."""
    check_vector("target_local", target_local, n_rows, (torch.int32, torch.int64))
    for name, vector in (("lse", lse), ("p_coef", coefs.p_coef),
                         ("target_grad", coefs.target_grad), ("smooth_coef", coefs.smooth_coef)):
        if vector is not None:
            check_vector(name, vector, n_rows, (torch.float32,))


def check_row_vectors(
    n_rows: int,
    target_local: torch.Tensor,
    row_order: torch.Tensor,
    n_valid: torch.Tensor,
    lse: torch.Tensor,
    coefs: RowCoefficients,
) -> None:
    """The per-row inputs of the backward kernels that walk ``row_order``: the row terms, the
    order (int32) and the count of non-ignored rows (a device scalar)."""
    check_row_terms(n_rows, target_local, lse, coefs)
    check_vector("row_order", row_order, n_rows, (torch.int32,))
    check_scalar("n_valid", n_valid, torch.int32)


def use_tma(*tensors: torch.Tensor, enabled: bool = True) -> bool:
    """Whether the kernels may read these 16-bit (rows, D) tensors through tensor descriptors.

    Hopper and newer GPUs have the copy engine; the interpreter emulates it, which keeps the TMA
    kernels under CI. The descriptors need a unit last stride and 16-byte aligned rows and base.
    ``enabled=False`` selects the pointer kernels (the op passes ``LCEOptions.tma_allowed``: the
    option, or the FUSED_LCE_TMA environment variable that fused_lce/options.py reads).
    """
    if not enabled:
        return False
    first = tensors[0]
    if first.dtype not in (torch.bfloat16, torch.float16):
        return False
    if first.device.type == "cuda":
        if _cuda_device(first.device).major < 9:
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


# The logit epilogue and the logit gradient: every kernel that sees logits, whether it computes
# them (lse_forward, tiles_backward, gemm_backward) or reads them from a buffer (logit_rows), goes
# through these, so all of them apply bias, rounding and cap in the same order and differentiate
# the same numbers. fp32 throughout.


@triton.jit
def logit_epilogue(
    logits, bias_ptr, cols, col_mask, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ROUND: tl.constexpr,
):
    """(z, t) of x = round(logits) + bias[cols]: t = tanh(x / softcap), z = softcap * t.

    ``logits`` are fp32: a (rows, cols) tile, where ``cols`` (masked by ``col_mask``) index its
    columns, or a vector with one column each (a gathered target logit); the bias broadcasts
    along the last axis. t is what the gradient needs for the cap's derivative
    (``softcap_derivative``); without soft-capping z = x and t is a placeholder (x) that nothing
    reads.
    """
    logits = round_logits(logits, ROUND)
    if HAS_BIAS:
        logits += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    capped = logits
    if HAS_SOFTCAP:
        capped = tanh(logits / softcap)
        logits = softcap * capped
    return logits, capped


@triton.jit
def load_row_terms(rows, row_mask, target_ptr, lse_ptr, p_coef_ptr, target_grad_ptr,
                   smooth_coef_ptr, HAS_SMOOTHING: tl.constexpr):
    """(target, lse, p_coef, target_grad, smooth_coef) of ``rows``, what ``grad_from_prob``
    takes per row; masked rows read target -1 and zeros. Without smoothing, smooth_coef is a
    placeholder (p_coef) that the formula never reads."""
    target = tl.load(target_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    p_coef = tl.load(p_coef_ptr + rows, mask=row_mask, other=0.0)
    target_grad = tl.load(target_grad_ptr + rows, mask=row_mask, other=0.0)
    smooth_coef = p_coef
    if HAS_SMOOTHING:
        smooth_coef = tl.load(smooth_coef_ptr + rows, mask=row_mask, other=0.0)
    return target, lse, p_coef, target_grad, smooth_coef


@triton.jit
def grad_from_prob(
    prob, cols, in_tile, target, p_coef, target_grad, smooth_coef, HAS_SMOOTHING: tl.constexpr,
):
    """(G before the cap's derivative, is_target) of a (rows, cols) tile from its softmax
    ``prob`` (0 outside ``in_tile``): p_coef * prob - smooth_coef, with target_grad in place of
    the softmax term in the target's column, which ``is_target`` marks (the formula is in
    kernels/tiles_backward.py's docstring). With soft-capping the caller multiplies by
    ``softcap_derivative``."""
    is_target = (cols[None, :] == target[:, None]) & in_tile
    grad = tl.where(is_target, target_grad[:, None], p_coef[:, None] * prob)
    if HAS_SMOOTHING:
        grad -= tl.where(in_tile, smooth_coef[:, None], 0.0)
    return grad, is_target


@triton.jit
def softcap_derivative(capped):
    """dz/dx of z = softcap * tanh(x / softcap), from t = tanh(x / softcap) (``logit_epilogue``'s
    second value): 1 - t^2."""
    return 1.0 - capped * capped


@triton.jit
def grad_from_logits(
    logits, bias_ptr, cols, row_mask, col_mask, target, lse, p_coef, target_grad, smooth_coef,
    softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    ROUND: tl.constexpr,
):
    """(G, prob, is_target) of a tile from its raw fp32 logits E @ C.T: the epilogue, the
    softmax against the rows' ``lse``, ``grad_from_prob`` and the cap's derivative."""
    logits, capped = logit_epilogue(
        logits, bias_ptr, cols, col_mask, softcap, HAS_BIAS, HAS_SOFTCAP, ROUND
    )
    in_tile = row_mask[:, None] & col_mask[None, :]
    prob = tl.where(in_tile, tl.exp(logits - lse[:, None]), 0.0)
    grad, is_target = grad_from_prob(
        prob, cols, in_tile, target, p_coef, target_grad, smooth_coef, HAS_SMOOTHING
    )
    if HAS_SOFTCAP:
        grad *= softcap_derivative(capped)
    return grad, prob, is_target


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


def _cuda_device(device: torch.device):
    """The properties of a CUDA device, read once per device: every launch asks for them, and
    torch's query costs the host microseconds a call."""
    return _device_properties(torch.cuda.current_device() if device.index is None
                              else device.index)


@functools.cache
def _device_properties(index: int):
    return torch.cuda.get_device_properties(index)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _cuda_device(device).multi_processor_count


def gpu_family(device: torch.device) -> str:
    if device.type != "cuda":
        return "interpreter"
    major = _cuda_device(device).major
    if major == 9:
        return "hopper"
    if major >= 10:
        return "blackwell"
    return "ampere"


# cuBLAS products for the host drivers: 16-bit operands, fp32 accumulation, one rounding.
