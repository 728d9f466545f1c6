"""A masked vocabulary: classes forbidden by a -inf bias, on every impl and path.

torch's ``F.cross_entropy(x @ w.T + b, t)`` is finite with finite gradients when some classes
have a -inf bias and the targets lie among the others. Every online softmax here merges partial
statistics (tiles, vocabulary chunks, kernel splits, ranks); a partial whose logits are all -inf
has max -inf, and the naive merge gives exp(-inf - -inf) = NaN. These tests mask blocks at the
start, in the middle and at the end of odd-sized vocabularies, wider than a tile, a chunk and a
split, and compare with float64 torch. A row whose every class is masked gives what torch gives.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers_parallel import run_on_ranks

from fused_lce import linear_cross_entropy
from fused_lce.kernels import lse_forward as lse_forward_module
from fused_lce.kernels.common import INTERPRET

N, V, D = 37, 701, 24
# The Triton paths run under the interpreter on CPU tensors, or on a GPU where there is one.
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"

PATHS = {
    "default": dict(impl="cce"),
    "gemm": dict(impl="cce", backward="gemm"),
    "lean": dict(impl="cce", backward="gemm", scratch_mb=12),
    "kept": dict(impl="cce", backward="gemm", keep_logits=True),
    "tiles": dict(impl="cce", backward="tiles"),
    "chunked-vocab": dict(impl="chunked", vocab_chunk_size=128),
    "chunked-tokens": dict(impl="chunked", chunk_by="tokens", token_chunk_size=8),
}

# Masked classes: wider than the interpreter's 128-column tile and the chunks above.
MASKS = {"start": slice(0, 300), "middle": slice(200, 520), "end": slice(430, V)}


def masked_problem(mask: slice, seed: int, regime: str = "peaked"):
    generator = torch.Generator().manual_seed(seed)
    scale = 1.0 if regime == "peaked" else 0.05  # peaked or near-uniform softmax
    hidden = torch.randn(N, D, generator=generator)
    weight = torch.randn(V, D, generator=generator) * scale
    bias = torch.randn(V, generator=generator) * 0.1
    bias[mask] = float("-inf")
    allowed = torch.isfinite(bias).nonzero().squeeze(1)
    target = allowed[torch.randint(len(allowed), (N,), generator=generator)]
    return hidden, weight, bias, target


def reference(hidden, weight, bias, target, *, softcap=None, upstream=None, **options):
    """(loss, d_hidden, d_weight, d_bias) by float64 torch."""
    inputs = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    logits = inputs[0] @ inputs[1].T + inputs[2]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, target, **options)
    (loss if upstream is None else (loss * upstream.double()).sum()).backward()
    return (loss.detach(), *(t.grad for t in inputs))


def ours(hidden, weight, bias, target, path, *, train=True, upstream=None, **options):
    """(loss, d_hidden, d_weight, d_bias) on DEVICE, returned on the CPU."""
    inputs = [t.to(DEVICE, copy=True).requires_grad_(train) for t in (hidden, weight, bias)]
    with torch.set_grad_enabled(train):
        loss = linear_cross_entropy(inputs[0], inputs[1], target.to(DEVICE), inputs[2],
                                    **PATHS[path], **options)
    if not train:
        return (loss.detach().cpu(), None, None, None)
    (loss if upstream is None else (loss * upstream.to(DEVICE)).sum()).backward()
    return (loss.detach().cpu(), *(t.grad.cpu() for t in inputs))


def assert_matches(actual, expected, tol=2e-4):
    names = ("loss", "d_hidden", "d_weight", "d_bias")
    for name, a, e in zip(names, actual, expected):
        if a is None:
            continue
        assert torch.isfinite(a).all(), f"{name} is not finite"
        err = (a.double() - e).abs().max().item()
        assert err <= tol * max(1.0, e.abs().max().item()), f"{name}: max error {err:.3g}"


@pytest.mark.parametrize("softcap", [None, 20.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("where", list(MASKS))
@pytest.mark.parametrize("path", list(PATHS))
def test_masked_classes_train_and_evaluate_like_torch(path, where, softcap):
    problem = masked_problem(MASKS[where], seed=len(path) * 7 + len(where))
    expected = reference(*problem, softcap=softcap)
    assert_matches(ours(*problem, path, softcap=softcap), expected)
    assert_matches(ours(*problem, path, train=False, softcap=softcap), expected)


@pytest.mark.parametrize("path", ["default", "gemm", "kept", "tiles"])
def test_masked_classes_across_several_vocabulary_splits(path, monkeypatch):
    """The forward kernel splits the vocabulary on GPUs (one split under the interpreter): force
    three, so one split sees only masked classes and the splits' merge meets a max of -inf."""
    monkeypatch.setattr(lse_forward_module, "vocab_splits", lambda *args: 3)
    problem = masked_problem(slice(0, 300), seed=3, regime="uniform")
    expected = reference(*problem)
    assert_matches(ours(*problem, path, train=False), expected)
    assert_matches(ours(*problem, path), expected)


