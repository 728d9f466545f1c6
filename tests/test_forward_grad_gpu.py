"""The gradient-in-forward backward on a CUDA GPU (skipped without one): for bf16 the
exponentials walk (kernels/exp_logits.py), for fp32 cuBLAS logits and the logit_rows kernels,
several token chunks with both weight-gradient accumulations, the
Megatron-style masked "none" loss and the exact recompute, against fp64 (bound: twice torch's own
error in the same dtype on the GPU). Run: ``python -m pytest -q -s tests/test_forward_grad_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers_lce import compare_to_reference, make_problem

from fused_lce import linear_cross_entropy

pytestmark = pytest.mark.requires_cuda

SHAPE = (2501, 20011, 257)  # odd everywhere: no chunk, block or tile divides it


CASES = {
    "mean": dict(),
    "sum-softcap-smoothing-z": dict(reduction="sum", softcap=20.0, label_smoothing=0.1,
                                    z_loss=1e-4),
    "two-chunks": dict(token_chunk_size=1400),
    "five-chunks-fp32-acc": dict(token_chunk_size=512),
    "five-chunks-own-dtype": dict(token_chunk_size=512, fp32_weight_grad=False),
    # A per-token loss without a mask takes the recomputing backward from the start (no walk);
    # "recompute" walks, reads the backward's verdict and recomputes: the exact fallback.
    "none-recompute": dict(reduction="none", upstream_mismatch="recompute"),
    "lse-recompute": dict(return_lse=True),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("regime", ["peaked", "near-uniform"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_fp64(dtype, regime, case, walks):
    n, v, d = SHAPE
    hidden, weight, target, bias = make_problem(n, v, d, dtype, regime, ignore_frac=0.1,
                                                bias=True, seed=21)
    compare_to_reference(hidden, weight, target, bias, impl="cce", device="cuda", **CASES[case])
    assert len(walks) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_masked_none_loss_keeps_the_forward_gradients(dtype, walks, recwarn):
    n, v, d = SHAPE
    hidden, weight, target, _ = make_problem(n, v, d, dtype, "peaked", seed=22)
    mask = (torch.arange(n) % 5 != 0).float()

    def objective(h, w, **kw):
        loss = linear_cross_entropy(h, w, target.to(h.device), reduction="none", **kw)
        return 0.125 * (loss.float() * mask.to(h.device)).sum()

    h = hidden.cuda().requires_grad_()
    w = weight.cuda().requires_grad_()
    objective(h, w, impl="cce", loss_mask=mask.cuda()).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    objective(h64, w64, impl="torch").backward()
    h16 = hidden.cuda().requires_grad_()
    w16 = weight.cuda().requires_grad_()
    objective(h16, w16, impl="torch").backward()
    assert len(walks) == 1 and not [w for w in recwarn if "loss_mask" in str(w.message)]
    for ours, base, ref in ((h.grad, h16.grad, h64.grad), (w.grad, w16.grad, w64.grad)):
        scale = ref.abs().max()
        err = (ours.double().cpu() - ref).abs().max() / scale
        base_err = (base.double().cpu() - ref).abs().max() / scale
        assert err <= 2 * base_err + 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_masked_none_loss_never_syncs_with_upstream_mismatch_nan(dtype, walks):
    """Megatron's masked loss with ``upstream_mismatch="nan"`` and ``check_targets=False`` (the
    adapter's call): neither its forward nor its backward waits for the GPU. A host sync a
    micro-batch lengthened the TP4 training step (docs/benchmarks/training_step.md)."""
    n, v, d = SHAPE
    hidden, weight, target, _ = make_problem(n, v, d, dtype, "peaked", seed=23)
    mask = (torch.arange(n) % 5 != 0).float().cuda()
    h, w, target = hidden.cuda().requires_grad_(), weight.cuda().requires_grad_(), target.cuda()
    options = dict(impl="cce", reduction="none", loss_mask=mask, check_targets=False,
                   upstream_mismatch="nan")
    (linear_cross_entropy(h, w, target, **options) * mask).sum().backward()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = linear_cross_entropy(h, w, target, **options)
        (0.25 * (loss * mask).sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(walks) == 2 and h.grad.isfinite().all()


def test_masked_none_loss_steps_never_wait_for_the_gpu(walks):
    """The adapter's call, two steps queued behind a long sleep kernel: the host finishes them
    while the GPU still sleeps, so neither waited for a kernel, the verdicts' reads included
    (``VERDICT_LAG_CALLS`` calls later; read at the next call, the second step waited for the
    first's backward). Sync debug mode does not see event waits; this does."""
    n, v, d = SHAPE
    hidden, weight, target, _ = make_problem(n, v, d, torch.bfloat16, "peaked", seed=25)
    mask = (torch.arange(n) % 5 != 0).float().cuda()
    h, w, target = hidden.cuda().requires_grad_(), weight.cuda().requires_grad_(), target.cuda()
    options = dict(impl="cce", reduction="none", loss_mask=mask, check_targets=False,
                   upstream_mismatch="nan")
    for _ in range(2):  # compiles, and leaves verdicts of its own in flight
        (linear_cross_entropy(h, w, target, **options) * mask).sum().backward()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second
    for _ in range(2):
        (linear_cross_entropy(h, w, target, **options) * mask).sum().backward()
    still_asleep = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_asleep and h.grad.isfinite().all()


def test_upstream_mismatch_nan_is_caught_on_the_gpu(walks):
    """The verdict's pinned host copy (fused_lce/faults.py): a loss weighed otherwise than the
    mask gives NaN gradients; once the caller has synchronised (an optimizer step would), the
    next call raises, reading the copy without a wait, and the calls after it run."""
    n, v, d = SHAPE
    hidden, weight, target, _ = make_problem(n, v, d, torch.bfloat16, "peaked", seed=24)
    h, w, target = hidden.cuda().requires_grad_(), weight.cuda().requires_grad_(), target.cuda()
    mask = (torch.arange(n) % 5 != 0).float().cuda()
    options = dict(impl="cce", reduction="none", loss_mask=mask, upstream_mismatch="nan")
    loss = linear_cross_entropy(h, w, target, **options)
    (loss * mask * torch.linspace(0.5, 1.5, n, device="cuda")).sum().backward()
    assert h.grad.isnan().all() and w.grad.isnan().all()
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="upstream_mismatch='recompute'"):
        linear_cross_entropy(h, w, target, **options)
    assert linear_cross_entropy(h.detach(), w.detach(), target, **options).isfinite().all()


