"""The exponentials kernels (fused_lce/kernels/exp_logits.py and exp_logits_grad.py), called
directly, against float64 torch on the same bf16 inputs: the target logits and their column
codes, the stored exponentials and their sums (through tensor descriptors and through pointers),
the row scales and the scaled operand, the input gradient's finish and the target rows' sums into
the weight and bias gradients (runs of equal targets longer than the kernel's block, and a
vocabulary shard).

Sizes are ragged (150 x 307 x 72 and 70): no tile divides them; 72 columns of bf16 make 16-byte
rows (the descriptors' path), 70 do not (the pointers').
"""

from __future__ import annotations

import pytest
import torch
from helpers import logits64

from fused_lce.kernels.exp_logits import (
    IGNORED,
    OTHER_SHARD,
    ExpLogitsConfig,
    exp_logits,
    exp_logits_config,
    repair_exponentials,
    target_logits,
)
from fused_lce.kernels.exp_logits_grad import add_target_rows, finish_input_grad, row_scales

pytestmark = pytest.mark.cpu_kernels

N, V = 150, 307
IGNORE = -100
RTOL = 1e-5  # fp32 sums of exact products


def _problem(d: int, seed: int, *, scale: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, d, generator=gen).bfloat16()
    weight = (torch.randn(V, d, generator=gen) * scale).bfloat16()
    bias = (torch.randn(V, generator=gen) * 0.5).bfloat16()
    # Targets of a whole vocabulary of 2V classes: this shard holds [V, 2V); some ignored.
    target = torch.randint(0, 2 * V, (N,), generator=gen)
    target[torch.rand(N, generator=gen) < 0.2] = IGNORE
    return hidden, weight, bias, target



def _columns64(target, vocab_start):
    local = target - vocab_start
    owned = (target != IGNORE) & (local >= 0) & (local < V)
    live = torch.where(target != IGNORE, OTHER_SHARD, IGNORED)
    return torch.where(owned, local, live)


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_target_logits_and_columns(softcap, with_bias):
    hidden, weight, bias, target = _problem(70, seed=1)
    bias = bias if with_bias else None
    logit, columns = target_logits(hidden, weight, bias, target, vocab_start=V,
                                   ignore_index=IGNORE, softcap=softcap, round_16bit=False)
    expected_columns = _columns64(target, V)
    assert torch.equal(columns.long(), expected_columns)
    owned = expected_columns >= 0
    z = logits64(hidden, weight, bias, softcap)
    expected = torch.where(owned, z[torch.arange(N), expected_columns.clamp(min=0)], 0.0)
    torch.testing.assert_close(logit.double(), expected, rtol=RTOL, atol=1e-6)
    assert (logit[~owned] == 0).all()


@pytest.mark.parametrize("d", [72, 70], ids=["descriptors", "pointers"])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("regime", ["peaked", "near-uniform"])
# Groups of 2 row tiles over 3 (150 rows in 64-row tiles): a full group and a partial one; and
# the warp-specialised tile loop (the interpreter runs it as a plain loop: this checks the wiring).
@pytest.mark.parametrize("split, group, warp_specialize",
                         [(1, None, False), (2, 2, False), (2, None, True)],
                         ids=["whole-tile", "split-epilogue-group2", "warp-specialized"])