@pytest.mark.parametrize("path", ["default", "gemm", "tiles", "chunked-vocab"])
def test_masked_classes_with_options_and_reduction_none(path):
    """z-loss, reduction 'none' with a random upstream gradient and a non-default ignore_index;
    label smoothing gives torch's +inf (the uniform term meets -inf logits), not NaN."""
    hidden, weight, bias, target = masked_problem(MASKS["middle"], seed=11)
    target[::5] = 7 if not torch.isinf(bias[7]) else 0
    ignore = int(target[0])
    upstream = torch.rand(N, generator=torch.Generator().manual_seed(2)) + 0.5
    # torch's z-loss is not an option of F.cross_entropy: check it by difference below.
    expected = reference(hidden, weight, bias, target, upstream=upstream, reduction="none",
                         ignore_index=ignore)
    actual = ours(hidden, weight, bias, target, path, upstream=upstream, reduction="none",
                  ignore_index=ignore)
    assert_matches(actual, expected)
    smoothed = ours(hidden, weight, bias, target, path, train=False, label_smoothing=0.1,
                    ignore_index=ignore)[0]
    torch_smoothed = reference(hidden, weight, bias, target, label_smoothing=0.1,
                               ignore_index=ignore)[0]
    assert torch.isinf(torch_smoothed) and torch.isinf(smoothed) and smoothed > 0
    with_z = ours(hidden, weight, bias, target, path, train=False, z_loss=1e-3,
                  ignore_index=ignore)[0]
    assert torch.isfinite(with_z) and with_z > expected[0][target != ignore].mean()


@pytest.mark.parametrize("path", ["default", "gemm", "tiles", "chunked-vocab"])
def test_rows_with_every_class_masked_give_what_torch_gives(path):
    """Every class masked: torch's per-token loss is NaN (its softmax is 0 / 0), and so is ours,
    in training and evaluation, rather than a finite number."""
    hidden, weight, bias, target = masked_problem(MASKS["start"], seed=5)
    bias = torch.full_like(bias, float("-inf"))
    expected = F.cross_entropy(hidden.double() @ weight.double().T + bias.double(), target,
                               reduction="none")
    assert torch.isnan(expected).all()
    for train in (True, False):
        loss = ours(hidden, weight, bias, target, path, train=train, reduction="none",
                    upstream=torch.ones(N))[0]
        assert torch.isnan(loss).all(), f"train={train}: {loss[:4]}"


# ---------------------------------------------------------------------------------------------
# Vocab-parallel: one rank's whole shard masked
# ---------------------------------------------------------------------------------------------

TP_PATHS = ["cce-default", "cce-gemm", "cce-tiles", "chunked"]


def _masked_shard_suite(rank: int, world: int, device: str) -> list[str]:
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    errors = []
    shards = [250, 451]  # uneven; rank 0's whole shard is masked
    problem = masked_problem(slice(0, shards[0]), seed=13)
    hidden, weight, bias, target = problem
    expected = reference(*problem)
    lo = sum(shards[:rank])
    hi = lo + shards[rank]
    for name in TP_PATHS:
        impl, _, backward = name.partition("-")
        options = dict(impl=impl)
        if backward and backward != "default":
            options["backward"] = backward
        for train in (True, False):
            x = hidden.to(device, copy=True).requires_grad_(train)
            w = weight[lo:hi].to(device, copy=True).requires_grad_(train)
            b = bias[lo:hi].to(device, copy=True).requires_grad_(train)
            with torch.set_grad_enabled(train):
                loss = vocab_parallel_linear_cross_entropy(x, w, target.to(device), b, **options)
            label = f"tp={world} rank={rank} {name} {'train' if train else 'eval'}"
            grads = (None, None, None)
            if train:
                loss.backward()
                grads = (x.grad.cpu(), w.grad.cpu(), b.grad.cpu())
            wanted = (expected[0], expected[1], expected[2][lo:hi], expected[3][lo:hi])
            try:
                assert_matches((loss.detach().cpu(), *grads), wanted)
            except AssertionError as error:
                errors.append(f"{label}: {error}")
    return errors


