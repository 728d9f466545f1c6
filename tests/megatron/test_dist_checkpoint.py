"""The launcher's checkpoints through megatron-core's dist_checkpointing (lce_train.checkpoint).

Resharding on gloo, two CPU processes per run, the tiny model with the distributed optimizer
(whose Adam state is resharded with the model):

    TP2, 4 steps, saved at 2             the unbroken run
    TP1 x DP2 from step 2, saved at 3    TP2 -> TP1: steps 3, 4 as the unbroken run's
    TP1 x PP2 from step 3                TP1 -> PP2: step 4 as the unbroken run's

"as" is within fp32 rounding (the sums run in another order at another layout); the same-layout
resume is bitwise (tests/megatron/test_launcher.py::test_resume_continues_bitwise with megatron's
optimizer; here one process with the launcher's plain AdamW on bf16 weights). Bad checkpoints (a
missing shard, tracker files empty or garbage, folders that are not checkpoints, the old per-rank
format) are refused with a message naming the file or folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from lce_train import checkpoint

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "scripts" / "pretrain_gpt.py"
COMMON = ["--config", "tiny", "--num-layers", "2", "--hidden-size", "64", "--vocab-size", "1000",
          "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--cross-entropy-fusion-impl", "cce", "--lr", "3e-3", "--lr-decay-iters", "4",
          "--train-iters", "4", "--use-distributed-optimizer"]
# fp32 losses of the same model summed in another order (another TP / PP / DP split).
FP32_REL = 2e-6

two_ranks = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="the torchrun jobs need 2 GPUs on a CUDA machine (or none: gloo)")


def _launch(log: Path, *flags: str, check: bool = True, nproc: int = 2,
            common: list[str] = COMMON) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(LAUNCHER), *common, "--log-json", str(log), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=240)
    if check and proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return proc


def _losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


def _assert_continues(resumed: dict[int, float], straight: dict[int, float]) -> None:
    for step, loss in resumed.items():
        rel = abs(loss - straight[step]) / abs(straight[step])
        assert rel <= FP32_REL, (step, loss, straight[step], rel)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """The TP2 run: its losses, and its checkpoint directory (saved at step 2 and 4)."""
    tmp = tmp_path_factory.mktemp("unbroken")
    _launch(tmp / "log.json", "--tensor-model-parallel-size", "2", "--save", str(tmp / "ckpt"),
            "--save-interval", "2")
    return _losses(tmp / "log.json"), tmp / "ckpt"


@two_ranks
def test_resume_tp2_to_tp1_then_pp2(unbroken, tmp_path):
    straight, ckpt = unbroken
    assert sorted(straight) == [1, 2, 3, 4]
    folder = ckpt / "iter_0000002"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4\n"
    assert (folder / "metadata.json").is_file() and (folder / "common.pt").is_file()

    tp1 = tmp_path / "tp1"
    proc = _launch(tmp_path / "tp1.json", "--tensor-model-parallel-size", "1", "--load", str(ckpt),
                   "--ckpt-step", "2", "--save", str(tp1), "--save-interval", "1")
    assert "model and optimizer resharded" in proc.stdout, proc.stdout
    resumed = _losses(tmp_path / "tp1.json")
    assert sorted(resumed) == [3, 4]
    _assert_continues(resumed, straight)

    _launch(tmp_path / "pp2.json", "--pipeline-model-parallel-size", "2", "--load", str(tp1),
            "--ckpt-step", "3")
    resumed = _losses(tmp_path / "pp2.json")
    assert sorted(resumed) == [4]
    _assert_continues(resumed, straight)


@two_ranks
def test_missing_shard_names_the_folder(unbroken, tmp_path):
    _, ckpt = unbroken
    broken = tmp_path / "broken"
    shutil.copytree(ckpt / "iter_0000002", broken / "iter_0000002")
    (broken / "latest_checkpointed_iteration.txt").write_text("2\n")
    shards = sorted((broken / "iter_0000002").glob("*.distcp"))
    assert shards, list((broken / "iter_0000002").iterdir())
    shards[0].unlink()
    proc = _launch(tmp_path / "log.json", "--tensor-model-parallel-size", "2", "--load",
                   str(broken), check=False)
    assert proc.returncode != 0
    assert f"{broken / 'iter_0000002'}: cannot load the checkpoint" in proc.stdout + proc.stderr, \
        (proc.stdout + proc.stderr)[-3000:]


def test_plain_adamw_bf16_resumes_bitwise(tmp_path):
    """lce_train's TorchAdamW (--optimizer-impl torch) keeps fp32 main copies of bf16 weights:
    its sharded state (moments and main copies) resumes one process bitwise."""
    common = [*COMMON[:-1], "--bf16", "--optimizer-impl", "torch"]
    ckpt = tmp_path / "ckpt"
    _launch(tmp_path / "straight.json", "--save", str(ckpt), "--save-interval", "2", nproc=1,
            common=common)
    _launch(tmp_path / "resumed.json", "--load", str(ckpt), "--ckpt-step", "2", nproc=1,
            common=common)
    straight, resumed = _losses(tmp_path / "straight.json"), _losses(tmp_path / "resumed.json")
    assert sorted(resumed) == [3, 4]
    assert resumed == {k: straight[k] for k in (3, 4)}, (straight, resumed)


# ---------------------------------------------------------------------------------------------
# Bad directories, without ranks: refused before anything is read
# ---------------------------------------------------------------------------------------------


def _load_args(path: Path, step=None) -> Namespace:
    return Namespace(load=str(path), ckpt_step=step)


@pytest.mark.parametrize("content, found", [("", "an empty file"), ("  \n", "an empty file"),
                                            ("iter_10\n", "'iter_10'")])
def test_bad_tracker_file_is_named(tmp_path, content, found):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(content)
    with pytest.raises(SystemExit) as err:
        checkpoint.load_checkpoint(_load_args(tmp_path), None, None)
    message = str(err.value)
    assert str(tmp_path / "latest_checkpointed_iteration.txt") in message
    assert found in message and "--ckpt-step" in message


def test_directory_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="no such directory"):
        checkpoint.load_checkpoint(_load_args(tmp_path / "absent"), None, None)
    with pytest.raises(SystemExit, match="latest_checkpointed_iteration.txt not found "
                                         r"\(not a checkpoint directory"):
        checkpoint.load_checkpoint(_load_args(tmp_path), None, None)
    (tmp_path / "iter_0000005").mkdir()
    with pytest.raises(SystemExit, match=r"it holds iter_0000005: pass --ckpt-step N"):
        checkpoint.load_checkpoint(_load_args(tmp_path), None, None)
    with pytest.raises(SystemExit, match=f"{tmp_path / 'iter_0000007'} does not exist"):
        checkpoint.load_checkpoint(_load_args(tmp_path, step=7), None, None)
    with pytest.raises(SystemExit, match=f"{tmp_path / 'iter_0000005'}: not a dist_checkpointing "
                                         "checkpoint"):
        checkpoint.load_checkpoint(_load_args(tmp_path, step=5), None, None)


def test_old_per_rank_format_is_refused(tmp_path):
    folder = tmp_path / "iter_0000002"
    folder.mkdir()
    torch.save({"step": 2}, folder / "rank_00000.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2\n")
    with pytest.raises(SystemExit, match=f"{folder} holds per-rank torch.save files"):
        checkpoint.load_checkpoint(_load_args(tmp_path), None, None)
