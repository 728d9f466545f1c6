"""The gradient-in-forward backward (fused_lce/token_walk.py) against the fp64 oracle.

Each case checks that the mode really ran (the token-chunk walk, or the exact recompute where the
upstream gradient is not the assumed one), then compares loss and gradients with float64 on the
CPU through ``compare_to_reference`` (bound: twice torch's own error in the same dtype). Sizes
are odd, so no chunk or block divides them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers_lce import SCALAR_UPSTREAM, compare_to_reference, make_problem, run_reference_fp64

import fused_lce
from fused_lce import engine, faults, linear_cross_entropy, token_walk, upstream
from fused_lce.options import LCEOptions
from fused_lce.shard import ForwardGradPlan
from fused_lce.token_walk import DEFAULT_CHUNK_BYTES, MIN_CHUNK_ROWS, plan_forward_gradients

N, V, D = 45, 203, 23


@pytest.fixture
def recomputes(monkeypatch) -> list[str]:
    """One entry per backward that fell back to the exact recompute."""
    calls = []
    monkeypatch.setattr(engine, "warn_recompute", lambda where: calls.append(where))
    return calls


OPTION_SETS = {
    "plain": {},
    "softcap+smoothing+z": {"softcap": 4.0, "label_smoothing": 0.1, "z_loss": 1e-3},
    "ignored": {"ignore_frac": 0.3},
    "bias": {"bias": True},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("regime", ["peaked", "near-uniform"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("options", list(OPTION_SETS), ids=list(OPTION_SETS))
@pytest.mark.parametrize("chunk", [None, 8], ids=["one-chunk", "chunks-of-8"])
def test_scalar_losses_match_fp64(dtype, regime, reduction, options, chunk, walks, recomputes):
    kw = dict(OPTION_SETS[options])
    problem_kw = {k: kw.pop(k) for k in ("ignore_frac", "bias") if k in kw}
    hidden, weight, target, bias = make_problem(N, V, D, dtype, regime, seed=3, **problem_kw)
    if chunk is not None:
        kw["token_chunk_size"] = chunk
    compare_to_reference(hidden, weight, target, bias, impl="cce", reduction=reduction, **kw)
    assert len(walks) == 1 and not recomputes
    # 45 rows in chunks of 8 is 6 chunks: the weight gradient then sums in fp32. bf16 without
    # smoothing stores exponentials (kernels/exp_logits.py), the rest logits.
    exponentials = dtype == torch.bfloat16 and "label_smoothing" not in kw
    assert walks[0] == ForwardGradPlan(N if chunk is None else 8, chunk is not None, exponentials)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_chunks_sum_the_weight_gradient_in_its_dtype(dtype, walks, recomputes):
    hidden, weight, target, bias = make_problem(N, V, D, dtype, "peaked", seed=5, bias=True)
    compare_to_reference(hidden, weight, target, bias, impl="cce", token_chunk_size=23)
    assert walks == [ForwardGradPlan(23, False, dtype == torch.bfloat16)] and not recomputes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_many_chunks_without_fp32_weight_grad_round_per_chunk(dtype, walks, recomputes):
    # Six chunks summed in the weight's dtype: one rounding a chunk, inside the bound still
    # (the bound is twice torch's own error; six bf16 roundings of a sum stay below it here).
    hidden, weight, target, bias = make_problem(N, V, D, dtype, "near-uniform", seed=6)
    compare_to_reference(hidden, weight, target, bias, impl="cce", token_chunk_size=8,
                         fp32_weight_grad=False)
    assert walks == [ForwardGradPlan(8, False, dtype == torch.bfloat16)] and not recomputes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weights", ["binary", "real"])
def test_none_with_its_loss_mask_keeps_the_forward_gradients(dtype, weights, walks, recomputes):
    """Megatron's 0/1 mask, or any per-token weights (RL advantages, importance weights) passed
    as ``loss_mask``: the forward's gradients apply, with no recompute."""
    hidden, weight, target, bias = make_problem(N, V, D, dtype, "peaked", ignore_frac=0.2, seed=7)
    mask = (torch.arange(N) % 3 != 0).to(dtype)
    if weights == "real":
        mask = mask * torch.linspace(-1.5, 2.0, N).to(dtype)
    scale = 0.37

    def megatron_objective(h, w, impl, **kw):
        loss = linear_cross_entropy(h, w, target, impl=impl, reduction="none", **kw)
        return scale * (loss.float() * mask.to(loss.device).float()).sum()

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    megatron_objective(h, w, "cce", loss_mask=mask, token_chunk_size=16).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    megatron_objective(h64, w64, "torch").backward()
    assert len(walks) == 1 and not recomputes
    bound = 2e-5 if dtype == torch.float32 else 2e-2
    for ours, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
        err = (ours.double() - ref).abs().max() / ref.abs().max()
        assert err < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("how", ["none-random-upstream", "lse-in-objective"])
