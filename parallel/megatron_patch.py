"""The megatron-core adapter's model side: GPTModel's loss under ``--cross-entropy-fusion-impl cce``
(alias ``linear``) runs our op.

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

This module patches the model; the op's options reach it from a command line as ``--cce-...``
flags, built and read back by :mod:`fused_lce.parallel.megatron_flags`. Megatron-LM's own
``pretrain_gpt.py`` runs through :mod:`fused_lce.parallel.megatron_lm` (docs/megatron.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .megatron_flags import ADAPTER_OPTIONS, CCE_CHOICES

_PATCHED = "_fused_lce_patched"


@dataclass
class DeferredLogits:
    """What the output layer returns under cce: the matmul's operands, not its product."""

    hidden: torch.Tensor  # [s, b, h], or [s / tp, b, h] under sequence parallelism
    weight: torch.Tensor  # this rank's (V / tp, h) shard of the output weight
    bias: torch.Tensor | None
    sequence_parallel: bool


def wants_cce(config) -> bool:
    """Whether a model's ``config`` asks for our loss: the fusion on, its impl cce or linear."""
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
            ``scratch_mb``, ``deterministic``, ``round_logits``, ``keep_logits``,
            ``fp32_weight_grad``, ``upstream_mismatch`` (default "auto": with the forward's
            loss mask, which Megatron's loss meets, checked on the device, no sync),
            ``cuda_graphs`` (default True: the loss forward replayed from its own CUDA graph,
            outside Megatron's full-iteration capture); and
            ``vocab_size`` (the true vocabulary size when Megatron pads it; default: every row of
            the output weight is a class, as in Megatron's own loss).
        options_from: instead of ``options``, a function returning them, called at the first
            cce loss (Megatron-LM parses its command line after the plugin is installed).

    Installing twice is harmless: an already patched model or class is left as it is.
    """
    unknown = set(options) - set(ADAPTER_OPTIONS)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; expected some of {ADAPTER_OPTIONS}")
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
        with _deferred_output(self, resolved[0], arguments.get("loss_mask"), labels):
            return function(self, *args, **kwargs)

    setattr(wrapper, _PATCHED, True)
    return wrapper


@contextlib.contextmanager
def _deferred_output(gpt, options: dict, loss_mask: torch.Tensor | None = None,
                     labels: torch.Tensor | None = None):
    """For one call: the output layer defers its matmul and the loss consumes the deferral.
    ``loss_mask`` (the forward's, [b, s]) tells the op what the loss function will weigh each
    token's loss by, so it can compute the gradients in its forward (fused_lce.token_walk).
    It is passed only for the loss of the forward's own ``labels``: multi-token prediction's
    losses, of rolled labels, weigh tokens by a rolled mask, so they go without one and take the
    recomputing backward (exact for any weights, no host sync)."""
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

    def loss(call_labels, logits):
        if isinstance(logits, DeferredLogits):
            vouched = loss_mask is not None and call_labels is labels
            return _per_token_loss(gpt, call_labels, logits, options, loss_mask, vouched)
        return original_loss(call_labels, logits)

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
                    loss_mask: torch.Tensor | None = None, vouched: bool = False):
    """Megatron's per-token loss [b, s] from labels [b, s] and the deferred output layer.
    ``vouched``: Megatron's loss function will weigh these losses by ``loss_mask`` times one
    number, so the backward need not read its verdict on the host."""
    import torch.distributed as dist

    from .vocab_parallel import vocab_parallel_linear_cross_entropy

    group = _tensor_parallel_group(gpt)
    weight = deferred.weight
    # Megatron splits the (padded) vocabulary evenly: the layout is known (the host agreement
    # still checks, at the first call, that it tiles the vocabulary).
    padded = weight.shape[0] * dist.get_world_size(group)
    expected = getattr(gpt, "vocab_size", padded)
    if padded != expected:
        raise ValueError(
            f"--cross-entropy-fusion-impl {gpt.config.cross_entropy_fusion_impl}: the output "
            f"weight shard has {weight.shape[0]} rows x TP={dist.get_world_size(group)} = "
            f"{padded}, but the model's vocabulary is {expected}; cce needs Megatron's even "
            "vocabulary split"
        )
    if not vouched or loss_mask is None or tuple(loss_mask.shape) != tuple(labels.shape):
        # Not the per-token mask these losses will be weighed by: without one the op takes the
        # recomputing backward, exact whatever the weights.
        loss_mask = None
    options = {"vocab_size": padded, **options}
    accumulator = None
    if getattr(gpt.config, "gradient_accumulation_fusion", False):
        accumulator = getattr(weight, "main_grad", None)
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
        agree_every_call=False,  # nor a barrier of the ranks' hosts: their calls are the same
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
