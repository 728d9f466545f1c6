"""torch.compile holds the op as one node: ``fullgraph=True`` traces a model that calls it, with
static and dynamic shapes, and the compiled model's loss and gradients equal the eager model's
(fused_lce/api.py, "torch.compile: the op as one node").

``aot_eager`` runs AOTAutograd, which traces the backward through the op's backward node, without
generating code; one case goes through inductor, the default backend, where a C++ compiler is.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

import fused_lce

V, D = 203, 48  # odd: no whole blocks


class TinyHead(nn.Module):
    """The last layers of a GPT: a projection, a norm, and the loss over the vocabulary."""

    def __init__(self, **options):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.output = nn.Parameter(torch.randn(V, D) * 0.2)
        self.options = options

    def forward(self, hidden, target, loss_mask=None):
        hidden = self.norm(torch.relu(self.proj(hidden)))
        loss = fused_lce.linear_cross_entropy(hidden, self.output, target, loss_mask=loss_mask,
                                              **self.options)
        return (loss * loss_mask).sum() if loss_mask is not None else loss


class ModuleHead(TinyHead):
    """The same through ``fused_lce.LinearCrossEntropy``."""

    def __init__(self, **options):
        super().__init__()
        self.loss = fused_lce.LinearCrossEntropy(**options)

    def forward(self, hidden, target, loss_mask=None):
        hidden = self.norm(torch.relu(self.proj(hidden)))
        loss = self.loss(hidden, self.output, target, loss_mask=loss_mask)
        return (loss * loss_mask).sum() if loss_mask is not None else loss


CASES = {
    "cce-mean-softcap-zloss": dict(impl="cce", softcap=20.0, z_loss=1e-4),
    "cce-none-loss-mask": dict(impl="cce", reduction="none"),
    "cce-filter-number-smoothing": dict(impl="cce", backward="tiles", filter_eps=1e-5,
                                        label_smoothing=0.1),
    "chunked-sum-ignore": dict(impl="chunked", reduction="sum", ignore_index=-1),
    "chunked-tokens": dict(impl="chunked", chunk_by="tokens", token_chunk_size=32),
}


def _data(batch: int, seq: int, seed: int, case: dict):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, D, generator=g)
    target = torch.randint(0, V, (batch, seq), generator=g)
    if "ignore_index" in case:
        target[:, ::5] = case["ignore_index"]
    mask = ((torch.rand(batch, seq, generator=g) > 0.25).float()
            if case.get("reduction") == "none" else None)
    return hidden, target, mask


def _step(model, data):
    model.zero_grad(set_to_none=True)
    loss = model(*data)
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def _check(model_class, case: dict, dynamic: bool, backend: str):
    torch.manual_seed(0)
    eager = model_class(**case)
    compiled_model = model_class(**case)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True, dynamic=dynamic, backend=backend)
    # Two shapes: with dynamic shapes the second reuses the graph, without it recompiles.
    for seed, (batch, seq) in enumerate([(2, 37), (3, 29)]):
        data = _data(batch, seq, seed, case)
        expected = _step(eager, data)
        got = _step(compiled, data)
        for name, ours, theirs in zip(["loss", *dict(eager.named_parameters())], got, expected):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(CASES))
def test_fullgraph_compile_equals_eager(name, dynamic):
    torch._dynamo.reset()
    _check(TinyHead, CASES[name], dynamic, "aot_eager")


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_the_module_compiles_whole(dynamic):
    torch._dynamo.reset()
    _check(ModuleHead, CASES["cce-mean-softcap-zloss"], dynamic, "aot_eager")


def test_the_op_is_one_node_of_one_graph():
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = TinyHead(impl="chunked")
    torch.compile(model, fullgraph=True, backend=backend)(*_data(2, 37, 0, {})[:2]).backward()
    (graph,) = graphs
    calls = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.fused_lce.loss) == 1, calls


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU backend needs a C++ compiler")
def test_inductor_compiles_the_head():
    torch._dynamo.reset()
    _check(TinyHead, CASES["cce-none-loss-mask"], False, "inductor")


def test_bad_options_are_refused_when_the_compiled_call_runs():
    torch._dynamo.reset()
    model = TinyHead(impl="chunked", reduction="median")
    with pytest.raises(ValueError, match="reduction must be one of"):
        torch.compile(model, fullgraph=True, backend="aot_eager")(*_data(2, 37, 0, {})[:2])