def test_unexpected_upstream_gradients_are_recomputed_exactly(dtype, how, walks, recomputes):
    """A "none" loss weighted at random per token (the checked mode, "recompute"), or a
    gradient through the lse: the stored gradients do not apply, and the exact recompute runs
    instead (never a wrong result)."""
    hidden, weight, target, bias = make_problem(N, V, D, dtype, "peaked", ignore_frac=0.2,
                                                seed=11, bias=True)
    kw = ({"reduction": "none", "upstream_mismatch": "recompute"}
          if how == "none-random-upstream" else {"return_lse": True})
    compare_to_reference(hidden, weight, target, bias, impl="cce", token_chunk_size=16, **kw)
    assert len(walks) == 1 and len(recomputes) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_none_without_a_loss_mask_takes_the_recomputing_backward(dtype, walks, recomputes):
    """By default a "none" loss with no ``loss_mask`` cannot know the per-token weights its
    caller applies, so it computes no gradient in the forward: the recomputing backward is
    exact for any upstream gradient, with no verdict to read."""
    hidden, weight, target, bias = make_problem(N, V, D, dtype, "near-uniform", ignore_frac=0.2,
                                                seed=14, bias=True)
    compare_to_reference(hidden, weight, target, bias, impl="cce", reduction="none")
    assert walks == [] and recomputes == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_upstream_mismatch_nan_keeps_the_forward_gradients_where_the_mask_holds(
        dtype, walks, recomputes):
    """``upstream_mismatch="nan"`` changes nothing where the upstream gradient is c * mask: the
    same gradients as "recompute", bit for bit, no recompute, and the next call runs."""
    hidden, weight, target, _ = make_problem(N, V, D, dtype, "peaked", ignore_frac=0.2, seed=12)
    mask = (torch.arange(N) % 4 != 1).to(dtype)
    grads = {}
    for mode in ("recompute", "nan"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, target, impl="cce", reduction="none", loss_mask=mask,
                                    token_chunk_size=16, upstream_mismatch=mode)
        (0.37 * (loss * mask).sum()).backward()
        grads[mode] = (h.grad, w.grad)
    assert len(walks) == 2 and not recomputes
    for ours, theirs in zip(grads["nan"], grads["recompute"]):
        assert torch.equal(ours, theirs)
    linear_cross_entropy(hidden, weight, target, impl="cce")  # nothing was left to raise


@pytest.mark.parametrize("impl", ["cce", "chunked"])
@pytest.mark.parametrize("mode", ["nan", "auto-with-mask"])
def test_upstream_mismatch_nan_poisons_the_gradients_and_a_later_call_raises(
        impl, mode, walks, recomputes):
    """Per-token weights that are not the mask: no recompute, every gradient NaN, and the next
    call, which finds the verdict on the host (on the CPU at once), raises the error naming the
    fix, once; the calls after it run."""
    hidden, weight, target, bias = make_problem(N, V, D, torch.float32, "peaked", seed=13,
                                                bias=True)
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    extra = {"chunk_by": "tokens"} if impl == "chunked" else {}
    extra.update({"upstream_mismatch": "nan"} if mode == "nan" else {"loss_mask": torch.ones(N)})
    loss = linear_cross_entropy(h, w, target, b, impl=impl, reduction="none",
                                token_chunk_size=16, **extra)
    (loss * torch.linspace(0.5, 1.5, N)).sum().backward()
    assert not recomputes
    assert all(g.isnan().all() for g in (h.grad, w.grad, b.grad))
    with pytest.raises(RuntimeError, match="upstream_mismatch='recompute'"):
        linear_cross_entropy(hidden, weight, target, impl=impl)
    assert linear_cross_entropy(hidden, weight, target, impl=impl).isfinite()


