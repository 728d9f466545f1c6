"""Input the op cannot take gets a clear error naming what to change, not an internal one.

Each case here once failed deep inside: batched gradients and torch.func
transforms ("Cannot access storage of BatchedTensorImpl"), an infinite scratch budget
(OverflowError from int(inf)), tensors on the meta device (".item() cannot be called on meta
tensors"), a string where a bool belongs (taken as True). fp16 logits past 65504 gave a finite
evaluation loss on some paths and NaN on others; every path now rounds them as torch does. The
last tests hold conftest's rule for test files that run the kernels on CPU tensors.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err
from helpers_parallel import run_on_ranks

from fused_lce import LinearCrossEntropy, linear_cross_entropy
from fused_lce.kernels.common import INTERPRET
from fused_lce.options import ENV_SCRATCH_MB, LCEOptions, user_fields

N, V, D = 13, 37, 16
# The Triton paths run on a GPU where there is one, else under the interpreter on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
ON_CPU = [pytest.mark.cpu_kernels] if DEVICE == "cpu" else []

# Every backward that forms its gradient by hand: the gradient-in-forward one (the default),
# the two recomputing ones and the chunked vocabulary walk.
HAND_MADE_BACKWARDS = [
    pytest.param(dict(impl="cce"), id="cce-forward", marks=ON_CPU),
    pytest.param(dict(impl="cce", backward="gemm"), id="cce-gemm", marks=ON_CPU),
    pytest.param(dict(impl="cce", backward="tiles"), id="cce-tiles", marks=ON_CPU),
    pytest.param(dict(impl="chunked", vocab_chunk_size=16), id="chunked-vocab"),
    pytest.param(dict(impl="chunked", chunk_by="tokens", token_chunk_size=4),
                 id="chunked-tokens"),
]
TOKEN_CHUNKS = dict(impl="chunked", chunk_by="tokens", token_chunk_size=4)


def problem(dtype=torch.float32, seed=0, device=DEVICE):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=generator, dtype=torch.float64)
    weight = torch.randn(V, D, generator=generator, dtype=torch.float64) / D**0.5
    target = torch.randint(V, (N,), generator=generator)
    return hidden.to(device, dtype), weight.to(device, dtype), target.to(device)


# ---------------------------------------------------------------------------------------------
# torch.func transforms and batched gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("options", HAND_MADE_BACKWARDS)
def test_batched_gradients_are_refused_naming_the_feature(options, reduction):
    hidden, weight, target = problem()
    hidden.requires_grad_()
    weight.requires_grad_()
    loss = linear_cross_entropy(hidden, weight, target, reduction=reduction, **options)
    upstream = torch.randn(3, *loss.shape, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"is_grads_batched=True.*Use impl='torch'"):
        torch.autograd.grad(loss, (hidden, weight), upstream, is_grads_batched=True)


@pytest.mark.parametrize("transform", ["vmap", "grad"])
@pytest.mark.parametrize("options", HAND_MADE_BACKWARDS)
def test_function_transforms_are_refused_naming_the_feature(options, transform):
    hidden, weight, target = problem()

    def loss_of(h):
        return linear_cross_entropy(h, weight, target, **options)

    call = (torch.func.vmap(loss_of) if transform == "vmap" else torch.func.grad(loss_of))
    batch = hidden.expand(2, N, D) if transform == "vmap" else hidden
    with pytest.raises(RuntimeError, match=r"does not support torch\.func transforms"):
        call(batch)


def test_the_advised_impl_runs_under_vmap():
    hidden, weight, target = problem(torch.float64, device="cpu")
    batch = torch.stack((hidden, 2 * hidden))
    got = torch.func.vmap(lambda h: linear_cross_entropy(h, weight, target, impl="torch",
                                                         check_targets=False))(batch)
    want = torch.stack([F.cross_entropy(h @ weight.T, target) for h in batch])
    assert rel_err(got, want) < 1e-12


# ---------------------------------------------------------------------------------------------
# scratch_mb and its environment variable: finite
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("inf"), float("nan"), float("-inf")])
def test_non_finite_scratch_budget_is_refused(value):
    with pytest.raises(ValueError, match=r"scratch_mb must be > 0 and finite"):
        LCEOptions(scratch_mb=value)
    hidden, weight, target = problem(device="cpu")
    with pytest.raises(ValueError, match=r"scratch_mb must be > 0 and finite"):
        linear_cross_entropy(hidden, weight, target, scratch_mb=value)


@pytest.mark.parametrize("raw", ["inf", "Infinity", "nan", "-inf"])
def test_non_finite_scratch_environment_is_refused(monkeypatch, raw):
    monkeypatch.setenv(ENV_SCRATCH_MB, raw)
    with pytest.raises(ValueError, match=rf"{ENV_SCRATCH_MB} must be a finite positive number"):
        LCEOptions()


# ---------------------------------------------------------------------------------------------
# The meta device
# ---------------------------------------------------------------------------------------------


def _meta_problem():
    hidden, weight, target = problem(device="meta")
    return hidden.requires_grad_(), weight.requires_grad_(), target


@pytest.mark.parametrize("impl", ["chunked", "auto"])
def test_meta_tensors_are_refused_by_the_chunked_impl(impl):
    with pytest.raises(ValueError, match=r"impl='chunked'.*meta device.*impl='torch'"):
        linear_cross_entropy(*_meta_problem(), impl=impl, check_targets=False)


def test_meta_tensors_are_refused_by_cce():
    with pytest.raises(ValueError, match=r"impl='cce' needs CUDA tensors.*got device meta"):
        linear_cross_entropy(*_meta_problem(), impl="cce")


def test_meta_targets_cannot_be_checked():
    with pytest.raises(ValueError, match=r"check_targets=True.*meta device.*check_targets=False"):
        linear_cross_entropy(*_meta_problem(), impl="torch")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_impl_gives_shapes_on_meta(reduction):
    hidden, weight, target = _meta_problem()
    loss, lse = linear_cross_entropy(hidden, weight, target, impl="torch", check_targets=False,
                                     reduction=reduction, return_lse=True)
    assert loss.device.type == "meta" and lse.shape == (N,)
    assert loss.shape == ((N,) if reduction == "none" else ())
    loss.sum().backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


# ---------------------------------------------------------------------------------------------
# Switches are bools
# ---------------------------------------------------------------------------------------------


def _bool_arguments(annotations: dict) -> list[str]:
    return [name for name, kind in annotations.items() if kind in ("bool", "bool | None")]


FRONT_DOOR_BOOLS = _bool_arguments(
    {name: p.annotation for name, p in
     inspect.signature(linear_cross_entropy).parameters.items()})
OPTION_BOOLS = _bool_arguments({f.name: f.type for f in user_fields()})


def test_every_switch_is_found():
    assert {"return_lse", "check_targets", "vocab_sort", "tma"} <= set(FRONT_DOOR_BOOLS)
    assert set(OPTION_BOOLS) <= set(FRONT_DOOR_BOOLS)


@pytest.mark.parametrize("name", FRONT_DOOR_BOOLS)
@pytest.mark.parametrize("value", ["no", "false", 0])
def test_front_door_switches_refuse_non_bools(name, value):
    hidden, weight, target = problem(device="cpu")
    with pytest.raises(TypeError, match=rf"^{name} must be a bool.*got {value!r}"):
        linear_cross_entropy(hidden, weight, target, impl="torch", **{name: value})


@pytest.mark.parametrize("name", ["return_lse", "check_targets", *OPTION_BOOLS])
def test_module_switches_refuse_non_bools(name):
    with pytest.raises(TypeError, match=rf"^{name} must be a bool.*got 'false'"):
        LinearCrossEntropy(**{name: "false"})


def test_module_with_both_switches_as_strings_turns_neither_on():
    with pytest.raises(TypeError, match=r"must be a bool"):
        LinearCrossEntropy(check_targets="false", return_lse="false")


# ---------------------------------------------------------------------------------------------
# The vocab-parallel layer: the same refusals, on every rank
# ---------------------------------------------------------------------------------------------


def _parallel_refusals(rank: int, world: int) -> list[str]:
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    hidden, weight, target = problem(device="cpu")
    shard = weight.chunk(world)[rank]

    def call(h=hidden, **kwargs):
        return vocab_parallel_linear_cross_entropy(h, shard, target, impl="chunked", **kwargs)

    errors = []

    def expect(label, error, pattern, run):
        try:
            run()
        except error as exc:
            if not re.search(pattern, str(exc)):
                errors.append(f"rank {rank} {label}: {type(exc).__name__}: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - reported with its type
            errors.append(f"rank {rank} {label}: {type(exc).__name__}: {exc}")
            return
        errors.append(f"rank {rank} {label}: nothing raised")

    for name in ("return_lse", "check_targets", "agree_every_call"):
        expect(name, TypeError, rf"{name} must be a bool, got 'no'",
               lambda n=name: call(**{n: "no"}))
    expect("vmap", RuntimeError, r"torch\.func transforms",
           lambda: torch.func.vmap(lambda h: call(h=h))(hidden.expand(2, N, D)))

    h = hidden.clone().requires_grad_()
    loss = call(h=h, reduction="none")
    expect("is_grads_batched", RuntimeError, r"is_grads_batched=True",
           lambda: torch.autograd.grad(loss, h, torch.ones(2, N), is_grads_batched=True))
    return errors


@pytest.mark.timeout(300)
def test_vocab_parallel_refuses_the_same_on_every_rank(tmp_path):
    run_on_ranks(2, _parallel_refusals, out_dir=tmp_path, timeout_s=60)


# ---------------------------------------------------------------------------------------------
# fp16 logits past 65504: one behaviour, torch's, on every path, in training and evaluation
# ---------------------------------------------------------------------------------------------

FP16_PATHS = [
    *HAND_MADE_BACKWARDS,
    pytest.param(dict(impl="cce", backward="gemm", keep_logits=True), id="cce-kept",
                 marks=ON_CPU),
    pytest.param(dict(impl="torch"), id="torch"),
]


def overflowing_fp16_problem():
    """Row 0's logit of class 3 is 70 * 70 * 16 = 78400, past fp16's 65504; the rest are small."""
    hidden, weight, target = problem(torch.float32, seed=3, device="cpu")
    hidden[0], weight[3] = 70.0, 70.0
    return hidden.half(), weight.half(), target


def fp16_reference(hidden, weight, target):
    """torch's per-token losses in fp64 from the logits rounded to fp16 (row 0: inf)."""
    logits = (hidden.double() @ weight.double().T).half().double()
    return F.cross_entropy(logits, target, reduction="none")


