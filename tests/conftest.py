"""Shared pytest setup: the Triton interpreter switch, GPU skips, the `seed` fixture, the
`walks` spy on the gradient-in-forward mode, and TorchDynamo switched off only while the
Megatron tests run.

The markers themselves are declared in pyproject.toml; this file only acts on them.
"""

import os
import re

import pytest
import torch

# Triton reads TRITON_INTERPRET once, when a kernel module is imported; without it and without a
# GPU every launch fails with "0 active drivers". Setting it here, before any test module (and so
# any kernel) is imported, lets a plain `pytest tests` run the kernels on a CPU machine too.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


# Tests that launch the Triton kernels on CPU tensors (directly, or through impl="cce" on the CPU,
# gloo ranks included) need the interpreter: these files and tests, and in the files of
# CPU_KERNEL_IDS the parametrizations whose id names "cce". A new test of that kind elsewhere
# says so with @pytest.mark.cpu_kernels; one in these files that launches none, with
# @pytest.mark.cpu_kernels(False).
CPU_KERNEL_TESTS = frozenset({
    "test_cce.py", "test_cce_kernels.py", "test_forward_grad.py", "test_forward_grad_parallel.py",
    "test_tma_option.py", "test_parallel_reliability.py",
    "test_parallel.py::test_matches_single_device",
    "test_megatron_adapter.py::test_the_loss_mask_reaches_the_op",
    "test_ignore_index_and_scale.py::test_vocab_parallel_matches_torch",
})
CPU_KERNEL_IDS = frozenset({"test_reliability.py", "test_validation.py", "test_autocast.py",
                            "test_ignore_index_and_scale.py", "test_graphs.py"})


def cpu_kernels_skip_reason(interpret: bool, cuda: bool) -> str | None:
    """Why a test that runs the kernels on CPU tensors cannot run here, or None where it can.

    The interpreter is the only way to run them on CPU tensors; without it a launch fails with
    "0 active drivers" (no GPU) or "Pointer argument cannot be accessed from Triton (cpu
    tensor?)" (a GPU machine, where this file leaves TRITON_INTERPRET unset)."""
    if interpret:
        return None
    rerun = "rerun with TRITON_INTERPRET=1 (set before Python starts) to run it"
    if cuda:
        return (f"runs the Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1; "
                f"this GPU machine runs the CUDA tests (requires_cuda); {rerun}")
    return ("runs the Triton kernels on CPU tensors, and neither TRITON_INTERPRET=1 nor a GPU is "
            f"here; {rerun}")


def runs_kernels_on_cpu(item) -> bool:
    if item.get_closest_marker("requires_cuda") or item.get_closest_marker("requires_gpus"):
        return False
    marker = item.get_closest_marker("cpu_kernels")
    if marker is not None:
        return marker.args[0] if marker.args else True
    file = item.path.name
    if file in CPU_KERNEL_TESTS or f"{file}::{item.originalname}" in CPU_KERNEL_TESTS:
        return True
    callspec = getattr(item, "callspec", None)
    return (file in CPU_KERNEL_IDS and callspec is not None
            and "cce" in re.split(r"[-_\[\]]", callspec.id))


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    from fused_lce.kernels.common import INTERPRET

    cpu_kernels_reason = cpu_kernels_skip_reason(INTERPRET, n_gpus > 0)
    for item in items:
        if cpu_kernels_reason and runs_kernels_on_cpu(item):
            item.add_marker(pytest.mark.skip(reason=cpu_kernels_reason))
        if item.get_closest_marker("requires_cuda") and n_gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        marker = item.get_closest_marker("requires_gpus")
        if marker is not None:
            needed = marker.args[0] if marker.args else marker.kwargs.get("n", 1)
            if n_gpus < needed:
                item.add_marker(
                    pytest.mark.skip(reason=f"needs {needed} CUDA GPUs, found {n_gpus}")
                )


@pytest.fixture
def seed():
    """Seeds torch's generators (CPU and every GPU) and returns the seed."""
    value = 0
    torch.manual_seed(value)
    return value


@pytest.fixture
def walks(monkeypatch):
    """The plans of the gradient-in-forward walks (fused_lce/token_walk.py) run during a test,
    in call order: whether, and how, the mode ran (an evaluation's statistics-only walk is not
    one)."""
    from fused_lce import graphs, token_walk

    # A walk captured by an earlier test replays without entering Python: start with none.
    graphs.clear()
    plans = []
    original = token_walk.walk_token_chunks

    def spy(strategy, inputs, call, plan, needs, d_hidden_dtype, assumed):
        if assumed is not None:
            plans.append(plan)
        return original(strategy, inputs, call, plan, needs, d_hidden_dtype, assumed)

    monkeypatch.setattr(token_walk, "walk_token_chunks", spy)
    return plans


@pytest.fixture(autouse=True, scope="module")
def dynamo_off_only_in_megatron_tests(request):
    """lce_train.megatron_cpu's CPU mode switches TorchDynamo off for the whole process
    (megatron's fused kernels would compile for ~22 s a rank on the CPU). Folders collected
    after tests/megatron (tests/op/test_compile.py) need it on, so each Megatron module gives
    back the switch it found, and one that runs once CPU mode is on gets TorchDynamo off, as CPU
    mode promises. (One conftest for the suite: ``import conftest`` in a test then finds this
    one.)"""
    if "megatron" not in request.path.parent.name:
        yield
        return
    import torch._dynamo

    from lce_train import megatron_cpu

    saved = torch._dynamo.config.disable, os.environ.get("TORCHDYNAMO_DISABLE")
    if megatron_cpu._ENABLED:
        megatron_cpu._disable_dynamo()
    yield
    torch._dynamo.config.disable = saved[0]
    if saved[1] is None:
        os.environ.pop("TORCHDYNAMO_DISABLE", None)
    else:
        os.environ["TORCHDYNAMO_DISABLE"] = saved[1]