def test_upstream_mismatch_is_checked():
    with pytest.raises(ValueError, match="upstream_mismatch must be one of"):
        LCEOptions(upstream_mismatch="ignore")


@pytest.mark.parametrize("chunk", [None, 16], ids=["one-chunk", "chunks-of-16"])
def test_rows_out_of_the_exponentials_range_are_recomputed(chunk, walks, recomputes,
                                                             monkeypatch):
    # Losses of hundreds of nats: exp(z - z_y) would overflow for those rows, so the walk stores
    # them again against their lse (repair_exponentials) and the result stays exact. The repair
    # must have had rows to repair, and none elsewhere.
    from fused_lce.kernels import exp_logits

    hidden, weight, target, _ = make_problem(N, V, D, torch.bfloat16, "near-uniform", seed=8)
    weight = (weight.float() * 4000.0).bfloat16()
    repaired = []
    original = exp_logits.repair_exponentials

    def counting(*args, **kwargs):
        out = args[6]
        before = out.clone()
        original(*args, **kwargs)
        repaired.append(not torch.equal(before, out))

    monkeypatch.setattr(exp_logits, "repair_exponentials", counting)
    kw = {} if chunk is None else {"token_chunk_size": chunk}
    compare_to_reference(hidden, weight, target, None, impl="cce", **kw)
    assert any(repaired)
    assert len(walks) == 1 and walks[0].exponentials and not recomputes


@pytest.mark.parametrize("wanted", ["input", "weight", "bias"])
def test_one_leaf_alone_gets_its_gradient_from_the_exponentials(wanted, walks):
    # Each gradient of the bf16 walk on its own: the bias's alone takes the target terms'
    # sums without a weight gradient to add them to.
    from helpers import assert_close_rel

    hidden, weight, target, bias = make_problem(N, V, D, torch.bfloat16, "peaked", seed=10,
                                                bias=True, ignore_frac=0.2)
    leaves = dict(input=hidden.clone(), weight=weight.clone(), bias=bias.clone())
    leaves[wanted].requires_grad_()
    linear_cross_entropy(leaves["input"], leaves["weight"], target, leaves["bias"], impl="cce",
                         token_chunk_size=16).backward()
    exact = dict(input=hidden.double(), weight=weight.double(), bias=bias.double())
    exact[wanted].requires_grad_()
    linear_cross_entropy(exact["input"], exact["weight"], target, exact["bias"],
                         impl="torch").backward()
    assert walks[0].exponentials
    assert_close_rel(leaves[wanted].grad, exact[wanted].grad, 1e-2, wanted)
    assert all(leaf.grad is None for name, leaf in leaves.items() if name != wanted)


def test_non_finite_input_gives_nan_as_torch_does(walks):
    hidden, weight, target, _ = make_problem(N, V, D, torch.bfloat16, "peaked", seed=9)
    hidden = hidden.clone()
    hidden[3, 2] = float("nan")
    weight.requires_grad_()
    loss = linear_cross_entropy(hidden, weight, target, impl="cce")
    assert loss.isnan()
    loss.backward()
    assert weight.grad.isnan().any() and len(walks) == 1


def test_the_recompute_warns_once_per_backward():
    hidden, weight, target, _ = make_problem(N, V, D, torch.float32, "peaked", seed=2)
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, target, impl="cce", reduction="none",
                                upstream_mismatch="recompute")
    with pytest.warns(UserWarning, match="loss_mask"):
        (loss * torch.linspace(0.5, 1.5, N)).sum().backward()


