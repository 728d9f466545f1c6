"""Bad inputs raise before any work starts, with the offending argument named in the message.

Every case runs for impl in ("torch", "chunked", "cce"). The ``no_work`` fixture replaces each
implementation's entry point and the Triton launchers with a function that fails the test, so a
check that only fires inside a kernel (or not at all) is caught: ``pytest.raises`` does not
swallow the AssertionError it raises.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_rel

import fused_lce.api
import fused_lce.chunked
import fused_lce.reference
import fused_lce.triton_shard
from fused_lce import LinearCrossEntropy, linear_cross_entropy

IMPLS = ("torch", "chunked", "cce")
N, V, D = 12, 23, 16


def _problem():
    gen = torch.Generator().manual_seed(0)
    return dict(
        input=torch.randn(N, D, generator=gen),
        weight=torch.randn(V, D, generator=gen),
        # Below 20, so that only the value a case plants is out of range for num_classes=20.
        target=torch.randint(0, 20, (N,), generator=gen),
        bias=torch.randn(V, generator=gen),
    )


def _with_target(value, index=4):
    target = _problem()["target"].clone()
    target[index] = value
    return target


def _work_ran(*args, **kwargs):
    raise AssertionError("an implementation or kernel ran before the bad input was rejected")


@pytest.fixture
def no_work(monkeypatch):
    for module, name in (
        (fused_lce.api, "single_device_loss"),  # cce and chunked
        (fused_lce.triton_shard, "lse_forward"),
        (fused_lce.triton_shard, "lce_backward"),
        (fused_lce.reference, "reference_linear_cross_entropy"),
    ):
        monkeypatch.setattr(module, name, _work_ran)


# (id, tensor overrides, option overrides, exception, regex naming the argument)
BAD_INPUTS = [
    # shapes
    ("input-D-mismatch", lambda p: {"input": p["input"][:, :-1]}, {}, ValueError,
     r"input's last dimension \(15\) must equal weight's second dimension D=16"),
    ("input-scalar", lambda p: {"input": torch.tensor(1.0)}, {}, ValueError,
     r"input must have at least one dimension"),
    ("target-shape", lambda p: {"target": p["target"][:-1]}, {}, ValueError,
     r"target must have shape \(12,\)"),
    ("target-extra-dim", lambda p: {"target": p["target"][:, None]}, {}, ValueError,
     r"target must have shape \(12,\)"),
    ("weight-1d", lambda p: {"weight": p["weight"][0]}, {}, ValueError, r"weight must be 2-D"),
    ("weight-3d", lambda p: {"weight": p["weight"][None]}, {}, ValueError, r"weight must be 2-D"),
    ("bias-shape", lambda p: {"bias": p["bias"][:-1]}, {}, ValueError,
     r"bias must have shape \(23,\)"),
    ("bias-2d", lambda p: {"bias": p["bias"][None]}, {}, ValueError,
     r"bias must have shape \(23,\)"),
    # dtypes and types
    ("input-integer", lambda p: {"input": p["input"].long()}, {}, TypeError,
     r"input must be a floating-point tensor"),
    ("input-not-tensor", lambda p: {"input": p["input"].tolist()}, {}, TypeError,
     r"input must be a torch.Tensor"),
    ("target-float", lambda p: {"target": p["target"].float()}, {}, TypeError,
     r"target must hold integer class indices"),
    ("target-bool", lambda p: {"target": p["target"] > 3}, {}, TypeError,
     r"target must hold integer class indices"),
    ("weight-dtype", lambda p: {"weight": p["weight"].double()}, {}, TypeError,
     r"weight must have input's dtype torch.float32, got torch.float64"),
    ("weight-dtype-bf16", lambda p: {"weight": p["weight"].bfloat16()}, {}, TypeError,
     r"weight must have input's dtype"),
    ("bias-dtype", lambda p: {"bias": p["bias"].half()}, {}, TypeError,
     r"bias must have input's dtype"),
    ("bias-not-tensor", lambda p: {"bias": 0.5}, {}, TypeError,
     r"bias must be a torch.Tensor or None"),
    # devices
    ("weight-on-meta", lambda p: {"weight": p["weight"].to("meta")}, {}, ValueError,
     r"weight is on meta but input is on cpu"),
    ("target-on-meta", lambda p: {"target": p["target"].to("meta")}, {}, ValueError,
     r"target is on meta but input is on cpu"),
    ("bias-on-meta", lambda p: {"bias": p["bias"].to("meta")}, {}, ValueError,
     r"bias is on meta but input is on cpu"),
    ("input-on-meta", lambda p: {"input": p["input"].to("meta")}, {}, ValueError,
     r"weight is on cpu but input is on meta"),
    # options
    ("softcap-zero", lambda p: {}, {"softcap": 0.0}, ValueError, r"softcap must be a finite"),
    ("softcap-negative", lambda p: {}, {"softcap": -5.0}, ValueError, r"softcap must be a finite"),
    ("softcap-nan", lambda p: {}, {"softcap": math.nan}, ValueError, r"softcap must be a finite"),
    ("softcap-inf", lambda p: {}, {"softcap": math.inf}, ValueError, r"softcap must be a finite"),
    ("softcap-string", lambda p: {}, {"softcap": "5"}, TypeError, r"softcap must be a number"),
    ("reduction", lambda p: {}, {"reduction": "avg"}, ValueError, r"reduction must be one of"),
    ("label-smoothing-negative", lambda p: {}, {"label_smoothing": -0.1}, ValueError,
     r"label_smoothing must be in \[0, 1\]"),
    ("label-smoothing-above-one", lambda p: {}, {"label_smoothing": 1.5}, ValueError,
     r"label_smoothing must be in \[0, 1\]"),
    ("label-smoothing-nan", lambda p: {}, {"label_smoothing": math.nan}, ValueError,
     r"label_smoothing must be in \[0, 1\]"),
    ("z-loss-negative", lambda p: {}, {"z_loss": -1e-4}, ValueError, r"z_loss must be a finite"),
    ("z-loss-inf", lambda p: {}, {"z_loss": math.inf}, ValueError, r"z_loss must be a finite"),
    ("z-loss-nan", lambda p: {}, {"z_loss": math.nan}, ValueError, r"z_loss must be a finite"),
    ("filter-eps-string", lambda p: {}, {"filter_eps": "fast"}, ValueError,
     r"filter_eps must be 'safe', 'paper'"),
    ("round-logits-not-bool", lambda p: {}, {"round_logits": "bf16"}, TypeError,
     r"round_logits must be a bool, got 'bf16'"),
    ("keep-logits-not-bool", lambda p: {}, {"keep_logits": 0}, TypeError,
     r"keep_logits must be a bool, got 0"),
    ("recompute-logits-renamed", lambda p: {}, {"recompute_logits": False}, TypeError,
     r"recompute_logits was renamed: pass keep_logits=not recompute_logits"),
    ("fp32-weight-grad-not-bool", lambda p: {}, {"fp32_weight_grad": "yes"}, TypeError,
     r"fp32_weight_grad must be a bool, got 'yes'"),
    ("kept-logits-with-tiles", lambda p: {}, {"keep_logits": True, "backward": "tiles"},
     ValueError, r"keep_logits=True needs backward='gemm' or 'auto'"),
    ("deterministic-not-bool", lambda p: {}, {"deterministic": 1}, TypeError,
     r"deterministic must be a bool, got 1"),
    ("filter-eps-negative", lambda p: {}, {"filter_eps": -1e-6}, ValueError,
     r"filter_eps must be in \[0, 1\)"),
    ("filter-eps-one", lambda p: {}, {"filter_eps": 1.0}, ValueError,
     r"filter_eps must be in \[0, 1\)"),
    ("filter-eps-nan", lambda p: {}, {"filter_eps": math.nan}, ValueError,
     r"filter_eps must be in \[0, 1\)"),
    ("num-classes-above-V", lambda p: {}, {"num_classes": V + 1}, ValueError,
     r"num_classes \(24\) must be at most weight's number of rows 23"),
    ("num-classes-zero", lambda p: {}, {"num_classes": 0}, ValueError, r"num_classes must be > 0"),
    ("num-classes-float", lambda p: {}, {"num_classes": 20.0}, TypeError,
     r"num_classes must be an int"),
    ("ignore-index-float", lambda p: {}, {"ignore_index": -100.0}, TypeError,
     r"ignore_index must be an int"),
    ("chunk-by", lambda p: {}, {"chunk_by": "rows"}, ValueError, r"chunk_by must be one of"),
    ("backward", lambda p: {}, {"backward": "fused"}, ValueError, r"backward must be one of"),
    ("vocab-chunk-size-zero", lambda p: {}, {"vocab_chunk_size": 0}, ValueError,
     r"vocab_chunk_size must be a positive int"),
    ("token-chunk-size-float", lambda p: {}, {"token_chunk_size": 32.0}, TypeError,
     r"token_chunk_size must be a positive int"),
    ("scratch-mb-zero", lambda p: {}, {"scratch_mb": 0.0}, ValueError, r"scratch_mb must be > 0"),
]


# Target values live on the device: the op checks them there, in the call (fused_lce/faults.py),
# so these raise during it (on the CPU, at its end) rather than before any work.
BAD_TARGETS = [
    ("target-negative", lambda p: {"target": _with_target(-5)}, {},
     r"target holds class -5, outside \[0, 23\)"),
    ("target-ignore-index-of-other-call", lambda p: {"target": _with_target(-100)},
     {"ignore_index": -1}, r"target holds class -100.*ignore_index \(-1\)"),
    ("target-equals-V", lambda p: {"target": _with_target(V)}, {},
     r"target holds class 23, outside \[0, 23\)"),
    ("target-beyond-num-classes", lambda p: {"target": _with_target(21)}, {"num_classes": 20},
     r"target holds class 21, outside \[0, 20\)"),
]


def _call(impl, tensors, options):
    args = _problem()
    args.update(tensors(args))
    return linear_cross_entropy(
        args["input"], args["weight"], args["target"], args["bias"], impl=impl, **options
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "tensors, options, error, message",
    [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUTS],
)
def test_bad_input_raises_before_any_work(no_work, impl, tensors, options, error, message):
    with pytest.raises(error, match=message):
        _call(impl, tensors, options)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "tensors, options, message", [pytest.param(*case[1:], id=case[0]) for case in BAD_TARGETS],
)
def test_bad_target_raises_in_the_call(impl, tensors, options, message):
    with pytest.raises(ValueError, match=message):
        _call(impl, tensors, options)


@pytest.mark.parametrize("impl", IMPLS)
def test_valid_call_reaches_the_implementation(no_work, impl):
    """The fixture has teeth: a well-formed call does get past validation (and hits it)."""
    with pytest.raises(AssertionError, match="ran before the bad input was rejected"):
        _call(impl, lambda p: {}, {})


def test_unknown_impl(no_work):
    with pytest.raises(ValueError, match=r"impl must be one of"):
        _call("triton", lambda p: {}, {})


def test_cce_rejects_fp64(no_work):
    with pytest.raises(TypeError, match=r"impl='cce' supports float16, bfloat16 and float32"):
        _call("cce", lambda p: {k: v.double() for k, v in p.items() if k != "target"}, {})


def test_module_validates_options_at_construction():
    with pytest.raises(ValueError, match=r"reduction must be one of"):
        LinearCrossEntropy(reduction="avg")
    with pytest.raises(ValueError, match=r"softcap must be a finite"):
        LinearCrossEntropy(softcap=-1.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_module_validates_inputs(no_work, impl):
    p = _problem()
    module = LinearCrossEntropy(impl=impl)
    with pytest.raises(ValueError, match=r"input's last dimension"):
        module(p["input"][:, :-1], p["weight"], p["target"])


@pytest.mark.parametrize(
    "variable, raw, options",
    [
        ("FUSED_LCE_VOCAB_CHUNK", "abc", {}),
        ("FUSED_LCE_VOCAB_CHUNK", "0", {}),
        ("FUSED_LCE_VOCAB_CHUNK", "-3", {}),
        ("FUSED_LCE_TOKEN_CHUNK", "abc", {"chunk_by": "tokens"}),
    ],
)
def test_bad_chunk_env_var_raises(monkeypatch, variable, raw, options):
    """The chunked impl reads its chunk sizes from the environment before any matmul."""
    monkeypatch.setenv(variable, raw)
    with pytest.raises(ValueError, match=rf"environment variable {variable} must be a positive"):
        _call("chunked", lambda p: {}, options)


def test_chunk_size_argument_beats_env_var(monkeypatch):
    """The argument's chunks are the ones walked, and the loss is right."""
    widths = []
    fold = fused_lce.chunked._fold_into_lse_
    monkeypatch.setattr(fused_lce.chunked, "_fold_into_lse_",
                        lambda z, *a: widths.append(z.shape[1]) or fold(z, *a))
    monkeypatch.setenv("FUSED_LCE_VOCAB_CHUNK", "abc")
    loss = _call("chunked", lambda p: {}, {"vocab_chunk_size": 8})
    assert widths == [8, 8, 7]  # V = 23
    p = {k: v.double() if v.is_floating_point() else v for k, v in _problem().items()}
    expected = F.cross_entropy(p["input"] @ p["weight"].t() + p["bias"], p["target"])
    assert_close_rel(loss, expected, 1e-6, "loss")


