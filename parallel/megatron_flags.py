"""The megatron adapter's command-line side: ``--cross-entropy-fusion-impl cce`` and ``--cce-*``.

:func:`add_arguments` adds ``cce`` (alias ``linear``) to Megatron's ``--cross-entropy-fusion-impl``
choices. :func:`add_cce_arguments` adds one ``--cce-<option>`` flag (``--cce-softcap``,
``--cce-z-loss``, ``--cce-backward``, ...) per option the adapter passes to the op, each derived
from the :class:`~fused_lce.options.LCEOptions` field of the same name: its type gives the flag's
type and choices, the docstring under it the flag's help, so an option is declared once.
:func:`cce_options_from_args` reads the flags back from a parsed namespace and
:func:`check_cce_options` says which flags cannot run together. :func:`extra_args_provider` is
both adders in the form Megatron-LM takes.

This module only builds and reads flags; :mod:`fused_lce.parallel.megatron_patch` routes the
model's loss through the op. Neither imports megatron at import time.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass

CCE_CHOICES = ("cce", "linear")
"""The ``--cross-entropy-fusion-impl`` values that select our op."""
ADAPTER_OPTIONS = ("softcap", "z_loss", "label_smoothing", "impl", "backward", "filter_eps",
                   "scratch_mb", "deterministic", "round_logits", "keep_logits",
                   "fp32_weight_grad", "upstream_mismatch", "cuda_graphs", "vocab_size")
"""The options the adapter passes to the op: LCEOptions fields, and ``vocab_size``, an argument of
the vocab-parallel layer rather than a field, so it has no flag."""

CCE_FLAG_PREFIX = "cce_"
_OFF = "none"  # a flag's explicit None ("off"), told apart from "not given" (None)


def add_arguments(parser):
    """Add ``cce`` and ``linear`` to ``--cross-entropy-fusion-impl`` (adding the flag if absent)."""
    for action in parser._actions:
        if "--cross-entropy-fusion-impl" in action.option_strings:
            if action.choices is not None:
                action.choices = list(action.choices) + [
                    c for c in CCE_CHOICES if c not in action.choices
                ]
            return parser
    parser.add_argument(
        "--cross-entropy-fusion-impl",
        default="native",
        choices=["native", "te", *CCE_CHOICES],
        help="fused cross-entropy implementation; cce (alias linear): fused_lce's vocab-parallel "
        "linear cross-entropy, which never forms the logits",
    )
    return parser


def extra_args_provider(parser):
    """For Megatron-LM's ``parse_and_validate_args(extra_args_provider=...)`` (0.18+) or
    ``pretrain(..., extra_args_provider=...)`` (0.16, 0.17): the cce choices and the --cce-*
    flags."""
    return add_cce_arguments(add_arguments(parser))


def cce_flag(name: str) -> str:
    """The command-line flag of option ``name``: ``--cce-z-loss`` for ``z_loss``; for a bool
    that is on by default, the flag that turns it off (``--cce-no-fp32-weight-grad``)."""
    option = _option_fields()[name]
    negate = option.type is bool and option.default is True
    return "--cce-" + ("no-" if negate else "") + name.replace("_", "-")


def add_cce_arguments(parser: argparse.ArgumentParser, title: str | None = None):
    """Add a ``--cce-<option>`` flag for every option the adapter passes to the op.

    Each flag's type, choices and help come from the :class:`~fused_lce.options.LCEOptions`
    field of the same name. Every flag defaults to "not given" (the op's own default applies);
    a bool that is off by default is switched on by its flag, one that is on by default is
    switched off (``--cce-no-fp32-weight-grad``). Adding twice is harmless.
    """
    if any(CCE_FLAG_PREFIX + "impl" == action.dest for action in parser._actions):
        return parser
    group = parser.add_argument_group(
        title or "fused_lce options (with --cross-entropy-fusion-impl cce or linear)"
    )
    docs = _field_docs()
    for name, option in _option_fields().items():
        help_text = " ".join(docs.get(name, "").split()).replace("%", "%%")
        dest = CCE_FLAG_PREFIX + name
        if option.type is bool:
            if option.default:  # the docstring speaks of True and False: say what the flag sets
                help_text = f"Sets {name}=False (default True). {name}: {help_text}"
            group.add_argument(cce_flag(name), dest=dest, action="store_const",
                               const=not option.default, default=None, help=help_text)
            continue
        kwargs = _value_kwargs(name, option.type, none_allowed=option.default is not None)
        group.add_argument(cce_flag(name), dest=dest, default=None, help=help_text, **kwargs)
    return parser


def cce_options_from_args(args) -> dict:
    """The options given as ``--cce-*`` flags in ``args`` (a parsed namespace), by option name.

    Flags not given are left out, so the op's defaults apply. Values are not cross-checked
    here: :func:`check_cce_options` does that.
    """
    options = {}
    for name in _option_fields():
        value = getattr(args, CCE_FLAG_PREFIX + name, None)
        if value is not None:
            options[name] = None if value == _OFF else value
    return options


def check_cce_options(options: dict) -> None:
    """Raise ValueError naming the flags if ``options`` (from :func:`cce_options_from_args`)
    cannot run together."""
    if options.get("keep_logits") is True and options.get("backward") == "tiles":
        raise ValueError(
            "--cce-keep-logits needs the gemm backward (the tiles backward always recomputes "
            "the logits): drop --cce-backward tiles"
        )
    from fused_lce.options import LCEOptions

    try:
        LCEOptions(**options)
    except (TypeError, ValueError) as err:
        flags = ", ".join(f"{cce_flag(k)} {v}" for k, v in options.items())
        raise ValueError(f"{flags}: {err}") from None


@functools.cache
def _option_fields() -> dict:
    """The LCEOptions fields that get a flag, with their resolved types: those the adapter
    passes to the op, less any field marked as no user option (``metadata={"user": False}``,
    such as the environment the options were built in)."""
    from fused_lce.options import LCEOptions

    hints = typing.get_type_hints(LCEOptions)
    return {
        f.name: _Field(hints[f.name], f.default)
        for f in dataclasses.fields(LCEOptions)
        if f.name in ADAPTER_OPTIONS and f.metadata.get("user", True)
    }


@dataclass(frozen=True)
class _Field:
    type: object
    default: object


@functools.cache
def _field_docs() -> dict[str, str]:
    """Each LCEOptions field's docstring (the string literal under it), by name."""
    from fused_lce.options import LCEOptions

    body = ast.parse(textwrap.dedent(inspect.getsource(LCEOptions))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = after.value.value
    return docs


def _value_kwargs(name: str, hint, none_allowed: bool) -> dict:
    """argparse keywords (type, choices, metavar) for a field annotated ``hint``."""
    if typing.get_origin(hint) is typing.Literal:
        return {"choices": typing.get_args(hint)}
    members = typing.get_args(hint) or (hint,)
    words = [w for m in members if typing.get_origin(m) is typing.Literal
             for w in typing.get_args(m)]
    if type(None) in members and none_allowed:
        words.append(_OFF)
    numeric = [m for m in members if m in (int, float)]
    if not numeric:
        raise TypeError(f"LCEOptions.{name}: no command-line form for {hint}")
    number = numeric[0]
    if not words:
        return {"type": number}

    def parse(text: str):
        if text in words:
            return text
        try:
            return number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {', '.join(words)} or a number, got {text!r}"
            ) from None

    parse.__name__ = name
    return {"type": parse, "metavar": "{" + ",".join(words) + ",X}"}
