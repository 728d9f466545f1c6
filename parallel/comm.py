"""The few collectives the vocab-parallel layer needs, each taking an explicit process group.

Nothing here reads global parallel state: the caller (or the megatron adapter) passes the
tensor-parallel group. Every function is a thin wrapper that names what it does to the first
(token or sequence) dimension, so the layer reads as its communication budget.

Host-side collectives (the per-call agreement, parallel/agreement.py) run on CPU tensors: over
the group itself when it is gloo, else over a *host group*, a gloo backend of the same ranks
formed at the first call on them and kept. Two rules keep every wait there bounded and free of
order effects:

- Every wait is bounded by the timeout of the group the caller passed (``group_timeout``: its
  backend's ``options._timeout``, i.e. the ``timeout`` given to ``init_process_group`` or
  ``new_group``, present in torch 2.11 and 2.13), not torch's 30-minute gloo default: the host
  group's rendezvous and every all-gather on it. A member that never comes makes every member
  that did raise ``HostGroupError`` naming the group's ranks and what to check; a host group
  that failed once raises the same at every later call instead of waiting again.
- The host group is not made with ``new_group``. ``new_group(..., use_local_synchronization=
  True)`` (the previous design) names the group by a hash of its ranks *and the number of groups
  this process already has*, so a rank that had made one more group than its peer (a group of
  its own, a subgroup it is the only member of, any history that differs) looked for its peers
  under another name and waited 30 minutes; without local synchronisation every rank of the
  world must enter in the same order, which a lazily made group cannot promise, and registering
  it would also shift the names of the user's later groups on the members only. Instead the
  gloo backend is built directly (``ProcessGroupGloo`` over a ``PrefixStore`` of the default
  store) under a name that depends only on the sorted member ranks and how many host groups of
  those ranks this process has released: the same on every member whatever else it made before.
  So the point where the members meet is their first call on the group, which an SPMD program
  reaches in the same order on every member; nothing outside the members takes part, and
  torch's registry of groups is untouched. Groups with the same ranks share one host group.
"""

from __future__ import annotations

import atexit
import functools
import math
import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from fused_lce import graphs


def _graphs_released_first(destroy):
    """``destroy_process_group`` that first drops the op's captured forwards: NCCL does not
    destroy a communicator while a CUDA graph that captured its collectives lives (measured
    2026-11-27, torch 2.11 on 2 x H200: the call never returned)."""

    @functools.wraps(destroy)
    def destroy_process_group(*args, **kwargs):
        graphs.clear()
        return destroy(*args, **kwargs)

    destroy_process_group.releases_fused_lce_graphs = True
    return destroy_process_group


if not getattr(dist.destroy_process_group, "releases_fused_lce_graphs", False):
    dist.destroy_process_group = _graphs_released_first(dist.destroy_process_group)


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
    """fused_lce.shard's ShardReducer over ``group``: the cross-rank parts of the loss."""

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

    def gathered_rows(self, input: torch.Tensor) -> int:
        rows = math.prod(input.shape[:-1])
        return rows * self.world_size if self.sequence_parallel else rows

    def reduce_input_grad(self, d_hidden: torch.Tensor) -> torch.Tensor:
        # Every rank holds a partial sum of d_hidden over its classes: sum them in fp32.
        if self.sequence_parallel:
            return reduce_scatter_first_dim(d_hidden, self.group)
        return all_reduce_sum_(d_hidden, self.group)


# ---------------------------------------------------------------------------------------------
# Host-side collectives: small agreements that must not wait for the GPU (parallel/agreement.py)
# ---------------------------------------------------------------------------------------------


class HostGroupError(RuntimeError):
    """A host-side exchange among a group's ranks did not complete within the group's timeout
    (a member is absent or waits elsewhere), or whose host group failed so before."""


@dataclass
class HostGroup:
    """A gloo backend of the members of one or more process groups with the same ranks.

    ``gloo`` is built directly over the default store, not by ``new_group``: see the module
    docstring for why. Its rank order is ``members`` (the sorted global ranks)."""

    gloo: object
    members: tuple[int, ...]
    failure: str | None = None


_host_groups: dict[tuple[int, ...], HostGroup] = {}
_generations: dict[tuple[int, ...], int] = {}  # host groups of these members made so far
_world: list = [None]  # the default group the host groups above belong to


def takes_cpu_tensors(group) -> bool:
    """Whether ``group``'s collectives take CPU tensors (gloo, or a backend list with gloo)."""
    return "gloo" in str(dist.get_backend(group))


def group_timeout(group) -> timedelta:
    """The timeout ``group``'s own collectives run under: its backend's option (the
    ``timeout`` given to ``init_process_group`` or ``new_group``, else torch's default for the
    backend), the smallest over its devices' backends; else the default store's timeout."""
    found = []
    for device in getattr(group, "_device_types", ()):
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, timedelta) and timeout > timedelta(0):
            found.append(timeout)
    if found:
        return min(found)
    try:
        return c10d._get_default_store().timeout
    except (AttributeError, RuntimeError, ValueError):
        return c10d.default_pg_timeout