def test_bad_scratch_env_var_raises(monkeypatch):
    """cce reads FUSED_LCE_SCRATCH_MB when it plans the backward: a bad value must still be
    reported by name, at the latest when the backward runs."""
    monkeypatch.setenv("FUSED_LCE_SCRATCH_MB", "abc")
    p = _problem()
    hidden = p["input"].requires_grad_(True)
    with pytest.raises(ValueError, match=r"environment variable FUSED_LCE_SCRATCH_MB"):
        linear_cross_entropy(hidden, p["weight"], p["target"], impl="cce").backward()


def test_options_keep_their_environment_through_replace(monkeypatch):
    """The environment is read once, into a field that dataclasses.replace carries over."""
    import dataclasses

    from fused_lce.options import LCEOptions

    monkeypatch.setenv("FUSED_LCE_SCRATCH_MB", "7")
    monkeypatch.setenv("FUSED_LCE_VOCAB_CHUNK", "33")
    opts = LCEOptions()
    monkeypatch.setenv("FUSED_LCE_SCRATCH_MB", "9")
    monkeypatch.delenv("FUSED_LCE_VOCAB_CHUNK")
    changed = dataclasses.replace(opts, reduction="sum")
    assert (changed.scratch_bytes, changed.vocab_chunk, changed.scratch_explicit) == (
        7 * 2**20, 33, True)
    assert LCEOptions().scratch_bytes == 9 * 2**20 and LCEOptions().vocab_chunk == 4096
    assert changed == LCEOptions(reduction="sum")  # the snapshot is not part of equality


