"""Two nodes simulated on 127.0.0.1: scripts/pretrain_gpt.sh's NNODES / NODE_RANK path.

Two ``pretrain_gpt.sh`` invocations (NNODES=2, NODE_RANK 0 and 1, two CPU processes each, gloo,
a c10d rendezvous on a free port of 127.0.0.1) form one job of 4 ranks: TP2 inside a node
(ranks 0-1 and 2-3), data parallel across the node boundary, the distributed optimizer sharded
over it. It trains 4 steps and saves a sharded checkpoint at step 2; one node then resumes that
checkpoint at another layout (TP1 x PP2, 2 ranks) and its steps 3 and 4 match the two-node run's
within fp32 rounding.

Only 127.0.0.1 is used (rendezvous, torchrun's --local-addr, gloo's interface), and every wait
is bounded: the rendezvous by RDZV_TIMEOUT, each job by a timeout that kills its process group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="simulates nodes with gloo CPU processes")

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--config", "tiny", "--num-layers", "2", "--hidden-size", "64", "--vocab-size", "1000",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--cross-entropy-fusion-impl", "cce", "--lr", "3e-3", "--lr-decay-iters", "4",
         "--train-iters", "4", "--use-distributed-optimizer"]
LOOPBACK = "127.0.0.1"
JOB_TIMEOUT = 300
FP32_REL = 2e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    return dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1",
                GLOO_SOCKET_IFNAME="lo", MASTER_ADDR=LOOPBACK, **extra)


def _start(env: dict, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(ROOT / "scripts" / "pretrain_gpt.sh"), *flags],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    """Wait for every job (at most JOB_TIMEOUT seconds in all), killing all on a timeout."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=JOB_TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"a node did not finish within {JOB_TIMEOUT} s") from None
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-4000:]}"
    return outputs


def _losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


def test_two_nodes_then_one_node_at_another_layout(tmp_path):
    ckpt, two_log, one_log = tmp_path / "ckpt", tmp_path / "two.json", tmp_path / "one.json"
    port = _free_port()
    nodes = [_start(_env(NNODES="2", NODE_RANK=str(rank), NGPU="2", MASTER_PORT=str(port),
                         LOCAL_ADDR=LOOPBACK, RDZV_ID=f"two_nodes_{port}", RDZV_TIMEOUT="120"),
                    *FLAGS, "--tensor-model-parallel-size", "2", "--save", str(ckpt),
                    "--save-interval", "2", "--log-json", str(two_log))
             for rank in (0, 1)]
    outputs = _finish(nodes)
    text = "\n".join(outputs)
    assert "--nnodes 2" in text and "--rdzv-backend c10d" in text
    assert "world 4 = TP 2 x PP 1 x CP 1 x DP 2" in text, text[-3000:]
    two = _losses(two_log)
    assert sorted(two) == [1, 2, 3, 4]
    assert (ckpt / "iter_0000002" / "metadata.json").is_file()

    single = _start(_env(NGPU="2", MASTER_PORT=str(_free_port())), *FLAGS,
                    "--pipeline-model-parallel-size", "2", "--load", str(ckpt),
                    "--ckpt-step", "2", "--log-json", str(one_log))
    out = _finish([single])[0]
    assert "world 2 = TP 1 x PP 2" in out and "model and optimizer resharded" in out, out[-3000:]
    one = _losses(one_log)
    assert sorted(one) == [3, 4]
    for step, loss in one.items():
        assert abs(loss - two[step]) <= FP32_REL * abs(two[step]), (step, loss, two[step])
