"""The bookkeeping of the replayed training forward (fused_lce/graphs.py), on the CPU.

A CUDA graph cannot run here, so ``graphs.record`` is replaced by ``RecordedWalk``, which keeps
what makes a graph hard to use: its replays read the static inputs and write into the *same*
output tensors every time. Everything else is the shipped code: the keys, the eager first call,
the copies into static inputs, the slots, their leases and the use counts that keep a slot whose
gradient someone still holds from being rewritten. tests/op/test_graph_replay.py runs the same steps
with real graphs on GPUs.
"""

from __future__ import annotations

import socket

import pytest
import test_graph_replay
import torch
import torch.distributed as dist
from helpers import assert_close_rel
from helpers_megatron import MaskedGPT, _inputs
from test_graph_replay import check_case

from fused_lce import graphs, linear_cross_entropy
from fused_lce.parallel import megatron_patch


class RecordedWalk:
    """A CUDA graph's contract without CUDA: a replay runs the walk on the static inputs and
    writes the results into the outputs of the recording run. The recording runs the walk (a
    capture only records it), so the first replay, which follows it on the same inputs, does
    nothing: the backward's walk scales gradients in place and must run once per replay."""

    def __init__(self, walk, static):
        self.walk, self.static = walk, static
        self.outputs = walk(*static)
        self.recorded_run_pending = True

    def replay(self) -> None:
        if self.recorded_run_pending:
            self.recorded_run_pending = False
            return
        for kept, new in zip(graphs._tensors(self.outputs),
                             graphs._tensors(self.walk(*self.static)), strict=True):
            kept.copy_(new)


def _record(walk, static):
    recorded = RecordedWalk(walk, static)
    return recorded, recorded.outputs


@pytest.fixture
def recorded(monkeypatch):
    """Replays on the CPU: every call with ``cuda_graphs=True`` takes the graph path."""
    monkeypatch.setattr(graphs, "record", _record)
    monkeypatch.setattr(graphs, "applies", lambda device, enabled: enabled)
    graphs.clear()
    yield graphs._WALKS
    graphs.clear()


# Small enough for the Triton interpreter; still no whole blocks.
SMALL = dict(N=300, D=40)
CPU_CASES = {
    "cce-fp32-mean": dict(dtype=torch.float32, impl="cce"),
    "cce-fp32-none-loss-mask": dict(dtype=torch.float32, impl="cce", reduction="none",
                                    mask=True),
    "tokens-bf16-sum-bias-softcap": dict(impl="chunked", chunk_by="tokens", reduction="sum",
                                         softcap=30.0, bias=True, token_chunk_size=128),
    "tokens-fp32-smoothing-ignore": dict(dtype=torch.float32, impl="chunked", chunk_by="tokens",
                                         label_smoothing=0.1, ignored=True,
                                         token_chunk_size=128),
}


def _single_loss(twin, hidden, target, mask, options):
    return linear_cross_entropy(hidden, twin.weight, target, twin.bias, loss_mask=mask,
                                **options)


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_replayed_forward_equals_eager(name, recorded, monkeypatch):
    for constant, value in SMALL.items():
        monkeypatch.setattr(test_graph_replay, constant, value)
    errors = check_case(name, CPU_CASES[name], _single_loss, 1001, 1001, torch.device("cpu"),
                        seed=len(name))
    assert not errors, "\n".join(errors)
    (walk,) = recorded.values()
    # 5 steps, 3 in flight and the bad target; the third in flight found both slots leased.
    assert walk.calls == 9 and len(walk.slots) == 2


def _step(weight, bias=None, keep=None):
    hidden = torch.randn(64, 24, requires_grad=True)
    target = torch.randint(0, weight.shape[0], (64,))
    linear_cross_entropy(hidden, weight, target, bias, impl="chunked", chunk_by="tokens",
                         token_chunk_size=32).backward()
    if keep is not None:
        keep.append(hidden)
    return hidden.grad


def test_a_held_gradient_keeps_its_slot(recorded):
    """A leaf's .grad may be a view of the slot's input gradient: while it is held the slot is
    not replayed, and the held gradient keeps its values."""
    weight = torch.randn(101, 24, requires_grad=True)
    held = []
    _step(weight)  # eager
    first = _step(weight, keep=held)  # captured, replayed, its gradient held
    copy = first.clone()
    _step(weight)
    _step(weight)
    (walk,) = recorded.values()
    assert len(walk.slots) == 2 and torch.equal(first, copy)
    held.clear()
    del first
    _step(weight)
    assert len(walk.slots) == 2 and all(slot.free for slot in walk.slots)