def test_bad_environment_is_refused_where_it_is_read(monkeypatch):
    from fused_lce.options import LCEOptions

    monkeypatch.setenv("FUSED_LCE_TOKEN_CHUNK", "-3")
    with pytest.raises(ValueError, match="environment variable FUSED_LCE_TOKEN_CHUNK"):
        LCEOptions()
    assert LCEOptions(token_chunk_size=5).token_chunk == 5  # overridden: never read
    with pytest.raises(TypeError, match="environment must be an options.Environment"):
        LCEOptions(environment={"tma": "0"})


def test_old_spelling_of_the_in_forward_backward_is_refused_naming_the_new_one():
    from fused_lce.options import LCEOptions

    with pytest.raises(ValueError, match="backward='forward' is now spelled backward='in_forward'"):
        LCEOptions(backward="forward")


def test_renamed_keyword_is_refused_naming_the_new_one_by_every_entry():
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    renamed = "recompute_logits was renamed: pass keep_logits=not recompute_logits"
    p = _problem()
    for call in (lambda: LinearCrossEntropy(recompute_logits=False),
                 lambda: vocab_parallel_linear_cross_entropy(
                     p["input"], p["weight"], p["target"], recompute_logits=False)):
        with pytest.raises(TypeError, match=renamed):
            call()


