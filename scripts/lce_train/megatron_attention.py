"""Core attention for megatron-core's local layer spec through torch's scaled_dot_product_attention.

Without transformer-engine, megatron-core's local spec runs ``DotProductAttention``: it builds
the (b, heads, s, s) scores, keeps their fp32 softmax for the backward and needs another fp32
buffer of that size while it runs. At sequence 4096 that is most of a layer's activations, and
it hides what the loss layer saves (docs/benchmarks/training_step.md). torch's SDPA
picks a flash or memory-efficient kernel on the GPU (the math one on the CPU), which keeps no
scores. It takes the same inputs and returns the same layout, so it drops into the spec:

    spec.submodules.self_attention.submodules.core_attention = SDPAttention

Supported: causal self-attention (the GPT case, whatever mask tensor megatron passes with it),
a padding or arbitrary boolean mask otherwise, grouped-query attention, dropout and a custom
softmax scale. Not supported (a clear error): packed sequences, an attention bias, context
parallelism. These need transformer-engine, as with megatron-core's own local attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class SDPAttention(torch.nn.Module):
    """Drop-in for megatron-core's ``DotProductAttention`` (same constructor, same forward).

    Shapes: query (sq, b, heads, hn), key and value (sk, b, groups, hn) for this TP rank;
    the result is (sq, b, heads * hn).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, **unused):
        super().__init__()
        if getattr(config, "context_parallel_size", 1) > 1:
            raise ValueError("SDPAttention has no context parallelism: use transformer-engine")
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else (
            getattr(config, "softmax_scale", None) or 1.0 / math.sqrt(head_dim)
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        if packed_seq_params is not None:
            raise ValueError("SDPAttention does not take packed sequences: use transformer-engine")
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = getattr(mask_type, "name", str(mask_type)) == "causal"
        heads, groups = query.shape[2], key.shape[2]
        if heads != groups:
            # Grouped-query attention: each key/value head serves heads / groups query heads.
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        # (s, b, heads, hn) -> (b, heads, s, hn): a view, as SDPA takes strided inputs.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None
        if not causal and attention_mask is not None:
            mask = ~attention_mask  # megatron's True means "masked out", SDPA's "attend"
        dropout = self.dropout if self.training else 0.0

        def attend():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                scale=self.softmax_scale,
            )

        if dropout > 0 and not getattr(self.config, "sequence_parallel", False):
            # As DotProductAttention: heads differ per TP rank, so their dropout masks must too.
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        sq, b = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * query.shape[3])
