"""lce_train.training_equivalence compact: one small file in place of a folder of run logs, from
which ``report`` writes the same table, CSV and target lines as from the logs themselves; and
the committed file of docs/training_equivalence/ still yields the numbers its page shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "training_equivalence"


def _script(*argv: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "lce_train.training_equivalence", *argv],
                          cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _logs(out: Path) -> None:
    """Launcher-like logs: float32 losses logged as doubles, raw step times, validation and
    probes at some steps (one probe failed), fields report does not read, and one skipped
    step with no loss."""
    rng = np.random.default_rng(7)
    out.mkdir()
    for corpus in ("text", "zipf"):
        for variant, offset in (("native", 0.0), ("cce", 0.003)):
            for seed in (1, 2, 3):
                lines = []
                for step in range(1, 61):
                    loss = 3 + 5 * np.exp(-step / 9) + offset + 1e-3 * rng.standard_normal()
                    record = {"step": step, "loss": float(np.float32(loss)),
                              "step_s": float(rng.uniform(0.05, 0.07)), "lr": 1e-3,
                              "peak_gib": [1.5], "skipped": False}
                    if step == 17 and seed == 2:
                        record.update(loss=None, skipped=True)
                    if step % 20 == 0:
                        record.update(valid_loss=loss + 0.05 * rng.random(),
                                      valid_unseen_loss=12 + rng.random(),
                                      valid_unseen_targets=9, eval_s=0.3)
                    if step in (1, 30, 60):
                        err = float(rng.uniform(1e-3, 3e-3))
                        record["probe"] = {
                            "tokens": 8192, "unseen_mass": float(rng.uniform(1e-4, 1e-3)),
                            "grad_rel_err": {"gemm": {"input": err, "weight": err / 2},
                                             "tiles_paper": {"input": 0.3, "weight": 0.1}}}
                    if step == 30 and seed == 3:
                        record["probe"] = {"error": "RuntimeError: out of memory"}
                    lines.append(json.dumps(record))
                (out / f"{corpus}_{variant}_s{seed}.jsonl").write_text("\n".join(lines) + "\n")
    batch = {"environment": {"gpu": "stand-in"}, "steps": 60, "overrides": {}, "wall_s": 1.0,
             "runs": [{"name": "text_native_s1", "returncode": 0, "wall_s": 1.0}]}
    (out / "runs.json").write_text(json.dumps(batch))


def test_report_from_compact_file_equals_report_from_logs(tmp_path):
    _logs(tmp_path / "logs")
    compact = tmp_path / "runs.jsonl.gz"
    _script("compact", "--out", str(tmp_path / "logs"), "--dest", str(compact))
    from_logs = _script("report", "--out", str(tmp_path / "logs"), "--dest",
                        str(tmp_path / "a"))
    from_compact = _script("report", "--out", str(compact), "--dest", str(tmp_path / "b"))
    assert from_logs.split("\nwrote")[0] == from_compact.split("\nwrote")[0]
    assert "probe at step 30 failed" in from_compact and "| zipf | cce | 1,2,3 |" in from_compact
    for name in ("final.csv", "summary.md"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert compact.stat().st_size < sum(p.stat().st_size for p in (tmp_path / "logs").iterdir())


def test_committed_records_give_the_pages_numbers(tmp_path):
    """docs/training_equivalence/summary.md (the table of docs/training_equivalence.md) is what
    report writes from the committed runs.jsonl.gz."""
    _script("report", "--out", str(DOCS / "runs.jsonl.gz"), "--dest", str(tmp_path))
    assert (tmp_path / "summary.md").read_text() == (DOCS / "summary.md").read_text()
    assert (tmp_path / "final.csv").read_text() == (DOCS / "final.csv").read_text()
