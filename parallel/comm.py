"""The few collectives the vocab-parallel layer needs, each taking an explicit process group.

Nothing here reads global parallel state: the caller (or the megatron adapter) passes the
tensor-parallel group. Every function is a thin wrapper that names what it does to the first
(token or sequence) dimension, so the layer reads as its communication budget.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def world_size(group) -> int:
    return dist.get_world_size(group)


def rank(group) -> int:
    return dist.get_rank(group)


def all_reduce_max_(tensor: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_reduce_sum_(tensor: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_first_dim(tensor: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (ranks in group order)."""
    size = world_size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    out = tensor.new_empty((tensor.shape[0] * size, *tensor.shape[1:]))
    dist.all_gather_into_tensor(out, tensor, group=group)
    return out


def reduce_scatter_first_dim(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum ``tensor`` over ranks and keep this rank's equal slice of dim 0."""
    size = world_size(group)
    if size == 1:
        return tensor
    if tensor.shape[0] % size:
        raise ValueError(
            f"reduce-scatter needs dim 0 ({tensor.shape[0]}) divisible by the group size {size}"
        )
    tensor = tensor.contiguous()
    rows = tensor.shape[0] // size
    if dist.get_backend(group) == "nccl":
        # NCCL reduces in place when the output is this rank's slice of the input (as Megatron's
        # distributed optimizer does): no second buffer of N/TP rows.
        start = rank(group) * rows
        out = tensor[start : start + rows]
    else:
        out = tensor.new_empty((rows, *tensor.shape[1:]))
    dist.reduce_scatter_tensor(out, tensor, group=group)
    return out


class GroupReducer:
    """fused_lce.engine's ShardReducer over ``group``: the cross-rank parts of the loss."""

    def __init__(self, group, sequence_parallel: bool) -> None:
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.world_size = world_size(group)

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduce_max_(tensor, self.group)

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum_(tensor, self.group)

    def gather_input(self, input: torch.Tensor) -> torch.Tensor:
        hidden = all_gather_first_dim(input, self.group) if self.sequence_parallel else input
        return hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])  # D = 0 too

    def reduce_input_grad(self, d_hidden: torch.Tensor) -> torch.Tensor:
        # Every rank holds a partial sum of d_hidden over its classes: sum them in fp32.
        if self.sequence_parallel:
            return reduce_scatter_first_dim(d_hidden, self.group)
        return all_reduce_sum_(d_hidden, self.group)


# Host-side collectives: small agreements that must not wait for the GPU (parallel/agreement.py).
# They run over a gloo group of the same ranks: the group itself when it is gloo, else one made
# at the first use and kept.
_host_groups: dict = {}


def host_group(group):
    """(a group of ``group``'s ranks whose collectives take CPU tensors, the position in its
    results of each of ``group``'s ranks, or None where they are the same)."""
    if takes_cpu_tensors(group):
        return group, None
    cached = _host_groups.get(group)
    if cached is None:
        cached = _host_groups[group] = make_host_group(group)
    return cached


def takes_cpu_tensors(group) -> bool:
    """Whether ``group``'s collectives take CPU tensors (gloo, or a backend list with gloo)."""
    return "gloo" in str(dist.get_backend(group))


def release_host_groups() -> None:
    """Destroy the gloo groups made by :func:`host_group` (before ``destroy_process_group``).

    A gloo group left to the interpreter's exit can be torn down while its threads still run,
    which aborts the process ("terminate called without an active exception")."""
    for cpu_group, _ in _host_groups.values():
        dist.destroy_process_group(cpu_group)
    _host_groups.clear()


def make_host_group(group):
    """A new gloo group of ``group``'s ranks, and its rank of each of them. Only they take part
    in making it (``use_local_synchronization``), so every tensor-parallel group can make its own
    at its first call, whatever the other groups are doing."""
    ranks = dist.get_process_group_ranks(group)
    cpu_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return cpu_group, [dist.get_group_rank(cpu_group, g) for g in ranks]


def all_gather_host_ints(values: list[int], group) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), in ``group``'s rank order; one
    small all-gather on the host, no device synchronisation."""
    size = world_size(group)
    if size == 1:
        return [list(values)]
    cpu_group, order = host_group(group)
    local = torch.tensor(values, dtype=torch.int64)
    out = local.new_empty((size, len(values)))
    dist.all_gather_into_tensor(out.view(-1), local, group=cpu_group)
    table = out.tolist()
    return table if order is None else [table[i] for i in order]


def all_gather_host_objects(obj, group) -> list:
    """Every rank's picklable ``obj``, in ``group``'s rank order (for error messages only)."""
    size = world_size(group)
    if size == 1:
        return [obj]
    cpu_group, order = host_group(group)
    out = [None] * size
    dist.all_gather_object(out, obj, group=cpu_group)
    return out if order is None else [out[i] for i in order]