# numpy, under the interpreter, warns where the kernels form inf and inf - inf.
OVERFLOW_WARNINGS = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                               "ignore:invalid value encountered:RuntimeWarning")


@OVERFLOW_WARNINGS
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("options", FP16_PATHS)
def test_fp16_overflow_gives_torch_non_finite_loss_on_every_path(options, train):
    hidden, weight, target = overflowing_fp16_problem()
    want = fp16_reference(hidden, weight, target)
    assert not want[0].isfinite() and want[1:].isfinite().all()
    h, w = (t.to(DEVICE).requires_grad_(train) for t in (hidden, weight))
    with torch.set_grad_enabled(train):
        losses = linear_cross_entropy(h, w, target.to(DEVICE), reduction="none", **options)
    losses = losses.detach().cpu().double()
    assert not losses[0].isfinite(), f"row 0 (a logit of 78400 in fp16) gave {losses[0]}"
    assert rel_err(losses[1:], want[1:]) < 2e-3


@OVERFLOW_WARNINGS
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_fp16_overflow_with_token_chunks(train):
    hidden, weight, target = overflowing_fp16_problem()
    h, w = hidden.requires_grad_(train), weight.requires_grad_(train)
    with torch.set_grad_enabled(train):
        loss = linear_cross_entropy(h, w, target, **TOKEN_CHUNKS)
    assert not loss.isfinite()


