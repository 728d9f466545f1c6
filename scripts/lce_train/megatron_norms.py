"""A LayerNorm / RMSNorm for megatron-core's local layer spec that supports sequence parallelism.

Without transformer-engine or apex, megatron-core's local spec uses ``WrappedTorchNorm``, which
asserts ``not config.sequence_parallel``. The only thing a norm needs for SP is that its
parameters carry ``sequence_parallel=True``: each TP rank then sees a different slice of the
sequence, so the weight gradients differ per rank, and megatron's ``finalize_model_grads``
all-reduces the gradients of exactly those parameters over the tensor-parallel group. This module
does that and nothing else; the arithmetic is PyTorch's fused ``layer_norm`` / ``rms_norm`` in
fp32.

    spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=MegatronNorm, ...))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class MegatronNorm(torch.nn.Module):
    """``config.normalization`` ("LayerNorm" or "RMSNorm") over the last dimension.

    Built by megatron-core's ``build_module(spec, config=..., hidden_size=..., eps=...)``.

    Args:
        config: the TransformerConfig; read for ``normalization``, ``sequence_parallel``,
            ``layernorm_zero_centered_gamma`` (weight stored as ``gamma - 1``, as in Gemma) and
            ``params_dtype``.
        hidden_size: width of the normalized (last) dimension.
        eps: added to the variance.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        kind = getattr(config, "normalization", "LayerNorm")
        if kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"MegatronNorm supports LayerNorm and RMSNorm, got {kind!r}")
        self.rms = kind == "RMSNorm"
        self.eps = eps
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        dtype = getattr(config, "params_dtype", torch.float32)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        for param in self.parameters():
            # finalize_model_grads all-reduces these over the TP group when SP is on.
            param.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() + 1.0 if self.zero_centered else self.weight.float()
        shape = (x.shape[-1],)
        if self.rms:
            out = F.rms_norm(x.float(), shape, weight, self.eps)
        else:
            out = F.layer_norm(x.float(), shape, weight, self.bias.float(), self.eps)
        return out.to(x.dtype)
