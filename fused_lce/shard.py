"""The contract between the engine and a shard strategy: what one call fixes (``ShardCall``),
the shard's view of it (``ShardInputs``), what a strategy returns (``ShardStatistics``, a
``ForwardGradPlan`` and its ``GradientChunks``), how ranks combine statistics (``ShardReducer``,
the identity ``LOCAL`` on one device, ``global_statistics``), and the strategy of a rank that holds
only vocabulary padding (``EmptyShard``), which takes part in every collective all the same.

It sits below the engine (fused_lce/engine.py) and the token walk (fused_lce/token_walk.py),
which both speak these types, and below every strategy. Pure torch: the chunked strategy runs
from here without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from .fp32_products import scale_in_fp32_
from .options import LCEOptions
from .softmax_merge import softmax_shift
from .terms import GradCoefficients


class ShardReducer(Protocol):
    """What the loss needs from the other ranks holding the rest of the vocabulary."""

    world_size: int

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def gather_input(self, input: torch.Tensor) -> torch.Tensor:
        """Every token's hidden state (N, D) from this rank's ``input`` (with SP, a shard)."""
        ...

    def gathered_rows(self, input: torch.Tensor) -> int:
        """N, the rows ``gather_input`` gives, without gathering."""
        ...

    def reduce_input_grad(self, d_hidden: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of the partial input gradients, this rank's rows of it."""
        ...


class LocalReducer:
    """One device: every reduction is the identity."""

    world_size = 1

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_input(self, input: torch.Tensor) -> torch.Tensor:
        return flat_rows(input)

    def gathered_rows(self, input: torch.Tensor) -> int:
        return flat_rows(input).shape[0]

    def reduce_input_grad(self, d_hidden: torch.Tensor) -> torch.Tensor:
        return d_hidden


LOCAL = LocalReducer()


def flat_rows(input: torch.Tensor) -> torch.Tensor:
    """(..., D) as (N, D); not reshape(-1, D): with D = 0 the -1 is ambiguous."""
    n_rows = 1
    for size in input.shape[:-1]:
        n_rows *= size
    return input.reshape(n_rows, input.shape[-1])


@dataclass(frozen=True)
class ShardCall:
    """What is fixed for one call: the options, the strategy, the shard's place and how to reach
    the others."""

    opts: LCEOptions
    strategy: ShardStrategy  # the same on every rank (a rank without classes: EmptyShard)
    vocab_start: int
    local_classes: int  # real classes in this shard (rows past it are vocabulary padding)
    num_classes: int  # classes over every shard
    reducer: ShardReducer = LOCAL
    weight_grad_accumulator: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None  # "none": what the caller multiplies the losses by
    # Check the targets against [0, num_classes) on the device (fused_lce/faults.py).
    check_targets: bool = False
    caller: str = "linear_cross_entropy(impl='cce')"  # named by the double-backward refusal
    # Whether autograd records the call, read before apply: inside forward grad mode is off,
    # and needs_input_grad does not see torch.no_grad().
    grad_enabled: bool = True


@dataclass
class ShardInputs:
    """One shard's view of the call, as every shard strategy takes it."""

    hidden: torch.Tensor  # (N, D), every token
    weight: torch.Tensor  # (V_local, D), real classes only
    bias: torch.Tensor | None  # (V_local,)
    target: torch.Tensor  # (N,) global class ids
    opts: LCEOptions
    vocab_start: int
    num_classes: int


@dataclass
class ShardGradRequest:
    """What the backward asks of a shard: gradients against the global lse."""

    lse: torch.Tensor  # (N,) fp32, global
    coefs: GradCoefficients
    needs: tuple[bool, bool, bool]  # (hidden, weight, bias)
    d_hidden_dtype: torch.dtype  # fp32 when partials are summed across ranks
    d_weight_accumulator: torch.Tensor | None  # fp32, the shard's rows; gradient added into it


class ShardStatistics(NamedTuple):
    """Per-row statistics of one shard, (N,) fp32; ignored rows hold max=-inf, sum_exp=0."""

    row_max: torch.Tensor
    sum_exp: torch.Tensor  # sum of exp(logit - row_max)
    row_sum: torch.Tensor | None  # sum of logits (label smoothing)
    target_logit: torch.Tensor  # 0 where another shard owns the target


@dataclass(frozen=True)
class ForwardGradPlan:
    """How the forward walks the tokens (fused_lce/token_walk.py, which also makes the Triton
    strategy's): ``chunk_rows`` at a time, the weight gradient summed in fp32
    (``fp32_weight_accumulator``) or in the weight's dtype, and with ``exponentials`` the
    chunks' logits stored as exponentials offset by the target logits, which every shard needs
    before the first chunk's GEMM (kernels/exp_logits.py): across shards, one more all-reduce a
    call, of one fp32 per token. Declared here, with the contract that returns it, so that
    every strategy and the walk can name it.
    """

    chunk_rows: int
    fp32_weight_accumulator: bool
    exponentials: bool = False


