"""Each option is declared once, as an LCEOptions field with its docstring: the public keyword
lists, the Megatron adapter's option names and docstring, and docs/algorithm.md's table are
checked against the fields here."""

import inspect
import re
from pathlib import Path

from fused_lce import linear_cross_entropy
from fused_lce.options import user_fields
from fused_lce.parallel import megatron_flags, megatron_patch, vocab_parallel_linear_cross_entropy

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {f.name: f.default for f in user_fields()}
# Keywords that are not options of the computation: what the call returns or checks, and the
# vocab-parallel layer's own arguments.
CALL_KEYWORDS = {"return_lse", "check_targets", "loss_mask"}
PARALLEL_KEYWORDS = {"group", "vocab_start_index", "vocab_size", "sequence_parallel",
                     "weight_grad_accumulator", "agree_every_call"}
# The vocab-parallel layer has no padding rows of its own (vocab_size) and chunks by vocabulary.
NOT_IN_PARALLEL = {"num_classes", "chunk_by"}


def _keywords(fn) -> dict:
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_linear_cross_entropy_takes_every_option_with_its_default():
    keywords = _keywords(linear_cross_entropy)
    options = {k: v for k, v in keywords.items() if k not in CALL_KEYWORDS}
    assert options == FIELDS
    assert set(keywords) - set(options) == CALL_KEYWORDS


def test_vocab_parallel_takes_the_options_with_their_defaults():
    keywords = _keywords(vocab_parallel_linear_cross_entropy)
    options = {k: v for k, v in keywords.items()
               if k not in CALL_KEYWORDS | PARALLEL_KEYWORDS}
    expected = {k: v for k, v in FIELDS.items() if k not in NOT_IN_PARALLEL}
    assert options == expected
    assert set(keywords) - set(options) == CALL_KEYWORDS | PARALLEL_KEYWORDS


def test_megatron_adapter_options_are_fields_and_documented():
    options = set(megatron_flags.ADAPTER_OPTIONS)
    assert options - {"vocab_size"} <= set(FIELDS), options - {"vocab_size"} - set(FIELDS)
    install_doc = megatron_patch.install.__doc__.split("options_from:")[0]
    documented = set(re.findall(r"``(\w+)``", install_doc))
    assert options <= documented, options - documented


def test_algorithm_page_lists_every_option_with_its_default():
    text = (ROOT / "docs" / "algorithm.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", text, flags=re.M))
    for name, default in FIELDS.items():
        assert name in rows, f"docs/algorithm.md's options table lacks `{name}`"
        if default is not None and name != "scratch_mb":
            assert rows[name].strip().strip('"') == str(default), (name, rows[name], default)
    for name in CALL_KEYWORDS:
        assert name in rows, name
