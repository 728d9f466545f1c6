"""The Megatron-LM plugin against the ``megatron/training`` that ships in megatron-core >= 0.19.

megatron-core 0.16.1 (CI, Python 3.11) has no ``megatron.training``: the parser tests skip there
and run on the GPU machines (Python 3.12, the 0.19 wheel); the class-level install needs only
megatron.core and runs everywhere. The adapter's model-level behaviour is tested on CPU in
test_megatron_adapter.py and through the launcher in test_launcher.py.
"""

from __future__ import annotations

import sys

import pytest

from fused_lce.parallel import megatron_flags, megatron_patch

pytest.importorskip("megatron.core")


@pytest.fixture
def arguments():
    """megatron/training's argument module (megatron-core >= 0.19), or a skip."""
    return pytest.importorskip("megatron.training.arguments")


def _parse(arguments, monkeypatch, flags):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    return arguments.parse_args(
        extra_args_provider=megatron_flags.extra_args_provider, ignore_unknown_args=True
    )


@pytest.mark.parametrize("impl", ["cce", "linear", "native"])
def test_megatron_lm_parser_accepts_cce(arguments, monkeypatch, impl):
    args = _parse(arguments, monkeypatch,
                  ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", impl])
    assert args.cross_entropy_loss_fusion
    assert args.cross_entropy_fusion_impl == impl


def test_megatron_lm_parser_rejects_unknown_impl(arguments, monkeypatch):
    with pytest.raises(SystemExit):
        _parse(arguments, monkeypatch, ["--cross-entropy-fusion-impl", "nonsense"])


def test_extending_twice_is_harmless(arguments, monkeypatch):
    def provider(parser):
        return megatron_flags.extra_args_provider(megatron_flags.extra_args_provider(parser))

    monkeypatch.setattr(sys, "argv", ["x", "--cross-entropy-fusion-impl", "cce"])
    args = arguments.parse_args(extra_args_provider=provider, ignore_unknown_args=True)
    assert args.cross_entropy_fusion_impl == "cce"


def test_class_level_install_is_idempotent(monkeypatch):
    from megatron.core.models.gpt import GPTModel

    original = GPTModel._postprocess
    monkeypatch.setattr(GPTModel, "_postprocess", original)  # restored after the test
    megatron_patch.install()
    first = GPTModel._postprocess
    assert first is not original and getattr(first, "_fused_lce_patched", False)
    megatron_patch.install()
    assert GPTModel._postprocess is first
