"""The Triton kernels, called directly (under the interpreter on CPU), against fp64 torch.

- ``lse_forward``: per-row max / sum-exp / row sum and per-column sums; ignored rows untouched.
- ``lse_forward``'s target logit, including a vocabulary shard (``vocab_start``).
- ``lce_backward`` (the fused "tiles" backward): MODE 0 (atomics) and the deterministic
  MODE 1 + 2 against fp64 gradients; FILTER 1 and 2 against fp64 gradients with exactly the
  tiles the criterion names removed; a tiny scratch budget that forces several token and
  vocabulary chunks.
- ``grad_logits`` / ``lce_backward_gemm`` (the GEMM backward): a chunk of the logit gradient G
  against fp64, and the gradients with one and with several chunks.
- ``scale_unless_one_``: the fp32 product rounded once, a scale of 1 a no-op.

Sizes are ragged (150 x 307 x 70): with the interpreter's 64 x 128 x 64 tiles that is 3 row
blocks, 3 vocabulary blocks and 2 hidden blocks, each with a partial last one.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_rel, logits64, rel_err
from helpers_lce import IGNORE_INDEX, make_problem, record_chunk_plans

from fused_lce.backward_plan import plan_gemm_backward_for
from fused_lce.kernels.common import use_tma
from fused_lce.kernels.gemm_backward import grad_logits, lce_backward_gemm
from fused_lce.kernels.lse_forward import lse_forward
from fused_lce.kernels.tiles_backward import (
    FILTER_ENTRY,
    FILTER_MASS,
    FILTER_OFF,
    backward_config,
    lce_backward,
    plan_chunks,
)
from fused_lce.options import LCEOptions
from fused_lce.terms import GradCoefficients
from fused_lce.token_walk import local_targets
from fused_lce.triton_shard import prepare_rows

N, V, D = 150, 307, 70
CPU = torch.device("cpu")
TOL = 1e-5  # fp32 accumulation (the interpreter upcasts 16-bit loads to fp32)


def _dtype_id(dtype):
    return str(dtype).removeprefix("torch.")



def _assert_sum_close(actual, terms, dim, name):
    """|actual - sum(terms)| <= TOL * sum(|terms|) along ``dim``, elementwise."""
    scaled = (actual.double() - terms.sum(dim)).abs() / terms.abs().sum(dim)
    worst = int(scaled.argmax())
    assert scaled[worst] <= TOL, (
        f"{name}[{worst}]: {actual[worst].item():.6g} vs {terms.sum(dim)[worst].item():.6g}, "
        f"error {scaled[worst].item():.2e} of the sum of |terms|"
    )


# ---------------------------------------------------------------------------------------------
# lse_forward
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("regime", ["peaked", "near-uniform"])
def test_lse_forward(dtype, softcap, regime):
    hidden, weight, target, bias = make_problem(
        N, V, D, dtype, regime, ignore_frac=0.2, bias=True, seed=41
    )
    rows = prepare_rows(target, IGNORE_INDEX)
    stats = lse_forward(
        hidden, weight, bias, rows.order, rows.n_valid, softcap=softcap,
        want_row_sum=True, want_col_sum=True,
    )
    logits = logits64(hidden, weight, bias, softcap)
    valid = rows.valid
    assert int(rows.n_valid) == int(valid.sum()) < N

    ref_max = logits.max(dim=1).values
    assert_close_rel(stats.max[valid], ref_max[valid], TOL, name="max")
    # sum_exp is relative to the kernel's own max; compare it against that max.
    ref_sum_exp = torch.exp(logits - stats.max.double()[:, None]).sum(dim=1)
    assert_close_rel(stats.sum_exp[valid], ref_sum_exp[valid], TOL, name="sum_exp")
    assert_close_rel(stats.lse[valid], torch.logsumexp(logits, 1)[valid], TOL, name="lse")
    # Sums of logits may cancel to near zero: measure their error against the sum of |logits|.
    # (With a softcap the kernel's tanh, 1 - 2 / (exp(2x) + 1), is accurate to ~1e-7 absolute,
    # not relative, for small logits.)
    _assert_sum_close(stats.row_sum[valid], logits[valid], dim=1, name="row_sum")
    _assert_sum_close(stats.col_sum, logits[valid], dim=0, name="col_sum")

    # Ignored rows are never visited.
    assert torch.all(stats.max[~valid] == float("-inf"))
    assert torch.all(stats.sum_exp[~valid] == 0)
    assert torch.all(stats.row_sum[~valid] == 0)


def test_lse_forward_optional_outputs_off_and_all_rows_ignored():
    hidden, weight, target, _ = make_problem(N, V, D, torch.float32, "peaked", 1.0, seed=42)
    rows = prepare_rows(target, IGNORE_INDEX)
    stats = lse_forward(hidden, weight, None, rows.order, rows.n_valid, want_col_sum=True)
    assert stats.row_sum is None
    assert torch.all(stats.max == float("-inf")) and torch.all(stats.sum_exp == 0)
    assert torch.count_nonzero(stats.col_sum) == 0


# ---------------------------------------------------------------------------------------------
# lse_forward's target logit
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("shard", [(0, V), (100, 250)], ids=["whole", "shard-100-250"])
def test_target_logit(dtype, softcap, shard):
    hidden, weight, target, bias = make_problem(
        N, V, D, dtype, "peaked", ignore_frac=0.2, bias=True, seed=43
    )
    start, stop = shard
    rows = prepare_rows(target, IGNORE_INDEX)
    stats = lse_forward(
        hidden, weight[start:stop], bias[start:stop], rows.order, rows.n_valid,
        target=target, vocab_start=start, softcap=softcap,
    )
    out = stats.target_logit
    logits = logits64(hidden, weight, bias, softcap)
    owned = (target >= start) & (target < stop)
    expected = torch.zeros(N, dtype=torch.float64)
    expected[owned] = logits[owned.nonzero().squeeze(1), target[owned]]

    assert out.dtype == torch.float32 and out.shape == (N,)
    assert owned.any() and (~owned & (target != IGNORE_INDEX)).any() == (stop - start < V)
    assert_close_rel(out, expected, TOL, name="target logit")
    # Targets outside the shard and ignored tokens give exactly 0.
    assert torch.count_nonzero(out[~owned]) == 0


# ---------------------------------------------------------------------------------------------
# lce_backward
# ---------------------------------------------------------------------------------------------


def _setup_backward(
    dtype, regime, options, seed, ignore_frac=0.2, num_classes=None, d=D, n=N, v=V
):
    """Inputs of lce_backward for the "mean" loss, and the fp64 logit gradient G (N, V).

    The lse fed to the kernel is the fp64 one rounded to fp32, as the forward would give it.
    """
    opts = LCEOptions(**options)
    hidden, weight, target, bias = make_problem(
        n, v, d, dtype, regime, ignore_frac, bias=True, seed=seed, num_classes=num_classes
    )
    rows = prepare_rows(target, IGNORE_INDEX)
    logits = (hidden.double() @ weight.double().t() + bias.double()).requires_grad_(True)
    capped = logits if opts.softcap is None else opts.softcap * torch.tanh(logits / opts.softcap)
    lse64 = torch.logsumexp(capped, 1)
    valid = rows.valid
    safe_target = torch.where(valid, target, 0)
    loss = lse64 - capped.gather(1, safe_target[:, None]).squeeze(1)
    if opts.label_smoothing:
        ls = opts.label_smoothing
        loss = (1 - ls) * loss + ls * (lse64 - capped.mean(1))
    loss = loss + opts.z_loss * lse64**2
    loss = torch.where(valid, loss, 0).sum() / valid.sum()
    (grad_logits,) = torch.autograd.grad(loss, logits)

    lse = torch.where(valid, lse64.detach(), 0).float()
    # The logit gradient's per-row coefficients (fused_lce.terms), written out: g = 1 / n_valid
    # for the "mean" loss, 0 for ignored rows.
    g = torch.where(valid, 1.0 / int(valid.sum()), 0.0)
    ls = opts.label_smoothing
    p_coef = g * (1.0 + 2.0 * opts.z_loss * lse)
    p_target = torch.exp(capped.gather(1, safe_target[:, None]).squeeze(1) - lse64).detach()
    coefs = GradCoefficients(
        p_coef=p_coef,
        target_grad=(p_coef * p_target - g * (1.0 - ls)).float(),
        smooth_coef=g * (ls / v) if ls > 0 else None,
    )
    inputs = dict(
        hidden=hidden, weight=weight, bias=bias,
        target_local=local_targets(target, valid, 0, v),
        row_order=rows.order, n_valid=rows.n_valid, lse=lse, coefs=coefs,
    )
    return inputs, grad_logits, opts


def _expected_grads(inputs, grad_logits):
    h, w = inputs["hidden"].double(), inputs["weight"].double()
    return {
        "input": grad_logits @ w,
        "weight": grad_logits.t() @ h,
        "bias": grad_logits.sum(0),
    }


def _run_backward(inputs, opts, *, filter_mode=FILTER_OFF, threshold=0.0, vocab_order=None,
                  deterministic=False, scratch_bytes=64 * 2**20, want=(True, True, True)):
    d_hidden, d_weight, d_bias = lce_backward(
        **inputs, softcap=opts.softcap, filter_mode=filter_mode, filter_threshold=threshold,
        vocab_order=vocab_order, deterministic=deterministic, scratch_bytes=scratch_bytes,
        want_hidden=want[0], want_weight=want[1], want_bias=want[2],
    )
    return {"input": d_hidden, "weight": d_weight, "bias": d_bias}


BACKWARD_OPTIONS = {
    "plain": {},
    "smoothing-softcap-zloss": dict(label_smoothing=0.1, softcap=5.0, z_loss=1e-3),
}


@pytest.mark.parametrize("options", BACKWARD_OPTIONS.values(), ids=BACKWARD_OPTIONS.keys())
@pytest.mark.parametrize(
    "dtype, regime",
    [(torch.float32, "peaked"), (torch.bfloat16, "near-uniform")],
    ids=["float32-peaked", "bfloat16-near-uniform"],
)
def test_backward_modes_match_fp64(options, dtype, regime):
    """MODE 0 (atomics) and MODE 1 + 2 (deterministic) both give the fp64 gradients."""
    inputs, grad_logits, opts = _setup_backward(dtype, regime, options, seed=44)
    expected = _expected_grads(inputs, grad_logits)
    # Gradients come back in the inputs' dtype: rounding to bf16 costs ~2^-9 relative.
    tol = TOL if dtype == torch.float32 else 4e-3
    atomic = _run_backward(inputs, opts)
    ordered = _run_backward(inputs, opts, deterministic=True)
    ignored = inputs["target_local"] < 0  # one shard owning every class: -1 means ignored
    for name, want in expected.items():
        for label, got in (("mode 0", atomic), ("modes 1+2", ordered)):
            assert got[name].dtype == dtype
            assert_close_rel(got[name], want, tol, name=f"{label} d{name}")
        assert_close_rel(atomic[name], ordered[name], tol, name=f"mode 0 vs 1+2 d{name}")
    # Ignored rows: exactly zero input gradient.
    assert ignored.any()
    assert torch.count_nonzero(atomic["input"][ignored]) == 0
    assert torch.count_nonzero(ordered["input"][ignored]) == 0


def test_backward_partial_outputs():
    """Asking for a subset of gradients returns None for the rest and the same values."""
    inputs, grad_logits, opts = _setup_backward(torch.float32, "peaked", {}, seed=45)
    full = _run_backward(inputs, opts, deterministic=True)
    for want in ((True, False, False), (False, True, True)):
        part = _run_backward(inputs, opts, deterministic=True, want=want)
        for flag, name in zip(want, ("input", "weight", "bias")):
            if flag:
                assert torch.equal(part[name], full[name]), name
            else:
                assert part[name] is None, name


@pytest.mark.parametrize("sorted_vocab", [False, True], ids=["natural-order", "vocab-order"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_backward_several_token_and_vocab_chunks(sorted_vocab, deterministic):
    """A scratch budget of ~30 KB forces 3 token chunks x 3 vocabulary chunks."""
    inputs, grad_logits, opts = _setup_backward(
        torch.float32, "peaked", dict(label_smoothing=0.1), seed=46, ignore_frac=0.1
    )
    scratch = 30_000
    plan = plan_chunks(N, V, D, scratch, backward_config(CPU))
    assert plan.rows_per_chunk < N and plan.vocab_per_chunk < V
    assert N % plan.rows_per_chunk and V % plan.vocab_per_chunk  # ragged last chunks
    order = None
    if sorted_vocab:
        gen = torch.Generator().manual_seed(0)
        order = torch.randperm(V, generator=gen).to(torch.int32)
    got = _run_backward(
        inputs, opts, vocab_order=order, deterministic=deterministic, scratch_bytes=scratch
    )
    for name, want in _expected_grads(inputs, grad_logits).items():
        assert_close_rel(got[name], want, TOL, name=f"d{name}")


def _tile_skips(inputs, grad_logits, mode, vocab_order):
    """Per tile (row block x vocabulary block, in the kernel's walk order): the statistic the
    filter compares with its threshold, and whether the tile holds a target.

    Rows are visited in ``row_order`` (ignored ones last, never in a tile), columns in
    ``vocab_order`` (or natural order).
    """
    cfg = backward_config(CPU)
    n_valid = int(inputs["n_valid"])
    row_pos = inputs["row_order"][:n_valid].long()
    col_pos = torch.arange(V) if vocab_order is None else vocab_order.long()
    lse = inputs["lse"].double()
    logits = inputs["hidden"].double() @ inputs["weight"].double().t() + inputs["bias"].double()
    prob = torch.exp(logits - lse[:, None])
    target = inputs["target_local"].long()
    tiles = []
    for r0 in range(0, n_valid, cfg.block_n):
        r = row_pos[r0 : r0 + cfg.block_n]
        for c0 in range(0, V, cfg.block_v):
            c = col_pos[c0 : c0 + cfg.block_v]
            p = prob[r][:, c]
            stat = p.max() if mode == FILTER_ENTRY else p.sum(1).max()
            has_target = bool(torch.isin(target[r], c).any())
            tiles.append((r, c, float(stat), has_target))
    return tiles


@pytest.mark.parametrize("mode", [FILTER_ENTRY, FILTER_MASS], ids=["entry", "mass"])
@pytest.mark.parametrize("sorted_vocab", [False, True], ids=["natural-order", "vocab-order"])
def test_filter_drops_exactly_the_negligible_tiles(mode, sorted_vocab):
    """With a threshold between two tiles' statistics, the kernel's gradients equal the fp64
    gradients with exactly the target-free tiles below the threshold removed, and differ
    clearly from the unfiltered ones (so the filter really skipped something)."""
    inputs, grad_logits, opts = _setup_backward(
        torch.float32, "near-uniform", {}, seed=47, ignore_frac=0.1, num_classes=100
    )
    order = None
    if sorted_vocab:
        # Shuffled, but the 100 target classes first, so later tiles stay target-free.
        gen = torch.Generator().manual_seed(1)
        order = torch.cat([torch.randperm(100, generator=gen),
                           100 + torch.randperm(V - 100, generator=gen)]).to(torch.int32)
    tiles = _tile_skips(inputs, grad_logits, mode, order)
    # Threshold in the widest gap between the statistics of target-free tiles.
    stats = sorted(stat for _, _, stat, has_target in tiles if not has_target)
    assert len(stats) >= 2
    ratio, low, high = max((b / a, a, b) for a, b in zip(stats, stats[1:]))
    assert ratio > 1.01, "no gap wide enough to place a threshold away from rounding"
    threshold = (low * high) ** 0.5

    masked = grad_logits.clone()
    skipped = 0
    for r, c, stat, has_target in tiles:
        if stat < threshold and not has_target:
            masked[r[:, None], c[None, :]] = 0
            skipped += 1
    assert 0 < skipped < len(tiles)

    expected = _expected_grads(inputs, masked)
    unfiltered = _expected_grads(inputs, grad_logits)
    for deterministic in (False, True):
        got = _run_backward(
            inputs, opts, filter_mode=mode, threshold=threshold, vocab_order=order,
            deterministic=deterministic,
        )
        for name in ("input", "weight", "bias"):
            assert_close_rel(got[name], expected[name], TOL, name=f"filtered d{name}")
            assert rel_err(got[name], unfiltered[name]) > 100 * TOL, name


# ---------------------------------------------------------------------------------------------
# The GEMM backward: grad_logits chunks consumed by matmuls
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", BACKWARD_OPTIONS.values(), ids=BACKWARD_OPTIONS.keys())
def test_grad_logits_chunk(options):
    _check_grad_logits_chunk(torch.float32, D, options)


def _check_grad_logits_chunk(dtype, d, options, tma=True):
    """G for positions [64, 150) of the row order x columns [128, 278): the fp64 logit
    gradient of those rows and columns, and exactly 0 for the ignored rows at the end."""
    inputs, grad_logits64, opts = _setup_backward(dtype, "peaked", options, seed=48, d=d)
    row_start, vocab_start, cols = 64, 128, 150
    positions = inputs["row_order"][row_start:].long()
    rows = positions.numel()
    hidden_chunk = inputs["hidden"].index_select(0, positions)
    out = torch.full((rows, cols), float("nan"))
    grad_logits(
        hidden_chunk, inputs["weight"], inputs["bias"], inputs["row_order"], inputs["n_valid"],
        inputs["target_local"], inputs["lse"], inputs["coefs"], out,
        row_start=row_start, vocab_start=vocab_start, softcap=opts.softcap, tma=tma,
    )
    expected = grad_logits64[positions][:, vocab_start : vocab_start + cols]
    assert_close_rel(out, expected, TOL, name="G chunk")
    ignored = row_start + torch.arange(rows) >= int(inputs["n_valid"])
    assert ignored.any() and torch.count_nonzero(out[ignored]) == 0


def _backward_gemm(inputs, softcap, scratch_bytes, **kwargs):
    """lce_backward_gemm under the plan that shard_backward makes for the same arguments."""
    plan = plan_gemm_backward_for(
        inputs["hidden"], inputs["weight"], inputs["bias"], scratch_bytes=scratch_bytes,
        into_accumulator=kwargs.get("d_weight_accumulator") is not None,
        kept=kwargs.get("kept") is not None,
    )
    return lce_backward_gemm(**inputs, softcap=softcap, plan=plan, **kwargs)


@pytest.mark.parametrize("options", BACKWARD_OPTIONS.values(), ids=BACKWARD_OPTIONS.keys())
@pytest.mark.parametrize("scratch", [64 * 2**20, 100_000], ids=["one-chunk", "several-chunks"])
def test_backward_gemm_matches_fp64(monkeypatch, options, scratch):
    inputs, grad_logits64, opts = _setup_backward(torch.float32, "near-uniform", options, seed=49)
    plans = record_chunk_plans(monkeypatch)

    def run():
        d_hidden, d_weight, d_bias = _backward_gemm(inputs, opts.softcap, scratch)
        return {"input": d_hidden, "weight": d_weight, "bias": d_bias}

    first, second = run(), run()
    rows, cols = plans[0][1]
    assert (rows, cols) == (N, V) if scratch > 10**6 else (rows < N and cols < V), (rows, cols)
    for name, want in _expected_grads(inputs, grad_logits64).items():
        assert_close_rel(first[name], want, TOL, name=f"d{name}")
        assert torch.equal(first[name], second[name]), f"d{name} not repeatable"
    ignored = inputs["target_local"] < 0
    assert torch.count_nonzero(first["input"][ignored]) == 0


# ---------------------------------------------------------------------------------------------
# Tiles read through tensor descriptors (TMA): 16-bit inputs whose rows are 16-byte aligned.
# D = 70 above keeps the pointer kernels; D_ALIGNED runs both, chosen by FUSED_LCE_TMA.
# ---------------------------------------------------------------------------------------------

D_ALIGNED = 72


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
def test_lse_forward_aligned_bf16(tma):
    hidden, weight, target, bias = make_problem(
        N, V, D_ALIGNED, torch.bfloat16, "peaked", ignore_frac=0.2, bias=True, seed=43
    )
    assert use_tma(hidden, weight, enabled=tma) == tma
    rows = prepare_rows(target, IGNORE_INDEX)
    stats = lse_forward(
        hidden, weight, bias, rows.order, rows.n_valid, softcap=5.0,
        want_row_sum=True, want_col_sum=True, tma=tma,
    )
    logits = logits64(hidden, weight, bias, 5.0)
    valid = rows.valid
    assert_close_rel(stats.lse[valid], torch.logsumexp(logits, 1)[valid], TOL, name="lse")
    _assert_sum_close(stats.row_sum[valid], logits[valid], dim=1, name="row_sum")
    _assert_sum_close(stats.col_sum, logits[valid], dim=0, name="col_sum")
    assert torch.all(stats.max[~valid] == float("-inf"))
    assert torch.all(stats.sum_exp[~valid] == 0)


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
def test_grad_logits_chunk_aligned_bf16(tma):
    _check_grad_logits_chunk(
        torch.bfloat16, D_ALIGNED, BACKWARD_OPTIONS["smoothing-softcap-zloss"], tma=tma
    )


def test_tma_needs_aligned_16_bit_rows():
    aligned = torch.zeros(8, D_ALIGNED, dtype=torch.bfloat16)
    assert use_tma(aligned, aligned)
    assert not use_tma(aligned.float(), aligned.float())
    assert use_tma(aligned[:, :70], aligned)  # the row stride is still 144 bytes
    assert not use_tma(aligned[:, 1:], aligned)  # base 2 bytes past alignment
    assert not use_tma(torch.zeros(8, 70, dtype=torch.bfloat16), aligned)
    assert not use_tma(aligned.t(), aligned)


# ---------------------------------------------------------------------------------------------
# The GEMM backward with its buffers inside the weight gradient (budgets too small for a
# chunk of every row). V >> N, as with real vocabularies, so that the weight gradient can
# host them: 150 tokens x 5003 classes.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, d, tol",
    # bf16: G and the gradients are rounded to bf16 (~2^-9 each), on either path.
    [(torch.float32, 70, TOL), (torch.bfloat16, D_ALIGNED, 8e-3)],
    ids=["float32-pointer", "bfloat16-aligned"],
)
@pytest.mark.parametrize("options", BACKWARD_OPTIONS.values(), ids=BACKWARD_OPTIONS.keys())
@pytest.mark.parametrize("small", [300, 40], ids=["small-300", "small-40"])
def test_backward_gemm_in_weight_buffer(monkeypatch, dtype, d, tol, options, small):
    import fused_lce.backward_plan as planner
    import fused_lce.kernels.gemm_backward as gemm

    n, v = N, 5003
    inputs, grad_logits64, opts = _setup_backward(
        dtype, "near-uniform", options, seed=50, d=d, n=n, v=v
    )
    layouts = []
    plan = planner.plan_weight_buffer
    monkeypatch.setattr(
        planner, "plan_weight_buffer", lambda *a: layouts.append(plan(*a)) or layouts[-1]
    )
    widths = []
    kernel = gemm.grad_logits
    monkeypatch.setattr(
        gemm, "grad_logits", lambda *a, **k: widths.append(a[8].shape[1]) or kernel(*a, **k)
    )
    elem = inputs["hidden"].element_size()
    # The per-token vectors, the fp32 bias gradient and a G chunk of `small` columns: far under
    # the budget of a chunk of every row.
    scratch = n * 64 + v * 4 + n * elem * small
    d_hidden, d_weight, d_bias = _backward_gemm(inputs, opts.softcap, scratch)
    (layout,) = layouts
    assert layout is not None and small - 16 <= layout.small_cols <= small
    # Each of the four passes of the docstring covers some columns. The last one goes through
    # the small buffer alone (small-300), or first through a chunk of half the width, 256
    # columns (the floor), then through the small buffer (small-40).
    assert layout.chunk_cols == 512
    assert (256 in widths) == (layout.small_cols < 256), (widths, layout)
    assert widths[-1] <= layout.small_cols
    assert 0 < layout.g_rows < layout.free_from < v - layout.chunk_cols
    got = {"input": d_hidden, "weight": d_weight, "bias": d_bias}
    whole = dict(zip(("input", "weight", "bias"), _backward_gemm(
        inputs, opts.softcap, 64 * 2**20
    )))
    for name, want in _expected_grads(inputs, grad_logits64).items():
        assert got[name].dtype == dtype
        assert_close_rel(got[name], want, tol, name=f"d{name}")
        assert_close_rel(got[name], whole[name], min(tol, 2e-3), name=f"d{name} vs one chunk")
    ignored = inputs["target_local"] < 0
    assert ignored.any() and torch.count_nonzero(d_hidden[ignored]) == 0


# ---------------------------------------------------------------------------------------------
# round_logits: each logit rounded to bf16 before bias, softcap and the softmax
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [D, D_ALIGNED], ids=["pointer", "aligned"])
def test_round_logits_matches_bf16_logits(d):
    """Forward statistics, target logit and G against fp64 math on bf16-rounded logits, and
    visibly different from the exact ones (the rounding is really applied)."""
    options = {"softcap": 5.0}
    inputs, _, opts = _setup_backward(torch.bfloat16, "peaked", options, seed=51, d=d)
    hidden, weight, bias = inputs["hidden"], inputs["weight"], inputs["bias"]
    raw = hidden.double() @ weight.double().t()
    rounded = raw.to(torch.bfloat16).double()  # round to nearest even, as the kernels do
    target_local = inputs["target_local"].long()
    rows = prepare_rows(torch.where(target_local >= 0, target_local, IGNORE_INDEX), IGNORE_INDEX)
    valid = rows.valid

    def capped(logits):
        return 5.0 * torch.tanh((logits + bias.double()) / 5.0)

    stats = lse_forward(hidden, weight, bias, rows.order, rows.n_valid, softcap=5.0,
                        round_16bit=True)
    want, exact = torch.logsumexp(capped(rounded), 1), torch.logsumexp(capped(raw), 1)
    assert_close_rel(stats.lse[valid], want[valid], TOL, name="lse")
    assert rel_err(stats.lse[valid], exact[valid]) > 10 * TOL

    target = torch.where(valid, inputs["target_local"].long(), 0)
    got = lse_forward(hidden, weight, bias, rows.order, rows.n_valid, target=target,
                      softcap=5.0, round_16bit=True).target_logit
    want_t = capped(rounded).gather(1, target[:, None]).squeeze(1)
    assert_close_rel(got[valid], want_t[valid], TOL, name="target logit")


def test_round_logits_end_to_end():
    """Loss and gradients of linear_cross_entropy(round_logits=True) against fp64 autograd
    through bf16-rounded logits (the rounding passes the gradient straight through, as a bf16
    logits tensor does)."""
    from fused_lce import linear_cross_entropy

    hidden, weight, target, bias = make_problem(
        N, V, D_ALIGNED, torch.bfloat16, "peaked", ignore_frac=0.2, bias=True, seed=52
    )
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    raw = h @ w.t()
    logits = raw + (raw.to(torch.bfloat16).double() - raw).detach() + bias.double()
    want = torch.nn.functional.cross_entropy(
        30.0 * torch.tanh(logits / 30.0), target, ignore_index=IGNORE_INDEX
    )
    want.backward()
    hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = linear_cross_entropy(
        hg, wg, target, bias, impl="cce", softcap=30.0, round_logits=True
    )
    got.backward()
    assert_close_rel(got, want.detach(), TOL, name="loss")
    # bf16 gradients: G and the outputs are rounded to bf16.
    assert_close_rel(hg.grad, h.grad, 8e-3, name="dinput")
    assert_close_rel(wg.grad, w.grad, 8e-3, name="dweight")


# ---------------------------------------------------------------------------------------------
# keep_logits=True: the forward keeps exp(logit - running max) per tile, the backward
# forms G from it in place and runs one GEMM per gradient, with no logit recomputed.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", BACKWARD_OPTIONS.values(), ids=BACKWARD_OPTIONS.keys())
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("kept_bits", [32, 16], ids=["kept-fp32", "kept-bf16"])
def test_backward_from_kept_logits(monkeypatch, options, tma, kept_bits):
    """The gradients match fp64 without a single grad_logits call. 16 bits: the interpreter
    truncates where the GPU rounds, so this bounds the GPU's error from above."""
    import fused_lce.kernels.gemm_backward as gemm
    import fused_lce.kernels.lse_forward as forward

    if kept_bits == 16:
        monkeypatch.setattr(forward, "kept_dtype", lambda hidden: torch.bfloat16)
    inputs, grad_logits64, opts = _setup_backward(
        torch.bfloat16, "peaked", options, seed=54, d=D_ALIGNED
    )
    stats = lse_forward(
        inputs["hidden"], inputs["weight"], inputs["bias"], inputs["row_order"],
        inputs["n_valid"], softcap=opts.softcap, keep_logits=True, tma=tma,
    )
    kept = stats.kept
    assert kept.scaled.dtype == (torch.bfloat16 if kept_bits == 16 else torch.float32)
    valid = prepare_rows(torch.where(inputs["target_local"] >= 0, 0, IGNORE_INDEX),
                         IGNORE_INDEX).valid
    # What was kept is the logits: max + log(scaled) against fp64, on the rows not ignored.
    exact = logits64(inputs["hidden"], inputs["weight"], inputs["bias"], opts.softcap)
    tile = torch.arange(V) // kept.block_v
    rebuilt = kept.tile_max[:, tile] + torch.log(kept.scaled.float())
    assert rel_err(rebuilt[valid], exact[valid]) < (2e-6 if kept_bits == 32 else 2e-3)

    def no_recompute(*args, **kwargs):
        raise AssertionError("a logit chunk was recomputed")

    monkeypatch.setattr(gemm, "grad_logits", no_recompute)
    d_hidden, d_weight, d_bias = _backward_gemm(inputs, opts.softcap, 64 * 2**20, kept=kept,
                                                tma=tma)
    assert kept.scaled is None  # consumed: G took its storage
    got = {"input": d_hidden, "weight": d_weight, "bias": d_bias}
    for name, want in _expected_grads(inputs, grad_logits64).items():
        assert got[name].dtype == torch.bfloat16
        assert_close_rel(got[name], want, 8e-3, name=f"d{name}")
    assert torch.count_nonzero(d_hidden[~valid]) == 0


@pytest.mark.parametrize("splits", [2, 3])
def test_kept_logits_with_vocabulary_splits(monkeypatch, splits):
    """On a GPU the forward splits each row's vocabulary over programs (the interpreter does
    not by itself); the last split runs past the vocabulary when the tiles do not divide evenly
    (3 tiles over 2 splits of 2; 3 over 3 of 1 for contrast). Its empty tiles must keep no max:
    writing one spilled into the next row's maxima (found on 2 x H200)."""
    import fused_lce.kernels.lse_forward as forward

    monkeypatch.setattr(forward, "vocab_splits", lambda *args: splits)
    inputs, _, _ = _setup_backward(torch.float32, "peaked", {}, seed=57)
    order, n_valid = inputs["row_order"], inputs["n_valid"]
    n_tiles = -(-V // 128)  # the interpreter's BLOCK_V
    kept = forward.lse_forward(inputs["hidden"], inputs["weight"], inputs["bias"], order,
                               n_valid, keep_logits=True).kept
    # One spare column of maxima per row, preset: a write past the last tile lands there.
    sentinel = torch.full((N, n_tiles + 1), 123.0)
    monkeypatch.setattr(forward.torch, "empty", _empty_returning(sentinel, (N, n_tiles)))
    kept = forward.lse_forward(inputs["hidden"], inputs["weight"], inputs["bias"], order,
                               n_valid, keep_logits=True).kept
    assert torch.all(sentinel[:, n_tiles] == 123.0)
    valid = forward.valid_rows(order, n_valid) != 0
    exact = logits64(inputs["hidden"], inputs["weight"], inputs["bias"], None)
    rebuilt = kept.tile_max[:, torch.arange(V) // kept.block_v] + torch.log(kept.scaled)
    assert rel_err(rebuilt[valid], exact[valid]) < 2e-6


def _empty_returning(storage, shape):
    """torch.empty that hands out a view of ``storage`` for ``shape`` (fp32), else as usual."""
    real = torch.empty

    def empty(*size, **kwargs):
        wanted = tuple(size[0]) if len(size) == 1 and isinstance(size[0], tuple) else size
        if wanted == shape and kwargs.get("dtype") == torch.float32:
            return storage[:, : shape[1]]
        return real(*size, **kwargs)

    return empty


def test_backward_from_kept_logits_into_fp32_partials():
    """The vocab-parallel shapes of the call: an fp32 partial d_hidden and Megatron's fp32
    main_grad as the weight gradient's accumulator."""
    inputs, grad_logits64, opts = _setup_backward(torch.bfloat16, "near-uniform", {}, seed=55)
    stats = lse_forward(inputs["hidden"], inputs["weight"], inputs["bias"],
                        inputs["row_order"], inputs["n_valid"], keep_logits=True)
    main_grad = torch.randn(V, D, dtype=torch.float32)
    before = main_grad.clone()
    d_hidden, d_weight, _ = _backward_gemm(
        inputs, None, 64 * 2**20, kept=stats.kept, d_hidden_dtype=torch.float32,
        d_weight_accumulator=main_grad,
    )
    want = _expected_grads(inputs, grad_logits64)
    assert d_weight is None and d_hidden.dtype == torch.float32
    assert_close_rel(d_hidden, want["input"], 4e-3, name="dinput")
    assert_close_rel(main_grad - before, want["weight"], 4e-3, name="dweight")


# Compiles the kept-logits G kernel for sm_90 and prints its PTX. It runs in a fresh Python
# without TRITON_INTERPRET: Triton 3.6's interpreter patches triton.language.core when an
# interpreted kernel calls a @triton.jit helper and never restores it
# (InterpretedFunction.__call__), so after any kernel has run under TRITON_INTERPRET=1 a real
# compile in the same process fails on "'ir.value' object has no attribute 'dtype'"; and with
# TRITON_INTERPRET set at import, the kernel's helpers (kernels/common.py) are interpreted
# functions, which no compile accepts. A warm Triton cache hid this: a cache hit compiles
# nothing.
_COMPILE_KEPT_G_FOR_SM90 = """
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import fused_lce.kernels.gemm_backward as gemm

signature = {
    "scaled_ptr": "*bf16", "tile_max_ptr": "*fp32", "row_valid_ptr": "*i8",
    "target_ptr": "*i32", "lse_ptr": "*fp32", "p_coef_ptr": "*fp32", "target_grad_ptr": "*fp32",
    "smooth_coef_ptr": "*fp32", "n_rows": "i32", "n_vocab": "i32", "stride_scaled": "i32",
    "stride_tile_max": "i32", "softcap": "fp32", "KEPT_BLOCK_V": "constexpr",
    "BLOCK_N": "constexpr", "BLOCK_V": "constexpr", "HAS_SOFTCAP": "constexpr",
    "HAS_SMOOTHING": "constexpr",
}
constants = {"KEPT_BLOCK_V": 256, "BLOCK_N": 32, "BLOCK_V": 256, "HAS_SOFTCAP": True,
             "HAS_SMOOTHING": True}
# The Python function under the heuristics, as a JIT function of its own.
function = gemm._grad_from_kept_kernel
while hasattr(function, "fn"):
    function = function.fn
compiled = triton.compile(
    ASTSource(fn=triton.runtime.jit.JITFunction(function), signature=signature,
              constexprs=constants),
    target=GPUTarget("cuda", 90, 32), options={"num_warps": 4},
)
sys.stdout.write(compiled.asm["ptx"])
"""


# ---------------------------------------------------------------------------------------------
# scale_unless_one_
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_dtype_id)
def test_scale_unless_one_rounds_the_fp32_product_once(dtype):
    """x *= s, the product formed in fp32 and rounded once to x's dtype, as torch rounds it (in
    bf16, 1/3 rounded first would bias every entry by 0.2%); a scale of 1 leaves x untouched,
    a NaN scale poisons every entry."""
    from fused_lce.kernels.scale import scale_unless_one_

    x = (torch.randn(3 * 65536 + 5, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    third = torch.tensor([1 / 3])
    expected = (x.float() * third).to(dtype)
    assert torch.equal(scale_unless_one_(x.clone(), third), expected)
    assert torch.equal(scale_unless_one_(x.clone(), torch.ones(1)), x)
    assert scale_unless_one_(x.clone(), torch.tensor([float("nan")])).isnan().all()


@pytest.mark.cpu_kernels(False)  # compiles in a child process; runs nothing on CPU tensors
def test_kept_gradient_kernel_compiles_without_fp64(tmp_path):
    """The kept-logits G kernel, compiled for Hopper (no GPU needed: Triton's own ptxas), does
    fp32 math only and spills nothing. A float literal below fp32's normal range made its
    softcap branch fp64, with register spills: 1.6x the default's time at Gemma-2 2B."""
    import os
    import subprocess
    import sys

    import triton
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton build has no nvidia backend")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("no ptxas in this triton build")
    # A cache of its own: every run compiles (a cache hit would test nothing new).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    child = subprocess.run([sys.executable, "-c", _COMPILE_KEPT_G_FOR_SM90], env=env,
                           capture_output=True, text=True)
    assert child.returncode == 0, f"compiling for sm_90 failed:\n{child.stderr[-4000:]}"
    ptx = child.stdout
    assert ".version" in ptx and ".f64" not in ptx
    source = tmp_path / "kept_g.ptx"
    source.write_text(ptx)
    report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(source), "-o", os.devnull],
                            capture_output=True, text=True, check=True)
    assert "0 bytes spill stores" in report.stderr + report.stdout, report.stderr
