"""Calls of the vocab-parallel layer on which the ranks disagree: every rank must raise.

Used by test_rank_agreement.py (gloo, CPU) and test_parallel_nccl.py (NCCL). ``disagreement_suite``
runs every case of ``disagreement_cases`` in turn on one process group; in each, rank 1's call
differs from rank 0's (or is wrong on rank 1 only). Every rank must raise TypeError or ValueError
matching the case's pattern, and where the layer promises one message for all (everything but an
argument that one rank rejects) every rank's message must be the same. After each case the ranks
exchange their outcomes (a collective every rank reaches only if none hangs in the layer), so a
regression shows as a mismatch or as the process group's timeout, never as a silent pass.
"""

from __future__ import annotations

import re
import traceback

import torch
import torch.distributed as dist

N, D = 12, 16  # tokens, hidden size
ROWS = (19, 18)  # rank 0's and rank 1's shard: 37 classes
V = sum(ROWS)


def _problem(device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.3
    target = torch.randint(0, V, (N,), generator=g)
    target[3] = -100
    return hidden.to(device), weight.to(device), target.to(device)


def disagreement_cases(rank: int, device: str, impl: str) -> list[tuple[str, list[dict], str]]:
    """(name, this rank's calls, regex every rank's error must match). All calls of a case but
    the last must succeed; the last must raise on every rank."""
    hidden, weight, target = _problem(device)
    start = sum(ROWS[:rank])
    shard = weight[start:start + ROWS[rank]]
    other = rank == 1

    def call(**overrides):
        args = dict(input=hidden, weight=shard, target=target, impl=impl)
        return {**args, **overrides}

    bad_target = target.clone()
    bad_target[5] = V
    half = N // 2
    return [
        ("different N", [call(input=hidden[: N - other], target=target[: N - other])],
         r"ranks disagree on input \(rank 0: \(12, 16\) float32, rank 1: \(11, 16\) float32\)"),
        ("different D",
         [call(input=hidden[:, : D - other], weight=shard[:, : D - other].contiguous())],
         r"ranks disagree on input .*weight D"),
        ("different label_smoothing", [call(label_smoothing=0.1 if other else 0.0)],
         r"ranks disagree on label_smoothing \(rank 0: 0.0, rank 1: 0.1\)"),
        ("mean on rank 0, sum on rank 1", [call(reduction="sum" if other else "mean")],
         r"ranks disagree on reduction \(rank 0: 'mean', rank 1: 'sum'\)"),
        ("different dtype",
         [call(input=hidden.to(torch.bfloat16), weight=shard.to(torch.bfloat16))
          if other else call()],
         r"ranks disagree on input \(rank 0: \(12, 16\) float32, rank 1: \(12, 16\) bfloat16\)"),
        ("sequence_parallel on rank 1 only",
         [call(input=hidden[half:], sequence_parallel=True) if other else call()],
         r"ranks disagree on .*sequence_parallel \(rank 0: False, rank 1: True\)"),
        ("input gradient wanted on rank 1 only",
         [call(input=hidden.clone().requires_grad_(other))],
         r"ranks disagree on gradients wanted"),
        ("overlapping explicit shards", [call(vocab_start_index=0, vocab_size=V)],
         r"do not tile the vocabulary \(overlap\): rank 1 starts at 0, expected 19"),
        ("gap in explicit shards",
         [call(vocab_start_index=start + other, vocab_size=V)],
         r"do not tile the vocabulary \(gap\): rank 1 starts at 20, expected 19"),
        ("target out of range on rank 1 only", [call(target=bad_target if other else target)],
         rf"target holds class {V}, outside \[0, {V}\)"),
        ("an option only rank 1 rejects", [call(label_smoothing=1.5 if other else 0.0)],
         r"label_smoothing must be in \[0, 1\]"),
        ("arguments only rank 1 rejects (dtype)",
         [call(weight=shard.double()) if other else call()],
         r"weight must have input's dtype"),
        ("agree_every_call not a bool, on every rank", [call(agree_every_call="yes")],
         r"agree_every_call must be a bool, got 'yes'"),
        # The first call agrees; then rank 1's changes while rank 0 repeats its own. A cache of
        # agreed signatures would let rank 0 skip the check here and hang.
        ("N changes on rank 1 after an agreed call",
         [call(), call(input=hidden[: N - other], target=target[: N - other])],
         r"ranks disagree on input"),
    ]


# The cases whose message names the rank that rejected its own arguments on the others.
_OWN_MESSAGE = ("an option only rank 1 rejects", "arguments only rank 1 rejects (dtype)")


def disagreement_suite(rank: int, world: int, device: str, impl: str,
                       names: tuple[str, ...] | None = None) -> list[str]:
    """Every case (or those named) in turn; the mismatches, one message each. ``device``:
    "cpu", or "cuda" for this rank's GPU."""
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    if device == "cuda":
        device = f"cuda:{rank}"
    errors = []
    cases = disagreement_cases(rank, device, impl)
    if names is not None:
        cases = [c for c in cases if c[0] in names]
        if len(cases) != len(names):
            return [f"rank={rank}: no case named {sorted(set(names) - {c[0] for c in cases})}"]
    for name, calls, pattern in cases:
        label = f"tp={world} rank={rank} '{name}'"
        outcome = None
        try:
            for i, args in enumerate(calls):
                loss = vocab_parallel_linear_cross_entropy(**args)
                if i < len(calls) - 1 and loss.requires_grad:
                    loss.backward()
            errors.append(f"{label}: no error raised")
        except (TypeError, ValueError) as exc:
            outcome = str(exc)
            if not re.search(pattern, outcome):
                errors.append(f"{label}: {type(exc).__name__} {outcome!r} does not match "
                              f"{pattern!r}")
        except Exception:
            errors.append(f"{label} raised:\n{traceback.format_exc()}")
            return errors  # out of step with the other ranks now
        outcomes = [None] * world
        dist.all_gather_object(outcomes, outcome)
        if name in _OWN_MESSAGE:
            if rank != 1 and outcome is not None and "rank 1 rejected its arguments" not in outcome:
                errors.append(f"{label}: the message does not name rank 1: {outcome!r}")
        elif len(set(outcomes)) > 1:
            errors.append(f"{label}: ranks raised different messages: {outcomes}")
    return errors
