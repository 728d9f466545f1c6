"""The tools behind the 4-GPU reports, on the CPU: lce_train.bench_parallel (--cpu-smoke),
lce_train.max_micro_batch and lce_train.plot_gpu_suite on the committed GPU results.

The last also holds lce_train.pp_memory to the peaks measured on 4 x H200: a change to the model
that moves a prediction more than 10% from its measurement fails here."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lce_train import plot_gpu_suite

pytest.importorskip("megatron.core")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "benchmarks"


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc


def test_bench_parallel_providers_on_cpu(tmp_path):
    out = tmp_path / "bench.csv"
    _torchrun("-m", "lce_train.bench_parallel", "--cpu-smoke", "--models", "gemma2_2b",
              "--providers", "ours", "ours-gemm", "ours-lean", "megatron-fused", "collectives",
              "--iters", "1", "--warmup", "0", "--out", str(out))
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    by = {(r["provider"], r["tp"], r["sp"]): r for r in rows}
    ours = ("ours", "ours-gemm", "ours-lean")
    # megatron's sequence-parallel all-gather allocates on CUDA: no SP for it in --cpu-smoke.
    assert set(by) == ({(p, tp, "off") for p in (*ours, "megatron-fused") for tp in "12"}
                       | {(p, "2", "on") for p in ours}
                       | {("collectives", "2", "off"), ("collectives", "2", "on")})
    # Every layout and mode computes the same loss, and megatron's fused loss too, up to the
    # rounding of bf16 logits (the default mode's are the GEMM's 16-bit output, gemm's are fp32).
    losses = [float(r["loss"]) for r in rows if r["provider"] != "collectives"]
    assert max(losses) - min(losses) < 1e-4 * max(losses)
    assert all(math.isnan(float(r["loss"])) and float(r["fwd_bwd_ms"]) > 0
               for r in rows if r["provider"] == "collectives")


_N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(0 < _N_GPUS < 2, reason="2 ranks: 2 GPUs on a CUDA machine (or none: gloo)")
def test_max_micro_batch_runs_to_its_limit(tmp_path):
    out = tmp_path / "mmb.json"
    _torchrun("-m", "lce_train.max_micro_batch", "--config", "tiny",
              "--tensor-model-parallel-size", "2", "--seq-length", "16",
              "--cross-entropy-fusion-impl", "cce", "--max-micro-batch", "3", "--out", str(out))
    result = json.loads(out.read_text())
    # On the CPU nothing runs out of memory: doubling stops at the limit.
    assert (result["max_micro_batch"], result["capped"]) == (3, True)
    assert result["tried"] == {"1": True, "2": True, "3": True}


def test_max_micro_batch_refuses_pipelines():
    from lce_train import max_micro_batch

    with pytest.raises(SystemExit, match="PP must be 1"):
        max_micro_batch.parse_args(["--config", "tiny", "--pipeline-model-parallel-size", "2",
                                    "--world-size", "2"])


def test_pp_memory_model_matches_the_h200_measurements(tmp_path, capsys):
    folder = tmp_path / "pp"
    shutil.copytree(RESULTS / "pp_memory_h200x4_202611", folder)
    plot_gpu_suite.main(["pp-memory", str(folder)])
    with open(folder / "predicted_vs_measured.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["layout"] for r in rows} == {"gemma", "llama"} and len(rows) == 24
    worst = max(abs(float(r["error"])) for r in rows)
    assert worst <= 0.10, f"a stage's prediction is {100 * worst:.1f}% off its H200 measurement"
    assert (folder / "predicted_vs_measured.png").read_bytes()[:4] == b"\x89PNG"


def test_plots_of_the_committed_runs(tmp_path, capsys):
    for what, name in (("parallel", "vocab_parallel_h200x4_202611"),
                       ("megatron", "megatron_h200x4_202611")):
        folder = tmp_path / name
        shutil.copytree(RESULTS / name, folder)
        # Run 1 of each report, from its runs.csv / runs.jsonl.
        plot_gpu_suite.main([what, str(folder), "--run", "run1"])
    out = capsys.readouterr().out
    assert "| gemma2_2b | 4 | off | 19.6 / 209 |" in out
    assert "| tp4 | 200 | 8.5708 / 8.5714 |" in out
    assert "cce: largest micro-batch 67 x 4096" in out
    for png in ("vocab_parallel_h200x4_202611/time_and_memory.png",
                "megatron_h200x4_202611/loss_curves.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_gpu_tests_lists_every_gpu_case_once_and_shards_the_large_files():
    script = [sys.executable, str(ROOT / "scripts" / "gpu_tests.py"), "out"]
    listed = subprocess.run(script + ["--list", "--shard", "45"], capture_output=True,
                            text=True, cwd=ROOT, check=True).stdout.splitlines()
    jobs = dict(line.split(": ", 1) for line in listed)
    assert "tests/op/test_cce_at_scale.py" in jobs.pop("multi_gpu").split()
    shards = [name for name in jobs if name.startswith("one_gpu_test_cce_at_scale_")]
    assert len(shards) == 4  # 163 cases, at most 45 a job
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/op/test_cce_at_scale.py"], capture_output=True, text=True, cwd=ROOT).stdout
    cases = sorted(line for line in collected.splitlines() if "::" in line)
    assert sorted(i for name in shards for i in jobs[name].split()) == cases
    no_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    missing = subprocess.run(script, capture_output=True, text=True, cwd=ROOT, env=no_gpu)
    assert missing.returncode == 2 and "no CUDA GPU here" in missing.stderr