def test_an_upstream_multiple_of_the_mean_needs_no_recompute(walks, recomputes):
    hidden, weight, target, _ = make_problem(N, V, D, torch.float32, "peaked", seed=4)
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, target, impl="cce")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        (SCALAR_UPSTREAM * loss).backward()
    ref = run_reference_fp64(hidden, weight, target, None)  # of SCALAR_UPSTREAM * loss
    err = (h.grad.double() - ref.grads["input"]).abs().max() / ref.grads["input"].abs().max()
    assert err < 1e-5 and not recomputes


def test_no_gradient_wanted_walks_without_gradients(monkeypatch, walks):
    """Evaluation walks the chunks training walks (so its loss comes from the same kernels) and
    computes no gradient: not one of the gradient walks the ``walks`` fixture counts."""
    statistics_only = []
    original = token_walk.walk_token_chunks

    def spy(strategy, inputs, call, plan, needs, d_hidden_dtype, assumed):
        statistics_only.append((plan, needs, assumed is None))
        return original(strategy, inputs, call, plan, needs, d_hidden_dtype, assumed)

    monkeypatch.setattr(token_walk, "walk_token_chunks", spy)
    hidden, weight, target, _ = make_problem(N, V, D, torch.float32, "peaked", seed=1)
    with torch.no_grad():
        linear_cross_entropy(hidden.requires_grad_(), weight, target, impl="cce")
    linear_cross_entropy(hidden.detach(), weight, target, impl="cce")  # nothing wants a grad
    assert walks == []
    plan = ForwardGradPlan(N, False)
    assert statistics_only == [(plan, (False, False, False), True)] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "options",
    [{}, {"backward": "gemm"}, {"backward": "tiles"}, {"keep_logits": True},
     {"scratch_mb": 0.01}, {"token_chunk_size": 16}, {"softcap": 3.0, "label_smoothing": 0.1}],
    ids=["default", "gemm", "tiles", "kept", "lean", "chunks", "softcap-smoothing"],
)
def test_evaluation_loss_is_the_training_loss(options, dtype):
    """Train and eval compute a batch's loss with the same kernels: the same number, bitwise."""
    hidden, weight, target, bias = make_problem(N, V, D, dtype, "peaked", seed=4, bias=True)
    train = linear_cross_entropy(hidden.clone().requires_grad_(), weight.clone().requires_grad_(),
                                 target, bias, impl="cce", reduction="none", **options)
    with torch.no_grad():
        evaluation = linear_cross_entropy(hidden, weight, target, bias, impl="cce",
                                          reduction="none", **options)
    assert torch.equal(train.detach(), evaluation)


@pytest.mark.parametrize(
    "options",
    [{"backward": "gemm"}, {"backward": "tiles"}, {"keep_logits": True},
     {"scratch_mb": 0.01}],
    ids=["gemm", "tiles", "kept", "budget-below-one-chunk"],
)
def test_other_backwards_do_not_walk(options, walks):
    hidden, weight, target, _ = make_problem(N, V, D, torch.float32, "peaked", seed=1)
    compare_to_reference(hidden, weight, target, None, impl="cce", **options)
    assert walks == []


def test_loss_mask_is_checked_before_any_kernel():
    hidden, weight, target, _ = make_problem(N, V, D, torch.float32, "peaked", seed=1)
    with pytest.raises(ValueError, match="reduction='none'"):
        linear_cross_entropy(hidden, weight, target, impl="cce", loss_mask=torch.ones(N))
    with pytest.raises(ValueError, match=r"loss_mask must have target's shape \(45,\)"):
        linear_cross_entropy(hidden, weight, target, impl="cce", reduction="none",
                             loss_mask=torch.ones(N + 1))
    with pytest.raises(TypeError, match="float or bool"):
        linear_cross_entropy(hidden, weight, target, impl="cce", reduction="none",
                             loss_mask=torch.ones(N, dtype=torch.int64))


