"""The training forward replayed from its own CUDA graph (fused_lce/graphs.py) gives what the
eager forward gives, on one GPU and over NCCL at TP2 and TP4 with and without SP.

Two copies of each problem (same weights) run side by side on the same fresh data each step, one
with ``cuda_graphs=True`` (the default: step 1 eager, step 2 captures, later steps replay) and one
with ``cuda_graphs=False``; their losses and every gradient must agree to the last bit where the
kernels are deterministic, and within a few units in the last place otherwise. The steps also
exercise what replays make hard:

- gradient accumulation into leaves over two steps without zeroing (a returned gradient that
  aliased the graph's memory would be rewritten by the next replay);
- two forwards in flight before their backwards (two slots) and three (the third runs eagerly);
- a loss kept from an earlier step still holding its value after later replays;
- an out-of-range target in a replay: NaN and the error, through the fault register.

Run on a GPU machine: ``python -m pytest -q tests/op/test_graph_replay.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers_parallel import run_on_ranks

import fused_lce
from fused_lce import graphs, linear_cross_entropy

N, D, V = 1000, 264, 20011  # odd sizes: no whole blocks
V_PADDED = 20016  # divisible by 2 and 4

CASES = {
    "bf16-mean": {},
    "bf16-sum-bias-softcap-zloss": dict(reduction="sum", softcap=30.0, z_loss=1e-4, bias=True),
    "bf16-smoothing-ignore": dict(label_smoothing=0.1, ignored=True),
    "bf16-none-loss-mask": dict(reduction="none", mask=True),
    "bf16-several-chunks": dict(token_chunk_size=256),
    "fp32-mean": dict(dtype=torch.float32),
    # fp16 recomputes in the backward by default (token_walk.py); its walk on request.
    "fp16-sum-in-forward": dict(dtype=torch.float16, reduction="sum", backward="in_forward"),
}
TEST_KEYS = ("dtype", "bias", "mask", "ignored")


class Twin:
    """One problem's leaves, for one of the two runs."""

    def __init__(self, weight, bias, dtype):
        self.weight = weight.detach().clone().requires_grad_()
        self.bias = None if bias is None else bias.detach().clone().requires_grad_()
        self.hidden = None
        self.dtype = dtype

    def leaves(self):
        return [x for x in (self.hidden, self.weight, self.bias) if x is not None]


def _draw(gen, device, n, dtype, case, n_classes):
    hidden = torch.randn(n, D, device=device, generator=gen, dtype=torch.float32).to(dtype)
    target = torch.randint(0, n_classes, (n,), device=device, generator=gen)
    if case.get("ignored"):
        target[torch.rand(n, device=device, generator=gen) < 0.2] = -100
    mask = ((torch.rand(n, device=device, generator=gen) > 0.3).float() if case.get("mask")
            else None)
    return hidden, target, mask


def _compare(name, what, ours, theirs, errors):
    if ours is None and theirs is None:
        return
    if torch.equal(ours, theirs):
        return
    tol = 1e-6 if ours.dtype == torch.float32 else 1e-2
    try:
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)
    except AssertionError as exc:
        errors.append(f"{name}: {what}: replay differs from eager: {exc}")