# ---------------------------------------------------------------------------------------------
# What the docs say about the token chunks' lse
# ---------------------------------------------------------------------------------------------


def test_token_chunks_lse_carries_a_gradient_as_documented():
    hidden, weight, target = problem(device="cpu")
    _, lse = linear_cross_entropy(hidden.requires_grad_(), weight, target, return_lse=True,
                                  **TOKEN_CHUNKS)
    assert lse.requires_grad
    doc = linear_cross_entropy.__doc__
    about_lse = doc[doc.index("return_lse:"): doc.index("num_classes:")]
    assert "differentiable" in about_lse and "no gradient" not in about_lse


# ---------------------------------------------------------------------------------------------
# conftest's rule: tests that run the kernels on CPU tensors skip, with a reason, where the
# interpreter is off
# ---------------------------------------------------------------------------------------------


def test_skip_reason_says_how_to_run_them():
    from conftest import cpu_kernels_skip_reason

    assert cpu_kernels_skip_reason(interpret=True, cuda=False) is None
    assert cpu_kernels_skip_reason(interpret=True, cuda=True) is None
    for cuda in (False, True):
        reason = cpu_kernels_skip_reason(interpret=False, cuda=cuda)
        assert "CPU tensors" in reason and "TRITON_INTERPRET=1" in reason
    assert "GPU machine" in cpu_kernels_skip_reason(interpret=False, cuda=True)