class _GPULikeRegister(faults.DeviceFaults):
    """The CPU's fault register with a host copy of its own that only ``land`` updates: a GPU
    whose copies have not reached the host yet."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.host = torch.zeros_like(self.register)

    def publish(self) -> None:
        pass

    def land(self) -> None:
        self.host.copy_(self.register)


@pytest.fixture
def gpu_like_register(monkeypatch):
    register = _GPULikeRegister()
    monkeypatch.setitem(faults._DEVICES, torch.device("cpu"), register)
    return register


@pytest.mark.parametrize("impl", ["cce", "chunked"])
@pytest.mark.parametrize("options", [{}, {"token_chunk_size": 16}, {"scratch_mb": 0.01},
                                     {"reduction": "none", "loss_mask": torch.ones(N)}],
                         ids=["default", "chunks", "lean", "none-masked"])
def test_bad_targets_poison_the_call_and_raise_once_the_verdict_arrives(
        gpu_like_register, impl, options):
    """A bad target is found on the device: that call's loss and every gradient are NaN, the
    host is not asked to wait, and the first call after the verdict reached the host raises
    naming the class; later calls run."""
    hidden, weight, target, bias = make_problem(N, V, D, torch.float32, "peaked", seed=6,
                                                bias=True)
    bad = target.clone()
    bad[N // 2] = V + 4
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    loss = linear_cross_entropy(h, w, bad, b, impl=impl, **options)
    assert loss.isnan().all()
    loss.sum().backward()
    assert all(g.isnan().all() for g in (h.grad, w.grad, b.grad))
    assert linear_cross_entropy(hidden, weight, target, impl=impl).isfinite()  # not arrived
    gpu_like_register.land()
    with pytest.raises(ValueError, match=rf"target holds class {V + 4}, outside \[0, {V}\)"):
        linear_cross_entropy(hidden, weight, target, impl=impl)
    assert linear_cross_entropy(hidden, weight, target, impl=impl).isfinite()


def test_raise_deferred_errors_reads_what_the_calls_found(gpu_like_register):
    hidden, weight, target, _ = make_problem(N, V, D, torch.float32, "peaked", seed=6)
    bad = target.clone()
    bad[3] = -7
    linear_cross_entropy(hidden, weight, bad, impl="cce")
    fused_lce.raise_deferred_errors()  # the copy has not landed: nothing to say yet
    gpu_like_register.land()
    with pytest.raises(ValueError, match="target holds class -7"):
        fused_lce.raise_deferred_errors()
    fused_lce.raise_deferred_errors()  # raised once


# --- the planner -------------------------------------------------------------------------------


def _plan(n, v=256000, d=2304, wants_weight=True, **options):
    return plan_forward_gradients(LCEOptions(**options), n, v, d, 2, wants_weight)


def test_default_plan_halves_the_tokens_within_the_byte_cap():
    assert _plan(8192) == ForwardGradPlan(4096, False)  # Gemma-2: 2 GiB holds 4194 rows
    assert _plan(8192, v=128256) == ForwardGradPlan(4096, False)
    assert DEFAULT_CHUNK_BYTES // (256000 * 2) == 4194  # rounded down to whole GEMM tiles:
    assert _plan(65536) == ForwardGradPlan(4096, True)
    assert _plan(1500) == ForwardGradPlan(1024, False)  # never under MIN_CHUNK_ROWS
    assert _plan(3000) == ForwardGradPlan(1536, False)  # half of it, up to whole tiles
    assert _plan(700) == ForwardGradPlan(700, False)


def test_explicit_budgets():
    assert _plan(8192, token_chunk_size=1000) == ForwardGradPlan(1000, True)
    # 1 GiB holds 2097 rows of V = 256000: four chunks, and the fp32 accumulator (2.2 GiB)
    # does not fit besides: the recompute backward runs.
    assert _plan(8192, scratch_mb=1024.0) is None
    assert _plan(8192, scratch_mb=1024.0, wants_weight=False) == ForwardGradPlan(2048, False)
    assert _plan(8192, scratch_mb=12.0) is None
    assert _plan(8192, scratch_mb=12.0, backward="gemm") is None
    with pytest.raises(ValueError, match="backward='in_forward' needs at least 1024 tokens"):
        _plan(8192, scratch_mb=12.0, backward="in_forward")
    assert MIN_CHUNK_ROWS == 1024


def test_without_fp32_weight_grad_a_tight_budget_keeps_the_forward_mode():
    # Phi-3.5 (V = 32064, D = 3072): 64 MiB holds 1046 rows, 1024 in whole tiles, as Liger's
    # chunk; with the fp32 accumulator (376 MiB) the budget is too small for the forward mode.
    assert _plan(8192, v=32064, d=3072, scratch_mb=64.0) is None
    assert _plan(8192, v=32064, d=3072, scratch_mb=64.0,
                 fp32_weight_grad=False) == ForwardGradPlan(1024, False)
    assert _plan(65536, fp32_weight_grad=False) == ForwardGradPlan(4096, False)
    # Below 1024 rows the recompute backward still takes over.
    assert _plan(8192, scratch_mb=12.0, fp32_weight_grad=False) is None


def test_exponentials_for_bf16_without_label_smoothing():
    def exponentials(dtype, **options):
        return plan_forward_gradients(LCEOptions(**options), 8192, 256000, 2304, 2, True,
                                      dtype).exponentials

    assert exponentials(torch.bfloat16)
    assert exponentials(torch.bfloat16, softcap=30.0, z_loss=1e-4, reduction="none")
    # fp16's range ends at exp(11): a near-uniform row of 256000 classes would overflow it.
    assert not exponentials(torch.float16, backward="in_forward")
    assert not exponentials(torch.float32)
    assert not exponentials(torch.bfloat16, label_smoothing=0.1)


def test_fp16_recomputes_in_the_backward_unless_asked_to_walk():
    """fp16's gradients need the loss scale before their cast (tests/op/test_loss_scale.py)."""
    def plan(**options):
        return plan_forward_gradients(LCEOptions(**options), 8192, 256000, 2304, 2, True,
                                      torch.float16)

    assert plan() is None
    assert plan(backward="in_forward") is not None