def check_case(name, case, loss_fn, rows, n_classes, device, seed) -> list[str]:
    """Steps of the two twins; the differences found. ``loss_fn(twin, hidden, target, mask,
    options)`` is the call; ``rows``: this rank's weight rows."""
    errors: list[str] = []
    options = {k: v for k, v in case.items() if k not in TEST_KEYS}
    dtype = case.get("dtype", torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight = (torch.randn(rows, D, device=device, generator=gen) * 0.05).to(dtype)
    bias = ((torch.randn(rows, device=device, generator=gen) * 0.1).to(dtype)
            if case.get("bias") else None)
    twins = {True: Twin(weight, bias, dtype), False: Twin(weight, bias, dtype)}

    def forward(twin, graphed, data):
        hidden, target, mask = data
        twin.hidden = hidden.detach().clone().requires_grad_()
        loss = loss_fn(twin, twin.hidden, target, mask, dict(options, cuda_graphs=graphed))
        objective = (loss * mask).sum() if mask is not None else loss.sum()
        return loss, objective

    def zero():
        for twin in twins.values():
            for leaf in twin.leaves():
                leaf.grad = None

    def grads(twin):
        return [twin.hidden.grad, twin.weight.grad, None if twin.bias is None else twin.bias.grad]

    def compare(step):
        for what, ours, theirs in zip(("d_hidden", "d_weight", "d_bias"), grads(twins[True]),
                                      grads(twins[False])):
            _compare(name, f"step {step} {what}", ours, theirs, errors)

    kept = None
    for step in range(5):  # eager, capture, replays; steps 3 and 4 accumulate
        if step != 4:
            zero()
        data = _draw(gen, device, N, dtype, case, n_classes)
        losses = {}
        for graphed, twin in twins.items():
            loss, objective = forward(twin, graphed, data)
            objective.backward()
            losses[graphed] = loss.detach()
        _compare(name, f"step {step} loss", losses[True], losses[False], errors)
        if step == 2:
            kept = (losses[True], losses[False].clone())
        # Step 4 adds its weight gradient to step 3's: a leaf's .grad must not alias a slot.
        compare(step)
    _compare(name, "a loss kept across replays", kept[0], kept[1], errors)

    # Three forwards in flight, then their backwards in reverse order.
    zero()
    pending = {True: [], False: []}
    for _ in range(3):
        data = _draw(gen, device, N, dtype, case, n_classes)
        for graphed, twin in twins.items():
            loss, objective = forward(twin, graphed, data)
            pending[graphed].append((loss.detach(), objective, twin.hidden))
    for i in reversed(range(3)):
        (ours, ours_obj, ours_h), (theirs, theirs_obj, theirs_h) = (pending[True][i],
                                                                    pending[False][i])
        ours_obj.backward()
        theirs_obj.backward()
        _compare(name, f"in flight {i} loss", ours, theirs, errors)
        _compare(name, f"in flight {i} d_hidden", ours_h.grad, theirs_h.grad, errors)
    compare("in flight")

    if options.get("check_targets", True):
        data = list(_draw(gen, device, N, dtype, case, n_classes))
        data[1] = data[1].clone()
        data[1][N // 3] = n_classes + 3
        loss = None
        with pytest.raises(ValueError, match=f"target holds class {n_classes + 3}"):
            loss, objective = forward(twins[True], True, data)
            fused_lce.raise_deferred_errors()
        if loss is not None and not bool(loss.isnan().all()):
            errors.append(f"{name}: a replayed bad target's loss is not NaN")
    fused_lce.raise_deferred_errors()
    return errors


def _single_loss(twin, hidden, target, mask, options):
    return linear_cross_entropy(hidden, twin.weight, target, twin.bias, loss_mask=mask,
                                **options)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_replayed_forward_equals_eager(name):
    graphs.clear()
    errors = check_case(name, CASES[name], _single_loss, V, V, torch.device("cuda"), len(name))
    assert not errors, "\n".join(errors)
    assert graphs._WALKS, "no forward was captured"


@pytest.mark.requires_cuda
def test_replays_make_no_sync_and_capture_only_once():
    graphs.clear()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(V, D, device="cuda", generator=gen) * 0.05).bfloat16().requires_grad_()
    for step in range(6):
        hidden, target, _ = _draw(gen, "cuda", N, torch.bfloat16, {}, V)
        hidden.requires_grad_()
        if step >= 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            linear_cross_entropy(hidden, weight, target).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    (walk,) = graphs._WALKS.values()
    assert walk.calls == 6 and len(walk.slots) == 1 and not walk.leased
    # The slot's second backward captured its graph; the later ones replayed it.
    assert len(walk.slots[0].backwards) == 1 and walk.slots[0].backward_calls == 5


def layer_suite(rank: int, world: int, sp: bool) -> list[str]:
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    group = dist.group.WORLD
    rows = V_PADDED // world

    def loss_fn(twin, hidden, target, mask, options):
        if sp:
            shard = hidden.shape[0] // world
            hidden = hidden[rank * shard:(rank + 1) * shard]
        return vocab_parallel_linear_cross_entropy(
            hidden, twin.weight, target, twin.bias, group=group, sequence_parallel=sp,
            vocab_size=V, loss_mask=mask, **options)

    errors = []
    for name, case in CASES.items():
        try:
            errors += [f"tp={world} sp={sp} rank={rank} {e}" for e in
                       check_case(name, case, loss_fn, rows, V, torch.device("cuda", rank),
                                  len(name))]
        except Exception as exc:  # the ranks may now disagree on the next collective: stop
            errors.append(f"tp={world} sp={sp} rank={rank} {name} raised: {exc!r}")
            break
    return errors


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize(
    "world", [pytest.param(2, id="tp2", marks=pytest.mark.requires_gpus(2)),
              pytest.param(4, id="tp4", marks=pytest.mark.requires_gpus(4))])
def test_replayed_layer_equals_eager_nccl(world, sp, tmp_path):
    run_on_ranks(world, layer_suite, sp, out_dir=tmp_path, backend="nccl", timeout_s=600,
                 interpret=False)
