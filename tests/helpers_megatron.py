"""A stand-in for megatron-core's GPTModel (no megatron-core needed), shared by the adapter's
tests (tests/megatron/test_megatron_adapter.py, test_cce_flags.py) and the replayed forward's
(tests/op/test_graphs.py).

``FakeGPT`` has the two calls the adapter relies on in GPTModel._postprocess: the output layer
``(logits, bias) = output_layer(hidden, weight=...)`` and ``compute_language_model_loss(labels,
logits)`` returning the per-token loss [b, s].
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

S, B, D, V = 7, 3, 16, 50


class OutputLayer(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, D) * 0.3)
        self.bias = None
        self.sequence_parallel = False

    def forward(self, input_, weight=None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        return input_ @ weight.t(), None


class FakeGPT(nn.Module):
    def __init__(self, group, impl="cce", vocab=V, fusion=True):
        super().__init__()
        self.config = SimpleNamespace(
            cross_entropy_loss_fusion=fusion,
            cross_entropy_fusion_impl=impl,
            gradient_accumulation_fusion=False,
        )
        self.pg_collection = SimpleNamespace(tp=group)
        self.vocab_size = vocab
        self.output_layer = OutputLayer(V)
        self.logits_calls = 0

    def compute_language_model_loss(self, labels, logits):
        self.logits_calls += 1
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.t().flatten(), reduction="none")
        return loss.view(labels.t().shape).t()

    def _postprocess(self, hidden_states, labels=None):
        logits, _ = self.output_layer(hidden_states)
        if labels is None:
            return logits.transpose(0, 1)
        return self.compute_language_model_loss(labels, logits)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, D, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, S), generator=g)
    return hidden, labels


class MaskedGPT(FakeGPT):
    """A GPTModel whose _postprocess also takes the loss mask, as megatron-core's does."""

    def _postprocess(self, hidden_states, labels=None, loss_mask=None):
        return super()._postprocess(hidden_states, labels=labels)


class MaskedMTPGPT(MaskedGPT):
    """As megatron-core's with multi-token prediction: a second loss of the same hidden states
    against rolled labels (a new tensor), which its loss function weighs by a rolled mask."""

    def _postprocess(self, hidden_states, labels=None, loss_mask=None):
        logits, _ = self.output_layer(hidden_states)
        rolled = torch.roll(labels, -1, dims=-1)
        return (self.compute_language_model_loss(rolled, logits),
                super()._postprocess(hidden_states, labels=labels, loss_mask=loss_mask))
