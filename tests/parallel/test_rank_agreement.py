"""Ranks that disagree on a vocab-parallel call: every rank raises the same clear error, quickly.

One case per way ranks can differ (tests/helpers_agreement.py): N, D, an option, the reduction,
the dtype, sequence parallelism, which gradients are wanted, overlapping or gapped explicit
shards, a target out of range on one rank, an argument one rank rejects, and N changing on one
rank after an agreed call. Before parallel/agreement.py these aborted a process inside gloo,
hung until the process-group timeout, or returned different losses.

Each spawned run has a short process-group timeout and pytest's own timeout, so a regression
fails within a minute instead of hanging CI. The host group that NCCL groups get is made here on
gloo, and scripts/studies/bench_agreement.py runs its CPU smoke mode.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers_agreement import disagreement_suite
from helpers_parallel import run_on_ranks

from fused_lce.parallel import agreement, comm

PG_TIMEOUT_S = 15


@pytest.mark.timeout(90)
@pytest.mark.parametrize("impl", ["chunked", "cce"])
def test_every_rank_raises_when_ranks_disagree(impl, tmp_path):
    run_on_ranks(2, disagreement_suite, "cpu", impl, out_dir=tmp_path,
                 timeout_s=PG_TIMEOUT_S, interpret=True)


def _through_host_group_suite(rank: int, world: int) -> list[str]:
    """The cases with the group treated as NCCL's: the layer makes a gloo host group at its
    first call and agrees over it."""
    comm.takes_cpu_tensors = lambda group: False
    errors = disagreement_suite(rank, world, "cpu", "chunked")
    if not comm._host_groups:
        errors.append(f"rank {rank}: no host group was made")
    return errors


@pytest.mark.timeout(90)
def test_every_rank_raises_through_a_host_group(tmp_path):
    run_on_ranks(2, _through_host_group_suite, out_dir=tmp_path, timeout_s=PG_TIMEOUT_S,
                 interpret=True)


def _host_group_suite(rank: int, world: int) -> list[str]:
    """Two TP groups of two ranks each make their gloo host groups at the same time, each
    without the other's ranks (as on NCCL), and the gathered rows follow the group's rank order."""
    unsorted = {"sort_ranks": False} if "sort_ranks" in inspect.signature(
        dist.new_group).parameters else {}
    tp_groups = [dist.new_group([0, 1]), dist.new_group([3, 2], **unsorted)]
    mine = tp_groups[rank // 2]
    expected_ranks = dist.get_process_group_ranks(mine)
    comm.takes_cpu_tensors = lambda group: False  # as for a NCCL group: through a host group
    table = comm.all_gather_host_ints([rank, 7], mine)
    if comm.all_gather_host_objects(f"r{rank}", mine) != [f"r{g}" for g in expected_ranks]:
        return [f"rank {rank}: objects out of the group's rank order"]
    expected = [[g, 7] for g in expected_ranks]
    return [] if table == expected else [f"rank {rank}: gathered {table}, expected {expected}"]


@pytest.mark.timeout(60)
def test_host_group_order(tmp_path):
    run_on_ranks(4, _host_group_suite, out_dir=tmp_path, timeout_s=PG_TIMEOUT_S)


def _on_change_suite(rank: int, world: int) -> list[str]:
    """``agree_every_call=False`` (the Megatron adapter's): the first call exchanges, a repeat
    does not, and a call that changed on every rank exchanges again and still raises when the
    ranks disagree. On a host group, as for NCCL. (A rank whose call changed alone waits in the
    exchange until the group's timeout and raises comm.HostGroupError, as test_group_timeouts.py
    tests for a member that never comes; that leaves the group unusable, so it is not run here.)"""
    from helpers_agreement import ROWS, N, _problem

    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    comm.takes_cpu_tensors = lambda group: False
    exchanges = []
    original = comm.all_gather_host_ints
    comm.all_gather_host_ints = lambda *a: exchanges.append(1) or original(*a)
    hidden, weight, target = _problem("cpu")
    start = sum(ROWS[:rank])
    shard = weight[start:start + ROWS[rank]]

    def call(n=N, **kw):
        return vocab_parallel_linear_cross_entropy(
            hidden[:n], shard, target[:n], impl="chunked", agree_every_call=False, **kw)

    errors = []
    first, again = call(), call()
    if len(exchanges) != 1 or not torch.equal(first, again):
        errors.append(f"rank {rank}: a repeated call exchanged ({len(exchanges)} exchanges)")
    call(n=N - 2)
    if len(exchanges) != 2:
        errors.append(f"rank {rank}: a call changed on every rank did not exchange")
    try:
        call(label_smoothing=0.1 * (rank + 1))
        errors.append(f"rank {rank}: ranks that disagree after an agreed call did not raise")
    except ValueError as exc:
        if "ranks disagree on label_smoothing" not in str(exc):
            errors.append(f"rank {rank}: {exc}")
    return errors


@pytest.mark.timeout(90)
def test_agreeing_on_change_skips_repeats_and_still_raises(tmp_path):
    run_on_ranks(2, _on_change_suite, out_dir=tmp_path, timeout_s=PG_TIMEOUT_S, interpret=True)


def test_disagreement_message_names_each_field_and_rank():
    message = agreement.disagreement_message([
        {"input": "(12, 16) float32", "reduction": "'mean'", "impl": "'chunked'"},
        {"input": "(11, 16) float32", "reduction": "'sum'", "impl": "'chunked'"},
    ])
    assert message.startswith("ranks disagree on input (rank 0: (12, 16) float32, rank 1: "
                              "(11, 16) float32); reduction (rank 0: 'mean', rank 1: 'sum')")
    assert "impl" not in message


def test_signature_hash_is_stable_across_processes():
    # Python's hash() of a str differs per process; the signature must not.
    facts = {"input": "(12, 16) float32", "reduction": "'mean'"}
    assert agreement.signature_hash(facts) == agreement.signature_hash(dict(reversed(
        facts.items())))
    assert agreement.signature_hash(facts) == 7425073011819755590


@pytest.mark.timeout(120)
def test_bench_agreement_runs_on_cpu():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(root / "scripts" / "studies" / "bench_agreement.py"), "--cpu-smoke", "--iters", "1",
           "--warmup", "0", "--agree-iters", "2"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for line in ("# agreement cost: TP=2", "agree later calls, check_targets=False",
                 "step without agreement (stub)", "host blocked: forward host ms"):
        assert line in proc.stdout, proc.stdout
