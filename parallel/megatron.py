"""megatron-core adapter: ``--cross-entropy-fusion-impl cce`` (alias ``linear``) runs our op.

How it hooks in. In megatron-core 0.16 to 0.19, ``GPTModel._postprocess`` computes

    logits, _ = self.output_layer(hidden_states, weight=output_weight, ...)
    loss = self.compute_language_model_loss(labels, logits)       # per-token loss [b, s]

:func:`install` wraps ``_postprocess`` (``forward`` in versions without it). When labels are given
and the model's config has ``cross_entropy_loss_fusion=True`` and ``cross_entropy_fusion_impl`` in
("cce", "linear"), then for that call the output layer returns a :class:`DeferredLogits` (its input,
weight and bias) instead of logits, and ``compute_language_model_loss`` turns it into Megatron's
per-token loss with :func:`fused_lce.parallel.vocab_parallel_linear_cross_entropy`. So the tied or
untied output weight, sequence parallelism (the hidden states arrive sequence-sharded), context
parallelism (each rank's tokens are its own) and multi-token prediction all follow Megatron's own
code, loss masks and schedules stay unchanged, and no logits tensor is formed. Without labels
(evaluation, generation) the ordinary logits path runs.

With gradient-accumulation fusion on (``config.gradient_accumulation_fusion`` and a ``main_grad``
on the weight), the weight gradient is added in fp32 straight into ``main_grad`` by our GEMMs,
following Megatron's protocol for it (``grad_added_to_main_grad``).

megatron-core is imported lazily: importing this module needs only torch.

The op's options reach it from a command line as ``--cce-...`` flags (``--cce-softcap``,
``--cce-z-loss``, ``--cce-backward``, ...): :func:`add_cce_arguments` derives them from the
:class:`~fused_lce.options.LCEOptions` fields and their docstrings, :func:`cce_options_from_args`
reads them back. Megatron-LM's own ``pretrain_gpt.py`` runs through
:mod:`fused_lce.parallel.megatron_lm` (docs/megatron.md).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch

CCE_CHOICES = ("cce", "linear")
_PATCHED = "_fused_lce_patched"
_OPTION_NAMES = ("softcap", "z_loss", "label_smoothing", "impl", "backward", "filter_eps",
                 "scratch_mb", "deterministic", "round_logits", "recompute_logits",
                 "fp32_weight_grad", "vocab_size")


@dataclass
class DeferredLogits:
    """What the output layer returns under cce: the matmul's operands, not its product."""

    hidden: torch.Tensor  # [s, b, h], or [s / tp, b, h] under sequence parallelism
    weight: torch.Tensor  # this rank's (V / tp, h) shard of the output weight
    bias: torch.Tensor | None
    sequence_parallel: bool


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


# The --cce-* flags, one per option the adapter passes to the op, derived from LCEOptions.
CCE_FLAG_PREFIX = "cce_"
_OFF = "none"  # a flag's explicit None ("off"), told apart from "not given" (None)
_FLAG_ALIASES = {"recompute_logits": ("--cce-keep-logits",)}


def cce_flag(name: str) -> str:
    """The command-line flag of option ``name``: ``--cce-z-loss`` for ``z_loss``; for a bool
    that is on by default, the flag that turns it off (``--cce-no-recompute-logits``)."""
    option = _option_fields()[name]
    negate = option.type is bool and option.default is True
    return "--cce-" + ("no-" if negate else "") + name.replace("_", "-")


