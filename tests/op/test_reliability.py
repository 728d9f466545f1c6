"""Edge cases a new user meets on one device, for every implementation.

- Strided arguments: input, weight (strided and column-major), target and bias given as views
  with non-unit strides give the loss, lse and gradients of their contiguous copies; the kernel
  launchers reject what their kernels would misread.
- Confident tokens: per-token losses, the lse and the gradients are as precise as torch's fp32
  ``F.cross_entropy`` (within 10x of its relative error against float64).
- Second-order use fails with a clear error in the hand-written backwards (``impl="torch"``
  differentiates twice); D = 0 gives torch's loss (log V without a bias); narrow and unsigned
  integer targets give the int64 results (uint8 as torch reads it), other dtypes a TypeError.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_rel, rel_err
from helpers_lce import compare_to_reference, make_problem
from helpers_reliability import (
    STRIDED_ARGUMENTS,
    confident_problem,
    cross_entropy_run,
    precision_failures,
    strided,
    upstream,
    with_strided_argument,
)

import fused_lce.chunked
import fused_lce.triton_shard
from fused_lce import linear_cross_entropy

N, V, D = 45, 131, 24

# (id, options): every implementation and backward path of linear_cross_entropy.
PATHS = [
    ("cce-gemm", dict(impl="cce", backward="gemm")),
    ("cce-tiles", dict(impl="cce", backward="tiles")),
    ("cce-kept", dict(impl="cce", backward="gemm", keep_logits=True)),
    ("chunked-vocab", dict(impl="chunked", chunk_by="vocab", vocab_chunk_size=48)),
    ("chunked-tokens", dict(impl="chunked", chunk_by="tokens", token_chunk_size=16)),
    ("torch", dict(impl="torch")),
]
PATH_IDS = [p[0] for p in PATHS]
PATH_OPTIONS = [p[1] for p in PATHS]


def _per_token_options(options: dict) -> dict:
    """Per-token losses and the lse where the path gives them (tokens mode: a scalar loss)."""
    if options.get("chunk_by") == "tokens":
        return dict(reduction="sum")
    return dict(reduction="none", return_lse=True)


# ---------------------------------------------------------------------------------------------
# Strided arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", PATH_OPTIONS, ids=PATH_IDS)
@pytest.mark.parametrize("which", ["input", "weight", "weight-column-major", "target", "bias",
                                   "input-one-row-broadcast", "bias-broadcast"])
def test_strided_argument(which, options):
    hidden, weight, target, bias = make_problem(N, V, D, torch.float32, "peaked", 0.1, bias=True,
                                                seed=7)
    args = with_strided_argument(which, hidden, weight, target, bias, V)
    compare_to_reference(*args, **options, **_per_token_options(options), seed=7)


@pytest.mark.parametrize("options", PATH_OPTIONS[:3], ids=PATH_IDS[:3])
@pytest.mark.parametrize("which", STRIDED_ARGUMENTS)
def test_strided_argument_bf16(which, options):
    """The kernels read 16-bit strided views as well (under the interpreter they compute in
    fp32; the bound is twice torch's own bf16 error, as on the GPU)."""
    hidden, weight, target, bias = make_problem(N, V, D, torch.bfloat16, "peaked", 0.1,
                                                bias=True, seed=9)
    args = with_strided_argument(which, hidden, weight, target, bias, V)
    compare_to_reference(*args, **options, reduction="none", return_lse=True, seed=9)


@pytest.mark.parametrize("options", PATH_OPTIONS[:1] + PATH_OPTIONS[3:4], ids=["cce", "chunked"])
def test_strided_target_batch(options):
    """A (B, T) target that is a strided view flattens to a strided (B*T,) view, not a copy."""
    hidden, weight, target, _ = make_problem((3, 15), V, D, torch.float32, "peaked", seed=8)
    target = strided(target, (target + 1) % V)
    assert target.reshape(-1).data_ptr() == target.data_ptr() or not target.is_contiguous()
    compare_to_reference(hidden, weight, target, None, **options, reduction="none", seed=8)


def test_launchers_reject_what_their_kernels_misread():
    from fused_lce.backward_plan import plan_gemm_backward_for
    from fused_lce.kernels.gemm_backward import lce_backward_gemm
    from fused_lce.kernels.lse_forward import lse_forward
    from fused_lce.kernels.tiles_backward import lce_backward
    from fused_lce.terms import GradCoefficients
    from fused_lce.token_walk import local_targets
    from fused_lce.triton_shard import prepare_rows

    hidden, weight, target, bias = make_problem(N, V, D, torch.float32, "peaked", bias=True)
    rows = prepare_rows(target, -100)
    with pytest.raises(ValueError, match=r"target must have unit stride.*target.contiguous\(\)"):
        lse_forward(hidden, weight, bias, rows.order, rows.n_valid,
                    target=strided(target, 0))
    with pytest.raises(ValueError, match=r"bias must have unit stride"):
        lse_forward(hidden, weight, strided(bias, 0.0), rows.order, rows.n_valid)
    with pytest.raises(ValueError, match=r"bias must have shape \(131,\)"):
        lse_forward(hidden, weight, bias[:-1], rows.order, rows.n_valid)
    with pytest.raises(ValueError, match=r"must share D"):
        lse_forward(hidden[:, :-1], weight, bias, rows.order, rows.n_valid)
    with pytest.raises(TypeError, match=r"row_order must have dtype torch.int32"):
        lse_forward(hidden, weight, bias, rows.order.long(), rows.n_valid)

    ones = torch.ones(N)
    coefs = GradCoefficients(ones, -ones, None)
    target_local = local_targets(target, rows.valid, 0, V)
    common = dict(softcap=None)
    tiles = dict(filter_mode=0, filter_threshold=0.0, vocab_order=None, deterministic=False,
                 scratch_bytes=2**20)
    gemm = dict(plan=plan_gemm_backward_for(hidden, weight, bias, scratch_bytes=2**20))
    for backward, extra in ((lce_backward, tiles), (lce_backward_gemm, gemm)):
        with pytest.raises(ValueError, match=r"target_local must have unit stride"):
            backward(hidden, weight, bias, strided(target_local, 0), rows.order, rows.n_valid,
                     ones, coefs, **common, **extra)
        with pytest.raises(TypeError, match=r"lse must have dtype torch.float32"):
            backward(hidden, weight, bias, target_local, rows.order, rows.n_valid,
                     ones.double(), coefs, **common, **extra)
        with pytest.raises(ValueError, match=r"target_grad must have shape \(45,\)"):
            backward(hidden, weight, bias, target_local, rows.order, rows.n_valid, ones,
                     GradCoefficients(ones, ones[:-1], None), **common, **extra)


# ---------------------------------------------------------------------------------------------
# Confident tokens
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", PATH_OPTIONS, ids=PATH_IDS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_confident_tokens_as_precise_as_torch(options, bias):
    hidden, weight, target, b = confident_problem(N, V, D, seed=3, bias=bias)
    per_token = _per_token_options(options)
    reduction = per_token["reduction"]
    exact = cross_entropy_run(hidden, weight, target, b, torch.float64, reduction)
    fp32 = cross_entropy_run(hidden, weight, target, b, torch.float32, reduction)
    if reduction == "none":
        assert exact["loss"].min() < 1e-4 and exact["loss"].max() > 1e-2, "not the problem meant"

    h, w = (x.clone().requires_grad_() for x in (hidden, weight))
    out = linear_cross_entropy(h, w, target, b, **options, **per_token)
    loss, lse = out if isinstance(out, tuple) else (out, None)
    upstream(loss).backward()
    ours = {"loss": loss, "lse": lse, "d_input": h.grad, "d_weight": w.grad}
    failures = precision_failures(ours, exact, fp32)
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("impl", ["cce", "chunked", "torch"])
def test_confident_tokens_with_every_term_stay_exact(impl):
    """Label smoothing, z-loss, softcap and ignored tokens around confident tokens: the fp64
    reference's loss, lse and gradients (the formula's rearrangement changed none of them)."""
    hidden, weight, target, bias = confident_problem(N, V, D, seed=5, bias=True)
    target[::7] = -100
    compare_to_reference(hidden, weight, target, bias, impl=impl, reduction="none",
                         return_lse=True, label_smoothing=0.1, z_loss=1e-4, softcap=60.0, seed=5)


# ---------------------------------------------------------------------------------------------
# Second order, D = 0, target dtypes
# ---------------------------------------------------------------------------------------------


def _fail_if_called(*args, **kwargs):
    raise AssertionError("a backward kernel ran before create_graph=True was refused")


_CREATE_GRAPH_CASES = [
    pytest.param(options, reduction, id=f"{reduction}-{name}")
    for options, name in zip(PATH_OPTIONS[:5], PATH_IDS[:5])
    for reduction in ("mean", "none")
]


@pytest.mark.parametrize("options, reduction", _CREATE_GRAPH_CASES)
def test_create_graph_is_refused_before_any_kernel(options, reduction, monkeypatch):
    monkeypatch.setattr(fused_lce.triton_shard, "shard_backward", _fail_if_called)
    monkeypatch.setattr(fused_lce.chunked, "vocab_backward", _fail_if_called)
    hidden, weight, target, _ = make_problem(N, V, D, seed=11)
    h = hidden.requires_grad_()
    loss = linear_cross_entropy(h, weight, target, **options, reduction=reduction)
    with pytest.raises(RuntimeError, match=r"second-order gradients are not supported by "
                                           r"linear_cross_entropy\(impl="):
        torch.autograd.grad(upstream(loss), h, create_graph=True)
    # First-order use of the same graph is unaffected.
    monkeypatch.undo()
    loss = linear_cross_entropy(h, weight, target, **options, reduction=reduction)
    (grad,) = torch.autograd.grad(upstream(loss), h)
    exact = cross_entropy_run(hidden.detach(), weight, target, None, torch.float64, reduction)
    assert_close_rel(grad, exact["d_input"], 1e-5, "input grad")


def test_create_graph_works_with_impl_torch():
    """impl="torch" is autograd all the way: its Hessian-vector product is torch's."""
    hidden, weight, target, bias = make_problem(N, V, D, torch.float64, seed=12, bias=True)
    direction = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def hvp(loss_fn):
        h = hidden.clone().requires_grad_()
        (grad,) = torch.autograd.grad(loss_fn(h), h, create_graph=True)
        (second,) = torch.autograd.grad((grad * direction).sum(), h)
        return second

    ours = hvp(lambda h: linear_cross_entropy(h, weight, target, bias, impl="torch",
                                              label_smoothing=0.1))
    want = hvp(lambda h: F.cross_entropy(F.linear(h, weight, bias), target, label_smoothing=0.1))
    assert rel_err(ours, want) < 1e-10


@pytest.mark.parametrize("options", PATH_OPTIONS, ids=PATH_IDS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_zero_hidden_size_follows_torch(options, bias):
    """D = 0: the logits are the bias (or 0), the loss log V without a bias, as torch gives."""
    gen = torch.Generator().manual_seed(13)
    n, v = 9, 17
    target = torch.randint(0, v, (n,), generator=gen)
    b = torch.randn(v, generator=gen) if bias else None

    def run(fn):
        h = torch.zeros(n, 0, requires_grad=True)
        w = torch.zeros(v, 0, requires_grad=True)
        bb = None if b is None else b.clone().requires_grad_()
        loss = fn(h, w, bb)
        loss.backward()
        return loss.detach(), h.grad, w.grad, None if bb is None else bb.grad

    ours = run(lambda h, w, bb: linear_cross_entropy(h, w, target, bb, **options))
    want = run(lambda h, w, bb: F.cross_entropy(F.linear(h, w, bb), target))
    if not bias:
        assert abs(want[0].item() - torch.log(torch.tensor(float(v))).item()) < 1e-6
    torch.testing.assert_close(ours[0], want[0])
    assert ours[1].shape == (n, 0) and ours[2].shape == (v, 0)
    if bias:
        torch.testing.assert_close(ours[3], want[3])


TARGET_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]


@pytest.mark.parametrize("options", PATH_OPTIONS, ids=PATH_IDS)
def test_integer_target_dtypes_give_the_int64_result(options):
    """Every accepted integer dtype gives int64's loss and gradients. uint8 cannot hold -100:
    a class 156 stays a class (torch's reading), where comparing in uint8 would ignore it."""
    v = 200
    hidden, weight, target, _ = make_problem(N, v, D, seed=14)
    target[0], target[1] = 156, 99
    signed = target.clamp(max=127)
    signed[2::5] = -100

    def run(t):
        h = hidden.clone().requires_grad_()
        loss = linear_cross_entropy(h, weight, t, **options, reduction="sum")
        loss.backward()
        return loss.detach(), h.grad

    for dtype in TARGET_DTYPES:
        base = target if dtype == torch.uint8 else signed
        want = run(base)
        got = run(base.to(dtype))
        torch.testing.assert_close(got, want, msg=f"target dtype {dtype}")
    want_uint8 = F.cross_entropy(hidden @ weight.t(), target.to(torch.uint8), reduction="sum")
    torch.testing.assert_close(run(target.to(torch.uint8))[0], want_uint8, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("impl", ["cce", "chunked", "torch"])
@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.bool, torch.float32],
                         ids=str)
