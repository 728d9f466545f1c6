"""impl="cce" end to end (Triton kernels; under the interpreter on CPU) against fp64.

Each cce call costs up to a second or two under the interpreter, so instead of a cartesian product a
list of combined cases covers every reduction, ignored tokens, label smoothing, softcap, z-loss,
bias, vocabulary padding, the returned lse used in the loss, every filter setting, vocab sorting
on and off, 16- and 32-bit inputs, both data regimes and leading batch dimensions.

The filter-safety tests at the end are the point of the default filter: on a near-uniform
problem over a large vocabulary the paper's per-entry filter drops a large part of the weight
gradient, and the default "safe" filter does not.
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err
from helpers_lce import (
    IGNORE_INDEX,
    SCALAR_UPSTREAM,
    assert_matches,
    compare_to_reference,
    make_common_direction_problem,
    make_problem,
    record_chunk_plans,
    run_impl,
    run_reference_fp64,
    skippable_tiles,
    tolerances,
)

from fused_lce import LinearCrossEntropy, linear_cross_entropy
from fused_lce.api import resolve_impl
from fused_lce.kernels.tiles_backward import FILTER_MASS, backward_config
from fused_lce.options import LCEOptions, filter_budget
from fused_lce.triton_shard import filter_settings

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SMALL = (150, 307, 70)
LARGER = (252, 507, 123)
CPU = torch.device("cpu")


def case(case_id, dtype, regime, shape, ignore_frac, bias, n=None, marks=(), **options):
    n_tokens, v, d = shape
    return pytest.param(
        dtype, regime, n or n_tokens, v, d, ignore_frac, bias, options, id=case_id, marks=marks
    )




# backward="auto" is the GEMM backward (no filtering); filter_eps and vocab_sort only act in the
# fused "tiles" backward, so the cases that set them ask for it.
CASES = [
    case("f32-peaked-mean", F32, "peaked", SMALL, 0.1, False),
    case("f32-uniform-sum-bias-tiles-nofilter", F32, "near-uniform", SMALL, 0.2, True,
         reduction="sum", backward="tiles", filter_eps=None),
    case("f32-peaked-none-smoothing-tiles-paper", F32, "peaked", LARGER, 0.1, True,
         reduction="none", label_smoothing=0.1, backward="tiles", filter_eps="paper"),
    case("f32-peaked-softcap-zloss-lse-tiles-eps1e-6", F32, "peaked", SMALL, 0.1, True,
         softcap=5.0, z_loss=1e-3, return_lse=True, backward="tiles", filter_eps=1e-6),
    case("f32-uniform-none-padding-tiles-nosort", F32, "near-uniform", SMALL, 0.0, True,
         reduction="none", num_classes=290, backward="tiles", vocab_sort=False),
    case("f32-peaked-batch-dims-lse-gemm", F32, "peaked", SMALL, 0.1, False, n=(3, 50),
         reduction="none", return_lse=True, backward="gemm"),
    case("f32-uniform-everything-padding", F32, "near-uniform", LARGER, 0.1, True,
         label_smoothing=0.1, softcap=5.0, z_loss=1e-3, num_classes=500, return_lse=True),
    case("bf16-peaked-mean-softcap-bias", BF16, "peaked", LARGER, 0.1, True, softcap=5.0),
    case("bf16-peaked-mean-softcap-bias-tiles", BF16, "peaked", LARGER, 0.1, True, softcap=5.0,
         backward="tiles"),
    case("bf16-uniform-none-zloss-padding", BF16, "near-uniform", SMALL, 0.2, True,
         reduction="none", z_loss=1e-3, num_classes=290),
    case("bf16-peaked-sum-smoothing-lse-tiles-paper", BF16, "peaked", SMALL, 0.1, False,
         reduction="sum", label_smoothing=0.1, return_lse=True, backward="tiles",
         filter_eps="paper"),
    case("bf16-uniform-everything-batch-dims-tiles", BF16, "near-uniform", SMALL, 0.1, True,
         n=(2, 75), label_smoothing=0.1, softcap=5.0, z_loss=1e-3, return_lse=True,
         backward="tiles", vocab_sort=False, filter_eps=None),
    case("bf16-peaked-none-tiles-safe", BF16, "peaked", SMALL, 0.1, True,
         reduction="none", backward="tiles"),
    case("bf16-peaked-none-tiles-eps1e-6-nosort", BF16, "peaked", SMALL, 0.1, True,
         reduction="none", backward="tiles", filter_eps=1e-6, vocab_sort=False),
    case("f16-peaked-mean-lse", F16, "peaked", SMALL, 0.1, True, return_lse=True),
    # The backward from the forward's kept logits (keep_logits=True).
    case("f32-uniform-everything-padding-kept", F32, "near-uniform", LARGER, 0.1, True,
         label_smoothing=0.1, softcap=5.0, z_loss=1e-3, num_classes=500, return_lse=True,
         keep_logits=True),
    case("bf16-peaked-none-zloss-batch-dims-kept", BF16, "peaked", SMALL, 0.2, True, n=(2, 75),
         reduction="none", z_loss=1e-3, keep_logits=True),
]


@pytest.mark.parametrize("dtype, regime, n, v, d, ignore_frac, bias, options", CASES)
def test_matches_reference(dtype, regime, n, v, d, ignore_frac, bias, options):
    num_classes = options.get("num_classes")
    problem = make_problem(
        n, v, d, dtype, regime, ignore_frac, bias, seed=51, num_classes=num_classes
    )
    ours, _ = compare_to_reference(*problem, impl="cce", **options)

    target = problem[2]
    ignored = target == IGNORE_INDEX
    assert ours.grads["input"].shape == problem[0].shape
    assert torch.count_nonzero(ours.grads["input"][ignored]) == 0
    if options.get("reduction") == "none":
        assert ours.loss.shape == target.shape
        assert torch.count_nonzero(ours.loss[ignored]) == 0
    if ours.lse is not None:
        assert ours.lse.dtype == torch.float32 and ours.lse.shape == target.shape
        assert torch.count_nonzero(ours.lse[ignored]) == 0
    if num_classes is not None:
        assert torch.count_nonzero(ours.grads["weight"][num_classes:]) == 0
        if bias:
            assert torch.count_nonzero(ours.grads["bias"][num_classes:]) == 0


@pytest.mark.parametrize(
    "dtype, backward",
    [(F32, "gemm"), (F32, "tiles"), (BF16, "tiles"), (BF16, "gemm")],
    ids=["f32-gemm", "f32-tiles", "bf16-tiles", "bf16-gemm"],
)
@pytest.mark.parametrize("regime", ["peaked", "near-uniform"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reduction_grid(reduction, regime, dtype, backward):
    """Every reduction x regime x backward path, with ignored tokens and a bias."""
    problem = make_problem(*SMALL, dtype, regime, 0.1, True, seed=59)
    compare_to_reference(*problem, impl="cce", reduction=reduction, backward=backward)


@pytest.mark.parametrize("backward", ["gemm", "tiles"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_several_backward_chunks(monkeypatch, backward, dtype):
    """A 100 KB buffer budget splits the backward into several token and vocabulary chunks
    (the plan the backward actually used is recorded and checked)."""
    n, v, d = SMALL
    plans = record_chunk_plans(monkeypatch)
    problem = make_problem(n, v, d, dtype, "peaked", 0.1, True, seed=52)
    compare_to_reference(
        *problem, impl="cce", reduction="none", backward=backward, scratch_mb=100_000 / 2**20
    )
    assert [kind for kind, _ in plans] == [backward]
    rows, cols = plans[0][1]
    assert rows < n and cols < v, (rows, cols)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_tokens_ignored(reduction):
    """Every token ignored: "mean" is NaN (as torch), "sum" is 0, lse and gradients are 0."""
    hidden, weight, target, bias = make_problem(*SMALL, F32, "peaked", 1.0, True, seed=53)
    h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
    loss, lse = linear_cross_entropy(
        h, w, target, b, impl="cce", reduction=reduction, return_lse=True
    )
    if reduction == "mean":
        assert torch.isnan(loss)
    elif reduction == "sum":
        assert loss.item() == 0.0
    else:
        assert torch.count_nonzero(loss) == 0
    assert torch.count_nonzero(lse) == 0
    loss.sum().backward()
    for name, t in (("input", h), ("weight", w), ("bias", b)):
        assert t.grad is not None and torch.count_nonzero(t.grad) == 0, name


@pytest.mark.parametrize(
    "dtype, regime, options",
    [
        (F32, "peaked", dict(softcap=5.0, backward="tiles", deterministic=True)),
        (BF16, "near-uniform", dict(label_smoothing=0.1, reduction="none", backward="tiles",
                                    deterministic=True)),
        (F32, "near-uniform", dict(z_loss=1e-3, backward="gemm")),
        (BF16, "peaked", dict(reduction="none", deterministic=True)),
    ],
    ids=["f32-peaked-tiles", "bf16-near-uniform-tiles", "f32-near-uniform-gemm",
         "bf16-peaked-auto"],
)
def test_deterministic_is_bitwise_repeatable(dtype, regime, options):
    """deterministic=True (and the GEMM backward, always): two runs agree bit for bit."""
    problem = make_problem(*SMALL, dtype, regime, 0.1, True, seed=54)
    first, _ = compare_to_reference(*problem, impl="cce", return_lse=True, **options)
    second = run_impl(*problem, impl="cce", return_lse=True, **options)
    assert torch.equal(first.loss, second.loss)
    assert torch.equal(first.lse, second.lse)
    for name, grad in first.grads.items():
        assert torch.equal(grad, second.grads[name]), name


def test_gradient_through_lse_alone():
    """Only the returned lse is used (the loss gets no gradient): d(sum w * lse) is right."""
    problem = make_problem(*SMALL, F32, "peaked", 0.1, True, seed=55)
    kw = dict(return_lse=True, reduction="none")
    h, w, b = (t.clone().requires_grad_(True) for t in (problem[0], problem[1], problem[3]))
    _, lse = linear_cross_entropy(h, w, problem[2], b, impl="cce", **kw)
    ref_h, ref_w, ref_b = (t.double().requires_grad_(True) for t in (h.detach(), w.detach(),
                                                                     b.detach()))
    _, ref_lse = linear_cross_entropy(ref_h, ref_w, problem[2], ref_b, impl="torch", **kw)
    scale = torch.linspace(0.5, 1.5, lse.numel(), dtype=torch.float64)
    (lse * scale.float()).sum().backward()
    (ref_lse * scale).sum().backward()
    for got, want in ((lse, ref_lse), (h.grad, ref_h.grad), (w.grad, ref_w.grad),
                      (b.grad, ref_b.grad)):
        assert rel_err(got, want) <= 1e-5


def test_frozen_weight_and_no_grad():
    """Gradients only where asked for (no weight or bias gradient), and a no_grad forward."""
    hidden, weight, target, bias = make_problem(*SMALL, F32, "near-uniform", 0.1, True, seed=56)
    ref = run_reference_fp64(hidden, weight, target, bias)
    h = hidden.clone().requires_grad_(True)
    loss = linear_cross_entropy(h, weight, target, bias, impl="cce")
    (SCALAR_UPSTREAM * loss).backward()  # the reference's objective
    assert rel_err(h.grad, ref.grads["input"]) <= 1e-5
    assert weight.grad is None and bias.grad is None
    with torch.no_grad():
        again = linear_cross_entropy(hidden, weight, target, bias, impl="cce")
    assert rel_err(again, ref.loss) <= 1e-5


def test_module_equals_function_and_auto_impl():
    hidden, weight, target, _ = make_problem(*SMALL, F32, "peaked", 0.1, False, seed=57)
    options = dict(impl="cce", softcap=5.0, deterministic=True)
    module = LinearCrossEntropy(**options)
    assert torch.equal(module(hidden, weight, target),
                       linear_cross_entropy(hidden, weight, target, **options))
    # "auto" picks cce only on CUDA, for 16/32-bit inputs.
    auto = LCEOptions(impl="auto")
    assert resolve_impl(auto, CPU, F32) == "chunked"
    assert resolve_impl(auto, torch.device("cuda"), BF16) == "cce"
    assert resolve_impl(auto, torch.device("cuda"), torch.float64) == "chunked"


# ---------------------------------------------------------------------------------------------
# Filter safety
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, paper",
    [(F32, 2.0**-12), (BF16, "paper")],
    ids=["f32-paper-eps-2^-12", "bf16-paper"],
)
def test_safe_filter_keeps_near_uniform_weight_gradient(dtype, paper):
    """Near-uniform softmax over V=5000 with hidden states sharing one direction.

    Every probability is below 2^-12, so the paper's filter skips every target-free tile, and
    the weight gradient of those classes, small per entry but all of one sign, is lost. The
    safe filter bounds the mass it may drop per token (fp32: 2^-28, bf16: 2^-12 in total) and
    here skips nothing it should not: it stays within the usual tolerance.
    """
    n, v, d = 64, 5000, 32
    problem = make_common_direction_problem(n, v, d, dtype, seed=58)
    hidden, weight, target, _ = problem
    probs = torch.softmax(hidden.double() @ weight.double().t(), dim=1)
    assert probs.max() < 2.0**-12  # the paper criterion holds for every entry
    assert filter_budget(dtype) == (2.0**-28 if dtype == F32 else 2.0**-12)

    ref = run_reference_fp64(*problem)
    torch_run = run_impl(*problem, impl="torch") if dtype == BF16 else None
    tols = tolerances(dtype, ref, torch_run)

    # Filtering happens in the fused tile backward; filter_eps="safe" is the default.
    safe = run_impl(*problem, impl="cce", backward="tiles")
    safe_errors = assert_matches(safe, ref, tols, label=f"safe filter {dtype}")
    unsafe = run_impl(*problem, impl="cce", backward="tiles", filter_eps=paper)
    paper_errors = {name: rel_err(grad, ref.grads[name]) for name, grad in unsafe.grads.items()}
    print(
        f"\n{dtype} V={v}: safe filter rel. errors {safe_errors}; "
        f"paper filter ({paper}) rel. errors {paper_errors}"
    )
    # The test has teeth: the paper filter's weight gradient is far off.
    assert paper_errors["weight"] > 1e-2
    assert paper_errors["weight"] > 10 * safe_errors["weight"]
    assert paper_errors["weight"] > 10 * tols["weight"]


def test_safe_filter_skips_tiles_in_peaked_regime():
    """Peaked (trained-like) bf16 problem where the safe criterion holds for many tiles of the
    vocab-sorted walk: the cce backward skips them and still meets the usual tolerance."""
    dtype, (n, v, d) = BF16, (150, 2053, 70)
    problem = make_problem(n, v, d, dtype, "peaked", 0.0, False, seed=3, peak=3.0)
    code, threshold = filter_settings(LCEOptions(), dtype, v, CPU)
    assert code == FILTER_MASS
    cfg = backward_config(CPU)
    skippable, total = skippable_tiles(
        *problem, threshold=threshold, mode="mass", block_n=cfg.block_n, block_v=cfg.block_v
    )
    print(f"\nsafe filter may skip {skippable} of {total} tiles")
    assert skippable >= 5
    compare_to_reference(*problem, impl="cce", backward="tiles")


def test_kept_logits_skip_the_recompute(monkeypatch):
    """keep_logits=True really takes the kept path: no logit chunk is recomputed."""
    import fused_lce.kernels.gemm_backward as gemm

    def no_recompute(*args, **kwargs):
        raise AssertionError("a logit chunk was recomputed")

    monkeypatch.setattr(gemm, "grad_logits", no_recompute)
    hidden, weight, target, bias = make_problem(40, 300, 24, BF16, "peaked", 0.1, bias=True,
                                                seed=56)
    compare_to_reference(hidden, weight, target, bias, impl="cce", keep_logits=True)
    hidden.requires_grad_()
    with pytest.raises(AssertionError, match="recomputed"):
        linear_cross_entropy(hidden, weight, target, impl="cce", backward="gemm").backward()


def test_evaluation_keeps_no_logits(monkeypatch):
    """Without a backward to come (no grad mode, or no input wanting a gradient) the forward
    keeps nothing, whatever keep_logits says."""
    import fused_lce.triton_shard as function

    asked = []
    statistics = function.shard_statistics
    monkeypatch.setattr(function, "shard_statistics",
                        lambda *a, **k: asked.append(function.keeps_logits(a[5])) or
                        statistics(*a, **k))
    hidden, weight, target, _ = make_problem(40, 300, 24, BF16, "peaked", 0.1, seed=58)
    with torch.no_grad():
        linear_cross_entropy(hidden.requires_grad_(), weight, target, impl="cce",
                             keep_logits=True)
    linear_cross_entropy(hidden.detach(), weight, target, impl="cce", keep_logits=True)
    linear_cross_entropy(hidden.requires_grad_(), weight, target, impl="cce",
                         keep_logits=True)
    assert asked == [False, False, True]