def test_exponentials_and_their_sums(d, softcap, regime, split, group, warp_specialize):
    hidden, weight, bias, target = _problem(d, seed=2, scale=0.3 if regime == "peaked" else 0.01)
    columns = _columns64(target, V).to(torch.int32)
    # Offsets as the walk passes them: the target logit (another shard's, here random).
    z = logits64(hidden, weight, bias, softcap)
    offsets = (torch.randn(N) * 2).float()
    out = torch.full((N, V + 5), float("nan"), dtype=torch.bfloat16)[:, :V]  # strided rows
    config = ExpLogitsConfig(exp_logits_config(hidden.device).tile, split=split, group=group,
                             warp_specialize=warp_specialize)
    row_max, sum_exp, target_logit = exp_logits(hidden, weight, bias, columns, offsets, out,
                                                softcap=softcap, round_16bit=False,
                                                config=config)
    keep = torch.ones(N, V, dtype=torch.bool)
    ignored = columns == IGNORED
    keep[ignored] = False
    owned = columns >= 0
    keep[owned.nonzero().squeeze(1), columns[owned].long()] = False
    # The row's logits as the statistics count them: the owned target's is the offset.
    counted = torch.where(keep, z, float("-inf"))
    counted[owned, columns[owned].long()] = offsets.double()[owned]
    expected_lse = torch.logsumexp(counted, 1)
    live = ~ignored
    # row_max is a shift (the largest of the target's logit and the tiles' log-sums): the
    # statistics hold lse = shift + log(sum_exp), and the shift is the target's logit where that
    # dominates, so a confident token's nll = (shift - z_y) + log(sum_exp) keeps its precision.
    assert (row_max[owned] >= offsets[owned]).all()
    lse = row_max.double() + torch.log(sum_exp.double())
    torch.testing.assert_close(lse[live], expected_lse[live], rtol=RTOL, atol=1e-5)
    assert (row_max[ignored] == 0).all() and (sum_exp[ignored] == 1).all()
    assert torch.equal(target_logit, torch.where(owned, offsets, 0.0))
    exps = torch.where(keep, torch.exp(z - offsets.double()[:, None]), 0.0)
    stored = exps
    if softcap is not None:
        stored = exps * (1 - (z / softcap) ** 2)
    # 16-bit storage: each entry rounded once, to bf16's half-spacing (2^-9 relative).
    assert not out.isnan().any()
    error = (out.double() - stored).abs()
    assert (error <= stored.abs() * 2.0**-8 + 1e-30).all()
    assert (out[~keep] == 0).all()


def test_exponentials_without_storage_give_the_same_sums():
    hidden, weight, bias, target = _problem(72, seed=3)
    columns = _columns64(target, 0).to(torch.int32)
    offsets = torch.zeros(N)
    stored = exp_logits(hidden, weight, None, columns, offsets,
                        torch.empty(N, V, dtype=torch.bfloat16), softcap=None, round_16bit=False)
    alone = exp_logits(hidden, weight, None, columns, offsets, None, softcap=None,
                       round_16bit=False)
    assert all(torch.equal(a, b) for a, b in zip(stored, alone))


@pytest.mark.parametrize("split", [1, 2], ids=["whole-tile", "split-epilogue"])
def test_sums_stay_exact_where_exponentials_overflow(split):
    """Rows whose logits pass their offset by more than fp32's exp range (a loss over 88 nats, a
    target under a -inf bias): their tiles are summed again against the tile's max, so the
    statistics stay exact, and the other rows of those tiles keep theirs."""
    hidden, weight, bias, target = _problem(72, seed=12)
    columns = _columns64(target, V).to(torch.int32)
    z = logits64(hidden, weight, bias, None)
    gen = torch.Generator().manual_seed(13)
    offsets = (torch.randn(N, generator=gen) * 2).float()
    offsets[[5, 70]] = -120.0
    offsets[100] = -300.0
    offsets[140] = float("-inf")
    live = columns != IGNORED
    config = ExpLogitsConfig(exp_logits_config(hidden.device).tile, split=split)
    row_max, sum_exp, _ = exp_logits(hidden, weight, bias, columns, offsets,
                                     torch.empty(N, V, dtype=torch.bfloat16), softcap=None,
                                     round_16bit=False, config=config)
    keep = torch.ones(N, V, dtype=torch.bool)
    owned = columns >= 0
    keep[owned.nonzero().squeeze(1), columns[owned].long()] = False
    counted = torch.where(keep, z, float("-inf"))
    counted[owned, columns[owned].long()] = offsets.double()[owned]
    expected_lse = torch.logsumexp(counted, 1)
    lse = row_max.double() + torch.log(sum_exp.double())
    assert live[[5, 70, 100, 140]].all()
    torch.testing.assert_close(lse[live], expected_lse[live], rtol=RTOL, atol=1e-5)