def add_cce_arguments(parser: argparse.ArgumentParser, title: str | None = None):
    """Add a ``--cce-<option>`` flag for every option the adapter passes to the op.

    Each flag's type, choices and help come from the :class:`~fused_lce.options.LCEOptions`
    field of the same name. Every flag defaults to "not given" (the op's own default applies);
    a bool that is off by default is switched on by its flag, one that is on by default is
    switched off (``--cce-no-recompute-logits``, alias ``--cce-keep-logits``). Adding twice is
    harmless.
    """
    if any(CCE_FLAG_PREFIX + "impl" == action.dest for action in parser._actions):
        return parser
    group = parser.add_argument_group(
        title or "fused_lce options (with --cross-entropy-fusion-impl cce or linear)"
    )
    docs = _field_docs()
    for name, option in _option_fields().items():
        flags = [cce_flag(name), *_FLAG_ALIASES.get(name, ())]
        help_text = " ".join(docs.get(name, "").split()).replace("%", "%%")
        dest = CCE_FLAG_PREFIX + name
        if option.type is bool:
            if option.default:  # the docstring speaks of True and False: say what the flag sets
                help_text = f"Sets {name}=False (default True). {name}: {help_text}"
            group.add_argument(*flags, dest=dest, action="store_const",
                               const=not option.default, default=None, help=help_text)
            continue
        kwargs = _value_kwargs(name, option.type, none_allowed=option.default is not None)
        group.add_argument(*flags, dest=dest, default=None, help=help_text, **kwargs)
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
    if options.get("recompute_logits") is False and options.get("backward") == "tiles":
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
    """The LCEOptions fields the adapter accepts, with their resolved types."""
    from fused_lce.options import LCEOptions

    hints = typing.get_type_hints(LCEOptions)
    return {
        f.name: _Field(hints[f.name], f.default)
        for f in dataclasses.fields(LCEOptions)
        if f.name in _OPTION_NAMES
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


def wants_cce(config) -> bool:
    return bool(getattr(config, "cross_entropy_loss_fusion", False)) and (
        getattr(config, "cross_entropy_fusion_impl", None) in CCE_CHOICES
    )


def install(model=None, *, options_from: Callable[[], dict] | None = None, **options):
    """Route the loss of GPT models whose config asks for cce through our op.

    Args:
        model: a GPTModel, a wrapper (DDP, Float16Module, ...) or a list of them; every GPTModel
            inside is patched. None patches the GPTModel class, so every model built afterwards
            is (the Megatron-LM plugin route).
        options: passed to the op, each an ``LCEOptions`` field of the same name: ``softcap``,
            ``z_loss``, ``label_smoothing``, ``impl``, ``backward``, ``filter_eps``,
            ``scratch_mb``, ``deterministic``, ``round_logits``, ``recompute_logits``,
            ``fp32_weight_grad``; and
            ``vocab_size`` (the true vocabulary size when Megatron pads it; default: every row of
            the output weight is a class, as in Megatron's own loss).
        options_from: instead of ``options``, a function returning them, called at the first
            cce loss (Megatron-LM parses its command line after the plugin is installed).

    Installing twice is harmless: an already patched model or class is left as it is.
    """
    unknown = set(options) - set(_OPTION_NAMES)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; expected some of {_OPTION_NAMES}")
    # Bad values fail here, at install, rather than at the first training step.
    from fused_lce.options import LCEOptions

    LCEOptions(**{k: v for k, v in options.items() if k != "vocab_size"})
    if options_from is not None:
        if options:
            raise TypeError("install: pass options or options_from, not both")
        options = options_from
    if model is None:
        try:
            from megatron.core.models.gpt import GPTModel
        except ImportError as exc:
            raise ImportError(
                "--cross-entropy-fusion-impl cce needs megatron-core: pip install "
                "fused_lce[megatron]"
            ) from exc

        name = _hook_name(GPTModel)
        original = getattr(GPTModel, name)
        if not getattr(original, _PATCHED, False):
            setattr(GPTModel, name, _wrap(original, options))
        return None
    patched = 0
    for gpt in _gpt_models(model):
        name = _hook_name(type(gpt))
        if getattr(getattr(type(gpt), name), _PATCHED, False) or getattr(
            getattr(gpt, name), _PATCHED, False
        ):
            patched += 1
            continue
        setattr(gpt, name, types.MethodType(_wrap(getattr(type(gpt), name), options), gpt))
        patched += 1
    if patched == 0:
        raise ValueError("install(model): found no megatron language model inside `model`")
    return model


def _gpt_models(model):
    """Every language model inside ``model``, pipeline stages without an output layer included
    (their patched call simply takes the ordinary path)."""
    models = model if isinstance(model, (list, tuple)) else [model]
    for m in models:
        for module in m.modules():
            if hasattr(module, "compute_language_model_loss") and hasattr(module, "config"):
                yield module


def _hook_name(cls) -> str:
    return "_postprocess" if hasattr(cls, "_postprocess") else "forward"


def _wrap(function, options: dict | Callable[[], dict]):
    """``function`` (an unbound GPTModel method taking ``labels``) with the cce route;
    ``options`` may be a function giving them, called once, at the first cce call."""
    signature = inspect.signature(function)
    resolved = [options] if isinstance(options, dict) else []

    @functools.wraps(function)
    def wrapper(self, *args, **kwargs):
        arguments = signature.bind_partial(self, *args, **kwargs).arguments
        labels = arguments.get("labels")
        if (
            labels is None
            or not wants_cce(self.config)
            or getattr(self, "output_layer", None) is None
        ):
            return function(self, *args, **kwargs)
        if not resolved:
            resolved.append(options())
        with _deferred_output(self, resolved[0], arguments.get("loss_mask")):
            return function(self, *args, **kwargs)

    setattr(wrapper, _PATCHED, True)
    return wrapper


@contextlib.contextmanager
def _deferred_output(gpt, options: dict, loss_mask: torch.Tensor | None = None):
    """For one call: the output layer defers its matmul and the loss consumes the deferral.
    ``loss_mask`` (the forward's, [b, s]) tells the op what the loss function will weigh each
    token's loss by, so it can compute the gradients in its forward (fused_lce.forward_grad)."""
    layer = gpt.output_layer
    had_forward = "forward" in layer.__dict__
    saved_forward = layer.__dict__.get("forward")
    had_loss = "compute_language_model_loss" in gpt.__dict__
    saved_loss = gpt.__dict__.get("compute_language_model_loss")
    original_loss = gpt.compute_language_model_loss

    def deferred_forward(input_, weight=None, runtime_gather_output=None, **_):
        weight = layer.weight if weight is None else weight
        bias = getattr(layer, "bias", None)
        if getattr(layer, "skip_bias_add", False):
            bias = None
        sp = bool(getattr(layer, "sequence_parallel", False))
        return DeferredLogits(input_, weight, bias, sp), None

    def loss(labels, logits):
        if isinstance(logits, DeferredLogits):
            return _per_token_loss(gpt, labels, logits, options, loss_mask)
        return original_loss(labels, logits)

    layer.forward = deferred_forward
    gpt.compute_language_model_loss = loss
    try:
        yield
    finally:
        _restore(layer, "forward", had_forward, saved_forward)
        _restore(gpt, "compute_language_model_loss", had_loss, saved_loss)


def _restore(obj, name: str, had: bool, saved) -> None:
    if had:
        setattr(obj, name, saved)
    else:
        obj.__dict__.pop(name, None)


def _per_token_loss(gpt, labels: torch.Tensor, deferred: DeferredLogits, options: dict,
                    loss_mask: torch.Tensor | None = None):
    """Megatron's per-token loss [b, s] from labels [b, s] and the deferred output layer."""
    import torch.distributed as dist

    from .vocab_parallel import vocab_parallel_linear_cross_entropy

    group = _tensor_parallel_group(gpt)
    weight = deferred.weight
    # Megatron splits the (padded) vocabulary evenly: the layout is known (the per-call host
    # agreement still checks that it tiles the vocabulary).
    padded = weight.shape[0] * dist.get_world_size(group)
    expected = getattr(gpt, "vocab_size", padded)
    if padded != expected:
        raise ValueError(
            f"--cross-entropy-fusion-impl {gpt.config.cross_entropy_fusion_impl}: the output "
            f"weight shard has {weight.shape[0]} rows x TP={dist.get_world_size(group)} = "
            f"{padded}, but the model's vocabulary is {expected}; cce needs Megatron's even "
            "vocabulary split"
        )
    options = {"vocab_size": padded, **options}
    accumulator = None
    if getattr(gpt.config, "gradient_accumulation_fusion", False):
        accumulator = getattr(weight, "main_grad", None)
    if loss_mask is not None and tuple(loss_mask.shape) != tuple(labels.shape):
        loss_mask = None  # not the per-token mask of these labels (the op then assumes all ones)
    loss = vocab_parallel_linear_cross_entropy(
        deferred.hidden,
        weight,
        labels.transpose(0, 1).contiguous(),
        deferred.bias,
        group=group,
        vocab_start_index=dist.get_rank(group) * weight.shape[0],
        sequence_parallel=deferred.sequence_parallel,
        reduction="none",
        check_targets=False,  # as Megatron's own loss: no host sync per micro-batch
        weight_grad_accumulator=accumulator,
        loss_mask=None if loss_mask is None else loss_mask.transpose(0, 1).contiguous(),
        **options,
    )
    return loss.transpose(0, 1).contiguous()


def _tensor_parallel_group(gpt):
    collection = getattr(gpt, "pg_collection", None)
    if collection is not None and getattr(collection, "tp", None) is not None:
        return collection.tp
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()
