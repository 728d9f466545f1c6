"""Shared pytest setup: the Triton interpreter switch, GPU skips, the `seed` fixture and the
`walks` spy on the gradient-in-forward mode.

The markers themselves are declared in pyproject.toml; this file only acts on them.
"""

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET once, when a kernel module is imported; without it and without a
# GPU every launch fails with "0 active drivers". Setting it here, before any test module (and so
# any kernel) is imported, lets a plain `pytest tests` run the kernels on a CPU machine too.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
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
    """The plans of the gradient-in-forward walks (fused_lce/forward_grad.py) run during a test,
    in call order: whether, and how, the mode ran."""
    from fused_lce import engine

    plans = []
    original = engine._gradients_in_forward

    def spy(strategy, inputs, call, plan, *args):
        plans.append(plan)
        return original(strategy, inputs, call, plan, *args)

    monkeypatch.setattr(engine, "_gradients_in_forward", spy)
    return plans
