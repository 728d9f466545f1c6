"""The few collectives the vocab-parallel layer needs, each taking an explicit process group.

Nothing here reads global parallel state: the caller (or the megatron adapter) passes the
tensor-parallel group. Every function is a thin wrapper that names what it does to the first
(token or sequence) dimension, so the layer reads as its communication budget.
"""

from __future__ import annotations

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


def all_gather_ints(values: list[int], group, device: torch.device) -> torch.Tensor:
    """(world, len(values)) int64: every rank's ``values``; one small collective."""
    local = torch.tensor(values, dtype=torch.int64, device=device)
    out = local.new_empty((world_size(group), len(values)))
    dist.all_gather_into_tensor(out.view(-1), local, group=group)
    return out


def collective_device(group, fallback: torch.device) -> torch.device:
    """Where the group's collectives expect tensors: CUDA for NCCL, the CPU for gloo."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    return fallback
