"""The op's argument checks, shared by the front door (fused_lce.api) and the vocab-parallel
layer: everything here raises a TypeError/ValueError naming the argument before any kernel runs.
"""

from __future__ import annotations

import torch

from .options import LCEOptions
from .terms import refuse_function_transforms

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Class ids: torch's cross_entropy takes int64 and uint8; int32 (the kernels' own) and the narrow
# signed types are taken too. Everything but int32 and int64 is widened to int64 first: uint8
# compared with ignore_index=-100 would wrap around (156 == -100 in uint8).
TARGET_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def resolve_impl(opts: LCEOptions, device: torch.device, dtype: torch.dtype) -> str:
    if opts.impl != "auto":
        return opts.impl
    return "cce" if device.type == "cuda" and dtype in CCE_DTYPES else "chunked"


def validate(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    opts: LCEOptions,
    check_targets: bool,
) -> None:
    """Raise TypeError/ValueError naming the argument; run before anything is launched."""
    for name, value in (("input", input), ("weight", weight), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if input.dtype not in FLOAT_DTYPES:
        raise TypeError(f"input must be a floating-point tensor, got dtype {input.dtype}")
    if weight.dtype != input.dtype:
        raise TypeError(f"weight must have input's dtype {input.dtype}, got {weight.dtype}")
    if bias is not None and bias.dtype != input.dtype:
        raise TypeError(f"bias must have input's dtype {input.dtype}, got {bias.dtype}")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(
            "target must hold integer class indices (int64, int32, int16, int8 or uint8), got "
            f"dtype {target.dtype}"
        )
    if input.dim() < 1:
        raise ValueError("input must have at least one dimension (..., D), got a scalar")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (V, D), got shape {tuple(weight.shape)}")
    if input.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"input's last dimension ({input.shape[-1]}) must equal weight's second "
            f"dimension D={weight.shape[1]}"
        )
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(
            f"target must have shape {tuple(input.shape[:-1])} (input's shape without D), "
            f"got {tuple(target.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    for name, value in (("weight", weight), ("target", target), ("bias", bias)):
        if value is not None and value.device != input.device:
            raise ValueError(f"{name} is on {value.device} but input is on {input.device}")
    n_classes = weight.shape[0] if opts.num_classes is None else opts.num_classes
    if n_classes > weight.shape[0]:
        raise ValueError(
            f"num_classes ({n_classes}) must be at most weight's number of rows {weight.shape[0]}"
        )
    impl = resolve_impl(opts, input.device, input.dtype)
    if impl != "torch":
        refuse_function_transforms(f"impl={impl!r}", input, weight, target, bias)
    if impl == "cce":
        _check_cce_supported(input)
    if impl == "chunked" and input.device.type == "meta":
        raise ValueError(
            "impl='chunked' (impl='auto' off CUDA) reads the targets' values, which tensors on "
            "the meta device do not hold: use cpu or cuda tensors, or impl='torch' (on meta: "
            "shapes and dtypes only, with check_targets=False)"
        )
    if check_targets:
        check_target_range(target, opts.ignore_index, n_classes)


def autocast_on(input) -> bool:
    """Whether ``torch.autocast`` is on for ``input``'s device (a device type it knows)."""
    if not isinstance(input, torch.Tensor) or input.device.type not in ("cpu", "cuda"):
        return False
    return torch.is_autocast_enabled(input.device.type)


def autocast_operands(input, weight, bias):
    """(input, weight, bias) as ``torch.autocast`` hands a linear layer its operands: where it is
    on for the input's device, 16- and 32-bit floating tensors in its dtype (float64 and
    anything not a tensor as they are). The op's statistics stay fp32 whatever the GEMMs take."""
    if not autocast_on(input):
        return input, weight, bias
    dtype = torch.get_autocast_dtype(input.device.type)

    def cast(x):
        if isinstance(x, torch.Tensor) and x.dtype in CCE_DTYPES and x.dtype != dtype:
            return x.to(dtype)
        return x

    return cast(input), cast(weight), cast(bias)


def check_flag(name: str, value: object) -> None:
    """A switch of the call that is not an ``LCEOptions`` field (``return_lse``,
    ``check_targets``): a bool, as LCEOptions requires of its own, not anything truthy."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_loss_mask(
    loss_mask: torch.Tensor | None, target: torch.Tensor, reduction: str
) -> None:
    """``loss_mask``: None, or a float/bool tensor of ``target``'s shape and device for a
    "none" reduction."""
    if loss_mask is None:
        return
    if not isinstance(loss_mask, torch.Tensor):
        raise TypeError(f"loss_mask must be a torch.Tensor or None, got {type(loss_mask).__name__}")
    if reduction != "none":
        raise ValueError(
            f"loss_mask describes the per-token losses of reduction='none', got "
            f"reduction={reduction!r}"
        )
    if tuple(loss_mask.shape) != tuple(target.shape):
        raise ValueError(
            f"loss_mask must have target's shape {tuple(target.shape)}, got "
            f"{tuple(loss_mask.shape)}"
        )
    if not (loss_mask.dtype.is_floating_point or loss_mask.dtype == torch.bool):
        raise TypeError(f"loss_mask must be a float or bool tensor, got {loss_mask.dtype}")
    if loss_mask.device != target.device:
        raise ValueError(f"loss_mask is on {loss_mask.device} but target is on {target.device}")


def check_target_range(target: torch.Tensor, ignore_index: int, n_classes: int) -> None:
    """Raise if a target other than ``ignore_index`` lies outside [0, n_classes): a host sync,
    taken by ``impl="torch"`` (the oracle) and by ``validate``; the training path checks on the
    device instead (fused_lce/faults.py)."""
    if target.numel() == 0:
        return
    if target.device.type == "meta":
        raise ValueError(
            "check_targets=True reads the targets' values, which tensors on the meta device do "
            "not hold: pass check_targets=False"
        )
    target = class_ids(target)
    bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
    if bool(bad.any()):
        first = target[bad].flatten()[0].item()
        raise ValueError(
            f"target holds class {first}, outside [0, {n_classes}) and not ignore_index "
            f"({ignore_index})"
        )


def class_ids(target: torch.Tensor) -> torch.Tensor:
    """``target`` as int32 or int64 class ids (the narrower types widened to int64)."""
    if target.dtype in (torch.int32, torch.int64):
        return target
    return target.long()


def _check_cce_supported(input: torch.Tensor) -> None:
    from .kernels.common import INTERPRET

    if input.dtype not in CCE_DTYPES:
        raise TypeError(
            f"impl='cce' supports float16, bfloat16 and float32 inputs, got {input.dtype}; "
            "use impl='chunked' or 'torch'"
        )
    if input.device.type != "cuda" and not (INTERPRET and input.device.type == "cpu"):
        raise ValueError(
            f"impl='cce' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
            f"import), got device {input.device}; use impl='chunked' on this device"
        )
