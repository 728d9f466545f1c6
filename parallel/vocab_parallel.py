"""Vocab-parallel cut cross-entropy: each tensor-parallel rank holds a shard of the classifier.

Rank r holds rows ``[start_r, start_r + V_r)`` of the (V, D) classifier weight. Every rank sees all
N tokens (with sequence parallelism it holds N / TP of them and gathers the rest). The loss needs
per token only the global log-sum-exp, the target logit and (for label smoothing) the sum of
logits, all of which combine across shards:

    M   = max_r m_r                                  (one all-reduce MAX)
    S   = sum_r s_r exp(m_r - M),  lse = M + log S   (packed into one all-reduce SUM with
    z_y = sum_r z_y,r  (0 off the owning rank)        the target logit and the row sum)
    nll = (M - z_y) + log S                          (fused_lce.terms: exact where y holds M)

Each shard's (m_r, s_r) come from the same kernels as the single-device op, so nothing of size
N x V_r is ever stored. By default (fused_lce/token_walk.py) the forward walks token chunks of
R rows: each chunk's statistics are combined as above, then its logits become the logit gradient
against the global lse, and the shard's weight gradient and partial input gradient are summed
there; the backward scales them by the upstream gradient, or, where that is not the one the
forward assumed, recomputes. The recomputing backwards (``backward="gemm"``/``"tiles"``, the lean
budget) take the statistics in the forward and recompute each shard's logit tiles against the
global lse in the backward, filtering included (the filter's budget is set by the global V). An
evaluation call walks the chunks training walks, statistics only.

Collective budget per call (N tokens in the TP group, D hidden, TP ranks, R rows a chunk):

    forward   SP only: all-gather hidden   [N/TP x D -> N x D], input dtype
              check_targets only: all-reduce MAX [2] int64, the targets' extremes (the device's
                                            verdict, read by the host only once it is there:
                                            fused_lce/faults.py)
              bf16 walk only: all-reduce SUM [N] fp32, every row's target logit, once before
                                            the first chunk (the exponentials' offsets;
                                            kernels/exp_logits.py)
              per chunk (default; one chunk of N rows for the recomputing backwards):
              all-reduce MAX               [R] fp32
              all-reduce SUM               [2R] fp32, [3R] with label smoothing
    backward  reduction "none" with loss_mask: all-reduce MAX [1] fp32, the ranks' verdicts on
                                            the assumed upstream gradient, left on the device
                                            (read on the host, one sync, only with
                                            upstream_mismatch="recompute")
              recompute only, SP only: all-gather hidden [N/TP x D -> N x D], input dtype
                                            (re-gathered rather than saved: saves (TP-1)/TP of
                                            N x D per layer)
              all-reduce SUM d_hidden       [N x D] fp32, or with SP
              reduce-scatter d_hidden       [N x D -> N/TP x D] fp32, in place on NCCL
    per call  agreement all-gather          [TP x 5] int64 on the host (gloo; no device sync),
                                            before any other collective: shapes, options and
                                            layout agree, the verdicts of every rank's checks
                                            (parallel/agreement.py); with
                                            ``agree_every_call=False`` only where this rank's
                                            call changed
"""

from __future__ import annotations

import ast

import torch
import torch.distributed as dist

from fused_lce import faults
from fused_lce.checks import (
    autocast_on,
    autocast_operands,
    check_flag,
    check_loss_mask,
    class_ids,
    resolve_impl,
    validate,
)
from fused_lce.custom_ops import (
    fake_gradients,
    fake_loss,
    register_loss_autograd,
    rerun_gradients,
)
from fused_lce.engine import LCEFunction
from fused_lce.options import LCEOptions, refusing_renamed, without_backward_options
from fused_lce.shard import ShardCall

from . import agreement, comm


