"""Ranks agree on a call before any collective whose size depends on it.

Every collective of the vocab-parallel layer has a size set by the call (N tokens, D, label
smoothing adds a row to the packed SUM, SP gathers, whether a backward runs). If one rank's call
differs, its collectives no longer pair with its peers': gloo aborts the process ("Received data
size doesn't match") and NCCL waits for the process-group timeout. A rank that rejects its own
arguments and raises leaves the others waiting in the first collective. So each call starts with
one collective of a FIXED size that every rank enters before it can raise, and every rank reads
the same gathered table and takes the same decision:

    one all-gather of 5 int64 per rank: [validation failed, signature hash, shard rows,
    vocab_start_index given, vocab_start_index]

- a rank whose arguments failed the local checks (options, dtypes, shapes, devices) sets its
  flag: it raises its own error and every other rank raises "rank r rejected its arguments: ...";
- the signature hash covers everything that must be equal on every rank (shapes, dtypes, device
  type, which gradients a backward needs, sequence_parallel, vocab_size and every option): if the
  hashes differ, every rank raises the same error naming each field that differs, per rank;
- the shard layout (rows and given starts) must tile [0, total rows) without gap or overlap, and
  ``vocab_size`` must not exceed the total: with the starts given explicitly this is the only
  check they get;

The targets' range is not part of it: their values live on the device, so the op checks them
there (fused_lce/faults.py), combining the ranks' verdicts in a collective of its own.

Only when something is wrong does a second, slower exchange follow (``all_gather_object`` of the
messages or of the readable call descriptions) to build the message; the ranks enter it together
because they all read the same table.

Why every call, and not once per signature. A cache of signatures already agreed cannot be safe:
a rank that skips the check because its signature is cached learns nothing about a peer whose call
changed (a new N, say); the peer enters the check, this rank enters the forward's first
collective, and the two hang or abort. No scheme in which some rank skips all communication can
tell it that a peer differs. What a training step must not pay is a device-to-host
synchronisation (it drains the GPU's queue and stops the host from running ahead). So the check
runs on the host: over the group itself when it is a gloo group (CPU tensors), and otherwise over
a gloo group of the same ranks formed by the members at their first call on them (comm.host_group;
its module docstring says why it is not made with ``new_group``). Every wait of the exchange is
bounded by the group's own timeout: a member that does not come makes the others raise
comm.HostGroupError naming the group, instead of waiting for torch's 30-minute gloo default.
Per call this is one host-to-host all-gather of TP x 5 int64 and ~25 us of Python to describe
the call; the GPU queue is not touched.

A caller whose ranks make the same call by construction can ask for less (``every_call=False``,
the Megatron adapter's choice: every tensor-parallel rank runs the same model on the same batch,
as Megatron's own loss assumes). The exchange then runs at the first call and again only where
this rank's own call changed (its table of words differs from the last one agreed on this
group). In training that is once, then at each switch between training and evaluation. What it
gives up is the case above: a rank whose call changed alone waits in the exchange for peers that
skipped it, and raises comm.HostGroupError after the group's timeout, where every call's
exchange would have raised at once. Why bother: the exchange is a barrier of the ranks' hosts.
In a training step whose host barely keeps ahead of the GPU (four layers at TP4, traced on
4 x H200, 2026-11-27), each host waited 2-2.6 ms in it for the slowest, while its GPU idled,
eight times a step (docs/benchmarks/training_step.md).

What is cached: the gloo group per set of ranks and, with ``every_call=False``, the last agreed
call per group, nothing else. Measured with
scripts/studies/bench_agreement.py --cpu-smoke (gloo, TP 2, a 2-core machine shared with other
jobs, so
upper bounds): the first call 1-3 ms, later calls 0.3-0.6 ms, of which ~25 us is Python
(describing and hashing the call) and the rest the loopback all-gather (two processes meeting
on two busy cores); the layer's step at a tiny shape, timed in turn with the check stubbed
out, took 6.60 against 6.52 ms (medians of 100). On NCCL the first call also makes the gloo
group; the GPU figures at the Gemma-2 shape come from the same script.

Deadlock: the host all-gather blocks this rank's host until every peer's host reaches the same
call. In an SPMD program the peers issue the same collectives in the same order before it, and
those run on their GPUs without their hosts, so no peer can be waiting for this rank's host.
Where that does not hold (a member never calls, or its host blocks first in something this rank
has not reached: making a group every rank must enter, a gloo collective of another group, this
layer on another group in another order), every member that came raises comm.HostGroupError
after the group's timeout.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from . import comm

_WORDS = ("failed", "signature", "rows", "start_given", "start")


@dataclass(frozen=True)
class AgreedLayout:
    """What every rank agreed on: this rank's shard start and the number of classes."""

    start: int
    num_classes: int
    total_rows: int