def test_rows_past_the_range_are_stored_again_against_their_lse():
    hidden, weight, bias, target = _problem(72, seed=10)
    columns = _columns64(target, 0).to(torch.int32)
    z = logits64(hidden, weight, bias, None)
    gen = torch.Generator().manual_seed(11)
    lse = torch.logsumexp(z, 1).float()
    # Offsets 60 nats under the lse in a few rows (their E would reach exp(60)), NaN in one.
    offsets = lse - torch.rand(N, generator=gen) * 5
    far = torch.zeros(N, dtype=torch.bool)
    far[[3, 64, 65, 149]] = True
    offsets[far] = lse[far] - 60.0
    offsets[7] = float("nan")
    far[7] = True
    out = torch.full((N, V), 7.0, dtype=torch.bfloat16)
    repair_exponentials(hidden, weight, bias, columns, offsets, lse, out, softcap=None,
                        round_16bit=False)
    assert (out[~far] == 7.0).all()  # rows in range untouched
    owned = columns >= 0
    expected = torch.exp(z - lse.double()[:, None])
    expected[owned, columns[owned].long()] = 0.0
    expected[columns == IGNORED] = 0.0
    error = (out.double() - expected).abs()[far]
    assert (error <= expected[far].abs() * 2.0**-8 + 1e-30).all()


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
def test_row_scales_and_the_scaled_operand(softcap):
    hidden, _, _, target = _problem(70, seed=4)
    gen = torch.Generator().manual_seed(5)
    columns = _columns64(target, V).to(torch.int32)
    lse = torch.randn(N, generator=gen) + 5
    offsets = lse - torch.rand(N, generator=gen) * 3
    p_coef = torch.rand(N, generator=gen)
    p_coef[columns == IGNORED] = 0.0
    target_grad = -torch.rand(N, generator=gen)
    out = torch.empty(N, 70, dtype=torch.bfloat16)
    scale, tgrad = row_scales(hidden, lse, offsets, p_coef, target_grad, columns,
                              softcap=softcap, out=out)
    expected = p_coef.double() * torch.exp(offsets.double() - lse.double())
    torch.testing.assert_close(scale.double(), expected, rtol=RTOL, atol=0)
    factor = 1.0 if softcap is None else 1 - (offsets.double() / softcap) ** 2
    owned = columns >= 0
    expected_t = torch.where(owned, target_grad.double() * factor, 0.0)
    torch.testing.assert_close(tgrad.double(), expected_t, rtol=RTOL, atol=0)
    torch.testing.assert_close(out, (expected[:, None] * hidden.double()).bfloat16(),
                               rtol=0, atol=0)
    # Into a caller's buffer (the walk keeps every row's for the target terms after the walk).
    buffer = torch.full((N + 5,), float("nan"))
    _, into = row_scales(hidden, lse, offsets, p_coef, target_grad, columns, softcap=softcap,
                         target_grad_out=buffer[2:N + 2])
    assert into.data_ptr() == buffer[2:].data_ptr()
    torch.testing.assert_close(buffer[2:N + 2], tgrad, rtol=0, atol=0)
    assert buffer[:2].isnan().all() and buffer[N + 2:].isnan().all()
    with pytest.raises(TypeError, match="target_grad_out must have dtype torch.float32"):
        row_scales(hidden, lse, offsets, p_coef, target_grad, columns, softcap=softcap,
                   target_grad_out=torch.empty(N, dtype=torch.float64))


def test_finish_input_grad():
    hidden, weight, _, target = _problem(70, seed=6)
    gen = torch.Generator().manual_seed(7)
    columns = _columns64(target, V).to(torch.int32)
    partial = torch.randn(N, 70, generator=gen)
    scale, tgrad = torch.rand(N, generator=gen), torch.randn(N, generator=gen)
    owned = columns >= 0
    tgrad[~owned] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        grad = partial.to(dtype)
        expected = scale.double()[:, None] * grad.double()
        expected[owned] += tgrad.double()[owned, None] * weight.double()[columns[owned].long()]
        finish_input_grad(grad, weight, scale, tgrad, columns)
        tol = 1e-6 if dtype == torch.float32 else 2.0**-8
        assert ((grad.double() - expected).abs() <= tol * expected.abs() + 1e-6).all()