@refusing_renamed
def vocab_parallel_linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
    sequence_parallel: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    impl: str = "auto",
    return_lse: bool = False,
    backward: str = "auto",
    filter_eps: float | str | None = "safe",
    vocab_sort: bool = True,
    deterministic: bool = False,
    round_logits: bool = False,
    keep_logits: bool = False,
    fp32_weight_grad: bool = True,
    upstream_mismatch: str = "auto",
    vocab_chunk_size: int | None = None,
    token_chunk_size: int | None = None,
    scratch_mb: float | None = None,
    tma: bool | None = None,
    cuda_graphs: bool = True,
    check_targets: bool = True,
    weight_grad_accumulator: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    agree_every_call: bool = True,
):
    """Linear cross-entropy with the classifier split over the vocabulary across ``group``.

    The result, and each rank's gradients, equal :func:`fused_lce.linear_cross_entropy` on the
    concatenated weight: every rank returns the same loss, the gradient of its own weight shard
    and the full (or, with SP, its sequence shard of the) input gradient.

    Args:
        input: (S, ..., D) hidden states; with ``sequence_parallel`` this rank's contiguous shard
            of the first (sequence) dimension, (S / TP, ..., D).
        weight: (V_local, D) this rank's shard of the classifier; shards may be uneven.
        target: (S, ...) global class ids for the whole sequence (labels are not sequence-
            sharded, as in Megatron); ``ignore_index`` marks ignored tokens.
        bias: (V_local,) this rank's shard of the bias, or None.
        group: the tensor-parallel process group (None: the default group).
        vocab_start_index: global id of this shard's first row; default from the group's shard
            sizes (shards in rank order). Give it on every rank or on none; the shards must
            tile the vocabulary without gap or overlap (checked on every call).
        vocab_size: the true number of classes; rows at or past it (Megatron's vocabulary padding)
            are not classes. Default: the sum of the shards.
        sequence_parallel: ``input`` is sequence-sharded: all-gather it in, reduce-scatter its
            gradient out.
        weight_grad_accumulator: an fp32 buffer of ``weight``'s shape (Megatron's ``main_grad``)
            into which the backward adds the weight gradient directly, instead of returning it
            in the weight's dtype; the weight then receives no ``.grad`` from this op (or, if it
            has Megatron's ``grad_added_to_main_grad`` attribute, an unset dummy and the flag).
        loss_mask: ("none" only) what the caller multiplies the per-token losses by, shape of
            ``target`` (Megatron's loss mask): the gradients are then computed in the forward
            (fused_lce/token_walk.py). It does not mask the returned losses.
        agree_every_call: True checks every call against the other ranks' (one host exchange,
            a barrier of the ranks' hosts) before any collective, so a rank's bad or different
            call raises on every rank. False, for callers whose ranks make the same call by
            construction (the Megatron adapter), checks only a call that differs from this
            rank's last one (parallel/agreement.py says what that gives up).
        Other arguments: as for :func:`fused_lce.linear_cross_entropy` (``chunk_by`` is always
            "vocab" here).

    Returns:
        The loss ("none": shape of ``target``), and with ``return_lse`` the pair (loss, lse).
    """
    if torch.compiler.is_compiling():
        loss, lse = _compiled_call(
            input, weight, target, bias, loss_mask, weight_grad_accumulator,
            group_name="" if group is None else group.group_name,
            vocab_start_index=vocab_start_index, vocab_size=vocab_size,
            sequence_parallel=sequence_parallel, check_targets=check_targets,
            agree_every_call=agree_every_call, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss, impl=impl,
            backward=backward, filter_eps=filter_eps, vocab_sort=vocab_sort,
            deterministic=deterministic, round_logits=round_logits, keep_logits=keep_logits,
            fp32_weight_grad=fp32_weight_grad, upstream_mismatch=upstream_mismatch,
            vocab_chunk_size=vocab_chunk_size, token_chunk_size=token_chunk_size,
            scratch_mb=scratch_mb, tma=tma, cuda_graphs=cuda_graphs)
        return (loss, lse) if return_lse else loss
    if group is None:
        group = dist.group.WORLD
    # Under autocast the GEMMs take its dtype, as a linear layer's do (every rank alike).
    autocast = autocast_on(input)
    input, weight, bias = autocast_operands(input, weight, bias)
    if dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of `group`")
    options = dict(
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        softcap=softcap, z_loss=z_loss, impl=impl, backward=backward, filter_eps=filter_eps,
        vocab_sort=vocab_sort, deterministic=deterministic, round_logits=round_logits,
        keep_logits=keep_logits, fp32_weight_grad=fp32_weight_grad,
        upstream_mismatch=upstream_mismatch, vocab_chunk_size=vocab_chunk_size,
        token_chunk_size=token_chunk_size, scratch_mb=scratch_mb, tma=tma,
        cuda_graphs=cuda_graphs,
    )
    # Every check that could fail on one rank only runs before the ranks' one agreement
    # collective, which carries its verdict: a rank that raised alone would leave its peers
    # waiting in the forward's first collective.
    error, opts = None, None
    try:
        # An earlier call's fault, once its verdict reached this rank's host: carried to every
        # rank by the exchange below.
        if isinstance(input, torch.Tensor):
            faults.raise_found(input.device)
        for name, flag in (("return_lse", return_lse), ("check_targets", check_targets),
                           ("agree_every_call", agree_every_call)):
            check_flag(name, flag)
        opts = _check_call(input, weight, target, bias, options, group, sequence_parallel,
                           vocab_start_index, vocab_size, weight_grad_accumulator)
        check_loss_mask(loss_mask, target, opts.reduction)
    except Exception as exc:  # raised after the exchange, on every rank
        error = exc
    facts = _call_facts(input, weight, target, bias, weight_grad_accumulator, options,
                        sequence_parallel=sequence_parallel, vocab_size=vocab_size,
                        return_lse=return_lse, check_targets=check_targets)
    agreed = agreement.agree_on_call(
        group, facts=facts, shard_rows=weight.shape[0] if error is None else 0,
        vocab_start_index=vocab_start_index, vocab_size=vocab_size, error=error,
        every_call=agree_every_call,
    )
    start, num_classes = agreed.start, agreed.num_classes

    target = class_ids(target)  # narrow and unsigned ids widened, as the single-device op does
    local_classes = max(0, min(weight.shape[0], num_classes - start))
    opts = without_backward_options(opts, input, weight, bias)
    call = ShardCall(
        opts, _strategy(resolve_impl(opts, input.device, input.dtype)), vocab_start=start,
        local_classes=local_classes, num_classes=num_classes,
        reducer=comm.GroupReducer(group, sequence_parallel),
        weight_grad_accumulator=weight_grad_accumulator,
        loss_mask=None if loss_mask is None else loss_mask.reshape(-1),
        check_targets=check_targets, caller="vocab_parallel_linear_cross_entropy",
        grad_enabled=torch.is_grad_enabled(),
    )
    if autocast:  # inside, every dtype is the op's own choice (fp32 statistics)
        with torch.autocast(input.device.type, enabled=False):
            loss, lse = LCEFunction.apply(input, weight, bias, target, call)
    else:
        loss, lse = LCEFunction.apply(input, weight, bias, target, call)
    if opts.reduction == "none":
        loss = loss.reshape(target.shape)
    lse = lse.reshape(target.shape)
    return (loss, lse) if return_lse else loss