# ---------------------------------------------------------------------------------------------
# Non-finite and empty inputs behave as torch does
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_input_propagates(impl):
    p = _problem()
    hidden = p["input"].clone()
    hidden[3] = math.nan
    hidden[7, 1] = math.nan
    expected = F.cross_entropy(hidden @ p["weight"].t(), p["target"], reduction="none")

    per_token = linear_cross_entropy(hidden, p["weight"], p["target"], impl=impl, reduction="none")
    assert torch.equal(torch.isnan(per_token), torch.isnan(expected))
    assert torch.isnan(per_token).tolist() == [i in (3, 7) for i in range(N)]
    for reduction in ("mean", "sum"):
        leaf = hidden.clone().requires_grad_(True)
        loss = linear_cross_entropy(leaf, p["weight"], p["target"], impl=impl, reduction=reduction)
        assert torch.isnan(loss), reduction
        loss.backward()  # completes (no hang, no error)
        assert torch.isnan(leaf.grad[3]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_inf_input_gives_non_finite_loss(impl):
    p = _problem()
    hidden = p["input"].clone()
    hidden[5, 2] = math.inf
    hidden[9, 0] = -math.inf
    expected = F.cross_entropy(hidden @ p["weight"].t(), p["target"], reduction="none")

    per_token = linear_cross_entropy(hidden, p["weight"], p["target"], impl=impl, reduction="none")
    assert torch.equal(torch.isfinite(per_token), torch.isfinite(expected))
    assert not torch.isfinite(per_token[5]) and not torch.isfinite(per_token[9])
    loss = linear_cross_entropy(hidden, p["weight"], p["target"], impl=impl)
    assert not torch.isfinite(loss)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_input(impl):
    """N = 0: "sum" is 0, "mean" is NaN and "none" is empty, as in torch; gradients are zero."""
    p = _problem()
    weight = p["weight"].clone().requires_grad_(True)
    hidden = torch.zeros(0, D, requires_grad=True)
    target = torch.zeros(0, dtype=torch.long)
    empty_logits = torch.zeros(0, V)

    total = linear_cross_entropy(hidden, weight, target, impl=impl, reduction="sum")
    assert total.item() == 0.0 == F.cross_entropy(empty_logits, target, reduction="sum").item()
    total.backward()
    assert hidden.grad.shape == (0, D)
    assert torch.count_nonzero(weight.grad) == 0

    mean = linear_cross_entropy(hidden, weight, target, impl=impl)
    assert torch.isnan(mean) and torch.isnan(F.cross_entropy(empty_logits, target))

    none = linear_cross_entropy(
        hidden.reshape(0, 3, D), weight, target.reshape(0, 3), impl=impl, reduction="none"
    )
    assert none.shape == (0, 3)
