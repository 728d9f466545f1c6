"""SDPAttention (lce_train.megatron_attention) against fp64 attention math, and as
megatron-core's core attention inside the launcher (test_launcher.py runs it at TP2 with SP)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_close_rel

from lce_train.megatron_attention import SDPAttention

SQ, B, HEADS, GROUPS, HN = 37, 2, 6, 2, 24
CAUSAL = SimpleNamespace(name="causal")
PADDING = SimpleNamespace(name="padding")


def _config(**overrides):
    fields = dict(attention_dropout=0.0, kv_channels=HN, context_parallel_size=1,
                  sequence_parallel=False)
    return SimpleNamespace(**{**fields, **overrides})


def _inputs(seed, groups=GROUPS):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(SQ, B, HEADS, HN, generator=gen)
    k = torch.randn(SQ, B, groups, HN, generator=gen) * 2  # peaked rows as well as flat ones
    v = torch.randn(SQ, B, groups, HN, generator=gen)
    return q, k, v


def _reference(q, k, v, masked_out, scale):
    """fp64 softmax(q k^T * scale) v, masked_out (b, 1 or heads, sq, sk) True = not attended."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    probs = scores.masked_fill(masked_out, float("-inf")).softmax(-1)
    out = probs @ v  # (b, heads, sq, hn)
    return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)


@pytest.mark.parametrize("groups", [GROUPS, HEADS], ids=["gqa", "mha"])
def test_causal_matches_fp64(groups):
    q, k, v = (t.requires_grad_() for t in _inputs(60, groups))
    attention = SDPAttention(_config(), layer_number=1, attn_mask_type=CAUSAL)
    # Megatron passes its causal mask along; the causal flag decides.
    causal = torch.ones(SQ, SQ, dtype=torch.bool).triu(1)
    out = attention(q, k, v, causal.expand(B, 1, SQ, SQ))
    assert out.shape == (SQ, B, HEADS * HN)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _reference(qd, kd, vd, causal.expand(B, 1, SQ, SQ), 1 / math.sqrt(HN))
    assert_close_rel(out, want, 1e-5, name="output")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(61))
    out.backward(grad)
    want.backward(grad.double())
    for name, got, ref in (("dq", q, qd), ("dk", k, kd), ("dv", v, vd)):
        assert_close_rel(got.grad, ref.grad, 1e-5, name=name)


def test_padding_mask_and_scale():
    q, k, v = _inputs(62)
    masked_out = torch.zeros(B, 1, SQ, SQ, dtype=torch.bool)
    masked_out[0, :, :, -5:] = True  # the first sequence's last 5 keys are padding
    attention = SDPAttention(_config(), layer_number=3, attn_mask_type=PADDING, softmax_scale=0.3)
    out = attention(q, k, v, masked_out)
    assert_close_rel(out, _reference(q, k, v, masked_out, 0.3), 1e-5, name="output")
    # Not the causal result: the mask type really decides.
    causal = torch.ones(SQ, SQ, dtype=torch.bool).triu(1).expand(B, 1, SQ, SQ)
    assert (out.double() - _reference(q, k, v, causal, 0.3)).abs().max() > 1e-2


def test_unsupported_inputs_are_refused():
    q, k, v = _inputs(63)
    attention = SDPAttention(_config(), layer_number=1, attn_mask_type=CAUSAL)
    with pytest.raises(ValueError, match="packed sequences"):
        attention(q, k, v, None, packed_seq_params=object())
    with pytest.raises(ValueError, match="attention bias"):
        attention(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="context parallelism"):
        SDPAttention(_config(context_parallel_size=2), layer_number=1, attn_mask_type=CAUSAL)