def _strategy(impl: str):
    """The shard strategy of a resolved impl; imported here, so that the chunked impl needs no
    Triton."""
    if impl == "cce":
        from fused_lce.triton_shard import TritonShard

        return TritonShard
    from fused_lce.chunked import ChunkedShard

    return ChunkedShard


def _check_call(input, weight, target, bias, options: dict, group, sequence_parallel,
                vocab_start_index, vocab_size, weight_grad_accumulator) -> LCEOptions:
    """This rank's own checks (no collective): the options, and the single-device checks with
    this shard as the weight; raises TypeError/ValueError naming the argument."""
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    opts = LCEOptions(**options)
    if opts.impl not in ("auto", "cce", "chunked"):
        raise ValueError(f"impl must be 'auto', 'cce' or 'chunked' here, got {opts.impl!r}")
    for name, value in (("input", input), ("weight", weight), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    for name, value in (("vocab_start_index", vocab_start_index), ("vocab_size", vocab_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int or None, got {value!r}")
    if vocab_size is not None and vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    tp = comm.world_size(group)
    if sequence_parallel:
        if input.dim() < 2:
            raise ValueError("sequence_parallel needs input of shape (S / TP, ..., D)")
        full_shape = (input.shape[0] * tp, *input.shape[1:-1])
        if tuple(target.shape) != full_shape:
            raise ValueError(
                f"with sequence_parallel, target must cover the whole sequence: expected shape "
                f"{full_shape} (input's first dimension times TP={tp}), got {tuple(target.shape)}"
            )
    # The single-device checks (dtypes, devices, D, bias), with this shard as the weight and,
    # under SP, the rows of target that match this rank's input; the target range is checked
    # against the global vocabulary by the agreement.
    local_target = target[: input.shape[0]] if sequence_parallel else target
    validate(input, weight, local_target, bias, opts, check_targets=False)
    if weight_grad_accumulator is not None and (
        tuple(weight_grad_accumulator.shape) != tuple(weight.shape)
        or weight_grad_accumulator.dtype != torch.float32
    ):
        raise ValueError(
            f"weight_grad_accumulator must be fp32 of weight's shape {tuple(weight.shape)}, got "
            f"{weight_grad_accumulator.dtype} {tuple(weight_grad_accumulator.shape)}"
        )
    return opts


def _call_facts(input, weight, target, bias, weight_grad_accumulator, options: dict,
                **more) -> dict[str, str]:
    """What every rank's call must share, as readable strings (never raises): everything that
    sets a collective's size or whether it runs, and every option."""
    def wants_grad(x):
        return isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()

    weight_is_tensor = isinstance(weight, torch.Tensor) and weight.dim() == 2
    facts = {
        "input": agreement.describe_tensor(input),
        "target": agreement.describe_tensor(target),
        "weight D and dtype": (f"{weight.shape[1]} {weight.dtype}" if weight_is_tensor
                               else agreement.describe_tensor(weight)),
        "bias": "None" if bias is None else str(getattr(bias, "dtype", type(bias).__name__)),
        "device type": str(getattr(getattr(input, "device", None), "type", None)),
        "gradients wanted (input, weight, bias)": str(tuple(wants_grad(x)
                                                            for x in (input, weight, bias))),
        "weight_grad_accumulator": str(weight_grad_accumulator is not None),
    }
    facts.update({name: repr(value) for name, value in {**options, **more}.items()})
    return facts


# ---------------------------------------------------------------------------------------------
# torch.compile: the layer as one node of the compiled graph
# ---------------------------------------------------------------------------------------------
#
# As for the single-device op (fused_lce/api.py), Dynamo does not trace the layer's Python (its
# agreement exchanges on the host, its checks branch on what they find): while compiling, the
# layer calls ``fused_lce::vocab_parallel_loss``, which runs the eager layer without autograd,
# and its backward ``fused_lce::vocab_parallel_loss_backward`` runs it again with autograd. Both
# run the layer's collectives inside the node, every rank in the same order. The group travels
# by name (a custom op takes no process group); its words and typed numbers as in api.py.

_WORDS = ("group_name", "sequence_parallel", "check_targets", "agree_every_call", "reduction",
          "impl", "backward", "filter_eps", "vocab_sort", "deterministic", "round_logits",
          "keep_logits", "fp32_weight_grad", "upstream_mismatch", "tma", "cuda_graphs")
_NUMBERS = ("ignore_index", "label_smoothing", "softcap", "z_loss", "filter_eps",
            "vocab_chunk_size", "token_chunk_size", "scratch_mb", "vocab_start_index",
            "vocab_size")
_NUMBERS_SCHEMA = ("int ignore_index, float label_smoothing, float? softcap, float z_loss, "
                   "float? filter_eps, int? vocab_chunk_size, int? token_chunk_size, "
                   "float? scratch_mb, int? vocab_start_index, int? vocab_size")


def _compiled_call(input, weight, target, bias, loss_mask, weight_grad_accumulator, **options):
    """(loss, lse) through the custom ops, the layer's arguments given by name."""
    if weight_grad_accumulator is not None:
        raise ValueError(
            "weight_grad_accumulator must be None under torch.compile: the compiled layer "
            "returns the weight gradient (add it to your fp32 buffer after the backward, or "
            "call the layer outside the compiled region)")
    spelled = isinstance(options["filter_eps"], str)
    words = [repr("number" if name == "filter_eps" and not spelled else options[name])
             for name in _WORDS]
    numbers = [None if name == "filter_eps" and spelled else options[name] for name in _NUMBERS]
    return torch.ops.fused_lce.vocab_parallel_loss(input, weight, target, bias, loss_mask,
                                                   ", ".join(words), *numbers)


def _eager_arguments(words: str, numbers) -> dict:
    """The eager layer's keyword arguments, the group resolved, from a compiled call's words
    and numbers."""
    arguments = dict(zip(_WORDS, ast.literal_eval(f"({words},)"), strict=True))
    given = dict(zip(_NUMBERS, numbers, strict=True))
    if arguments["filter_eps"] == "number":
        arguments["filter_eps"] = given["filter_eps"]
    del given["filter_eps"]
    name = arguments.pop("group_name")
    group = None if name == "" else dist.distributed_c10d._resolve_process_group(name)
    return {**arguments, **given, "group": group, "return_lse": True}


@torch.library.custom_op(
    "fused_lce::vocab_parallel_loss", mutates_args=(),
    schema="(Tensor input, Tensor weight, Tensor target, Tensor? bias, Tensor? loss_mask, "
           f"str words, {_NUMBERS_SCHEMA}) -> (Tensor, Tensor)")
def _compiled_loss(input, weight, target, bias, loss_mask, words, *numbers):
    with torch.no_grad():
        loss, lse = vocab_parallel_linear_cross_entropy(
            input, weight, target, bias, loss_mask=loss_mask, **_eager_arguments(words, numbers))
    return loss, lse


@_compiled_loss.register_fake
def _(input, weight, target, bias, loss_mask, words, *numbers):
    reduction = dict(zip(_WORDS, ast.literal_eval(f"({words},)")))["reduction"]
    return fake_loss(input, target, reduction)


@torch.library.custom_op(
    "fused_lce::vocab_parallel_loss_backward", mutates_args=(),
    schema="(Tensor? grad_loss, Tensor? grad_lse, Tensor input, Tensor weight, Tensor target, "
           f"Tensor? bias, Tensor? loss_mask, bool[] needs, str words, {_NUMBERS_SCHEMA}) "
           "-> (Tensor, Tensor, Tensor)")
def _compiled_loss_backward(grad_loss, grad_lse, input, weight, target, bias, loss_mask, needs,
                            words, *numbers):
    arguments = {**_eager_arguments(words, numbers), "check_targets": False}  # checked before

    def call(input, weight, bias):
        return vocab_parallel_linear_cross_entropy(input, weight, target, bias,
                                                   loss_mask=loss_mask, **arguments)

    return rerun_gradients(call, grad_loss, grad_lse, input, weight, bias, needs)


@_compiled_loss_backward.register_fake
def _(grad_loss, grad_lse, input, weight, target, bias, *rest):
    return fake_gradients(input, weight, bias)


register_loss_autograd(_compiled_loss, _compiled_loss_backward, trailing=0)
