"""The front door: ``linear_cross_entropy`` and the ``LinearCrossEntropy`` module.

Every argument is checked here, before any kernel runs, and then one ``LCEOptions`` travels to the
chosen implementation:

- ``"cce"``: Triton kernels (fused_lce.function), the product on GPUs;
- ``"chunked"``: pure PyTorch, vocabulary or token chunks (fused_lce.chunked), any device;
- ``"torch"``: full logits (fused_lce.reference), the oracle;
- ``"auto"``: cce on CUDA for 16/32-bit floats, chunked elsewhere.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .options import LCEOptions

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Class ids: torch's cross_entropy takes int64 and uint8; int32 (the kernels' own) and the narrow
# signed types are taken too. Everything but int32 and int64 is widened to int64 first: uint8
# compared with ignore_index=-100 would wrap around (156 == -100 in uint8).
_TARGET_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    impl: str = "auto",
    return_lse: bool = False,
    num_classes: int | None = None,
    backward: str = "auto",
    filter_eps: float | str | None = "safe",
    vocab_sort: bool = True,
    deterministic: bool = False,
    round_logits: bool = False,
    recompute_logits: bool = True,
    chunk_by: str = "vocab",
    vocab_chunk_size: int | None = None,
    token_chunk_size: int | None = None,
    scratch_mb: float | None = None,
    tma: bool | None = None,
    check_targets: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``softcap(input @ weight.T + bias)`` against ``target``, without logits.

    Equals ``F.cross_entropy(softcap_fn(input @ weight.T + bias).float(), target, ...)`` plus
    ``z_loss * logsumexp(logits)**2`` per non-ignored token (fused_lce.options has the formula).

    Args:
        input: (..., D) hidden states, float16 / bfloat16 / float32 (float64 outside cce).
        weight: (V, D) classifier, same dtype and device as ``input``.
        target: (...) class ids (int64, int32, int16, int8 or uint8), the shape of ``input``
            without its last dimension.
        bias: (V,) or None.
        ignore_index: target value that contributes no loss and no gradient.
        reduction: "mean" (over non-ignored tokens), "sum" or "none" (loss of shape ``target``).
        label_smoothing: in [0, 1], torch's convention.
        softcap: cap logits with ``softcap * tanh(x / softcap)``; None for no cap.
        z_loss: coefficient of ``lse**2`` per token.
        impl: "auto", "cce", "chunked" or "torch".
        return_lse: also return the (differentiable) per-token log-sum-exp, shape ``target``,
            fp32; 0 for ignored tokens.
        num_classes: weight rows at or past this index are vocabulary padding, not classes.
        backward: cce backward, "auto", "gemm" (gradient chunks + GEMMs) or "tiles" (fused
            tile kernel with gradient filtering and vocab sorting).
        filter_eps: tiles backward filtering: "safe" (default), "paper", a float, or None (off).
        vocab_sort: tiles backward: walk the vocabulary by mean logit so negligible tiles cluster.
        deterministic: bitwise repeatable results (cce: no order-dependent atomics).
        round_logits: cce: round each logit to the 16-bit input dtype before the softmax, as
            a layer that stores bf16 logits does (off: exact fp32 logits).
        recompute_logits: cce: False keeps the logits (as 16-bit exponentials, N x V) from the
            forward so the backward skips recomputing them: faster, at a bf16 logits tensor's
            memory.
        chunk_by: chunked impl: "vocab" or "tokens" (gradients in the forward; scalar losses).
        vocab_chunk_size, token_chunk_size: chunk sizes of the chunked impl (env overrides:
            FUSED_LCE_VOCAB_CHUNK, FUSED_LCE_TOKEN_CHUNK).
        scratch_mb: cce backward buffer budget in MiB (env FUSED_LCE_SCRATCH_MB, 512); 12
            (``fused_lce.options.LEAN_SCRATCH_MB``) is the lean mode, under 16 MiB in all.
        tma: cce: False keeps the pointer kernels rather than TMA tensor descriptors (env
            FUSED_LCE_TMA=0); None: the environment's choice, on by default.
        check_targets: raise on targets outside [0, num_classes) (costs one host sync on GPUs).

    Returns:
        The loss (fp32; fp64 for fp64 inputs), and with ``return_lse`` the pair (loss, lse).

    Per-token losses of confident tokens keep fp32's relative precision, as torch's do
    (fused_lce.terms). Any strides are accepted. With D = 0 the logits are the bias (or 0), as
    torch gives. Second-order gradients (``create_graph=True``) work with ``impl="torch"``
    only; the other backwards raise a RuntimeError saying so.
    """
    opts = LCEOptions(
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        softcap=softcap,
        z_loss=z_loss,
        num_classes=num_classes,
        backward=backward,
        filter_eps=filter_eps,
        vocab_sort=vocab_sort,
        deterministic=deterministic,
        round_logits=round_logits,
        recompute_logits=recompute_logits,
        impl=impl,
        chunk_by=chunk_by,
        vocab_chunk_size=vocab_chunk_size,
        token_chunk_size=token_chunk_size,
        scratch_mb=scratch_mb,
        tma=tma,
    )
    loss, lse = _dispatch(input, weight, target, bias, opts, check_targets)
    return (loss, lse) if return_lse else loss