def _item(file: str, name: str, callspec_id: str | None = None, **markers):
    def closest(marker):
        return markers.get(marker)

    return SimpleNamespace(path=Path("tests", file), originalname=name,
                           get_closest_marker=closest,
                           callspec=None if callspec_id is None else SimpleNamespace(
                               id=callspec_id))


CPU_KERNELS = SimpleNamespace(args=())


@pytest.mark.parametrize("item, expected", [
    (_item("test_cce_kernels.py", "test_lse"), True),
    (_item("test_cce_kernels.py", "test_compiles",
           cpu_kernels=SimpleNamespace(args=(False,))), False),
    (_item("test_parallel.py", "test_matches_single_device", "tp2"), True),
    (_item("test_parallel.py", "test_case_layouts"), False),
    (_item("test_reliability.py", "test_strided_argument", "input-cce-gemm"), True),
    (_item("test_reliability.py", "test_strided_argument", "input-chunked-vocab"), False),
    (_item("test_gpu.py", "test_matches", "cce", requires_cuda=CPU_KERNELS), False),
    (_item("test_new.py", "test_kernel", cpu_kernels=CPU_KERNELS), True),
], ids=["kernel-file", "opted-out", "listed-test", "other-test", "cce-id", "chunked-id",
        "cuda-test", "marked"])
def test_which_tests_run_kernels_on_cpu(item, expected):
    from conftest import runs_kernels_on_cpu

    assert runs_kernels_on_cpu(item) is expected


@pytest.mark.timeout(300)
def test_kernel_file_skips_without_the_interpreter():
    """tests/kernels/test_cce_kernels.py with TRITON_INTERPRET=0 and no GPU: every test that
    runs the kernels on CPU tensors is skipped with the reason, none fails."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "tests/kernels/test_cce_kernels.py", "-k", "not compiles"],
        cwd=root, env=env, capture_output=True, text=True, timeout=280,
    )
    summary = child.stdout.strip().splitlines()[-1]
    assert child.returncode == 0 and "failed" not in summary, child.stdout[-3000:]
    assert "neither TRITON_INTERPRET=1 nor a GPU" in child.stdout
    assert int(summary.split(" skipped")[0].split()[-1]) >= 60, summary