@pytest.mark.parametrize("with_weight_grad", [True, False], ids=["weight+bias", "bias-only"])
def test_target_rows_summed_once_per_weight_row(with_weight_grad):
    hidden, _, _, _ = _problem(70, seed=8)
    gen = torch.Generator().manual_seed(9)
    # Long runs: 150 rows over 4 classes of the shard, plus other shards' and ignored rows.
    columns = torch.randint(0, 4, (N,), generator=gen) * 37
    columns[torch.rand(N, generator=gen) < 0.2] = OTHER_SHARD
    columns[torch.rand(N, generator=gen) < 0.1] = IGNORED
    columns = columns.to(torch.int32)
    coef = torch.randn(N, generator=gen)
    start = torch.randn(V, 70, generator=gen)
    owned = columns >= 0
    expected = start.double().index_add(0, columns[owned].long(),
                                        coef.double()[owned, None] * hidden.double()[owned])
    expected_bias = torch.zeros(V, dtype=torch.float64).index_add(0, columns[owned].long(),
                                                                  coef.double()[owned])
    assert torch.bincount(columns[owned].long()).max() > 32  # longer than one block of the run
    weight_grad = start.clone() if with_weight_grad else None
    bias_grad = torch.zeros(V)
    add_target_rows(weight_grad, hidden, coef, columns, bias_grad)
    torch.testing.assert_close(bias_grad.double(), expected_bias, rtol=RTOL, atol=1e-6)
    if with_weight_grad:
        torch.testing.assert_close(weight_grad.double(), expected, rtol=RTOL, atol=1e-5)
        # bf16 weight gradient: the same sums, rounded once.
        bf16 = start.bfloat16()
        exact = bf16.double().index_add(0, columns[owned].long(),
                                        coef.double()[owned, None] * hidden.double()[owned])
        add_target_rows(bf16, hidden, coef, columns)
        assert ((bf16.double() - exact).abs() <= exact.abs() * 2.0**-8).all()


def test_a_frequent_targets_run_spans_many_tail_steps():
    # A Zipf vocabulary's first token: hundreds of rows share one column, a run longer than
    # the launcher's piece plus several of its tail steps; the rows before and after it and
    # the ignored ones must not leak into it.
    gen = torch.Generator().manual_seed(13)
    n_rows, d_model, n_cols = 701, 45, 9
    hidden = torch.randn(n_rows, d_model, generator=gen).bfloat16()
    columns = torch.where(torch.rand(n_rows, generator=gen) < 0.7, 4,
                          torch.randint(0, n_cols, (n_rows,), generator=gen))
    columns[torch.rand(n_rows, generator=gen) < 0.05] = IGNORED
    columns = columns.to(torch.int32)
    coef = torch.randn(n_rows, generator=gen)
    owned = columns >= 0
    assert (columns == 4).sum() > 32 + 3 * 64
    start = torch.randn(n_cols, d_model, generator=gen)
    expected = start.double().index_add(0, columns[owned].long(),
                                        coef.double()[owned, None] * hidden.double()[owned])
    expected_bias = torch.zeros(n_cols, dtype=torch.float64).index_add(
        0, columns[owned].long(), coef.double()[owned])
    weight_grad, bias_grad = start.clone(), torch.zeros(n_cols)
    add_target_rows(weight_grad, hidden, coef, columns, bias_grad)
    torch.testing.assert_close(weight_grad.double(), expected, rtol=RTOL, atol=1e-4)
    torch.testing.assert_close(bias_grad.double(), expected_bias, rtol=RTOL, atol=1e-5)


def test_launchers_name_a_bad_argument():
    hidden, weight, bias, target = _problem(70, seed=12)
    columns = _columns64(target, 0).to(torch.int32)
    offsets = torch.zeros(N)
    with pytest.raises(TypeError, match="columns must have dtype torch.int32"):
        exp_logits(hidden, weight, None, columns.long(), offsets, None, softcap=None,
                   round_16bit=False)
    with pytest.raises(ValueError, match=r"out must be a \(150, 307\) matrix"):
        exp_logits(hidden, weight, None, columns, offsets, torch.empty(N, V + 1).bfloat16(),
                   softcap=None, round_16bit=False)
    with pytest.raises(ValueError, match=r"lse must have shape \(150,\)"):
        row_scales(hidden, torch.zeros(N - 1), offsets, offsets, offsets, columns, softcap=None)
