"""impl="chunked" (pure PyTorch, vocabulary or token chunks) against the fp64 reference.

Chunk sizes are small (64 vocabulary columns, 32 tokens) so that every call walks several chunks
and a ragged last one: V=307 gives 4 x 64 + 51, N=150 gives 4 x 32 + 22 (fewer once ignored
tokens are dropped). The path is fast, so the grids here are broad.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_rel
from helpers_lce import (
    IGNORE_INDEX,
    compare_to_reference,
    make_problem,
    run_impl,
    run_reference_fp64,
)

from fused_lce import LinearCrossEntropy, linear_cross_entropy

N, V, D = 150, 307, 70
CHUNKS = dict(vocab_chunk_size=64, token_chunk_size=32)
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
REGIMES = ["peaked", "near-uniform"]


def _modes_and_reductions():
    for chunk_by in ("vocab", "tokens"):
        for reduction in ("mean", "sum", "none"):
            yield pytest.param(chunk_by, reduction, id=f"{chunk_by}-{reduction}")


def _dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("chunk_by, reduction", list(_modes_and_reductions()))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("regime", REGIMES)
def test_matches_reference(chunk_by, reduction, dtype, regime):
    problem = make_problem(N, V, D, dtype, regime, ignore_frac=0.1, bias=True, seed=21)
    compare_to_reference(
        *problem, impl="chunked", chunk_by=chunk_by, reduction=reduction, **CHUNKS
    )


OPTION_GROUPS = {
    "label-smoothing": dict(label_smoothing=0.1),
    "softcap": dict(softcap=5.0),
    "z-loss": dict(z_loss=1e-3),
    "everything": dict(label_smoothing=0.1, softcap=5.0, z_loss=1e-3),
}


@pytest.mark.parametrize("options", OPTION_GROUPS.values(), ids=OPTION_GROUPS.keys())
@pytest.mark.parametrize("chunk_by", ["vocab", "tokens"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("regime", REGIMES)
def test_options(options, chunk_by, dtype, bias, regime):
    reduction = "none" if chunk_by == "vocab" else "mean"
    problem = make_problem(N, V, D, dtype, regime, ignore_frac=0.1, bias=bias, seed=22)
    compare_to_reference(
        *problem, impl="chunked", chunk_by=chunk_by, reduction=reduction, **options, **CHUNKS
    )


@pytest.mark.parametrize("chunk_by, reduction", list(_modes_and_reductions()))
@pytest.mark.parametrize("ignore_frac", [0.0, 0.3], ids=["none-ignored", "some-ignored"])
def test_ignored_tokens(chunk_by, reduction, ignore_frac):
    problem = make_problem(N, V, D, torch.float32, "peaked", ignore_frac, bias=True, seed=23)
    ours, _ = compare_to_reference(
        *problem, impl="chunked", chunk_by=chunk_by, reduction=reduction, **CHUNKS
    )
    ignored = problem[2] == IGNORE_INDEX
    assert int(ignored.sum()) == round(ignore_frac * N)
    # Ignored tokens get exactly no gradient (and, per token, exactly zero loss).
    assert torch.count_nonzero(ours.grads["input"][ignored]) == 0
    if reduction == "none":
        assert torch.count_nonzero(ours.loss[ignored]) == 0


@pytest.mark.parametrize("chunk_by, reduction", list(_modes_and_reductions()))
def test_all_tokens_ignored(chunk_by, reduction):
    """Every token ignored: "mean" is NaN (as torch), "sum" is 0, the lse and every gradient 0."""
    hidden, weight, target, bias = make_problem(
        N, V, D, torch.float32, "peaked", ignore_frac=1.0, bias=True, seed=24
    )
    assert (target == IGNORE_INDEX).all()
    h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
    loss, lse = linear_cross_entropy(
        h, w, target, b, impl="chunked", chunk_by=chunk_by, reduction=reduction,
        return_lse=True, **CHUNKS,
    )
    if reduction == "mean":
        assert torch.isnan(loss)
    elif reduction == "sum":
        assert loss.item() == 0.0
    else:
        assert loss.shape == (N,) and torch.count_nonzero(loss) == 0
    assert torch.count_nonzero(lse) == 0
    loss.sum().backward()
    for name, t in (("input", h), ("weight", w), ("bias", b)):
        assert t.grad is not None, name
        assert torch.count_nonzero(t.grad) == 0, name


@pytest.mark.parametrize("chunk_by", ["vocab", "tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_num_classes_padding_rows_get_zero_grad(chunk_by, dtype):
    problem = make_problem(
        N, V, D, dtype, "peaked", ignore_frac=0.1, bias=True, seed=25, num_classes=290
    )
    reduction = "none" if chunk_by == "vocab" else "sum"
    ours, _ = compare_to_reference(
        *problem, impl="chunked", chunk_by=chunk_by, reduction=reduction, num_classes=290,
        **CHUNKS,
    )
    assert torch.count_nonzero(ours.grads["weight"][290:]) == 0
    assert torch.count_nonzero(ours.grads["bias"][290:]) == 0
    assert torch.count_nonzero(ours.grads["weight"][:290]) > 0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_return_lse_used_in_the_loss(reduction, dtype):
    """vocab mode: the lse is returned, matches fp64, and gradients flow through it."""
    problem = make_problem(N, V, D, dtype, "near-uniform", ignore_frac=0.1, bias=True, seed=26)
    ours, _ = compare_to_reference(
        *problem, impl="chunked", chunk_by="vocab", reduction=reduction, return_lse=True,
        z_loss=1e-3, label_smoothing=0.1, **CHUNKS,
    )
    assert ours.lse.shape == (N,)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_tokens_mode_lse_carries_a_gradient(reduction, walks):
    """tokens mode computes gradients in the forward for the loss; a gradient through the
    returned lse (or a per-token one for "none") makes the backward recompute exactly."""
    problem = make_problem(N, V, D, torch.float32, "peaked", ignore_frac=0.1, bias=True, seed=27)
    # "recompute": a "none" loss with no loss_mask walks only when asked to (by default it
    # takes the recomputing backward from the start).
    ours, _ = compare_to_reference(*problem, impl="chunked", chunk_by="tokens",
                                   reduction=reduction, return_lse=True,
                                   upstream_mismatch="recompute", **CHUNKS)
    assert ours.lse.shape == (N,)
    assert len(walks) == 1 and walks[0].chunk_rows == CHUNKS["token_chunk_size"]


@pytest.mark.parametrize("chunk_by", ["vocab", "tokens"])
def test_leading_batch_dims(chunk_by):
    problem = make_problem((3, 50), V, D, torch.float32, "peaked", 0.1, bias=False, seed=28)
    reduction = "none" if chunk_by == "vocab" else "mean"
    ours, _ = compare_to_reference(
        *problem, impl="chunked", chunk_by=chunk_by, reduction=reduction, **CHUNKS
    )
    assert ours.grads["input"].shape == (3, 50, D)
    if reduction == "none":
        assert ours.loss.shape == (3, 50)


@pytest.mark.parametrize("chunk_by", ["vocab", "tokens"])
def test_default_and_env_chunk_sizes(monkeypatch, chunk_by):
    """The env vars set the chunk sizes: the same chunks as the arguments, bitwise."""
    problem = make_problem(N, V, D, torch.float32, "peaked", 0.1, bias=True, seed=29)
    by_argument = run_impl(*problem, impl="chunked", chunk_by=chunk_by, **CHUNKS)
    monkeypatch.setenv("FUSED_LCE_VOCAB_CHUNK", "64")
    monkeypatch.setenv("FUSED_LCE_TOKEN_CHUNK", "32")
    by_env = run_impl(*problem, impl="chunked", chunk_by=chunk_by)
    assert torch.equal(by_argument.loss, by_env.loss)
    for name, grad in by_argument.grads.items():
        assert torch.equal(grad, by_env.grads[name]), name
    # Default sizes (one chunk each here) agree with the reference as well.
    monkeypatch.delenv("FUSED_LCE_VOCAB_CHUNK")
    monkeypatch.delenv("FUSED_LCE_TOKEN_CHUNK")
    compare_to_reference(*problem, impl="chunked", chunk_by=chunk_by)


@pytest.mark.parametrize("chunk_by", ["vocab", "tokens"])
def test_module_equals_function(chunk_by):
    hidden, weight, target, bias = make_problem(
        N, V, D, torch.float32, "peaked", 0.1, bias=True, seed=30
    )
    options = dict(
        impl="chunked", chunk_by=chunk_by, label_smoothing=0.1, softcap=5.0, z_loss=1e-3,
        return_lse=True, **CHUNKS,
    )
    module = LinearCrossEntropy(**options)
    results = []
    for fn in (module, lambda *a: linear_cross_entropy(*a, **options)):
        h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
        loss, lse = fn(h, w, target, b)
        loss.backward()
        results.append((loss, lse, h.grad, w.grad, b.grad))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    assert "chunk_by" in repr(module)


def test_no_grad_forward():
    """Under no_grad both modes give the loss without doing (or needing) the gradient work."""
    problem = make_problem(N, V, D, torch.float32, "peaked", 0.1, bias=True, seed=31)
    ref = run_reference_fp64(*problem)
    for chunk_by in ("vocab", "tokens"):
        with torch.no_grad():
            loss = linear_cross_entropy(*problem, impl="chunked", chunk_by=chunk_by, **CHUNKS)
        assert_close_rel(loss, ref.loss, 1e-5, name=f"{chunk_by} loss")
