"""Multiply a tensor in place by a scalar that lives on the device, skipping the pass when it is 1.

The gradient-in-forward backward scales its stored gradients by the upstream gradient, which is
almost always exactly 1 (``loss.backward()``). Reading it on the host would cost a sync; every
program here reads it instead and returns at once when it is 1, so the common case costs a
launch, not a read and a write of the (V, D) weight gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, num_sms, round_code, round_logits


@triton.jit
def _scale_unless_one_kernel(x_ptr, scale_ptr, n_elements, BLOCK: tl.constexpr,
                             ROUND_OUT: tl.constexpr):
    scale = tl.load(scale_ptr)
    if scale == 1.0:
        return
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n_elements, step):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < n_elements
        x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
        tl.store(x_ptr + offsets, round_logits(x * scale, ROUND_OUT).to(x_ptr.dtype.element_ty),
                 mask=mask)


def scale_unless_one_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x *= scale`` in place, with ``scale`` a one-element fp32 tensor on x's device."""
    # Check constraints.
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got strides {x.stride()} for {tuple(x.shape)}")
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != x.device:
        raise ValueError(
            f"scale must be one fp32 element on {x.device}, got {scale.dtype} of shape "
            f"{tuple(scale.shape)} on {scale.device}"
        )
    if x.numel() == 0:
        return x
    block = 1 << 16 if INTERPRET else 2048
    grid = (min(triton.cdiv(x.numel(), block), num_sms(x.device) * 8),)
    # The interpreter truncates to 16 bits where the GPU rounds: there the kernel rounds first.
    _scale_unless_one_kernel[grid](x, scale, x.numel(), BLOCK=block,
                                   ROUND_OUT=round_code(x.dtype, INTERPRET), num_warps=8)
    return x