class LinearCrossEntropy(nn.Module):
    """Module form of :func:`linear_cross_entropy`; holds the options, not the weight.

    ``forward(input, weight, target, bias=None)``; the keyword arguments of the constructor are
    those of :func:`linear_cross_entropy`.
    """

    def __init__(self, **options) -> None:
        super().__init__()
        self.return_lse = bool(options.pop("return_lse", False))
        self.check_targets = bool(options.pop("check_targets", True))
        self.options = LCEOptions(**options)

    def forward(
        self,
        input: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
    ):
        loss, lse = _dispatch(input, weight, target, bias, self.options, self.check_targets)
        return (loss, lse) if self.return_lse else loss

    def extra_repr(self) -> str:
        return repr(self.options)


def resolve_impl(opts: LCEOptions, device: torch.device, dtype: torch.dtype) -> str:
    if opts.impl != "auto":
        return opts.impl
    return "cce" if device.type == "cuda" and dtype in _CCE_DTYPES else "chunked"


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
    if input.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"input must be a floating-point tensor, got dtype {input.dtype}")
    if weight.dtype != input.dtype:
        raise TypeError(f"weight must have input's dtype {input.dtype}, got {weight.dtype}")
    if bias is not None and bias.dtype != input.dtype:
        raise TypeError(f"bias must have input's dtype {input.dtype}, got {bias.dtype}")
    if target.dtype not in _TARGET_DTYPES:
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
    if impl == "cce":
        _check_cce_supported(input)
    if impl == "chunked" and opts.chunk_by == "tokens" and opts.reduction == "none":
        raise ValueError(
            "chunk_by='tokens' computes gradients in the forward and needs a scalar loss: "
            "use reduction='mean' or 'sum', or chunk_by='vocab'"
        )
    if check_targets:
        check_target_range(target, opts.ignore_index, n_classes)


def check_target_range(target: torch.Tensor, ignore_index: int, n_classes: int) -> None:
    """Raise if a target other than ``ignore_index`` lies outside [0, n_classes) (a host sync)."""
    if target.numel() == 0:
        return
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

    if input.dtype not in _CCE_DTYPES:
        raise TypeError(
            f"impl='cce' supports float16, bfloat16 and float32 inputs, got {input.dtype}; "
            "use impl='chunked' or 'torch'"
        )
    if input.device.type != "cuda" and not (INTERPRET and input.device.type == "cpu"):
        raise ValueError(
            f"impl='cce' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
            f"import), got device {input.device}; use impl='chunked' on this device"
        )


def _dispatch(input, weight, target, bias, opts: LCEOptions, check_targets: bool):
    validate(input, weight, target, bias, opts, check_targets)
    batch_shape = target.shape
    # Not reshape(-1, D): with D = 0 the -1 is ambiguous.
    hidden = input.reshape(math.prod(batch_shape), input.shape[-1])
    flat_target = class_ids(target).reshape(-1)
    impl = resolve_impl(opts, input.device, input.dtype)
    if impl == "cce" and hidden.shape[0] > 0:
        from .function import cce_linear_cross_entropy

        loss, lse = cce_linear_cross_entropy(hidden, weight, flat_target, bias, opts)
    elif impl == "chunked" and hidden.shape[0] > 0:
        from .chunked import chunked_linear_cross_entropy

        loss, lse = chunked_linear_cross_entropy(hidden, weight, flat_target, bias, opts)
    else:
        from .reference import reference_linear_cross_entropy

        loss, lse = reference_linear_cross_entropy(hidden, weight, flat_target, bias, opts)
        lse = torch.where(flat_target != opts.ignore_index, lse, torch.zeros_like(lse))
    if opts.reduction == "none":
        loss = loss.reshape(batch_shape)
    return loss, lse.reshape(batch_shape)
