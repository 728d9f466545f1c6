"""The --cce-* flags: derived from LCEOptions, read back into the op's options, and (through
``install(options_from=...)``) resolved at the first cce loss, as Megatron-LM's route needs."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_rel
from helpers_megatron import FakeGPT, _inputs
from test_megatron_adapter import group  # noqa: F401 (group: a fixture)

from fused_lce.options import LCEOptions
from fused_lce.parallel import megatron_flags, megatron_patch


def _parser():
    return megatron_flags.add_cce_arguments(argparse.ArgumentParser(prog="x"))


def _flags_by_dest(parser):
    return {a.dest: a for a in parser._actions if a.dest.startswith("cce_")}


def test_one_flag_per_adapter_option_with_the_field_docstring():
    actions = _flags_by_dest(_parser())
    names = {f.name for f in dataclasses.fields(LCEOptions)} & set(megatron_flags.ADAPTER_OPTIONS)
    assert {d.removeprefix("cce_") for d in actions} == names
    assert actions["cce_keep_logits"].option_strings == ["--cce-keep-logits"]
    assert actions["cce_z_loss"].help.startswith("Coefficient of the ``lse**2`` penalty")
    assert tuple(actions["cce_impl"].choices) == ("auto", "cce", "chunked", "torch")
    assert tuple(actions["cce_backward"].choices) == ("auto", "in_forward", "gemm", "tiles")



def test_fields_that_are_no_user_option_get_no_flag(monkeypatch):
    """A field marked ``metadata={"user": False}`` (the environment the options were built in)
    gets no flag, even were it named among the adapter's options."""
    hidden = [f.name for f in dataclasses.fields(LCEOptions) if f.metadata.get("user") is False]
    assert "environment" in hidden
    monkeypatch.setattr(megatron_flags, "ADAPTER_OPTIONS",
                        (*megatron_flags.ADAPTER_OPTIONS, *hidden))
    megatron_flags._option_fields.cache_clear()
    try:
        fields = megatron_flags._option_fields()
    finally:
        megatron_flags._option_fields.cache_clear()
    assert "softcap" in fields and not set(hidden) & set(fields)

def test_adding_twice_is_harmless():
    parser = _parser()
    megatron_flags.add_cce_arguments(parser)
    assert len(_flags_by_dest(parser)) == len(_flags_by_dest(_parser()))


@pytest.mark.parametrize("argv, options", [
    ([], {}),
    (["--cce-softcap", "30", "--cce-z-loss", "1e-4", "--cce-label-smoothing", "0.1"],
     {"softcap": 30.0, "z_loss": 1e-4, "label_smoothing": 0.1}),
    (["--cce-filter-eps", "none"], {"filter_eps": None}),
    (["--cce-filter-eps", "paper", "--cce-backward", "tiles"],
     {"filter_eps": "paper", "backward": "tiles"}),
    (["--cce-filter-eps", "2.5e-4"], {"filter_eps": 2.5e-4}),
    (["--cce-keep-logits", "--cce-round-logits", "--cce-deterministic"],
     {"keep_logits": True, "round_logits": True, "deterministic": True}),
    (["--cce-impl", "chunked", "--cce-scratch-mb", "16"], {"impl": "chunked", "scratch_mb": 16.0}),
])
def test_flags_read_back_as_options(argv, options):
    got = megatron_flags.cce_options_from_args(_parser().parse_args(argv))
    assert got == options
    megatron_flags.check_cce_options(got)
    LCEOptions(**got)


@pytest.mark.parametrize("argv", [["--cce-filter-eps", "tiny"], ["--cce-backward", "fast"],
                                  ["--cce-softcap", "none"], ["--cce-z-loss", "x"]])
def test_malformed_flags_are_refused_by_the_parser(argv):
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)


@pytest.mark.parametrize("options, message", [
    ({"softcap": -1.0}, "--cce-softcap -1.0: softcap must be"),
    ({"label_smoothing": 2.0}, "label_smoothing must be in"),
    ({"keep_logits": True, "backward": "tiles"}, "--cce-keep-logits needs the gemm"),
])
def test_bad_values_name_their_flags(options, message):
    with pytest.raises(ValueError, match=message):
        megatron_flags.check_cce_options(options)


def test_options_from_is_read_once_at_the_first_cce_loss(group):  # noqa: F811
    torch.manual_seed(5)
    reads = []

    def options():
        reads.append(1)
        return {"softcap": 3.0, "impl": "chunked"}

    gpt = FakeGPT(group)
    reference = FakeGPT(group, fusion=False)
    reference.load_state_dict(gpt.state_dict())
    megatron_patch.install(gpt, options_from=options)
    assert reads == [], "options are read at the first cce loss, not at install"
    for seed in (11, 12):
        hidden, labels = _inputs(seed)
        got = gpt._postprocess(hidden, labels=labels)
        logits = 3.0 * torch.tanh(reference.output_layer(hidden)[0].double() / 3.0)
        expected = F.cross_entropy(logits.flatten(0, 1), labels.t().flatten(), reduction="none")
        assert_close_rel(got, expected.view(labels.t().shape).t(), 1e-5, "softcapped loss")
    assert reads == [1]


def test_options_and_options_from_together_are_refused(group):  # noqa: F811
    with pytest.raises(TypeError, match="options or options_from"):
        megatron_patch.install(FakeGPT(group), options_from=dict, softcap=3.0)