def test_plan_reads_the_scratch_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("FUSED_LCE_SCRATCH_MB", "12")
    assert _plan(8192) is None
    monkeypatch.delenv("FUSED_LCE_SCRATCH_MB")
    assert _plan(8192) == ForwardGradPlan(4096, False)


def test_upstream_scale():
    valid = torch.tensor([True, True, False, True])
    assumed = torch.tensor([1.0, 0.0, 0.0, 1.0])

    def scale(*args):
        c, mismatch = upstream.upstream_scale(*args)
        return None if mismatch is not None and upstream.mismatch_found(mismatch) else c

    assert scale(torch.tensor([0.5, 0.0, 7.0, 0.5]), None, assumed, valid, "none") == 0.5
    assert scale(torch.tensor([0.5, 0.1, 0.0, 0.5]), None, assumed, valid, "none") is None
    assert scale(torch.tensor([0.5, 0.0, 0.0, 0.4]), None, assumed, valid, "none") is None
    assert scale(torch.tensor(2.0), torch.zeros(4), assumed, valid, "mean") is None
    assert scale(torch.tensor(2.0), None, assumed, valid, "mean") == 2.0


def test_backward_forward_is_the_walk_and_refuses_kept_logits(walks):
    hidden, weight, target, _ = make_problem(N, V, D, torch.float32, "peaked", seed=6)
    compare_to_reference(hidden, weight, target, None, impl="cce", backward="in_forward")
    assert walks == [ForwardGradPlan(N, False)]
    with pytest.raises(ValueError, match="keep_logits=True needs backward='gemm' or 'auto'"):
        linear_cross_entropy(hidden, weight, target, impl="cce", backward="in_forward",
                             keep_logits=True)


