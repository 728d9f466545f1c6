"""--data-path on Megatron's indexed datasets through megatron-core's classes (lce_train.data).

Tiny datasets written with megatron-core's IndexedDatasetBuilder: dataset "low" holds ids below
100, dataset "high" ids from 100 up, so the source of every token is known. Checked here: the
blend syntax and the errors that name missing files; GPTDataset windows (contiguous, shifted
labels, seeded, the same batches at any data-parallel split); a 1:3 blend draws 1:3 (one gloo
rank in a subprocess, as BlendedDataset needs torch.distributed); and the launcher trains a few
steps on one prefix (DP2) and on the blend (TP2), two CPU processes each.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

from lce_train import data

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "scripts" / "pretrain_gpt.py"
VOCAB = 200
SEQ = 32


def _write_dataset(prefix: Path, low: int, high: int, seed: int) -> Path:
    """40 documents of 20-90 consecutive ids (mod the range) in [low, high), each ending in
    ``high - 1`` as an end-of-document id."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(40):
        n = int(rng.integers(20, 90))
        start = int(rng.integers(low, high - 1))
        doc = low + (start - low + np.arange(n)) % (high - 1 - low)
        builder.add_document(np.append(doc, high - 1), [n + 1])
    builder.finalize(f"{prefix}.idx")
    return prefix


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("indexed")
    return (_write_dataset(root / "low", 0, 100, seed=0),
            _write_dataset(root / "high", 100, VOCAB, seed=1))


def _args(**kw) -> Namespace:
    base = dict(micro_batch_size=2, data_parallel_size=1, global_batch_size=4,
                num_microbatches=2)
    return Namespace(**{**base, **kw})


def test_blend_syntax():
    assert data.parse_blend(["data/a"]) == (["data/a"], None)
    assert data.parse_blend(["0.3 data/a 0.7 data/b"]) == (["data/a", "data/b"], [0.3, 0.7])
    assert data.parse_blend(["1", "data/a", "3", "data/b"]) == (["data/a", "data/b"], [1.0, 3.0])
    assert data.describe_blend(["1 a 3 b"]) == "25% a, 75% b"
    with pytest.raises(SystemExit, match="expected one prefix or pairs"):
        data.parse_blend(["0.3 data/a 0.7"])
    with pytest.raises(SystemExit, match="every other word is a weight"):
        data.parse_blend(["data/a data/b"])
    with pytest.raises(SystemExit, match="must be > 0"):
        data.parse_blend(["0 data/a 1 data/b"])


def test_missing_files_are_named(tmp_path, datasets):
    with pytest.raises(SystemExit, match=f"{tmp_path / 'none.idx'} not found"):
        data.check_data_vocab([str(tmp_path / "none")], "--data-path", 300)
    # The launcher's earlier flat token file (PREFIX.bin + PREFIX.json, no .idx).
    (tmp_path / "old.bin").write_bytes(np.arange(10, dtype=np.uint16).tobytes())
    (tmp_path / "old.json").write_text(json.dumps({"vocab_size": 257, "dtype": "uint16"}))
    with pytest.raises(SystemExit, match="earlier flat format.*rebuild it with "
                                         "lce-build-token-file"):
        data.check_data_vocab([str(tmp_path / "old")], "--data-path", 300)
    low, high = datasets
    # A blend is checked prefix by prefix.
    with pytest.raises(SystemExit, match=f"{tmp_path / 'none.idx'} not found"):
        data.check_data_vocab([f"1 {low} 1 {tmp_path / 'none'}"], "--data-path", 300)
    data.check_data_vocab([f"1 {low} 1 {high}"], "--data-path", 300)


def test_missing_compiled_helpers_say_what_to_do(monkeypatch):
    import megatron.core.datasets as datasets_pkg

    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)
    monkeypatch.delattr(datasets_pkg, "helpers_cpp", raising=False)
    with pytest.raises(SystemExit) as err:
        data._import_dataset_classes()
    assert "python -m pybind11 --includes) helpers.cpp -o helpers_cpp" in str(err.value)


