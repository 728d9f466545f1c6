"""The Megatron-LM plugin against the ``megatron/training`` that ships in megatron-core >= 0.19.

megatron-core 0.16.1 (CI, Python 3.11) has no ``megatron.training``: these tests skip there and
run on the GPU machines (Python 3.12, the 0.19 wheel). The adapter's model-level behaviour is
tested on CPU in test_megatron_adapter.py and through the launcher in test_launcher.py.
"""

from __future__ import annotations

import sys

import pytest

arguments = pytest.importorskip("megatron.training.arguments")

from fused_lce.parallel import megatron as lce_megatron  # noqa: E402


def _parse(monkeypatch, flags):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    return arguments.parse_args(
        extra_args_provider=lce_megatron.extra_args_provider, ignore_unknown_args=True
    )


@pytest.mark.parametrize("impl", ["cce", "linear", "native"])
def test_megatron_lm_parser_accepts_cce(monkeypatch, impl):
    args = _parse(monkeypatch, ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", impl])
    assert args.cross_entropy_loss_fusion
    assert args.cross_entropy_fusion_impl == impl


def test_megatron_lm_parser_rejects_unknown_impl(monkeypatch):
    with pytest.raises(SystemExit):
        _parse(monkeypatch, ["--cross-entropy-fusion-impl", "nonsense"])


def test_extending_twice_is_harmless(monkeypatch):
    def provider(parser):
        return lce_megatron.extra_args_provider(lce_megatron.extra_args_provider(parser))

    monkeypatch.setattr(sys, "argv", ["x", "--cross-entropy-fusion-impl", "cce"])
    args = arguments.parse_args(extra_args_provider=provider, ignore_unknown_args=True)
    assert args.cross_entropy_fusion_impl == "cce"


def test_class_level_install_is_idempotent():
    from megatron.core.models.gpt import GPTModel

    lce_megatron.install()
    first = GPTModel._postprocess
    lce_megatron.install()
    assert GPTModel._postprocess is first
    assert getattr(first, "_fused_lce_patched", False)