class GradientChunks(Protocol):
    """One call's walk over token chunks with gradients in the forward: (with
    ``ForwardGradPlan.exponentials``) ``target_logits`` once, then per chunk ``compute_logits``,
    ``statistics`` and (with the global lse) ``gradients``; ``finish`` once at the end. It keeps
    the chunk's logits between the calls."""

    def target_logits(self) -> torch.Tensor:
        """Every row's target logit, 0 where another shard owns the target (summed across shards
        into ``compute_logits``' offsets)."""
        ...

    def compute_logits(self, rows: slice, offsets: torch.Tensor | None = None) -> None: ...

    def statistics(self, rows: slice) -> ShardStatistics: ...

    def gradients(self, rows: slice, lse: torch.Tensor, coefs: GradCoefficients) -> None: ...

    def finish(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(d_hidden, d_weight, d_bias) for the assumed upstream gradient, None where not
        needed."""
        ...


class ShardStrategy(Protocol):
    """How one shard's statistics and gradients are computed: every strategy implements all of
    it, and the engine and the token walk call nothing else."""

    def plan_forward_gradients(self, opts: LCEOptions, n_rows: int, weight_rows: int,
                               d_model: int, elem_bytes: int, wants_weight_grad: bool,
                               dtype: torch.dtype | None = None) -> ForwardGradPlan | None:
        """The token walk's plan, or None for statistics now and gradients in the backward."""
        ...

    def statistics(self, inputs: ShardInputs) -> tuple[Any, ShardStatistics]:
        """(state for ``backward``, the shard's statistics)."""
        ...

    def backward(self, state: Any, inputs: ShardInputs, request: ShardGradRequest):
        """(d_hidden partial, d_weight, d_bias) of the shard against the global lse."""
        ...

    def recompute_state(self, inputs: ShardInputs) -> Any:
        """What ``backward`` needs where the forward walked instead of taking statistics."""
        ...

    def gradient_chunks(self, inputs: ShardInputs, plan: ForwardGradPlan, needs,
                        d_hidden_dtype: torch.dtype) -> GradientChunks: ...

    def scale_(self, tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``tensor *= scale`` in place, ``scale`` a one-element device tensor (never read by the
        host)."""
        ...


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16/32-bit inputs, fp64 for fp64: the dtype of every per-token vector."""
    return torch.promote_types(dtype, torch.float32)


def _empty_statistics(inputs: ShardInputs, n_rows: int) -> ShardStatistics:
    """What ``n_rows`` rows see of a shard without classes: max -inf, nothing to add."""
    zeros = torch.zeros((n_rows,), dtype=torch.float32, device=inputs.hidden.device)
    row_sum = zeros if inputs.opts.label_smoothing > 0 else None
    return ShardStatistics(torch.full_like(zeros, float("-inf")), zeros, row_sum, zeros)


class EmptyShard:
    """A shard with no real classes (only vocabulary padding): it adds nothing, but takes part
    in every collective like the others, following the plan of the group's strategy."""

    @staticmethod
    def plan_forward_gradients(opts, n_rows, weight_rows, d_model, elem_bytes, wants_weight_grad,
                               dtype=None):
        return None  # never asked: the walk plans with the group's strategy (ShardCall)

    scale_ = staticmethod(scale_in_fp32_)

    @staticmethod
    def statistics(inputs: ShardInputs):
        return None, _empty_statistics(inputs, inputs.hidden.shape[0])

    @staticmethod
    def backward(state, inputs: ShardInputs, request: ShardGradRequest):
        hidden, weight, bias = inputs.hidden, inputs.weight, inputs.bias
        d_hidden = torch.zeros(hidden.shape, dtype=request.d_hidden_dtype, device=hidden.device)
        d_weight = (None if request.d_weight_accumulator is not None
                    else weight.new_zeros(weight.shape))
        d_bias = None if bias is None else bias.new_zeros(bias.shape)
        return d_hidden, d_weight, d_bias

    @staticmethod
    def recompute_state(inputs: ShardInputs):
        return None

    @staticmethod
    def gradient_chunks(inputs: ShardInputs, plan: ForwardGradPlan, needs, d_hidden_dtype):
        return EmptyGradientChunks(inputs, needs, d_hidden_dtype)


class EmptyGradientChunks:
    """The empty shard in the gradient-in-forward walk: no statistics, zero gradients."""

    def __init__(self, inputs: ShardInputs, needs, d_hidden_dtype):
        self.inputs, self.needs, self.d_hidden_dtype = inputs, needs, d_hidden_dtype

    def target_logits(self) -> torch.Tensor:
        hidden = self.inputs.hidden
        return torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)

    def compute_logits(self, rows: slice, offsets: torch.Tensor | None = None) -> None:
        pass

    def statistics(self, rows: slice) -> ShardStatistics:
        return _empty_statistics(self.inputs, self._rows(rows))

    def _rows(self, rows: slice) -> int:
        return len(range(*rows.indices(self.inputs.hidden.shape[0])))

    def gradients(self, rows: slice, lse, coefs) -> None:
        pass

    def finish(self):
        request = ShardGradRequest(None, None, self.needs, self.d_hidden_dtype, None)
        d_hidden, d_weight, d_bias = EmptyShard.backward(None, self.inputs, request)
        return (d_hidden if self.needs[0] else None, d_weight if self.needs[1] else None,
                d_bias if self.needs[2] else None)


def global_statistics(stats: ShardStatistics, reducer) -> ShardStatistics:
    """The statistics over every shard: one MAX for the shift, one SUM for what adds up."""
    if reducer.world_size == 1:
        return stats
    # softmax_merge.merge_partials across ranks: the MAX collective, then softmax_shift's rule.
    shift = softmax_shift(reducer.all_reduce_max_(stats.row_max.clone()))
    packed = [stats.sum_exp * torch.exp(stats.row_max - shift), stats.target_logit]
    if stats.row_sum is not None:
        packed.append(stats.row_sum)
    packed = reducer.all_reduce_sum_(torch.stack(packed).float())
    row_sum = packed[2] if stats.row_sum is not None else None
    return ShardStatistics(shift, packed[0], row_sum, packed[1])
