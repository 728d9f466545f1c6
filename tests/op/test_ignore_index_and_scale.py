"""A non-default ``ignore_index`` with ignored tokens, and a loss whose upstream gradient is not 1,
on every path: cce (each backward) under the interpreter, chunked (both ``chunk_by``), and the
vocab-parallel layer on gloo (TP=2, both impls, with and without SP).

The two bugs these catch hid from the rest of the suite, whose problems mark ignored tokens with
the default -100 and whose scalar objectives were the loss itself:
- the valid-row mask built against -100 instead of ``ignore_index``;
- a gradient computed in the forward for an upstream gradient of 1 and not scaled by the actual
  one in the backward (the bias gradient, once).

Every case compares the loss and the gradients of input, weight and bias with
``torch.nn.functional.cross_entropy`` on float64 logits, under the same objective: ``3 * loss``
for "mean" and "sum"; for "none" either ``3 * loss.sum()`` (a multiple of the mask the cce
forward assumes, so its stored gradients are scaled) or a random weight per token (they are
recomputed). Sizes are odd, so no chunk or block divides them.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_rel
from helpers_lce import IGNORE_INDEX, make_problem
from helpers_parallel import run_on_ranks

from fused_lce import linear_cross_entropy

pytestmark = pytest.mark.filterwarnings("ignore:.*the gradients are recomputed exactly")

N, V, D = 45, 97, 23
TOL = 1e-5  # relative, fp32 against fp64
SCALE = 3.0

# (ignore_index, reduction, upstream): 7 is a class id (its tokens are ignored too), -1 is not.
CASES = [
    (7, "mean", "scaled"),
    (-1, "sum", "scaled"),
    (7, "none", "scaled"),
    (-1, "none", "random"),
]
CASE_IDS = [f"ignore{i}-{r}-{u}" for i, r, u in CASES]

# chunk sizes that split 45 tokens and 97 classes unevenly
PATHS = {
    "cce-forward": dict(impl="cce"),
    "cce-forward-chunks": dict(impl="cce", token_chunk_size=16),
    "cce-gemm": dict(impl="cce", backward="gemm"),
    "cce-tiles": dict(impl="cce", backward="tiles"),
    "chunked-vocab": dict(impl="chunked", chunk_by="vocab", vocab_chunk_size=32),
    "chunked-tokens": dict(impl="chunked", chunk_by="tokens", token_chunk_size=16),
}


def problem(ignore_index: int, seed: int, n=N, num_classes=None):
    """A peaked problem with a bias and a fifth of the tokens marked ``ignore_index``; targets
    below ``num_classes`` (default: every row)."""
    hidden, weight, target, bias = make_problem(n, V, D, torch.float32, ignore_frac=0.2,
                                                bias=True, seed=seed, num_classes=num_classes)
    target = target.masked_fill(target == IGNORE_INDEX, ignore_index)
    return hidden, weight, target, bias


def token_mask(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A 0/1 float mask, about 70% ones (Megatron's loss mask)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return (torch.rand(shape, generator=gen, dtype=torch.float64) < 0.7).double()


def objective(loss: torch.Tensor, upstream: str, seed: int, lse=None) -> torch.Tensor:
    """3 * loss; for "none" a sum weighted by 3, by 3 * token_mask ("masked") or by a random
    weight per token ("random"); plus the lse with random weights, when given."""
    gen = torch.Generator().manual_seed(seed)
    if upstream == "scaled":
        total = SCALE * loss.sum()
    elif upstream == "masked":
        total = SCALE * (loss * token_mask(tuple(loss.shape), seed).to(loss.dtype)).sum()
    else:
        weights = 0.5 + torch.rand(loss.shape, generator=gen, dtype=torch.float64)
        total = (loss * weights.to(loss.dtype)).sum()
    if lse is not None:
        total = total + (lse * torch.randn(lse.shape, generator=gen, dtype=torch.float64)
                         .to(lse.dtype)).sum()
    return total


def fp64_oracle(hidden, weight, target, bias, ignore_index, reduction, upstream, seed,
                terms=None, with_lse=False):
    """(loss, lse, {input, weight, bias} gradients) of torch's cross-entropy on fp64 logits.

    ``terms``: softcap, label_smoothing and z_loss, written out here from their definitions
    (fused_lce/options.py) rather than taken from the package. ``with_lse``: the lse (0 on
    ignored tokens) enters the objective too.
    """
    terms = terms or {}
    h, w, b = (x.detach().double().requires_grad_() for x in (hidden, weight, bias))
    logits = h @ w.t() + b
    if terms.get("softcap"):
        logits = terms["softcap"] * torch.tanh(logits / terms["softcap"])
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=terms.get("label_smoothing", 0.0))
    valid = target != ignore_index
    lse = torch.where(valid, torch.logsumexp(logits, dim=1), 0.0)
    z_loss = terms.get("z_loss", 0.0) * lse**2
    loss = loss + {"none": z_loss, "sum": z_loss.sum(), "mean": z_loss.sum() / valid.sum()}[
        reduction]
    objective(loss, upstream, seed, lse if with_lse else None).backward()
    return loss.detach(), lse.detach(), {"input": h.grad, "weight": w.grad, "bias": b.grad}


def check_run(loss, grads, expected_loss, expected_grads, ignored, label) -> None:
    assert_close_rel(loss, expected_loss, TOL, f"{label} loss")
    for name, grad in grads.items():
        assert grad is not None, f"{label} {name}: no gradient"
        assert_close_rel(grad, expected_grads[name], TOL, f"{label} {name} grad")
    assert not torch.count_nonzero(grads["input"][ignored]), f"{label}: ignored rows' gradient"


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("ignore_index, reduction, upstream", CASES, ids=CASE_IDS)
def test_single_device_matches_torch(path, ignore_index, reduction, upstream):
    options = PATHS[path]
    seed = 11 + CASES.index((ignore_index, reduction, upstream))
    hidden, weight, target, bias = problem(ignore_index, seed)
    ignored = target == ignore_index
    assert 0 < int(ignored.sum()) < N
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    loss = linear_cross_entropy(h, w, target, b, ignore_index=ignore_index, reduction=reduction,
                                **options)
    objective(loss, upstream, seed).backward()
    expected_loss, _, expected_grads = fp64_oracle(hidden, weight, target, bias, ignore_index,
                                                   reduction, upstream, seed)
    grads = {"input": h.grad, "weight": w.grad, "bias": b.grad}
    check_run(loss, grads, expected_loss, expected_grads, ignored, path)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("wanted", ["input", "weight", "bias"])
def test_only_the_wanted_gradient(path, wanted):
    """One leaf wants a gradient: it gets torch's, the others none (a recompute backward too:
    the lse carries a gradient, where the path lets it)."""
    options = PATHS[path]
    hidden, weight, target, bias = problem(-1, 27)
    leaves = dict(input=hidden.clone(), weight=weight.clone(), bias=bias.clone())
    leaves[wanted].requires_grad_()
    loss, lse = linear_cross_entropy(leaves["input"], leaves["weight"], target, leaves["bias"],
                                     ignore_index=-1, return_lse=True, **options)
    objective(loss, "scaled", 27, lse).backward()
    _, _, expected = fp64_oracle(hidden, weight, target, bias, -1, "mean", "scaled", 27,
                                 with_lse=True)
    for name, leaf in leaves.items():
        if name == wanted:
            assert_close_rel(leaf.grad, expected[name], TOL, f"{path} {name} grad")
        else:
            assert leaf.grad is None, f"{path}: {name} got a gradient it did not ask for"


TERMS = dict(softcap=4.0, label_smoothing=0.1, z_loss=1e-3)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_every_term_and_the_lse_match_torch(path, reduction):
    """Softcap, label smoothing and z-loss together, with a gradient through the returned lse
    as well (the gradient-in-forward paths then recompute)."""
    options = PATHS[path]
    seed = 23 if reduction == "mean" else 24
    hidden, weight, target, bias = problem(7, seed)
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    loss, lse = linear_cross_entropy(h, w, target, b, ignore_index=7, reduction=reduction,
                                     return_lse=True, **TERMS, **options)
    upstream = "scaled" if reduction == "mean" else "random"
    objective(loss, upstream, seed, lse).backward()
    expected_loss, expected_lse, expected_grads = fp64_oracle(
        hidden, weight, target, bias, 7, reduction, upstream, seed, TERMS, with_lse=True)
    assert_close_rel(lse, expected_lse, TOL, f"{path} lse")
    grads = {"input": h.grad, "weight": w.grad, "bias": b.grad}
    check_run(loss, grads, expected_loss, expected_grads, target == 7, path)


# ---------------------------------------------------------------------------------------------
# The vocab-parallel layer: TP=2 on gloo, every rank against its slice of the fp64 oracle
# ---------------------------------------------------------------------------------------------

S, B = 10, 3  # 30 tokens; with SP 5 positions a rank


def _parallel_case(rank: int, world: int, impl: str, sp: bool, case: tuple, seed: int,
                   terms: dict | None = None, vocab_size: int | None = None,
                   accumulate: bool = False) -> None:
    """One call on this rank against its slice of the oracle; with ``terms`` the lse is
    returned and enters the objective. ``vocab_size``: rows past it are vocabulary padding. An
    ignore_index of -100 is left to the layer's default; an upstream "masked" passes its mask
    as ``loss_mask``. ``accumulate``: the weight gradient goes into a filled
    ``weight_grad_accumulator`` (Megatron's main_grad) and the bias is frozen."""
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    ignore_index, reduction, upstream = case
    hidden, weight, target, bias = problem(ignore_index, seed, n=S * B, num_classes=vocab_size)
    hidden, target = hidden.reshape(S, B, D), target.reshape(S, B)
    lo, hi = rank * V // world, (rank + 1) * V // world  # 48 and 49 rows
    s_lo, s_hi = (rank * S // world, (rank + 1) * S // world) if sp else (0, S)
    h = hidden[s_lo:s_hi].clone().requires_grad_()
    w = weight[lo:hi].clone().requires_grad_()
    b = bias[lo:hi].clone().requires_grad_(not accumulate)  # a frozen bias beside main_grad
    options = dict(terms or {}, vocab_size=vocab_size)
    if ignore_index != -100:
        options["ignore_index"] = ignore_index
    if upstream == "masked":
        options["loss_mask"] = token_mask((S, B), seed).float()
    before = torch.randn(w.shape, generator=torch.Generator().manual_seed(seed))
    if accumulate:
        options["weight_grad_accumulator"] = before.clone()
    loss, lse = vocab_parallel_linear_cross_entropy(
        h, w, target, b, sequence_parallel=sp, impl=impl, reduction=reduction, return_lse=True,
        **options)
    objective(loss, upstream, seed, lse.reshape(-1) if terms else None).backward()
    classes = vocab_size or V
    flat = (hidden.reshape(-1, D), weight[:classes], target.reshape(-1), bias[:classes])
    expected_loss, expected_lse, full = fp64_oracle(*flat, ignore_index, reduction, upstream,
                                                    seed, terms, with_lse=bool(terms))
    for name in ("weight", "bias"):  # padding rows: zero gradient
        full[name] = torch.cat([full[name], full[name].new_zeros((V - classes,
                                                                  *full[name].shape[1:]))])
    label = f"tp={world} rank={rank} {impl} sp={sp} {case}{' terms' if terms else ''}"
    assert_close_rel(lse.reshape(-1), expected_lse, TOL, f"{label} lse")
    expected = {"input": full["input"].reshape(S, B, D)[s_lo:s_hi], "weight": full["weight"][lo:hi],
                "bias": full["bias"][lo:hi]}
    grads = {"input": h.grad, "weight": w.grad, "bias": b.grad}
    if accumulate:
        assert w.grad is None and b.grad is None, f"{label}: a .grad besides the accumulator"
        grads["weight"] = options["weight_grad_accumulator"] - before
        del grads["bias"]
    check_run(loss, grads, expected_loss.reshape(loss.shape), expected,
              target[s_lo:s_hi] == ignore_index, label)


def _partial_sums_in_fp32(rank: int, world: int) -> list[str]:
    """16-bit inputs: the ranks' partial input gradients are summed in fp32, as the collective
    budget in parallel/vocab_parallel.py says (in bf16 the sum of partials that cancel would
    keep only their rounding)."""
    from fused_lce.parallel import comm, vocab_parallel_linear_cross_entropy

    seen, original = [], comm.GroupReducer.reduce_input_grad

    def spy(self, d_hidden):
        seen.append(d_hidden.dtype)
        return original(self, d_hidden)

    comm.GroupReducer.reduce_input_grad = spy
    try:
        hidden, weight, target, bias = problem(7, 44, n=S * B)
        lo, hi = rank * V // world, (rank + 1) * V // world
        for impl in ("cce", "chunked"):
            for backward in ("auto", "gemm"):
                if impl == "chunked" and backward != "auto":
                    continue
                h = hidden.reshape(S, B, D).bfloat16().requires_grad_()
                loss = vocab_parallel_linear_cross_entropy(
                    h, weight[lo:hi].bfloat16(), target.reshape(S, B), impl=impl,
                    backward=backward, ignore_index=7)
                loss.backward()
    finally:
        comm.GroupReducer.reduce_input_grad = original
    if seen != [torch.float32] * 3:
        return [f"rank={rank}: partial input gradients summed in {seen}, expected 3 x fp32"]
    return []


def _parallel_suite(rank: int, world: int) -> list[str]:
    calls = [dict(impl=impl, sp=sp, case=case, seed=seed) for impl in ("cce", "chunked")
             for sp in (False, True) for seed, case in enumerate(CASES, start=31)]
    for impl in ("cce", "chunked"):
        calls += [
            # every term, the lse in the objective (the recompute backward), main_grad
            dict(impl=impl, sp=True, case=(7, "none", "random"), seed=41, terms=TERMS,
                 accumulate=True),
            # the default ignore_index, and 7 rows of vocabulary padding on rank 1
            dict(impl=impl, sp=False, case=(-100, "mean", "scaled"), seed=42, vocab_size=V - 7),
            # Megatron's masked sum, its mask passed as loss_mask
            dict(impl=impl, sp=True, case=(-1, "none", "masked"), seed=43),
        ]
    errors = []
    for call in calls:
        try:
            _parallel_case(rank, world, **call)
        except AssertionError as exc:
            errors.append(str(exc))
        except Exception:
            # The ranks may be out of step in their collectives now: stop here.
            errors.append(f"rank={rank} {call} raised:\n" + traceback.format_exc())
            return errors
    return errors + _partial_sums_in_fp32(rank, world)


def test_vocab_parallel_matches_torch(tmp_path):
    run_on_ranks(2, _parallel_suite, out_dir=tmp_path, interpret=True)
