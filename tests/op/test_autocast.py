"""The op under ``torch.autocast``: its GEMMs take autocast's dtype, as ``F.linear`` does, and its
statistics stay fp32, so a model with an fp32 head trains under autocast as with torch's own
layers (the call once raised "weight must have input's dtype").

Under autocast (CPU, bf16) the op with fp32 leaves equals the same op called with the leaves cast
to bf16 by hand, bitwise, its gradients arrive in fp32, and both stay close to torch's
``F.cross_entropy(F.linear(x, w).float())`` under the same autocast. A backward run inside the
autocast region gives the same gradients as one outside it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers_lce import make_problem

from fused_lce import linear_cross_entropy

N, V, D = 45, 203, 23
OPTIONS = {
    "cce": dict(impl="cce"),
    "cce-gemm": dict(impl="cce", backward="gemm"),
    "chunked-vocab": dict(impl="chunked"),
    "chunked-tokens": dict(impl="chunked", chunk_by="tokens", token_chunk_size=16),
}


def _run(hidden, weight, target, bias, options, *, autocast, backward_inside=False):
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = linear_cross_entropy(*leaves[:2], target, leaves[2], **options)
        if backward_inside:
            (2.0 * loss).backward()
    if not backward_inside:
        (2.0 * loss).backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


def _same(ours, theirs, device: str) -> None:
    """Bitwise on the CPU; on a GPU within a few of the output's roundings, where the GEMMs'
    reduction order is the library's choice from call to call."""
    if device == "cpu":
        assert torch.equal(ours, theirs)
    else:
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=1e-3 * theirs.abs().max())


DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.requires_cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", list(OPTIONS))
def test_autocast_casts_the_operands_as_a_linear_layer_does(path, device):
    hidden, weight, target, bias = (
        x.to(device) for x in make_problem(N, V, D, torch.float32, "peaked", seed=3, bias=True))
    options = OPTIONS[path]
    loss, grads = _run(hidden, weight, target, bias, options, autocast=True)
    assert loss.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    cast = [x.bfloat16() for x in (hidden, weight, bias)]
    by_hand, hand_grads = _run(*cast[:2], target, cast[2], options, autocast=False)
    _same(loss, by_hand, device)
    for ours, theirs in zip(grads, hand_grads):
        _same(ours, theirs.float(), device)
    inside, inside_grads = _run(hidden, weight, target, bias, options, autocast=True,
                                backward_inside=True)
    _same(inside, loss, device)
    for ours, theirs in zip(inside_grads, grads):
        _same(ours, theirs, device)

    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    with torch.autocast(device, dtype=torch.bfloat16):
        torch_loss = F.cross_entropy(F.linear(leaves[0], leaves[1], leaves[2]).float(), target)
    (2.0 * torch_loss).backward()
    assert abs(loss.item() - torch_loss.item()) < 1e-2 * abs(torch_loss.item())
    for ours, theirs in zip(grads, (leaf.grad for leaf in leaves)):
        assert (ours - theirs).abs().max() < 3e-2 * theirs.abs().max()


def test_autocast_leaves_float64_alone():
    hidden, weight, target, _ = make_problem(N, V, D, torch.float64, "peaked", seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, target, impl="chunked")
    assert loss.dtype == torch.float64


def test_autocast_takes_a_16_bit_hidden_state_and_an_fp32_head():
    """What an autocast model hands its head: bf16 hidden states, an fp32 weight."""
    hidden, weight, target, _ = make_problem(N, V, D, torch.float32, "peaked", seed=5)
    h, w = hidden.bfloat16().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, target, impl="chunked")
    loss.backward()
    expected = linear_cross_entropy(hidden.bfloat16(), weight.bfloat16(), target, impl="chunked")
    assert torch.equal(loss.detach(), expected)
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


def layer_suite(rank: int, world: int, device_type: str = "cpu") -> list[str]:
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    device = torch.device(device_type, rank if device_type == "cuda" else 0)
    hidden, weight, target, _ = (
        x if x is None else x.to(device)
        for x in make_problem(N, V, D, torch.float32, "peaked", seed=6))
    lo, hi = V * rank // world, V * (rank + 1) // world
    shard = weight[lo:hi]
    errors = []
    # The default impl (cce on a GPU) and the chunked one, each with and without SP.
    for impl in ("auto", "chunked"):
        for sp in (False, True):
            h_full = hidden[: N - N % world]
            t = target[: N - N % world]
            h_rank = h_full.chunk(world)[rank] if sp else h_full
            runs = []
            for autocast, h, w in ((True, h_rank, shard),
                                   (False, h_rank.bfloat16(), shard.bfloat16())):
                h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
                with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
                    loss = vocab_parallel_linear_cross_entropy(h, w, t, impl=impl,
                                                               sequence_parallel=sp)
                loss.backward()
                runs.append((loss.detach(), h.grad.float(), w.grad.float()))
            for name, ours, theirs in zip(("loss", "d_input", "d_weight"), *runs):
                try:
                    _same(ours, theirs, device_type)
                except AssertionError as exc:
                    errors.append(f"rank {rank} impl={impl} sp={sp}: {name} differs from the "
                                  f"hand-cast call: {exc}")
    return errors


def test_the_vocab_parallel_layer_follows_autocast(tmp_path):
    from helpers_parallel import run_on_ranks

    run_on_ranks(2, layer_suite, out_dir=tmp_path, timeout_s=90)


@pytest.mark.requires_gpus(2)
def test_the_vocab_parallel_layer_follows_autocast_over_nccl(tmp_path):
    from helpers_parallel import run_on_ranks

    run_on_ranks(2, layer_suite, "cuda", out_dir=tmp_path, backend="nccl", timeout_s=300,
                 interpret=False)
