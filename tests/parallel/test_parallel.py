"""The vocab-parallel layer on real collectives: gloo process groups spawned on the CPU.

One process group per world size TP (1, 2, 3, 4) runs every case of ``_cases`` in turn: starting
processes costs seconds, a case under the Triton interpreter a fraction of one. Each rank
compares its loss, lse, input gradient (with SP its sequence shard) and weight/bias gradient
shard with the float64 reference on the concatenated weight (helpers_parallel.check_case).

The vocabulary has 203 rows (not divisible by 2, 3 or 4: uneven shards) or, for the padding
cases, 216 rows of which 203 are classes, as Megatron pads its vocabulary to a multiple of TP.
Input (S, B, D) = (12, 3, 37): S divisible by every TP (sequence parallelism), B odd.

Bad inputs run on TP=2: every rank must raise the same ValueError (a rank that raises while
another enters a collective is a hang). Calls that are wrong on one rank only are tested at the
end; each waits at most ``SHORT_TIMEOUT_S`` for a collective it would leave unmatched.
"""

from __future__ import annotations

import re
import traceback

import pytest
import torch
import torch.distributed as dist
from helpers import rel_err
from helpers_lce import ATOL, make_problem
from helpers_parallel import case, layout, run_cases, run_on_ranks

from fused_lce import linear_cross_entropy

F32, BF16 = torch.float32, torch.bfloat16
S, B, D = 12, 3, 37
V = 203
V_PADDED = 216  # divisible by 1, 2, 3 and 4
# Long enough for a loaded 2-core machine's spawn skew (5 s flaked there), short enough that a
# regression to a hang fails the test rather than CI.
SHORT_TIMEOUT_S = 30