# ---------------------------------------------------------------------------------------------
# On a CUDA GPU: for bf16 the exponentials walk (kernels/exp_logits.py), for fp32 cuBLAS logits
# and the logit_rows kernels, several token chunks with both weight-gradient accumulations, the
# Megatron-style masked "none" loss and the exact recompute, against fp64 (bound: twice torch's
# own error in the same dtype on the GPU). On a GPU machine:
# ``python -m pytest -q -s tests/op/test_forward_grad.py -m requires_cuda``.
# ---------------------------------------------------------------------------------------------

CUDA_SHAPE = (2501, 20011, 257)  # odd everywhere: no chunk, block or tile divides it


CUDA_CASES = {
    "mean": dict(),
    "sum-softcap-smoothing-z": dict(reduction="sum", softcap=20.0, label_smoothing=0.1,
                                    z_loss=1e-4),
    "two-chunks": dict(token_chunk_size=1400),
    "five-chunks-fp32-acc": dict(token_chunk_size=512),
    "five-chunks-own-dtype": dict(token_chunk_size=512, fp32_weight_grad=False),
    # A per-token loss without a mask takes the recomputing backward from the start (no walk);
    # "recompute" walks, reads the backward's verdict and recomputes: the exact fallback.
    "none-recompute": dict(reduction="none", upstream_mismatch="recompute"),
    "lse-recompute": dict(return_lse=True),
}


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("regime", ["peaked", "near-uniform"])
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_matches_fp64(dtype, regime, case, walks):
    n, v, d = CUDA_SHAPE
    hidden, weight, target, bias = make_problem(n, v, d, dtype, regime, ignore_frac=0.1,
                                                bias=True, seed=21)
    compare_to_reference(hidden, weight, target, bias, impl="cce", device="cuda",
                         **CUDA_CASES[case])
    assert len(walks) == 1


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_masked_none_loss_keeps_the_forward_gradients(dtype, walks, recwarn):
    n, v, d = CUDA_SHAPE
    hidden, weight, target, _ = make_problem(n, v, d, dtype, "peaked", seed=22)
    mask = (torch.arange(n) % 5 != 0).float()

    def objective(h, w, **kw):
        loss = linear_cross_entropy(h, w, target.to(h.device), reduction="none", **kw)
        return 0.125 * (loss.float() * mask.to(h.device)).sum()

    h = hidden.cuda().requires_grad_()
    w = weight.cuda().requires_grad_()
    objective(h, w, impl="cce", loss_mask=mask.cuda()).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    objective(h64, w64, impl="torch").backward()
    h16 = hidden.cuda().requires_grad_()
    w16 = weight.cuda().requires_grad_()
    objective(h16, w16, impl="torch").backward()
    assert len(walks) == 1 and not [w for w in recwarn if "loss_mask" in str(w.message)]
    for ours, base, ref in ((h.grad, h16.grad, h64.grad), (w.grad, w16.grad, w64.grad)):
        scale = ref.abs().max()
        err = (ours.double().cpu() - ref).abs().max() / scale
        base_err = (base.double().cpu() - ref).abs().max() / scale
        assert err <= 2 * base_err + 1e-5


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_masked_none_loss_never_syncs_with_upstream_mismatch_nan(dtype, walks):
    """Megatron's masked loss with ``upstream_mismatch="nan"`` and ``check_targets=False`` (the
    adapter's call): neither its forward nor its backward waits for the GPU. A host sync a
    micro-batch lengthened the TP4 training step (docs/benchmarks/training_step.md)."""
    n, v, d = CUDA_SHAPE
    hidden, weight, target, _ = make_problem(n, v, d, dtype, "peaked", seed=23)
    mask = (torch.arange(n) % 5 != 0).float().cuda()
    h, w, target = hidden.cuda().requires_grad_(), weight.cuda().requires_grad_(), target.cuda()
    options = dict(impl="cce", reduction="none", loss_mask=mask, check_targets=False,
                   upstream_mismatch="nan")
    (linear_cross_entropy(h, w, target, **options) * mask).sum().backward()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = linear_cross_entropy(h, w, target, **options)
        (0.25 * (loss * mask).sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(walks) == 2 and h.grad.isfinite().all()


@pytest.mark.requires_cuda
def test_masked_none_loss_steps_never_wait_for_the_gpu(walks):
    """The adapter's call, two steps queued behind a long sleep kernel: the host finishes them
    while the GPU still sleeps, so neither waited for a kernel, the verdicts' reads included
    (``VERDICT_LAG_CALLS`` calls later; read at the next call, the second step waited for the
    first's backward). Sync debug mode does not see event waits; this does."""
    n, v, d = CUDA_SHAPE
    hidden, weight, target, _ = make_problem(n, v, d, torch.bfloat16, "peaked", seed=25)
    mask = (torch.arange(n) % 5 != 0).float().cuda()
    h, w, target = hidden.cuda().requires_grad_(), weight.cuda().requires_grad_(), target.cuda()
    options = dict(impl="cce", reduction="none", loss_mask=mask, check_targets=False,
                   upstream_mismatch="nan")
    for _ in range(2):  # compiles, and leaves verdicts of its own in flight
        (linear_cross_entropy(h, w, target, **options) * mask).sum().backward()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second
    for _ in range(2):
        (linear_cross_entropy(h, w, target, **options) * mask).sum().backward()
    still_asleep = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_asleep and h.grad.isfinite().all()


@pytest.mark.requires_cuda
def test_upstream_mismatch_nan_is_caught_on_the_gpu(walks):
    """The verdict's pinned host copy (fused_lce/faults.py): a loss weighed otherwise than the
    mask gives NaN gradients; once the caller has synchronised (an optimizer step would), the
    next call raises, reading the copy without a wait, and the calls after it run."""
    n, v, d = CUDA_SHAPE
    hidden, weight, target, _ = make_problem(n, v, d, torch.bfloat16, "peaked", seed=24)
    h, w, target = hidden.cuda().requires_grad_(), weight.cuda().requires_grad_(), target.cuda()
    mask = (torch.arange(n) % 5 != 0).float().cuda()
    options = dict(impl="cce", reduction="none", loss_mask=mask, upstream_mismatch="nan")
    loss = linear_cross_entropy(h, w, target, **options)
    (loss * mask * torch.linspace(0.5, 1.5, n, device="cuda")).sum().backward()
    assert h.grad.isnan().all() and w.grad.isnan().all()
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="upstream_mismatch='recompute'"):
        linear_cross_entropy(h, w, target, **options)
    assert linear_cross_entropy(h.detach(), w.detach(), target, **options).isfinite().all()


