"""The console scripts as a wheel's user meets them: no checkout at hand, maybe no GPU.

Their help and their errors must stand on their own: a traceback, a pointer to a module's
docstring or a ``python scripts/...`` line sends that user to files they do not have. Each test
calls a script's entry function in this process (the help pages, the errors before any work), or
runs it as ``python -m`` from a folder outside the checkout (the CPU search, about 15 s, most of it
importing megatron-core).
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lce_train import max_micro_batch, plot_gpu_suite

ROOT = Path(__file__).resolve().parents[2]


def _console_scripts() -> dict[str, str]:
    """setup.py's ``console_scripts``: command name -> ``module:function``."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            entries = ast.literal_eval(node.value)["console_scripts"]
            return dict((part.strip() for part in e.split("=")) for e in entries)
    raise AssertionError("setup.py has no entry_points=")


# ----------------------------------------------------------------------------------------------
# every console script's --help
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", sorted(_console_scripts()))
def test_help_names_no_checkout_paths(command, monkeypatch, capsys):
    module, function = _console_scripts()[command].split(":")
    entry = getattr(importlib.import_module(module), function)
    # As the installed command calls it: no arguments, the flags in sys.argv.
    monkeypatch.setattr(sys, "argv", [command, "--help"])
    with pytest.raises(SystemExit) as done:
        entry()
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith(f"usage: {command}"), out[:500]
    for checkout_only in ("scripts/", "pip install -e", "docstring"):
        assert checkout_only not in out, f"{command} --help names {checkout_only!r}"


# ----------------------------------------------------------------------------------------------
# lce-plot-gpu-suite
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("what, expected", [("parallel", "bench_parallel.csv"),
                                            ("megatron", "runs.jsonl"),
                                            ("pp-memory", "pp_gemma_measured.csv")])
def test_plot_gpu_suite_says_what_an_empty_folder_lacks(tmp_path, capsys, what, expected):
    with pytest.raises(SystemExit) as done:
        plot_gpu_suite.main([what, str(tmp_path)])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert done.value.code == 2
    assert str(tmp_path) in error and expected in error, error


def test_plot_gpu_suite_names_a_missing_folder(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        plot_gpu_suite.main(["parallel", str(tmp_path / "none")])
    assert done.value.code == 2
    assert f"{tmp_path / 'none'}: no such folder" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# lce-max-micro-batch
# ----------------------------------------------------------------------------------------------


def test_max_micro_batch_help_is_its_own(capsys):
    with pytest.raises(SystemExit) as done:
        max_micro_batch.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "--max-micro-batch N" in out and "lce-pretrain-gpt --help" in out
    # The launcher's own flags are its help's business, not this one's.
    assert "--data-cache-path" not in out


def test_max_micro_batch_without_torchrun_gives_the_command(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    # Whatever another test left behind, this process is not one of torchrun's.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    flags = ["--config", "tiny", "--tensor-model-parallel-size", "2"]
    with pytest.raises(SystemExit) as done:
        max_micro_batch.main(flags)
    message = str(done.value.code)
    assert "torchrun --nproc-per-node 2 -m lce_train.max_micro_batch " + " ".join(flags) \
        in message, message
    assert "docstring" not in message


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_max_micro_batch_on_the_cpu_measures_no_peak(tmp_path):
    pytest.importorskip("megatron.core")
    out = tmp_path / "mmb.json"
    # One rank, with the environment torchrun would give it; no GPU even where there is one.
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lce_train.max_micro_batch", "--config", "tiny",
           "--seq-length", "8", "--max-micro-batch", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "peak memory not measured on the CPU" in proc.stdout, proc.stdout
    assert "GiB" not in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    assert (result["max_micro_batch"], result["peak_gib"]) == (2, None)