def group_members(group) -> tuple[int, ...]:
    """The global ranks of ``group``, sorted."""
    return tuple(sorted(dist.get_process_group_ranks(group)))


def host_group(group) -> HostGroup:
    """The host group of ``group``'s ranks, formed at the first call on them (by the members
    only; bounded by ``group``'s timeout); raises HostGroupError if some member does not come."""
    world = c10d._get_default_group()
    if _world[0] is not world:  # a new init_process_group: its store and peers are new
        release_host_groups()
        _generations.clear()
        _world[0] = world
    members = group_members(group)
    cached = _host_groups.get(members)
    if cached is None:
        cached = _host_groups[members] = _form_host_group(members, group)
    if cached.failure is not None:
        raise HostGroupError(f"the host group of global ranks {list(members)} failed earlier "
                             f"and is not used again: {cached.failure}")
    return cached


def _form_host_group(members: tuple[int, ...], group) -> HostGroup:
    generation = _generations.get(members, 0)
    _generations[members] = generation + 1
    name = "_".join(map(str, members))
    store = c10d.PrefixStore(f"fused_lce/host_group/{name}/{generation}/",
                             c10d._get_default_store())
    timeout = group_timeout(group)
    me = dist.get_rank()
    try:
        gloo = c10d.ProcessGroupGloo(store, members.index(me), len(members), timeout)
    except RuntimeError as exc:
        failure = (
            f"rank {me} could not form the host (gloo) group of the process group of global "
            f"ranks {list(members)} within that group's timeout ({_seconds(timeout)}): a member "
            "did not reach its first vocab-parallel call on this group. " + _WHAT_TO_DO
            + f" ({type(exc).__name__}: {exc})"
        )
        _host_groups[members] = HostGroup(None, members, failure)
        raise HostGroupError(failure) from exc
    return HostGroup(gloo, members)


_WHAT_TO_DO = (
    "Every member must call vocab_parallel_linear_cross_entropy with this group, the same "
    "number of times and in the same order relative to its other collectives; a member that "
    "exited, raised, or waits in another group's collective leaves its peers here. Raise the "
    "group's timeout (init_process_group / new_group) if a member is only slow."
)


def release_host_groups() -> None:
    """Shut down the host groups (every member at the same point, before
    ``destroy_process_group``). The next call on the same ranks forms a new one. Left to the
    process's exit, they are shut down by an ``atexit`` hook, while the interpreter still runs
    (gloo's threads are then joined before Python tears down what they might touch)."""
    hosts = list(_host_groups.values())
    _host_groups.clear()
    for host in hosts:
        if host.gloo is not None and hasattr(host.gloo, "shutdown"):
            host.gloo.shutdown()


def _release_at_exit() -> None:
    try:
        release_host_groups()
    except RuntimeError:
        pass  # a peer already gone: nothing is left to agree on


atexit.register(_release_at_exit)


def all_gather_host_ints(values: list[int], group) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), in ``group``'s rank order; one
    small all-gather on the host, no device synchronisation."""
    if world_size(group) == 1:
        return [list(values)]
    return _host_all_gather(torch.tensor(values, dtype=torch.int64), group).tolist()


def all_gather_host_objects(obj, group) -> list:
    """Every rank's picklable ``obj``, in ``group``'s rank order (for error messages only):
    two host all-gathers, of the pickles' lengths and of the padded pickles."""
    if world_size(group) == 1:
        return [obj]
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = _host_all_gather(torch.tensor([data.numel()]), group).view(-1).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: data.numel()] = data
    rows = _host_all_gather(padded, group)
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]


def _host_all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """(world_size(group), *tensor.shape): every rank's CPU ``tensor`` in ``group``'s rank
    order, over ``group`` itself if it takes CPU tensors, else over its host group; every wait
    bounded by ``group``'s timeout."""
    size = world_size(group)
    out = tensor.new_empty((size, *tensor.shape))
    rows = list(out.unbind(0))
    if takes_cpu_tensors(group):
        try:
            dist.all_gather(rows, tensor, group=group)
        except RuntimeError as exc:
            raise HostGroupError(_exchange_failure(group, exc)) from exc
        return out
    host = host_group(group)
    opts = c10d.AllgatherOptions()
    opts.timeout = group_timeout(group)
    try:
        host.gloo.allgather([rows], [tensor], opts).wait()
    except RuntimeError as exc:
        host.failure = _exchange_failure(group, exc)
        raise HostGroupError(host.failure) from exc
    order = [host.members.index(g) for g in dist.get_process_group_ranks(group)]
    return out[order] if order != sorted(order) else out


def _exchange_failure(group, exc: Exception) -> str:
    return (
        f"rank {dist.get_rank()}: the vocab-parallel agreement over the process group of global "
        f"ranks {dist.get_process_group_ranks(group)} did not complete within that group's "
        f"timeout ({_seconds(group_timeout(group))}): a member did not reach the same call. "
        + _WHAT_TO_DO + f" ({type(exc).__name__}: {exc})"
    )


def _seconds(timeout: timedelta) -> str:
    return f"{timeout.total_seconds():g} s"