def test_other_target_dtypes_are_refused(impl, dtype):
    hidden, weight, target, _ = make_problem(N, V, D, seed=15)
    with pytest.raises(TypeError, match=r"target must hold integer class indices \(int64, "
                                        r"int32, int16, int8 or uint8\), got dtype"):
        linear_cross_entropy(hidden, weight, target.to(dtype), impl=impl)


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("softcap", [False, True], ids=["plain", "softcap"])
def test_forward_kernel_picking_the_target_spills_nothing(tma, softcap):
    """The forward kernel with its target-logit pick, compiled for Hopper at the tuned config
    (no GPU needed: Triton's own ptxas), keeps every value in registers; it is at the 255
    register limit, and carrying the target logit through the loop spilled up to 232 bytes.
    Without bias: with one, the kernel spilled 8-80 bytes before the pick too. It compiles in
    a child process: under TRITON_INTERPRET=1 the kernels are not compilable functions."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from helpers_reliability import hopper_forward_ptxas_report as r; "
            f"print(r(tma={tma}, softcap={softcap}, bias=False))")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # helpers_reliability's
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=tests,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    if run.stdout.startswith("SKIP"):
        pytest.skip(run.stdout.strip())
    assert "0 bytes spill stores" in run.stdout, run.stdout


# ---------------------------------------------------------------------------------------------
# On a CUDA GPU: the precision and strided-argument checks above with the real kernels, at sizes
# where the GPU tile configs, vocabulary splits and the copy engine (16-byte aligned 16-bit rows
# on Hopper) matter. For confident tokens, 16-bit inputs are held to torch's fp32
# ``F.cross_entropy`` on the same (rounded) values: our kernels keep fp32 logits. On a GPU
# machine: ``python -m pytest -q tests/op/test_reliability.py -m requires_cuda``.
# ---------------------------------------------------------------------------------------------

CUDA_N, CUDA_V = 1000, 5003
CUDA_PATHS = {
    "cce-gemm": dict(impl="cce", backward="gemm"),
    "cce-tiles": dict(impl="cce", backward="tiles"),
    "cce-kept": dict(impl="cce", backward="gemm", keep_logits=True),
    "chunked": dict(impl="chunked"),
}


# chunked rounds 16-bit logits as an unfused head does (torch's own error): fp32 only there.
_CUDA_CONFIDENT_CASES = [
    pytest.param(dtype, d, path, id=f"{dtype}-{name}-{path}")
    for dtype in (torch.float32, torch.bfloat16)
    for d, name in ((257, "pointer"), (256, "aligned"))
    for path in CUDA_PATHS
    if dtype == torch.float32 or path != "chunked"
]


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype, d, path", _CUDA_CONFIDENT_CASES)
def test_confident_tokens_as_precise_as_torch_on_cuda(dtype, d, path):
    hidden, weight, target, bias = confident_problem(CUDA_N, CUDA_V, d, seed=31, bias=True)
    hidden, weight, bias = (x.to(dtype).float() for x in (hidden, weight, bias))  # rounded
    exact = cross_entropy_run(hidden, weight, target, bias, torch.float64, "none")
    fp32 = cross_entropy_run(hidden, weight, target, bias, torch.float32, "none", "cuda")
    h, w = (x.to("cuda", dtype).requires_grad_() for x in (hidden, weight))
    loss, lse = linear_cross_entropy(h, w, target.cuda(), bias.to("cuda", dtype),
                                     reduction="none", return_lse=True, **CUDA_PATHS[path])
    upstream(loss).backward()
    ours = {"loss": loss, "lse": lse, "d_input": h.grad, "d_weight": w.grad}
    if dtype != torch.float32:
        # 16-bit gradients are rounded to 16 bits; only fp32 ones can match fp32's precision.
        ours["d_input"] = ours["d_weight"] = None
    failures = precision_failures(ours, exact, fp32)
    assert not failures, "; ".join(failures)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("path", CUDA_PATHS)
@pytest.mark.parametrize("which", ["input", "weight", "weight-column-major", "target", "bias",
                                   "input-one-row-broadcast", "bias-broadcast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_argument_on_cuda(dtype, which, path):
    hidden, weight, target, bias = make_problem(CUDA_N, CUDA_V, 256, dtype, "peaked", 0.1,
                                                bias=True, seed=32)
    hidden, weight, target, bias = (x.cuda() for x in (hidden, weight, target, bias))
    hidden, weight, target, bias = with_strided_argument(which, hidden, weight, target, bias,
                                                         CUDA_V)
    compare_to_reference(hidden, weight, target, bias, device="cuda", reduction="none",
                         return_lse=True, seed=32, **CUDA_PATHS[path])