def test_gpt_dataset_windows_are_step_addressed(datasets, tmp_path):
    low, _ = datasets
    cache = str(tmp_path / "cache")
    windows = data.IndexedWindows([str(low)], SEQ, VOCAB, seed=5, num_samples=16,
                                  cache_path=cache)
    whole = [b for b in windows.microbatches(2, _args(), 0, "cpu")]
    assert len(whole) == 2 and whole[0]["tokens"].shape == (2, SEQ)
    for batch in whole:
        tokens, labels = batch["tokens"], batch["labels"]
        assert torch.equal(tokens[:, 1:], labels[:, :-1])  # one window, labels shifted by one
        assert int(tokens.max()) < 100 and batch["loss_mask"].dtype == torch.float32
        assert torch.equal(batch["position_ids"][0], torch.arange(SEQ))
        # Within a document the ids are consecutive (mod 99); a new one starts after id 99.
        steps = (labels - tokens) % 99
        assert bool(((steps == 1) | (tokens == 99) | (labels == 99)).all())
    # The same global batch split over two data-parallel ranks, in the same order.
    split = [b["tokens"] for r in (0, 1)
             for b in windows.microbatches(2, _args(data_parallel_size=2, num_microbatches=1),
                                           r, "cpu")]
    assert torch.equal(torch.cat(split), torch.cat([b["tokens"] for b in whole]))
    again = data.IndexedWindows([str(low)], SEQ, VOCAB, seed=5, num_samples=16,
                                cache_path=cache)
    assert torch.equal(next(again.microbatches(2, _args(), 0, "cpu"))["tokens"],
                       whole[0]["tokens"])
    other = data.IndexedWindows([str(low)], SEQ, VOCAB, seed=6, num_samples=16,
                                cache_path=cache)
    assert not torch.equal(next(other.microbatches(2, _args(), 0, "cpu"))["tokens"],
                           whole[0]["tokens"])


def test_blend_draws_by_weight(datasets, tmp_path):
    """BlendedDataset needs torch.distributed: one gloo rank in a subprocess."""
    low, high = datasets
    script = textwrap.dedent(f"""
        import json, torch
        torch.distributed.init_process_group(
            "gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        from lce_train import data
        windows = data.IndexedWindows(["1 {low} 3 {high}"], {SEQ}, {VOCAB}, seed=3,
                                      num_samples=400, cache_path="{tmp_path / 'cache'}")
        high_share = [float((windows.dataset[i]["tokens"] >= 100).float().mean())
                      for i in range(400)]
        print(json.dumps(high_share))
        torch.distributed.destroy_process_group()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shares = json.loads(proc.stdout.strip().splitlines()[-1])
    # Every sample comes whole from one dataset; 3 in 4 from "high".
    assert set(shares) == {0.0, 1.0}
    assert abs(sum(shares) / len(shares) - 0.75) < 0.01


def _launch(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(LAUNCHER), "--config", "tiny", "--num-layers", "2", "--hidden-size", "64",
           "--vocab-size", str(VOCAB), "--seq-length", str(SEQ), "--micro-batch-size", "2",
           "--cross-entropy-fusion-impl", "cce", "--train-iters", "3", "--lr", "3e-3", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return proc


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="the torchrun jobs need 2 GPUs on a CUDA machine (or none: gloo)")
@pytest.mark.parametrize("layout, blend", [(["--tensor-model-parallel-size", "1"], False),
                                           (["--tensor-model-parallel-size", "2"], True)])
def test_launcher_trains_on_indexed_data(datasets, tmp_path, layout, blend):
    low, high = datasets
    path = [f"1 {low} 3 {high}"] if blend else [str(low)]
    log = tmp_path / "log.json"
    proc = _launch(*layout, "--data-path", *path, "--data-cache-path", str(tmp_path / "cache"),
                   "--log-json", str(log))
    expected = f"data        25% {low}, 75% {high}" if blend else f"data        {low}"
    assert expected in proc.stdout, proc.stdout
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == 3
    # Starts near ln(padded vocabulary) (a uniform guess) and learns the consecutive ids.
    assert abs(losses[0] - math.log(256)) < 0.5 and losses[-1] < losses[0], losses