def describe_tensor(value) -> str:
    """A short, never-raising description of an argument: shape and dtype of a tensor."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def signature_hash(facts: dict[str, str]) -> int:
    """A 64-bit hash of the call's description, the same in every process (unlike hash())."""
    text = repr(sorted(facts.items())).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def agree_on_call(
    group,
    *,
    facts: dict[str, str],
    shard_rows: int,
    vocab_start_index: int | None,
    vocab_size: int | None,
    error: Exception | None,
    every_call: bool = True,
) -> AgreedLayout:
    """Check the call against every rank's; raise the same error on every rank if they differ.

    Args:
        group: the tensor-parallel process group (this process is a member).
        facts: what must be equal on every rank, as readable strings (shapes, dtypes, options).
        shard_rows: the rows of this rank's weight shard.
        vocab_start_index: this shard's first global row, if the caller gave it.
        vocab_size: the number of classes, if given (else the rows of all shards).
        error: this rank's own validation failure, if any; it is raised after the exchange.
        every_call: False skips the exchange where this rank's call is the last agreed one
            (the module docstring says what that gives up).

    Returns:
        The agreed layout; on every rank the same except ``start``.
    """
    failed = error is not None
    given = vocab_start_index is not None
    words = [
        int(failed),
        0 if failed else signature_hash(facts),
        _int_or(shard_rows, 0),
        int(given),
        _int_or(vocab_start_index, 0) if given else 0,
    ]
    key = (comm.group_members(group), id(group))
    last = _LAST_AGREED.get(key)
    if not every_call and error is None and last is not None and last[0] == words:
        return last[1]
    table = comm.all_gather_host_ints(words, group)
    layout = _layout_from_table(table, group, facts, vocab_size, error)
    _LAST_AGREED[key] = (words, layout)
    return layout


# The last call agreed on, per group (its global ranks and the group object): this rank's words
# and the layout.
_LAST_AGREED: dict[tuple, tuple[list[int], AgreedLayout]] = {}


def _layout_from_table(table: list[list[int]], group, facts: dict[str, str],
                       vocab_size: int | None, error: Exception | None) -> AgreedLayout:
    """The same decision on every rank from the gathered table: raise, or the agreed layout."""
    failed = error is not None
    columns = {name: [row[i] for row in table] for i, name in enumerate(_WORDS)}
    me = comm.rank(group)

    if any(columns["failed"]):
        mine = f"{type(error).__name__}: {error}" if failed else None
        messages = comm.all_gather_host_objects(mine, group)
        if failed:
            raise error
        rejected = "; ".join(f"rank {r} rejected its arguments: {m}"
                             for r, m in enumerate(messages) if m is not None)
        raise ValueError(rejected)

    if len(set(columns["signature"])) > 1:
        described = comm.all_gather_host_objects(facts, group)
        raise ValueError(disagreement_message(described))

    rows, starts = columns["rows"], columns["start"]
    if len(set(columns["start_given"])) > 1:
        given_on = [r for r, g in enumerate(columns["start_given"]) if g]
        raise ValueError(
            f"vocab_start_index must be given on every rank or on none (given on ranks "
            f"{given_on} of {len(rows)})"
        )
    if columns["start_given"][me]:
        if any(s < 0 for s in starts):
            raise ValueError(f"vocab_start_index must be >= 0 on every rank, got {starts}")
    else:
        starts = [sum(rows[:r]) for r in range(len(rows))]
    total = _check_tiling(rows, starts)
    if total == 0:
        raise ValueError(f"the weight shards hold no rows together (shard sizes {rows}): the "
                         "vocabulary needs at least one class")

    num_classes = total if vocab_size is None else vocab_size
    if num_classes > total:
        raise ValueError(
            f"vocab_size ({num_classes}) exceeds the rows of all shards together ({total})"
        )
    return AgreedLayout(start=starts[me], num_classes=num_classes, total_rows=total)


def disagreement_message(described: list[dict[str, str]]) -> str:
    """"ranks disagree on ...", each differing field with every rank's value."""
    keys = sorted({k for d in described for k in d})
    parts = []
    for key in keys:
        values = [d.get(key, "<missing>") for d in described]
        if len(set(values)) > 1:
            parts.append(f"{key} (" + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                         + ")")
    detail = "; ".join(parts) if parts else "the call's signature"
    return f"ranks disagree on {detail}; every rank must make the same call"


def _check_tiling(rows: list[int], starts: list[int]) -> int:
    """The total rows, if the shards tile [0, total) without gap or overlap; else raise."""
    order = sorted(range(len(rows)), key=lambda r: starts[r])
    expected = 0
    for r in order:
        if starts[r] != expected:
            kind = "overlap" if starts[r] < expected else "gap"
            raise ValueError(
                f"vocabulary shards do not tile the vocabulary ({kind}): rank {r} starts at "
                f"{starts[r]}, expected {expected} (shard sizes {rows}, starts {starts})"
            )
        expected += rows[r]
    return expected


def _int_or(value, default: int) -> int:
    """``value`` as a word of the table (an int within int64, clamped), or ``default``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return max(-(2**62), min(value, 2**62))
    return default