@pytest.mark.requires_cuda
@pytest.mark.parametrize("grad", [True, False], ids=["walk", "no-grad"])
@pytest.mark.parametrize("bad", [20011, -3])
@pytest.mark.parametrize("dtype, options", [
    (torch.bfloat16, {}), (torch.bfloat16, {"token_chunk_size": 512}), (torch.float32, {}),
    (torch.bfloat16, {"scratch_mb": 1}),
], ids=["bf16", "bf16-chunks", "fp32", "lean"])
def test_out_of_range_targets_raise(grad, bad, dtype, options):
    """The target check, read once the whole forward is queued, still raises the same error,
    after kernels that met the bad target and addressed no memory out of bounds (the next
    synchronisation would report it)."""
    n, v, d = 1500, 20011, 257
    hidden, weight, target, _ = make_problem(n, v, d, dtype, "peaked", seed=4)
    hidden, weight, target = hidden.cuda(), weight.cuda(), target.cuda()
    target[n // 2] = bad
    hidden.requires_grad_(grad)
    with pytest.raises(ValueError, match=f"target holds class {bad}, outside \\[0, {v}\\)"):
        linear_cross_entropy(hidden, weight, target, impl="cce", **options)
    torch.cuda.synchronize()
    target[n // 2] = -100  # ignore_index passes, and the op still runs after the error
    loss = linear_cross_entropy(hidden, weight, target, impl="cce", **options)
    assert torch.isfinite(loss)
