"""The megatron adapter's mechanics on a stand-in model (no megatron-core needed).

``FakeGPT`` (tests/helpers_megatron.py) has the two calls the adapter relies on in
GPTModel._postprocess: the output layer ``(logits, bias) = output_layer(hidden, weight=...)``
and ``compute_language_model_loss(labels, logits)`` returning the per-token loss [b, s]. The
real models are exercised through the launcher
(test_launcher.py) and the Megatron-LM parser on the GPU machines (test_megatron_plugin.py).
"""

from __future__ import annotations

import argparse
import socket

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close_rel
from helpers_megatron import B, FakeGPT, MaskedGPT, MaskedMTPGPT, S, V, _inputs
from torch import nn

from fused_lce.parallel import megatron_flags, megatron_patch


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group in this process, torn down after the module."""
    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def test_cce_route_matches_the_model_own_loss(group):
    torch.manual_seed(0)
    native, cce = FakeGPT(group, fusion=False), FakeGPT(group)
    cce.load_state_dict(native.state_dict())
    megatron_patch.install(cce)
    hidden, labels = _inputs()
    h2 = hidden.detach().clone().requires_grad_()
    expected = native._postprocess(hidden, labels=labels)
    got = cce._postprocess(h2, labels=labels)
    assert cce.logits_calls == 0, "the cce route must not form logits"
    assert got.shape == (B, S)
    assert_close_rel(got, expected, 1e-5, "per-token loss")
    expected.sum().backward()
    got.sum().backward()
    assert_close_rel(h2.grad, hidden.grad, 1e-5, "hidden grad")
    assert_close_rel(cce.output_layer.weight.grad, native.output_layer.weight.grad, 1e-5, "weight")


def test_without_labels_the_logits_path_runs(group):
    gpt = FakeGPT(group)
    megatron_patch.install(gpt)
    hidden, _ = _inputs(1)
    logits = gpt._postprocess(hidden)
    expected = (hidden @ gpt.output_layer.weight.t()).transpose(0, 1)
    assert torch.equal(logits, expected), "the logits path must be the model's own, untouched"


def test_other_impls_are_untouched(group):
    gpt = FakeGPT(group, impl="native")
    megatron_patch.install(gpt)
    hidden, labels = _inputs(2)
    gpt._postprocess(hidden, labels=labels)
    assert gpt.logits_calls == 1


def test_install_twice_is_harmless(group):
    gpt = FakeGPT(group)
    megatron_patch.install(gpt)
    first = gpt._postprocess
    megatron_patch.install([gpt])
    assert gpt._postprocess is first
    hidden, labels = _inputs(3)
    assert gpt._postprocess(hidden, labels=labels).shape == (B, S)


def test_uneven_vocabulary_is_refused_naming_the_flag(group):
    gpt = FakeGPT(group, vocab=V + 2)
    megatron_patch.install(gpt)
    hidden, labels = _inputs(4)
    with pytest.raises(ValueError, match="--cross-entropy-fusion-impl cce"):
        gpt._postprocess(hidden, labels=labels)


def test_unknown_option_is_refused():
    with pytest.raises(TypeError, match="unknown option"):
        megatron_patch.install(nn.Linear(2, 2), temperature=2.0)


def test_bad_option_value_is_refused_at_install():
    with pytest.raises(ValueError, match="keep_logits=True needs backward"):
        megatron_patch.install(nn.Linear(2, 2), keep_logits=True, backward="tiles")
    with pytest.raises(ValueError, match="softcap must be"):
        megatron_patch.install(nn.Linear(2, 2), softcap=-1.0)


def test_gradient_goes_into_main_grad(group):
    torch.manual_seed(0)
    plain, fused = FakeGPT(group), FakeGPT(group)
    fused.load_state_dict(plain.state_dict())
    fused.config.gradient_accumulation_fusion = True
    weight = fused.output_layer.weight
    weight.main_grad = torch.full_like(weight, 0.5)
    weight.grad_added_to_main_grad = False
    for gpt in (plain, fused):
        megatron_patch.install(gpt)
    hidden, labels = _inputs(5)
    plain._postprocess(hidden, labels=labels).sum().backward()
    fused._postprocess(hidden.detach(), labels=labels).sum().backward()
    assert weight.grad_added_to_main_grad, "Megatron's flag must be set"
    assert_close_rel(weight.main_grad - 0.5, plain.output_layer.weight.grad, 1e-5, "main_grad")


def test_parser_gets_cce_choices():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"])
    megatron_flags.add_arguments(megatron_flags.add_arguments(parser))
    (action,) = [a for a in parser._actions if "--cross-entropy-fusion-impl" in a.option_strings]
    assert action.choices == ["native", "te", "cce", "linear"], "added once, after megatron's"
    for choice in ("native", "te", "cce", "linear"):
        args = parser.parse_args(["--cross-entropy-fusion-impl", choice])
        assert args.cross_entropy_fusion_impl == choice
    assert parser.parse_args([]).cross_entropy_fusion_impl == "native"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cross-entropy-fusion-impl", "bogus"])
    fresh = megatron_flags.add_arguments(argparse.ArgumentParser())
    args = fresh.parse_args(["--cross-entropy-fusion-impl", "cce"])
    assert args.cross_entropy_fusion_impl == "cce"
    assert fresh.parse_args([]).cross_entropy_fusion_impl == "native"



def test_the_documented_import_path_is_both_parts():
    """docs/megatron.md's ``fused_lce.parallel.megatron.install`` and ``.extra_args_provider``:
    the public module hands out the functions of megatron_patch and megatron_flags."""
    from fused_lce.parallel import megatron

    assert megatron.install is megatron_patch.install
    assert megatron.extra_args_provider is megatron_flags.extra_args_provider
    for name in megatron.__all__:
        part = megatron_flags if hasattr(megatron_flags, name) else megatron_patch
        assert getattr(megatron, name) is getattr(part, name), name

def _masks_given(monkeypatch) -> list[bool]:
    """Whether each op call the adapter makes is given a ``loss_mask``."""
    from fused_lce.parallel import vocab_parallel

    masks = []
    original = vocab_parallel.vocab_parallel_linear_cross_entropy

    def spy(*args, **kwargs):
        masks.append(kwargs.get("loss_mask") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(vocab_parallel, "vocab_parallel_linear_cross_entropy", spy)
    return masks


def test_only_the_main_loss_is_given_its_mask(group, monkeypatch, walks):
    """The adapter passes the forward's loss mask to the loss of the forward's own labels only:
    that one computes its gradients in the forward for Megatron's masked sum (checked on the
    device); multi-token prediction's loss (rolled labels, rolled mask) goes without and takes
    the recomputing backward. Both exact, neither with a host read."""
    from fused_lce import engine

    recomputes = []
    monkeypatch.setattr(engine, "warn_recompute", lambda where: recomputes.append(where))
    masks = _masks_given(monkeypatch)
    torch.manual_seed(0)
    native, cce = MaskedMTPGPT(group, fusion=False), MaskedMTPGPT(group)
    cce.load_state_dict(native.state_dict())
    megatron_patch.install(cce, impl="cce")
    hidden, labels = _inputs(4)
    loss_mask = (torch.arange(B * S).view(B, S) % 3 != 0).float()
    h2 = hidden.detach().clone().requires_grad_()
    expected = native._postprocess(hidden, labels=labels, loss_mask=loss_mask)
    got = cce._postprocess(h2, labels=labels, loss_mask=loss_mask)
    rolled_mask = torch.roll(loss_mask, -1, dims=-1)
    for losses in (expected, got):
        mtp, main = losses
        (0.25 * (main * loss_mask).sum() + 0.1 * (mtp * rolled_mask).sum()).backward()
    assert masks == [False, True] and len(walks) == 1 and not recomputes
    assert_close_rel(h2.grad, hidden.grad, 1e-5, "hidden grad")
    assert_close_rel(cce.output_layer.weight.grad, native.output_layer.weight.grad, 1e-5,
                     "weight grad")
    masks.clear()
    cce._postprocess(hidden.detach(), labels=labels)  # no mask: nothing to pass
    assert masks == [False, False]


def test_a_loss_that_is_not_the_masked_sum_is_caught(group):
    """Given the mask, but the loss function weighs tokens otherwise: every gradient is NaN and
    the next call that finds the verdict on the host (on the CPU, the next micro-batch) raises,
    naming the flag that recomputes instead."""
    torch.manual_seed(0)
    cce = MaskedGPT(group)
    megatron_patch.install(cce, impl="cce")
    hidden, labels = _inputs(6)
    loss_mask = (torch.arange(B * S).view(B, S) % 3 != 0).float()
    h = hidden.detach().clone().requires_grad_()
    got = cce._postprocess(h, labels=labels, loss_mask=loss_mask)
    (got * loss_mask * torch.linspace(0.5, 1.5, S)).sum().backward()
    assert h.grad.isnan().all() and cce.output_layer.weight.grad.isnan().all()
    with pytest.raises(RuntimeError, match="--cce-upstream-mismatch recompute"):
        cce._postprocess(hidden, labels=labels, loss_mask=loss_mask)
    assert cce._postprocess(hidden, labels=labels, loss_mask=loss_mask).isfinite().all()


@pytest.mark.parametrize("accumulate", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("pass_mask", [True, False], ids=["mask-given", "no-mask"])
def test_the_loss_mask_reaches_the_op(group, monkeypatch, pass_mask, accumulate, walks):
    """With the forward's loss mask the op keeps the gradients it computed in its forward for
    Megatron's masked sum; without it, it takes the recomputing backward. Both exact."""
    from fused_lce import engine

    recomputes = []
    monkeypatch.setattr(engine, "warn_recompute", lambda where: recomputes.append(where))
    torch.manual_seed(0)
    native, cce = MaskedGPT(group, fusion=False), MaskedGPT(group)
    cce.load_state_dict(native.state_dict())
    weight = cce.output_layer.weight
    if accumulate:
        cce.config.gradient_accumulation_fusion = True
        weight.main_grad = torch.full_like(weight, 0.5)
        weight.grad_added_to_main_grad = False
    megatron_patch.install(cce, impl="cce")
    hidden, labels = _inputs(3)
    loss_mask = (torch.arange(B * S).view(B, S) % 3 != 0).float()
    h2 = hidden.detach().clone().requires_grad_()
    expected = native._postprocess(hidden, labels=labels, loss_mask=loss_mask)
    got = cce._postprocess(h2, labels=labels, loss_mask=loss_mask if pass_mask else None)
    (0.25 * (expected * loss_mask).sum()).backward()
    (0.25 * (got * loss_mask).sum()).backward()
    assert len(walks) == (1 if pass_mask else 0) and not recomputes
    assert_close_rel(h2.grad, hidden.grad, 1e-5, "hidden grad")
    weight_grad = weight.main_grad - 0.5 if accumulate else weight.grad
    assert_close_rel(weight_grad, native.output_layer.weight.grad, 1e-5, "weight grad")