def test_a_new_shape_or_weight_is_a_new_key(recorded):
    weight = torch.randn(101, 24, requires_grad=True)
    for _ in range(3):
        _step(weight)
    _step(torch.randn(101, 24, requires_grad=True))
    assert [w.calls for w in recorded.values()] == [3, 1]
    assert len(recorded) == 2
    for _ in range(graphs.MAX_KEYS + 1):
        _step(torch.randn(101, 24, requires_grad=True))
    assert len(recorded) == graphs.MAX_KEYS


def test_cuda_graphs_false_never_records(recorded):
    weight = torch.randn(101, 24, requires_grad=True)
    for _ in range(3):
        hidden = torch.randn(64, 24, requires_grad=True)
        linear_cross_entropy(hidden, weight, torch.randint(0, 101, (64,)), impl="chunked",
                             chunk_by="tokens", cuda_graphs=False).backward()
    assert not recorded


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group in this process, torn down after the test."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.cpu_kernels  # the adapter's default impl="cce", on CPU tensors
def test_megatron_micro_batches_replay_one_key(recorded, one_rank_group):
    """The adapter's calls, micro-batch after micro-batch with the gradient in main_grad: one
    key, one slot, gradients equal to the eager calls'."""
    main_grads = []
    for cuda_graphs in (True, False):
        torch.manual_seed(0)
        gpt = MaskedGPT(one_rank_group)
        gpt.config.gradient_accumulation_fusion = True
        weight = gpt.output_layer.weight
        weight.main_grad = torch.zeros_like(weight)
        weight.grad_added_to_main_grad = False
        megatron_patch.install(gpt, impl="cce", cuda_graphs=cuda_graphs)
        for micro_batch in range(4):
            leaf, labels = _inputs(micro_batch)
            hidden = leaf * 1.0  # as the final layer norm's output: not a leaf
            loss_mask = (torch.rand(labels.shape) > 0.2).float()
            loss = gpt._postprocess(hidden, labels=labels, loss_mask=loss_mask)
            (loss * loss_mask).sum().backward()
        main_grads.append(weight.main_grad)
    (walk,) = recorded.values()
    # Micro-batch 2 captured the slot's backward, micro-batch 3 replayed it.
    assert walk.calls == 4 and len(walk.slots) == 1 and len(walk.slots[0].backwards) == 1
    assert_close_rel(main_grads[0], main_grads[1], 0.0, "main_grad")


def test_destroying_the_group_drops_the_graphs(recorded, one_rank_group):
    """NCCL hangs destroying a communicator that a live graph captured: the graphs go first."""
    weight = torch.randn(101, 24, requires_grad=True)
    for _ in range(2):
        _step(weight)
    assert recorded
    dist.destroy_process_group()
    assert not recorded


def test_a_bad_target_in_a_replay_raises(recorded):
    weight = torch.randn(101, 24, requires_grad=True)
    for _ in range(2):
        _step(weight)
    hidden = torch.randn(64, 24, requires_grad=True)
    target = torch.randint(0, 101, (64,))
    target[7] = 105
    with pytest.raises(ValueError, match="target holds class 105"):
        linear_cross_entropy(hidden, weight, target, impl="chunked", chunk_by="tokens",
                             token_chunk_size=32)
    (walk,) = recorded.values()
    assert walk.calls == 3 and len(walk.slots) == 1
    assert all(slot.free for slot in walk.slots), "a forward that raised left its slot leased"


def test_an_unexpected_upstream_gradient_in_a_replayed_backward_raises(recorded):
    """A per-token loss weighed by something other than its loss_mask: the replayed backward
    returns NaN gradients, and the next call raises, as the eager backward does."""
    weight = torch.randn(101, 24, requires_grad=True)
    options = dict(impl="chunked", chunk_by="tokens", token_chunk_size=32, reduction="none")

    def step(weights_differ=False):
        hidden = torch.randn(64, 24, requires_grad=True)
        target = torch.randint(0, 101, (64,))
        mask = (torch.rand(64) > 0.3).float()
        loss = linear_cross_entropy(hidden, weight, target, loss_mask=mask, **options)
        weights = mask * (torch.rand(64) + 0.5) if weights_differ else mask
        (loss * weights).sum().backward()
        return hidden.grad

    for _ in range(3):
        assert torch.isfinite(step()).all()
    (walk,) = recorded.values()
    assert len(walk.slots[0].backwards) == 1, "the third backward was not captured"
    assert torch.isnan(step(weights_differ=True)).all()
    with pytest.raises(RuntimeError, match="not c \\* loss_mask"):
        step()
