"""The front door: ``linear_cross_entropy`` and the ``LinearCrossEntropy`` module.

Every argument is checked here, before any kernel runs, and then one ``LCEOptions`` travels to the
chosen implementation:

- ``"cce"``: Triton kernels (fused_lce.triton_shard), the product on GPUs;
- ``"chunked"``: pure PyTorch, vocabulary or token chunks (fused_lce.chunked), any device;
- ``"torch"``: full logits (fused_lce.reference), the oracle;
- ``"auto"``: cce on CUDA for 16/32-bit floats, chunked elsewhere.
"""

from __future__ import annotations

import ast
import functools
import math

import torch
from torch import nn

# validate, resolve_impl, class_ids and check_target_range live in checks.py, shared with the
# vocab-parallel layer; they stay importable from here.
from . import faults
from .checks import (  # noqa: F401
    autocast_on,
    autocast_operands,
    check_flag,
    check_loss_mask,
    check_target_range,
    class_ids,
    resolve_impl,
    validate,
)
from .custom_ops import fake_gradients, fake_loss, register_loss_autograd, rerun_gradients
from .engine import LCEFunction
from .options import LCEOptions, refuse_renamed, refusing_renamed, without_backward_options
from .shard import ShardCall, ShardStrategy


@refusing_renamed
def linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    impl: str = "auto",
    return_lse: bool = False,
    num_classes: int | None = None,
    backward: str = "auto",
    filter_eps: float | str | None = "safe",
    vocab_sort: bool = True,
    deterministic: bool = False,
    round_logits: bool = False,
    keep_logits: bool = False,
    fp32_weight_grad: bool = True,
    upstream_mismatch: str = "auto",
    chunk_by: str = "vocab",
    vocab_chunk_size: int | None = None,
    token_chunk_size: int | None = None,
    scratch_mb: float | None = None,
    tma: bool | None = None,
    cuda_graphs: bool = True,
    check_targets: bool = True,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``softcap(input @ weight.T + bias)`` against ``target``, without logits.

    Equals ``F.cross_entropy(softcap_fn(input @ weight.T + bias).float(), target, ...)`` plus
    ``z_loss * logsumexp(logits)**2`` per non-ignored token (fused_lce.options has the formula).

    Args:
        input: (..., D) hidden states, float16 / bfloat16 / float32 (float64 outside cce).
        weight: (V, D) classifier, same dtype and device as ``input``.
        target: (...) class ids (int64, int32, int16, int8 or uint8), the shape of ``input``
            without its last dimension.
        bias: (V,) or None.
        ignore_index: target value that contributes no loss and no gradient.
        reduction: "mean" (over non-ignored tokens), "sum" or "none" (loss of shape ``target``).
        label_smoothing: in [0, 1], torch's convention.
        softcap: cap logits with ``softcap * tanh(x / softcap)``; None for no cap.
        z_loss: coefficient of ``lse**2`` per token.
        impl: "auto", "cce", "chunked" or "torch".
        return_lse: also return the (differentiable) per-token log-sum-exp, shape ``target``,
            fp32; 0 for ignored tokens.
        num_classes: weight rows at or past this index are vocabulary padding, not classes.
        backward: cce backward, "auto", "in_forward" (gradients computed in the forward, three
            GEMMs), "gemm" (gradient chunks + GEMMs in the backward) or "tiles" (fused tile
            kernel with gradient filtering and vocab sorting). "auto" computes in the forward
            where it fits, except for fp16, whose gradients need the loss scale before their
            cast (docs/algorithm.md, "fp16: gradients after the loss scale").
        filter_eps: tiles backward filtering: "safe" (default), "paper", a float, or None (off).
        vocab_sort: tiles backward: walk the vocabulary by mean logit so negligible tiles cluster.
        deterministic: bitwise repeatable results (cce: no order-dependent atomics).
        round_logits: cce: round each bf16 logit to bf16 before the softmax, as a layer that
            stores bf16 logits does (off: exact fp32 logits). fp16 logits are always rounded
            to fp16, so a logit past 65504 gives a non-finite loss on every path, as in torch.
        keep_logits: cce: keep the logits (as 16-bit exponentials, N x V) from the forward so
            the backward skips recomputing them: faster, at a bf16 logits tensor's memory.
        fp32_weight_grad: cce, gradient-in-forward backward: sum the weight gradient over
            token chunks in fp32 (False: in the weight's dtype, one rounding a chunk, as Liger
            does, so a tight ``scratch_mb`` needs no fp32 accumulator).
        upstream_mismatch: reduction "none": "auto" computes the gradients in the forward for
            ``c * loss_mask`` when ``loss_mask`` is given (checked as "nan"), else takes the
            recomputing backward (exact for any upstream gradient); "nan": where the per-token
            upstream gradient is not ``c * loss_mask``, NaN gradients and a later call raises
            (no host sync); "recompute": such gradients recomputed exactly (one host sync a
            backward).
        chunk_by: chunked impl: "vocab" or "tokens" (gradients in the forward, as cce's default).
        vocab_chunk_size, token_chunk_size: chunk sizes of the chunked impl (env overrides:
            FUSED_LCE_VOCAB_CHUNK, FUSED_LCE_TOKEN_CHUNK).
        scratch_mb: cce backward buffer budget in MiB (env FUSED_LCE_SCRATCH_MB, 512); 12
            (``fused_lce.options.LEAN_SCRATCH_MB``) is the lean mode, under 16 MiB in all.
        tma: cce: False keeps the pointer kernels rather than TMA tensor descriptors (env
            FUSED_LCE_TMA=0); None: the environment's choice, on by default.
        cuda_graphs: cce on a GPU: capture the training forward as a CUDA graph at the second
            call of a shape and replay it after (host cost of one launch); False: eager.
        check_targets: check for targets outside [0, num_classes) on the device, without a host
            sync: such a call's loss and gradients are NaN and it raises ValueError where its
            verdict reaches the host (CPU: in the call; GPU: a later call, or
            ``fused_lce.raise_deferred_errors()``). ``impl="torch"`` checks at once. False for
            tensors on the meta device, which hold no values.

    Returns:
        The loss (fp32; fp64 for fp64 inputs), and with ``return_lse`` the pair (loss, lse).

    Under ``torch.autocast`` the GEMMs take autocast's dtype, as ``F.linear``'s do (16- and
    32-bit inputs, weight and bias are cast; float64 is left alone), and the statistics and the
    loss stay fp32; gradients reach the leaves in their own dtypes.

    Per-token losses of confident tokens keep fp32's relative precision, as torch's do
    (fused_lce.terms). Any strides are accepted. With D = 0 the logits are the bias (or 0), as
    torch gives. Second-order gradients (``create_graph=True``), ``torch.func`` transforms
    (vmap, grad, jacrev, ...) and batched gradients (``is_grads_batched=True``) work with
    ``impl="torch"``; the other impls raise a RuntimeError saying so (``chunk_by="tokens"``
    takes batched gradients). On the meta device only ``impl="torch"`` runs (shapes and dtypes,
    with ``check_targets=False``).
    """
    if torch.compiler.is_compiling():
        loss, lse = _compiled_call(
            input, weight, target, bias, loss_mask, check_targets, ignore_index=ignore_index,
            reduction=reduction, label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
            num_classes=num_classes, backward=backward, filter_eps=filter_eps,
            vocab_sort=vocab_sort, deterministic=deterministic, round_logits=round_logits,
            keep_logits=keep_logits, fp32_weight_grad=fp32_weight_grad,
            upstream_mismatch=upstream_mismatch, impl=impl, chunk_by=chunk_by,
            vocab_chunk_size=vocab_chunk_size, token_chunk_size=token_chunk_size,
            scratch_mb=scratch_mb, tma=tma, cuda_graphs=cuda_graphs)
        return (loss, lse) if return_lse else loss
    check_flag("return_lse", return_lse)
    check_flag("check_targets", check_targets)
    opts = LCEOptions(
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        softcap=softcap,
        z_loss=z_loss,
        num_classes=num_classes,
        backward=backward,
        filter_eps=filter_eps,
        vocab_sort=vocab_sort,
        deterministic=deterministic,
        round_logits=round_logits,
        keep_logits=keep_logits,
        fp32_weight_grad=fp32_weight_grad,
        upstream_mismatch=upstream_mismatch,
        impl=impl,
        chunk_by=chunk_by,
        vocab_chunk_size=vocab_chunk_size,
        token_chunk_size=token_chunk_size,
        scratch_mb=scratch_mb,
        tma=tma,
        cuda_graphs=cuda_graphs,
    )
    loss, lse = _dispatch(input, weight, target, bias, opts, check_targets, loss_mask)
    return (loss, lse) if return_lse else loss


class LinearCrossEntropy(nn.Module):
    """Module form of :func:`linear_cross_entropy`; holds the options, not the weight.

    ``forward(input, weight, target, bias=None)``; the keyword arguments of the constructor are
    those of :func:`linear_cross_entropy`.
    """

    def __init__(self, **options) -> None:
        super().__init__()
        refuse_renamed(options)
        self.return_lse = options.pop("return_lse", False)
        self.check_targets = options.pop("check_targets", True)
        check_flag("return_lse", self.return_lse)
        check_flag("check_targets", self.check_targets)
        self.options = LCEOptions(**options)

    def forward(
        self,
        input: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ):
        if torch.compiler.is_compiling():
            fields = {name: getattr(self.options, name) for name in _WORDS + _NUMBERS}
            loss, lse = _compiled_call(input, weight, target, bias, loss_mask,
                                       self.check_targets, **fields)
        else:
            loss, lse = _dispatch(input, weight, target, bias, self.options, self.check_targets,
                                  loss_mask)
        return (loss, lse) if self.return_lse else loss

    def extra_repr(self) -> str:
        return repr(self.options)


def _dispatch(input, weight, target, bias, opts: LCEOptions, check_targets: bool,
              loss_mask: torch.Tensor | None = None):
    if isinstance(input, torch.Tensor):
        faults.raise_found(input.device)  # an earlier call's fault, once its verdict is here
    if not autocast_on(input):
        return _run(input, weight, target, bias, opts, check_targets, loss_mask)
    # Under autocast the GEMMs take its dtype, as F.linear's do; inside, every dtype is the
    # op's own choice (fp32 statistics), so autocast is off there.
    input, weight, bias = autocast_operands(input, weight, bias)
    with torch.autocast(input.device.type, enabled=False):
        return _run(input, weight, target, bias, opts, check_targets, loss_mask)


def _run(input, weight, target, bias, opts: LCEOptions, check_targets: bool,
         loss_mask: torch.Tensor | None):
    validate(input, weight, target, bias, opts, check_targets=False)
    check_loss_mask(loss_mask, target, opts.reduction)
    impl = resolve_impl(opts, input.device, input.dtype)
    n_classes = weight.shape[0] if opts.num_classes is None else opts.num_classes
    if check_targets and impl == "torch":
        check_target_range(target, opts.ignore_index, n_classes)
    batch_shape = target.shape
    # Not reshape(-1, D): with D = 0 the -1 is ambiguous.
    hidden = input.reshape(math.prod(batch_shape), input.shape[-1])
    flat_target = class_ids(target).reshape(-1)
    if impl == "cce" and hidden.shape[0] > 0:
        from .triton_shard import TritonShard

        loss, lse = single_device_loss(
            hidden, weight, flat_target, bias, without_backward_options(opts, hidden, weight, bias),
            TritonShard, caller="linear_cross_entropy(impl='cce')", loss_mask=loss_mask,
            check_targets=check_targets)
    elif impl == "chunked" and hidden.shape[0] > 0:
        from .chunked import ChunkedShard

        loss, lse = single_device_loss(hidden, weight, flat_target, bias, opts, ChunkedShard,
                                       caller=f"linear_cross_entropy(impl='chunked', "
                                              f"chunk_by={opts.chunk_by!r})",
                                       loss_mask=loss_mask, check_targets=check_targets)
    else:
        from .reference import reference_linear_cross_entropy

        loss, lse = reference_linear_cross_entropy(hidden, weight, flat_target, bias, opts)
        lse = torch.where(flat_target != opts.ignore_index, lse, torch.zeros_like(lse))
    if opts.reduction == "none":
        loss = loss.reshape(batch_shape)
    return loss, lse.reshape(batch_shape)


# ---------------------------------------------------------------------------------------------
# torch.compile: the op as one node of the compiled graph
# ---------------------------------------------------------------------------------------------
#
# Dynamo cannot trace the op's Python (its options snapshot the environment, its checks branch
# on what they find), so while compiling, ``linear_cross_entropy`` calls two custom ops instead:
# ``fused_lce::loss`` runs the eager op on its inputs without autograd and gives (loss, lse);
# ``fused_lce::loss_backward`` runs it again with autograd and returns the gradients of what
# the compiled graph sends back. The graph holds each as one node, with fake kernels giving
# the shapes, so ``fullgraph=True`` and dynamic shapes trace. The price: the forward's GEMM is
# run twice (four GEMMs, as ``backward="gemm"``). The options travel as one string of their
# words (strings, flags) and as typed numbers: under dynamic shapes Dynamo may trace a number
# symbolically, and cannot then spell it.

_WORDS = ("reduction", "backward", "filter_eps", "vocab_sort", "round_logits", "keep_logits",
          "fp32_weight_grad", "upstream_mismatch", "deterministic", "impl", "chunk_by", "tma",
          "cuda_graphs")
_NUMBERS = ("ignore_index", "label_smoothing", "softcap", "z_loss", "num_classes", "filter_eps",
            "vocab_chunk_size", "token_chunk_size", "scratch_mb")
_NUMBERS_SCHEMA = ("int ignore_index, float label_smoothing, float? softcap, float z_loss, "
                   "int? num_classes, float? filter_eps, int? vocab_chunk_size, "
                   "int? token_chunk_size, float? scratch_mb")


def _compiled_call(input, weight, target, bias, loss_mask, check_targets, **options):
    """(loss, lse) through the custom ops, the options given by name."""
    filter_eps = options["filter_eps"]
    spelled = isinstance(filter_eps, str)
    words = [repr("number" if name == "filter_eps" and not spelled else options[name])
             for name in _WORDS]
    numbers = [None if name == "filter_eps" and spelled else options[name] for name in _NUMBERS]
    return torch.ops.fused_lce.loss(input, weight, target, bias, loss_mask, ", ".join(words),
                                    *numbers, check_targets)


@functools.lru_cache(maxsize=64)
def _compiled_options(words: str, *numbers) -> LCEOptions:
    """The options of a compiled call, from the words and numbers ``linear_cross_entropy``
    passed (``filter_eps`` is a word where it is one, else a number)."""
    options = dict(zip(_WORDS, ast.literal_eval(f"({words},)"), strict=True))
    given = dict(zip(_NUMBERS, numbers, strict=True))
    if options["filter_eps"] == "number":
        options["filter_eps"] = given["filter_eps"]
    del given["filter_eps"]
    return LCEOptions(**options, **given)


@torch.library.custom_op(
    "fused_lce::loss", mutates_args=(),
    schema="(Tensor input, Tensor weight, Tensor target, Tensor? bias, Tensor? loss_mask, "
           f"str words, {_NUMBERS_SCHEMA}, bool check_targets) -> (Tensor, Tensor)")
def _compiled_loss(input, weight, target, bias, loss_mask, words, *rest):
    *numbers, check_targets = rest
    with torch.no_grad():
        return _dispatch(input, weight, target, bias, _compiled_options(words, *numbers),
                         check_targets, loss_mask)


@_compiled_loss.register_fake
def _(input, weight, target, bias, loss_mask, words, *rest):
    return fake_loss(input, target, ast.literal_eval(f"({words},)")[0])  # reduction: the first


@torch.library.custom_op(
    "fused_lce::loss_backward", mutates_args=(),
    schema="(Tensor? grad_loss, Tensor? grad_lse, Tensor input, Tensor weight, Tensor target, "
           f"Tensor? bias, Tensor? loss_mask, bool[] needs, str words, {_NUMBERS_SCHEMA}) "
           "-> (Tensor, Tensor, Tensor)")
def _compiled_loss_backward(grad_loss, grad_lse, input, weight, target, bias, loss_mask, needs,
                            words, *numbers):
    def call(input, weight, bias):  # the targets were checked by the forward
        return _dispatch(input, weight, target, bias, _compiled_options(words, *numbers), False,
                         loss_mask)

    return rerun_gradients(call, grad_loss, grad_lse, input, weight, bias, needs)


@_compiled_loss_backward.register_fake
def _(grad_loss, grad_lse, input, weight, target, bias, *rest):
    return fake_gradients(input, weight, bias)


register_loss_autograd(_compiled_loss, _compiled_loss_backward, trailing=1)  # check_targets


def single_device_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    opts: LCEOptions,
    strategy: ShardStrategy,
    *,
    caller: str,
    loss_mask: torch.Tensor | None = None,
    check_targets: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) of hidden (N, D) against the whole weight (V, D) on one device.
    ``check_targets``: check them on the device (fused_lce/faults.py); ``caller``: what the
    errors name."""
    if opts.num_classes is not None:
        # Autograd of the slice gives the padding rows their zero gradient.
        weight = weight[: opts.num_classes]
        bias = None if bias is None else bias[: opts.num_classes]
    n_classes = weight.shape[0]
    call = ShardCall(opts, strategy, vocab_start=0, local_classes=n_classes,
                     num_classes=n_classes,
                     loss_mask=None if loss_mask is None else loss_mask.reshape(-1),
                     check_targets=check_targets, caller=caller,
                     grad_enabled=torch.is_grad_enabled())
    return LCEFunction.apply(hidden, weight, bias, target, call)