@pytest.mark.parametrize("grad", [True, False], ids=["walk", "no-grad"])
@pytest.mark.parametrize("bad", [20011, -3])
@pytest.mark.parametrize("dtype, options", [
    (torch.bfloat16, {}), (torch.bfloat16, {"token_chunk_size": 512}), (torch.float32, {}),
    (torch.bfloat16, {"scratch_mb": 1}),
], ids=["bf16", "bf16-chunks", "fp32", "lean"])
def test_out_of_range_targets_raise(grad, bad, dtype, options):
    """The target check, read once the whole forward is queued, still raises the same error,
    after kernels that met the bad target and addressed no memory out of bounds (the next
    synchronisation would report it)."""
    n, v, d = 1500, 20011, 257
    hidden, weight, target, _ = make_problem(n, v, d, dtype, "peaked", seed=4)
    hidden, weight, target = hidden.cuda(), weight.cuda(), target.cuda()
    target[n // 2] = bad
    hidden.requires_grad_(grad)
    with pytest.raises(ValueError, match=f"target holds class {bad}, outside \\[0, {v}\\)"):
        linear_cross_entropy(hidden, weight, target, impl="cce", **options)
    torch.cuda.synchronize()
    target[n // 2] = -100  # ignore_index passes, and the op still runs after the error
    loss = linear_cross_entropy(hidden, weight, target, impl="cce", **options)
    assert torch.isfinite(loss)
