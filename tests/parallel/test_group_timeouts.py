"""Every wait of the vocab-parallel layer's host agreement is bounded by the group's timeout.

The agreement (parallel/agreement.py) runs on the host: on a NCCL group, over a gloo host group of
the same ranks (parallel/comm.py). Here the groups are gloo, treated as NCCL's
(``comm.takes_cpu_tensors`` patched), so the host group is formed and used exactly as on GPUs.
What must hold, each found broken by probes on the previous design (a host group made with
``new_group`` and torch's 30-minute default timeout):

- a member absent from a later call: the others raise a clear error within the world's timeout;
- a group made with its own, shorter timeout: that timeout bounds the host group's forming, and
  every member that came raises (with 3 ranks: both that came);
- ranks that meet their groups in a cyclic order (0 waits for 1 in group A, 1 for 2 in B, 2 for
  0 in C): every rank raises within the timeout;
- asymmetric membership (ranks that belong to different numbers of groups, or made a group of
  their own): the host groups still form and the losses are right (before: a hang).

Each spawned rank also arms ``signal.alarm``, so a regression kills the ranks (and fails the
test) instead of leaving them to wait for 30 minutes after pytest's own timeout.
"""

from __future__ import annotations

import datetime
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers_parallel import run_on_ranks

from fused_lce.parallel import comm, vocab_parallel_linear_cross_entropy

PG_TIMEOUT_S = 5
ALARM_S = 60  # a spawned rank still running after this is killed: a hang, not a slow machine
N, D = 7, 6


def _like_nccl() -> None:
    comm.takes_cpu_tensors = lambda group: False
    signal.alarm(ALARM_S)


def _store():
    return dist.distributed_c10d._get_default_store()


def _loss(group) -> torch.Tensor:
    """The layer on ``group``: every member draws the same problem (5 + r rows on group rank r)
    and checks the loss against float64 on the whole classifier; returns it."""
    ranks = dist.get_process_group_ranks(group)
    rows = [5 + r for r in range(len(ranks))]
    g = torch.Generator().manual_seed(len(ranks))
    hidden = torch.randn(N, D, generator=g)
    weight = torch.randn(sum(rows), D, generator=g)
    target = torch.randint(0, sum(rows), (N,), generator=g)
    me = ranks.index(dist.get_rank())
    start = sum(rows[:me])
    loss = vocab_parallel_linear_cross_entropy(hidden, weight[start:start + rows[me]], target,
                                               group=group, impl="chunked")
    expected = F.cross_entropy(hidden.double() @ weight.double().T, target)
    if abs(loss.item() - expected.item()) > 1e-5 * abs(expected.item()):
        raise AssertionError(f"loss {loss.item()} != float64 {expected.item()}")
    return loss


def _expect_timeout(group, limit_s: float, label: str) -> list[str]:
    """Call the layer on ``group`` where some member will not come: a HostGroupError naming the
    group's ranks and its timeout within ``limit_s`` seconds, else the mismatches."""
    ranks = dist.get_process_group_ranks(group)
    seconds = f"{comm.group_timeout(group).total_seconds():g} s"
    start = time.monotonic()
    try:
        _loss(group)
    except comm.HostGroupError as exc:
        waited = time.monotonic() - start
        message = str(exc)
        errors = [] if waited < limit_s else [f"{label}: raised after {waited:.1f} s"]
        for part in (f"global ranks {ranks}", seconds, "Every member must call"):
            if part not in message:
                errors.append(f"{label}: {part!r} not in {message!r}")
        return errors
    return [f"{label}: no error although a member never came"]


def _absent_later_suite(rank: int, world: int) -> list[str]:
    _like_nccl()
    group = dist.group.WORLD
    errors = []
    if comm.group_timeout(group) != datetime.timedelta(seconds=PG_TIMEOUT_S):
        errors.append(f"rank {rank}: group_timeout(WORLD) = {comm.group_timeout(group)}")
    _loss(group)  # the host group forms
    if rank == 1:
        _store().wait(["done"], datetime.timedelta(seconds=ALARM_S))
    else:
        errors += _expect_timeout(group, 3 * PG_TIMEOUT_S, "rank 0, later call")
        start = time.monotonic()  # the broken host group is not waited on again
        try:
            _loss(group)
            errors.append("rank 0: a call on the failed host group returned")
        except comm.HostGroupError as exc:
            if "failed earlier" not in str(exc) or time.monotonic() - start > 1:
                errors.append(f"rank 0: second failure {exc!r}")
        _store().set("done", "1")
    signal.alarm(0)
    return errors


@pytest.mark.timeout(90)
def test_a_later_call_with_a_member_absent_fails_within_the_world_timeout(tmp_path):
    run_on_ranks(2, _absent_later_suite, out_dir=tmp_path, timeout_s=PG_TIMEOUT_S)


def _group_timeout_suite(rank: int, world: int) -> list[str]:
    _like_nccl()
    group = dist.new_group([0, 1, 2], timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    errors = []
    if comm.group_timeout(group) != datetime.timedelta(seconds=PG_TIMEOUT_S):
        errors.append(f"rank {rank}: group_timeout(group) = {comm.group_timeout(group)}")
    if rank == 2:  # never calls the layer
        _store().wait(["came/0", "came/1"], datetime.timedelta(seconds=ALARM_S))
    else:
        errors += _expect_timeout(group, 3 * PG_TIMEOUT_S, f"rank {rank}, forming")
        _store().set(f"came/{rank}", "1")
    signal.alarm(0)
    return errors


@pytest.mark.timeout(90)
def test_a_member_that_never_comes_fails_every_member_within_the_group_timeout(tmp_path):
    # The world's timeout is long: only the group's own may bound the wait.
    run_on_ranks(3, _group_timeout_suite, out_dir=tmp_path, timeout_s=10 * PG_TIMEOUT_S)


def _cyclic_suite(rank: int, world: int) -> list[str]:
    _like_nccl()
    # A subgroup made without a timeout has torch's default (30 min on gloo), as its own
    # collectives do: give each the short one.
    timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
    groups = [dist.new_group(ranks, timeout=timeout) for ranks in ([0, 1], [1, 2], [0, 2])]
    errors = _expect_timeout(groups[rank], 3 * PG_TIMEOUT_S, f"rank {rank}, cyclic order")
    signal.alarm(0)
    return errors


@pytest.mark.timeout(90)
def test_groups_met_in_a_cyclic_order_fail_every_rank_within_the_timeout(tmp_path):
    run_on_ranks(3, _cyclic_suite, out_dir=tmp_path, timeout_s=PG_TIMEOUT_S)


def _asymmetric_suite(rank: int, world: int) -> list[str]:
    _like_nccl()
    first, second = dist.new_group([0, 1]), dist.new_group([1, 2])  # rank 1 is in both
    if rank in (0, 1):
        _loss(first)
    if rank in (1, 2):
        _loss(second)
    if rank == 0:  # a group of its own, made later: its peers have none
        dist.new_group([0], use_local_synchronization=True)
    _loss(dist.group.WORLD)
    signal.alarm(0)
    return []


@pytest.mark.timeout(90)
def test_host_groups_form_whatever_groups_each_rank_made_before(tmp_path):
    run_on_ranks(3, _asymmetric_suite, out_dir=tmp_path, timeout_s=PG_TIMEOUT_S)