def test_vocab_parallel_with_a_fully_masked_shard(tmp_path):
    # On a GPU machine both ranks share its GPU over gloo; elsewhere the interpreter runs them.
    device = "cuda:0" if DEVICE == "cuda" else "cpu"
    run_on_ranks(2, _masked_shard_suite, device, out_dir=tmp_path, timeout_s=300,
                 interpret=DEVICE == "cpu")


# ---------------------------------------------------------------------------------------------
# On a CUDA GPU: bf16, the GPU's tile configs and vocabulary splits. A probe shape of 512
# tokens, 50000 classes and D = 256: a -inf bias on a block at the start, in the middle or over
# the last quarter of the vocabulary, on every path, in training and evaluation, against float64
# torch on the same bf16-rounded values. On a GPU machine:
# ``python -m pytest -q tests/op/test_neg_inf_bias.py -m requires_cuda``.
# ---------------------------------------------------------------------------------------------

CUDA_N, CUDA_V, CUDA_D = 512, 50000, 256
# PATHS at the GPU's own chunk sizes.
CUDA_PATHS = {name: {k: v for k, v in options.items() if not k.endswith("_chunk_size")}
              for name, options in PATHS.items() if name != "chunked-tokens"}
CUDA_PATHS["chunked"] = CUDA_PATHS.pop("chunked-vocab")
CUDA_MASKS = {"start": slice(0, 12500), "middle": slice(20000, 30000),
              "last-quarter": slice(37500, CUDA_V)}


def _cuda_problem(mask: slice):
    generator = torch.Generator().manual_seed(mask.start + 1)
    hidden = torch.randn(CUDA_N, CUDA_D, generator=generator).bfloat16()
    weight = (torch.randn(CUDA_V, CUDA_D, generator=generator) * 0.05).bfloat16()
    bias = (torch.randn(CUDA_V, generator=generator) * 0.1).bfloat16()
    bias[mask] = float("-inf")
    allowed = torch.isfinite(bias).nonzero().squeeze(1)
    target = allowed[torch.randint(len(allowed), (CUDA_N,), generator=generator)]
    return hidden, weight, bias, target


def _cuda_reference(hidden, weight, bias, target, softcap):
    inputs = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    logits = inputs[0] @ inputs[1].T + inputs[2]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, target)
    loss.backward()
    return (loss.detach(), *(t.grad for t in inputs))


@pytest.mark.requires_cuda
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("where", list(CUDA_MASKS))
@pytest.mark.parametrize("path", list(CUDA_PATHS))
def test_masked_classes_on_the_gpu(path, where, softcap):
    hidden, weight, bias, target = _cuda_problem(CUDA_MASKS[where])
    expected = _cuda_reference(hidden, weight, bias, target, softcap)
    for train in (True, False):
        inputs = [t.cuda().requires_grad_(train) for t in (hidden, weight, bias)]
        with torch.set_grad_enabled(train):
            loss = linear_cross_entropy(inputs[0], inputs[1], target.cuda(), inputs[2],
                                        softcap=softcap, **CUDA_PATHS[path])
        assert torch.isfinite(loss), f"train={train}: loss {loss.item()}"
        assert abs(loss.item() - expected[0].item()) <= 2e-3 * abs(expected[0].item())
        if not train:
            continue
        loss.backward()
        for name, tensor, exact in zip(("d_hidden", "d_weight", "d_bias"), inputs, expected[1:]):
            grad = tensor.grad.double().cpu()
            assert torch.isfinite(grad).all(), f"{name} is not finite"
            err = ((grad - exact).norm() / exact.norm()).item()
            assert err < 2e-2, f"{name}: relative error {err:.2e}"
