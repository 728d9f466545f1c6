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
    # Clones: under mode="reduce-overhead" the next replay overwrites the graph's outputs.
    return [loss.detach().clone()] + [p.grad.clone() for p in model.parameters()]


def _check(model_class, case: dict, dynamic: bool | None, backend: str, *, device="cpu",
           mode: str | None = None, shapes=((2, 37), (3, 29)), tolerance=(1e-5, 1e-6)):
    torch.manual_seed(0)
    eager = model_class(**case).to(device)
    compiled_model = model_class(**case).to(device)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True, dynamic=dynamic, backend=backend,
                             mode=mode)
    # Two shapes: with dynamic shapes the second reuses the graph, without it recompiles.
    for seed, (batch, seq) in enumerate(shapes):
        data = tuple(None if x is None else x.to(device) for x in _data(batch, seq, seed, case))
        expected = _step(eager, data)
        got = _step(compiled, data)
        for name, ours, theirs in zip(["loss", *dict(eager.named_parameters())], got, expected):
            torch.testing.assert_close(ours, theirs, rtol=tolerance[0], atol=tolerance[1],
                                       msg=f"{name}, step {seed}")


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


# ---------------------------------------------------------------------------------------------
# The vocab-parallel layer compiled whole, on each rank of a group
# ---------------------------------------------------------------------------------------------

LAYER_CASES = {
    "mean": dict(),
    "none-loss-mask": dict(reduction="none"),
    "sp-softcap-zloss": dict(sequence_parallel=True, softcap=20.0, z_loss=1e-4),
    "sp-sum-ignore-smoothing": dict(sequence_parallel=True, reduction="sum", ignore_index=-1,
                                    label_smoothing=0.1),
}


class ShardedHead(nn.Module):
    """TinyHead with this rank's shard of the output weight and the vocab-parallel layer."""

    def __init__(self, rank: int, world: int, **options):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        full = torch.randn(V, D) * 0.2
        self.output = nn.Parameter(full[V * rank // world: V * (rank + 1) // world].clone())
        self.options = options

    def forward(self, hidden, target, loss_mask=None):
        from fused_lce.parallel import vocab_parallel_linear_cross_entropy

        hidden = self.norm(torch.relu(self.proj(hidden)))
        loss = vocab_parallel_linear_cross_entropy(hidden, self.output, target,
                                                   loss_mask=loss_mask, **self.options)
        return (loss * loss_mask).sum() if loss_mask is not None else loss


def _layer_data(seq: int, batch: int, seed: int, case: dict, rank: int, world: int, device):
    """(hidden, target, mask) in Megatron's [sequence, batch] layout, hidden sequence-sharded
    under SP; every rank draws the same whole tensors."""
    hidden, target, mask = _data(seq, batch, seed, case)
    if case.get("sequence_parallel"):
        hidden = hidden[seq * rank // world: seq * (rank + 1) // world]
    return tuple(None if x is None else x.to(device) for x in (hidden, target, mask))


def layer_compile_suite(rank: int, world: int, device_type: str, backend: str,
                        names: list[str]) -> list[str]:
    device = torch.device(device_type, rank if device_type == "cuda" else 0)
    errors = []
    for name in names:
        case = dict(LAYER_CASES[name])
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager = ShardedHead(rank, world, **case).to(device)
        compiled_model = ShardedHead(rank, world, **case).to(device)
        compiled_model.load_state_dict(eager.state_dict())
        compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
        for seed in range(2):
            data = _layer_data(4 * world + 2, 3, seed, case, rank, world, device)
            expected = _step(eager, data)
            got = _step(compiled, data)
            for label, ours, theirs in zip(["loss", *dict(eager.named_parameters())], got,
                                           expected):
                if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5):
                    errors.append(f"rank {rank} {name} seed {seed}: {label} differs by "
                                  f"{(ours - theirs).abs().max().item():.3g}")
    return errors


def test_the_vocab_parallel_layer_compiles_whole(tmp_path):
    from helpers_parallel import run_on_ranks

    run_on_ranks(2, layer_compile_suite, "cpu", "aot_eager", list(LAYER_CASES),
                 out_dir=tmp_path, timeout_s=300)


def test_the_layer_refuses_a_weight_grad_accumulator_under_compile(tmp_path):
    from helpers_parallel import run_on_ranks

    run_on_ranks(1, accumulator_suite, out_dir=tmp_path, timeout_s=120)


def accumulator_suite(rank: int, world: int) -> list[str]:
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    def head(hidden, weight, target, accumulator):
        return vocab_parallel_linear_cross_entropy(hidden, weight, target,
                                                   weight_grad_accumulator=accumulator)

    weight = torch.randn(V, D, requires_grad=True)
    try:
        torch.compile(head, fullgraph=True, backend="aot_eager")(
            torch.randn(5, D), weight, torch.randint(0, V, (5,)), torch.zeros(V, D))
    except Exception as exc:  # Dynamo wraps what the traced code raised
        if "weight_grad_accumulator must be None under torch.compile" in str(exc):
            return []
        return [f"raised, but not the accumulator's error: {exc!r}"]
    return ["a weight_grad_accumulator was accepted under torch.compile"]


# ---------------------------------------------------------------------------------------------
# On GPUs: inductor, CUDA graphs through mode="reduce-overhead", and TP=2 over NCCL
# ---------------------------------------------------------------------------------------------

GPU_CASES = {
    "default-mean-softcap-zloss": dict(softcap=20.0, z_loss=1e-4),
    "default-none-loss-mask": dict(reduction="none"),
    "cce-gemm-sum-ignore-smoothing": dict(backward="gemm", reduction="sum", ignore_index=-1,
                                          label_smoothing=0.1),
    "chunked-tokens": dict(impl="chunked", chunk_by="tokens", token_chunk_size=32),
}
# Inductor fuses the projection and norm its own way: fp32 roundings differ from eager's.
GPU_TOLERANCE = (1e-4, 1e-5)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_inductor_compiles_the_head_on_the_gpu(name, dynamic):
    torch._dynamo.reset()
    _check(TinyHead, GPU_CASES[name], dynamic, "inductor", device="cuda",
           tolerance=GPU_TOLERANCE)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_reduce_overhead_mode_replays_the_head_as_cuda_graphs(name):
    """mode="reduce-overhead": inductor's CUDA graphs record the op (its own graphs stand aside
    while a stream captures) and replay it on new data of the same shape."""
    torch._dynamo.reset()
    _check(TinyHead, GPU_CASES[name], False, "inductor", device="cuda", mode="reduce-overhead",
           shapes=[(2, 37)] * 5, tolerance=GPU_TOLERANCE)


@pytest.mark.requires_gpus(2)
@pytest.mark.timeout(600)
def test_the_vocab_parallel_layer_compiles_whole_over_nccl(tmp_path):
    from helpers_parallel import run_on_ranks

    run_on_ranks(2, layer_compile_suite, "cuda", "inductor", list(LAYER_CASES),
                 out_dir=tmp_path, backend="nccl", timeout_s=500, interpret=False)
