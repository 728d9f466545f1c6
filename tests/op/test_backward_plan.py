"""The GEMM backward's planner (fused_lce/backward_plan.py): which strategy a call takes.

The expected numbers are worked out by hand from the planners' arithmetic in each test's
comment, so a change of policy or of a constant shows here before it shows as a slower or
larger backward on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from fused_lce.backward_plan import (
    GemmBackwardPlan,
    WeightBufferLayout,
    plan_gemm_backward,
    plan_gemm_backward_for,
)
from fused_lce.kernels.gemm_backward import lce_backward_gemm
from fused_lce.terms import GradCoefficients

# 256 tokens of D = 64 in bf16 over 5003 columns, with a bias gradient: the budget is what is
# left for buffers plus the per-token vectors (64 bytes a token) and the fp32 bias gradient.
N, V, D, ELEM = 256, 5003, 64, 2
VECTORS = N * 64 + V * 4


def plan(
    buffers: int, *, n_rows=N, n_vocab=V, d_model=D, bias_grad=True, min_tiles=4, **choices
) -> GemmBackwardPlan:
    """The plan for a budget of ``buffers`` bytes beside the per-token and bias vectors."""
    vectors = n_rows * 64 + (n_vocab * 4 if bias_grad else 0)
    choices = dict(borrowable=True, kept=False) | choices
    return plan_gemm_backward(
        n_rows, n_vocab, d_model, ELEM, buffers + vectors, min_tiles=min_tiles,
        bias_grad=bias_grad, **choices,
    )


def test_kept_logits_are_used_whatever_the_budget():
    assert plan(20_480, kept=True) == GemmBackwardPlan("kept")
    assert plan(64 * 2**20, kept=True, borrowable=False) == GemmBackwardPlan("kept")


def test_no_rows_or_columns_plan_nothing():
    assert plan(0, n_rows=0) == GemmBackwardPlan("empty")
    assert plan(0, n_vocab=0, kept=True) == GemmBackwardPlan("empty")


def test_roomy_budget_takes_one_token_chunk_of_every_row():
    # Every row fits with 64 MiB: the columns stop at MAX_CHUNK_COLS, then at V.
    assert plan(64 * 2**20) == GemmBackwardPlan("token_chunks", chunk_rows=N, chunk_cols=V)


@pytest.mark.parametrize(
    "small, halved", [(300, ()), (40, ((1024, 256),))], ids=["small-300", "small-40"]
)
def test_tight_budget_borrows_the_weight_gradient(small, halved):
    # A G chunk of V // 8 rounded to 512 columns takes 256 * 512 * 2 bytes = 2048 weight rows
    # of 128 bytes, the fp32 accumulator 512 more. The small buffer is what the budget holds
    # after 8 bytes a token: (N * 2 * small - 2048) // 512, down to a multiple of 16 (288, 32).
    # With 32 columns the last pass first halves the chunk to 256 columns (1024 rows).
    layout = WeightBufferLayout(512, 2048, 2560, 288 if small == 300 else 32, halved)
    assert plan(N * ELEM * small) == GemmBackwardPlan("borrowed", layout=layout)


def test_one_chunk_of_every_row_that_overflows_the_budget_borrows():
    # 45 tokens: every row is one chunk (the floor is 128 rows), but its buffers, 45 * 384
    # bytes of rows and a G chunk of 256 columns (40320 bytes), overflow 27000. G takes
    # 45 * 512 * 2 bytes = 360 weight rows, the accumulator 90 more; small: 26640 // 90 -> 288.
    layout = WeightBufferLayout(512, 360, 450, 288, ())
    assert plan(45 * ELEM * 300, n_rows=45) == GemmBackwardPlan("borrowed", layout=layout)
    expected = GemmBackwardPlan("token_chunks", chunk_rows=45, chunk_cols=256)
    assert plan(45 * ELEM * 300, n_rows=45, borrowable=False) == expected


def test_tight_budget_without_a_borrowable_weight_gradient_walks_token_chunks():
    # No 1024 columns fit any row count: the rows shrink to the floor of 128, with the
    # narrowest G chunk of 256 columns.
    expected = GemmBackwardPlan("token_chunks", chunk_rows=128, chunk_cols=256)
    assert plan(N * ELEM * 300, borrowable=False) == expected


@pytest.mark.parametrize("n_vocab, kind", [(128_256, "borrowed"), (90_000, "token_chunks")])
def test_tall_token_chunks_win_over_a_long_second_pass(n_vocab, kind):
    # 16384 tokens of D = 4096: 20 MiB beside the dE accumulators and gathered rows of every
    # row hold 512 columns, under 1024, so the rows shrink to 15872 (1024 columns). Borrowing
    # puts G (16384 rows) and the accumulator (32768) below row 49152: within half of 128256
    # columns it wins, past half of 90000 the tall token chunks do.
    n_rows, d_model = 16384, 4096
    buffers = n_rows * d_model * 6 + 20 * 2**20
    got = plan(buffers, n_rows=n_rows, n_vocab=n_vocab, d_model=d_model, bias_grad=False,
               min_tiles=132)
    assert got.kind == kind
    if kind == "borrowed":
        assert (got.layout.g_rows, got.layout.free_from) == (16384, 49152)
    else:
        assert (got.chunk_rows, got.chunk_cols) == (15872, 1024)


def _plan_for(weight, **kwargs):
    hidden = torch.zeros(N, D, dtype=torch.bfloat16)
    return plan_gemm_backward_for(
        hidden, weight, torch.zeros(V, dtype=torch.bfloat16),
        scratch_bytes=VECTORS + N * ELEM * 300, **kwargs,
    ).kind


def test_only_a_fresh_contiguous_weight_gradient_beside_d_hidden_is_borrowed():
    weight = torch.zeros(V, D, dtype=torch.bfloat16)
    assert _plan_for(weight) == "borrowed"
    assert _plan_for(weight, kept=True) == "kept"
    # d_weight is empty_like(weight): a transposed weight gives a transposed gradient.
    assert _plan_for(torch.zeros(D, V, dtype=torch.bfloat16).t()) == "token_chunks"
    # A sliced weight is not dense: its gradient is allocated contiguous, and lends.
    assert _plan_for(torch.zeros(V, 2 * D, dtype=torch.bfloat16)[:, :D]) == "borrowed"
    assert _plan_for(weight, into_accumulator=True) == "token_chunks"
    assert _plan_for(weight, want_weight=False) == "token_chunks"
    assert _plan_for(weight, want_hidden=False) == "token_chunks"


@pytest.mark.parametrize(
    "plan_kind, transposed, message",
    [("kept", False, "kept logits go with"), ("borrowed", True, "contiguous d_weight"),
     ("empty", False, "needs a plan that computes")],
)
def test_the_driver_refuses_a_plan_its_buffers_cannot_follow(plan_kind, transposed, message):
    n, v, d = 4, 16, 8
    weight = torch.zeros(d, v).t() if transposed else torch.zeros(v, d)
    ones = torch.ones(n)
    layout = WeightBufferLayout(256, 8, 16, 16)
    with pytest.raises(ValueError, match=message):
        lce_backward_gemm(
            torch.zeros(n, d), weight, None, torch.zeros(n, dtype=torch.int32),
            torch.arange(n, dtype=torch.int32), torch.tensor(n, dtype=torch.int32), ones,
            GradCoefficients(ones, -ones, None), softcap=None,
            plan=GemmBackwardPlan(plan_kind, layout=layout),
        )