def _cases(world: int) -> list[dict]:
    """Every case of one world size, run in this order on one process group."""
    cases = []
    for impl in ("chunked", "cce"):
        cases += [
            case("mean", impl, V),
            # 204 rows after 203: at TP = 2, 3, 4 some rank keeps its row count while the
            # layout changes (a per-rank cache of shard starts once hung here).
            case("layout-change-204-rows", impl, V + 1, bias=True),
            case("mean-sp", impl, V, sp=True),
            case("sum-bias-uniform-sp", impl, V, regime="near-uniform", sp=True, ignore=0.25,
                 bias=True, reduction="sum"),
            case("none-lse-bias", impl, V, bias=True, reduction="none", return_lse=True),
            case("smoothing-sp", impl, V, sp=True, label_smoothing=0.1,
                 smoothing_is_global=True),
            case("smoothing-none-uniform", impl, V, regime="near-uniform", reduction="none",
                 label_smoothing=0.2),
            case("softcap-zloss-lse-sum", impl, V, bias=True, reduction="sum", softcap=3.0,
                 z_loss=1e-3, return_lse=True),
            case("padding-everything-sp", impl, V_PADDED, vocab_size=V, regime="near-uniform",
                 sp=True, bias=True, reduction="none", label_smoothing=0.1, softcap=3.0,
                 z_loss=1e-3, return_lse=True),
            case("padding-mean", impl, V_PADDED, vocab_size=V),
            case("all-ignored-mean", impl, V, ignore=1.0, bias=True),
            case("all-ignored-sum-lse-sp", impl, V, sp=True, ignore=1.0, reduction="sum",
                 return_lse=True, z_loss=1e-3),
            case("reversed-shards-bias", impl, V, reversed_shards=True, bias=True),
            case("bf16-bias-softcap-sp", impl, V, dtype=BF16, sp=True, bias=True, softcap=5.0),
            case("bf16-uniform-none-lse", impl, V, dtype=BF16, regime="near-uniform",
                 reduction="none", return_lse=True),
            case("accumulator-padding-sp", impl, V_PADDED, vocab_size=V, sp=True, bias=True,
                 accumulate=True),
            case("bf16-accumulator", impl, V, dtype=BF16, accumulate=True),
        ]
        if world > 1:
            # Too few classes to reach the last shard: that rank holds only padding rows.
            cases.append(case("padding-only-shard-lse", impl, V_PADDED, bias=True,
                              return_lse=True, vocab_size=V_PADDED - V_PADDED // world - 5))
    # The tiles backward (its gradient filter's budget is set by the global vocabulary) and
    # the deterministic mode.
    cases += [
        case("tiles-safe-filter", "cce", V, backward="tiles"),
        case("tiles-nofilter-smoothing-sp", "cce", V, sp=True, backward="tiles",
             filter_eps=None, label_smoothing=0.1, reduction="sum", smoothing_is_global=True),
        case("tiles-deterministic-bias", "cce", V, bias=True, backward="tiles",
             deterministic=True),
        # The backward from the forward's kept logits: G against the global lse.
        case("kept-logits-everything-sp", "cce", V_PADDED, vocab_size=V, sp=True, bias=True,
             reduction="none", label_smoothing=0.1, softcap=3.0, z_loss=1e-3,
             return_lse=True, keep_logits=True),
        case("kept-logits-bf16-accumulator", "cce", V, dtype=BF16, regime="near-uniform",
             accumulate=True, keep_logits=True),
    ]
    return cases


def _match_suite(rank: int, world: int) -> list[str]:
    return run_cases(rank, world, _cases(world), shape=(S, B, D), device="cpu")


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"tp{w}")
def test_matches_single_device(world, tmp_path):
    run_on_ranks(world, _match_suite, out_dir=tmp_path, interpret=True)


def test_case_layouts():
    """The tests' own bookkeeping: shards tile the rows, every TP divides S, V is ragged."""
    for world in (1, 2, 3, 4):
        assert S % world == 0
        for c in _cases(world):
            rows, starts = layout(c, world)
            spans = sorted(zip(starts, rows))
            assert [a for a, _ in spans] == [sum(n for _, n in spans[:i]) for i in range(world)]
            assert sum(rows) == c["rows"] >= (c["vocab_size"] or 0)
        if world > 1:
            assert V % world and V_PADDED % world == 0


# ---------------------------------------------------------------------------------------------
# Bad inputs (TP=2): every rank raises the same ValueError, and nothing hangs
# ---------------------------------------------------------------------------------------------


def _bad_cases(rank: int) -> list[tuple[str, dict, str]]:
    """(name, this rank's call arguments, regex of the ValueError every rank must raise)."""
    hidden, weight, target, _ = make_problem((S, B), V_PADDED, D, F32, seed=3, num_classes=V)

    def call(rows=(102, 101), given=None, **overrides):
        start = sum(rows[:rank])
        args = dict(input=hidden, weight=weight[start:start + rows[rank]], target=target,
                    impl="chunked")
        if given is not None and given[rank] is not None:
            args["vocab_start_index"] = given[rank]
        return {**args, **overrides}

    def with_target(index, value):
        changed = target.clone()
        changed[index] = value
        return changed

    sp_rows = slice(rank * S // 2, (rank + 1) * S // 2)
    return [
        ("start given on rank 0 only", call(given=(0, None)), "every rank or on none"),
        ("gap between shards", call(given=(0, 103)), "do not tile"),
        ("overlapping shards", call(given=(0, 100)), "do not tile"),
        ("shards not starting at 0", call(given=(1, 103)), "do not tile"),
        ("two shards at 0", call((102, 102), given=(0, 0)), "do not tile"),
        ("impl torch", call(impl="torch"), "impl"),
        ("SP target of the local shard only",
         call(input=hidden[sp_rows], target=target[sp_rows], sequence_parallel=True),
         "whole sequence"),
        ("target past the vocabulary", call(target=with_target((5, 1), V)),
         f"target holds class {V}"),
        ("negative target", call(target=with_target((0, 0), -7)), "target holds class -7"),
        ("target on a padding row",
         call((108, 108), vocab_size=V, target=with_target((2, 2), 205)),
         "target holds class 205"),
        ("vocab_size beyond the shards", call(vocab_size=V + 1), "vocab_size"),
        ("ranks disagree on tokens",
         call(input=hidden[: S - rank], target=target[: S - rank]),
         "ranks disagree"),
    ]


def _bad_input_suite(rank: int, world: int) -> list[str]:
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    errors = []
    for name, args, pattern in _bad_cases(rank):
        label = f"tp={world} rank={rank} bad input '{name}'"
        try:
            vocab_parallel_linear_cross_entropy(**args)
            errors.append(f"{label}: no error raised")
        except ValueError as exc:
            if not re.search(pattern, str(exc)):
                errors.append(f"{label}: ValueError {str(exc)!r} does not match {pattern!r}")
        except Exception:
            # Another error, or a collective that timed out: the ranks are out of step now.
            errors.append(f"{label} raised:\n{traceback.format_exc()}")
            return errors
        # Every rank must be here before the next case: a rank left inside a collective would
        # pair it with the wrong call (and then time out).
        dist.barrier()

    # A process outside `group`; every rank must take part in creating the subgroup.
    solo = dist.new_group([0])
    hidden, weight, target, _ = make_problem((S, B), V, D, F32, seed=4)
    label = f"tp={world} rank={rank} group without this rank"
    if rank == 0:
        # For its one member the subgroup is a valid TP=1 group: the single-device loss.
        loss = vocab_parallel_linear_cross_entropy(hidden, weight, target, group=solo,
                                                   impl="chunked")
        single = linear_cross_entropy(hidden, weight, target, impl="chunked")
        if rel_err(loss, single) > ATOL[F32]:
            errors.append(f"{label}: TP=1 subgroup loss {loss.item()} != {single.item()}")
    else:
        try:
            vocab_parallel_linear_cross_entropy(hidden, weight, target, group=solo,
                                                impl="chunked")
            errors.append(f"{label}: no error raised")
        except ValueError as exc:
            if "not a member" not in str(exc):
                errors.append(f"{label}: unexpected message {str(exc)!r}")
    dist.barrier()
    return errors


def test_bad_inputs_raise_on_every_rank(tmp_path):
    run_on_ranks(2, _bad_input_suite, out_dir=tmp_path, interpret=True)


# ---------------------------------------------------------------------------------------------
# Calls that are wrong on one rank only: every rank must still raise
# ---------------------------------------------------------------------------------------------


def _one_rank_differs_suite(rank: int, world: int, variant: str) -> list[str]:
    """A call that is wrong on rank 1 (or 0) only: every rank must raise the ValueError of the
    check that sees it, since a rank that goes on into a collective waits for ever. No barrier
    after it: a rank that raised leaves, which ends the other's wait."""
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    hidden, weight, target, _ = make_problem((S, B), V, D, F32, seed=6)
    shard = weight[rank * 102:(rank + 1) * 102]
    if variant == "negative-start":
        args = dict(input=hidden, target=target, vocab_start_index=-1 if rank == 0 else 102)
        expected = r"vocab_start_index must be >= 0 on every rank, got \[-1, 102\]"
    else:  # "sp-shard-size": rank 1's sequence shard is one position short
        # ... and its target matches it, so each rank's own checks pass: only the comparison of
        # the ranks' signatures can tell (the shapes of input and target differ).
        half = S // 2
        rows = half - rank
        args = dict(input=hidden[rank * half:rank * half + rows], target=target[:2 * rows],
                    sequence_parallel=True)
        expected = (r"ranks disagree on input \(rank 0: \(6, 3, 37\) float32, rank 1: "
                    r"\(5, 3, 37\) float32\); target")
    try:
        vocab_parallel_linear_cross_entropy(weight=shard, impl="chunked", **args)
    except ValueError as exc:
        if re.search(expected, str(exc)):
            return []
        return [f"rank={rank}: ValueError {str(exc)[:300]!r} does not match {expected!r}"]
    except Exception as exc:
        return [f"rank={rank}: {type(exc).__name__} instead of ValueError: {str(exc)[:200]}"]
    return [f"rank={rank}: no error raised"]


def test_negative_start_on_one_rank_raises_everywhere(tmp_path):
    run_on_ranks(2, _one_rank_differs_suite, "negative-start", out_dir=tmp_path,
                 timeout_s=SHORT_TIMEOUT_S, interpret=True)


def test_agreement_catches_sp_shard_size_disagreement(tmp_path):
    run_on_ranks(2, _one_rank_differs_suite, "sp-shard-size", out_dir=tmp_path,
                 timeout_s=SHORT_TIMEOUT_S, interpret=True)
