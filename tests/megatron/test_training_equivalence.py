"""lce_train.training_equivalence: the experiment's config, the run matrix, the report.

The config's every command is parsed by the launcher's own parser; the report's target checks
are run on synthetic logs that pass and on logs that must fail; and `run --cpu-smoke` trains two
tiny runs (native and cce, zipf mock data, 3 steps, over gloo) before `report` turns them into
the CSV, the PNGs and the table. About 20 s on two cores, mostly the two runs' start-up.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lce_train import arguments
from lce_train.equivalence_config import DEFAULT_CONFIG, Job, load_experiment
from lce_train.equivalence_logs import read_records, read_runs
from lce_train.equivalence_report import check_targets, summarize
from lce_train.equivalence_run import launcher_flags, prepare_data

pytest.importorskip("megatron.core")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


def _script(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "lce_train.training_equivalence", *argv],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def test_matrix_commands_parse_with_the_launcher(tmp_path):
    exp = load_experiment(DEFAULT_CONFIG)
    assert exp.matrix_variants == ["native", "cce", "cce-paper"] and len(exp.seeds) >= 2
    assert exp.corpora["zipf"]["vocab-size"] >= 256000
    assert exp.corpora["text"]["vocab-size"] >= 131072
    # Stand-in indexed datasets with the text corpus's vocabulary (ids up to 131071).
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = exp.corpora["text"]["data"]
    for split in ("train", "valid"):
        path = tmp_path / f"{prefix}_{split}"
        builder = IndexedDatasetBuilder(f"{path}.bin", dtype=np.int32)
        builder.add_document(np.arange(0, 131072, 7), [len(range(0, 131072, 7))])
        builder.finalize(f"{path}.idx")
        Path(f"{path}.json").write_text(json.dumps({"vocab_size": 131072, "dtype": "int32"}))
    data = prepare_data(exp, ["text", "zipf"], tmp_path, tmp_path / "cache")
    flags = {}
    for variant in exp.matrix_variants:
        for corpus in exp.corpora:
            job = Job(corpus, variant, exp.seeds[0])
            flags[job.name] = launcher_flags(exp, job, 50, data, tmp_path / "x.jsonl", {})
            args = arguments.parse_args([*flags[job.name], "--dry-run"])
            assert args.train_iters == 50 and args.bf16 and args.probe_interval
            assert args.eval_interval and args.tensor_model_parallel_size == 1
            assert args.model.num_layers == 8 and args.model.hidden_size == 512
    assert arguments.cce_options(arguments.parse_args(
        [*flags["zipf_cce-paper_s1"], "--dry-run"])) == {"backward": "tiles",
                                                          "filter_eps": "paper"}
    cce = arguments.parse_args([*flags["text_cce_s1"], "--dry-run"])
    assert arguments.cce_options(cce) == {} and cce.valid_data_path is not None
    native = arguments.parse_args([*flags["zipf_native_s1"], "--dry-run"])
    assert not native.uses_cce and native.mock_data and native.padded_vocab_size == 256000

    proc = _script("run", "--out", str(tmp_path / "dry"), "--dry-run", "--steps", "40",
                   "--set", "eval-interval=20")
    assert "12 runs (2 corpora x 3 variants x 2 seeds), 40 steps each" in proc.stdout
    ports = [line.split("--master-port ")[1].split()[0] for line in proc.stdout.splitlines()
             if "--master-port" in line]
    assert len(ports) == 12 == len(set(ports))
    assert proc.stdout.count("--eval-interval 20") == 12
    # The comparisons the targets need come first (two waves on 4 GPUs), cce-paper last.
    order = [line.split(":")[0] for line in proc.stdout.splitlines() if "--master-port" in line]
    assert {n.split("_")[1] for n in order[:8]} == {"native", "cce"}
    assert all("_cce-paper_" in n for n in order[8:])


def _fake_logs(out: Path, delta: float = 0.002, gemm_err: float = 2e-3,
               paper_gemm_err: float | None = None) -> None:
    """Logs of 100 steps for 2 corpora x 2 variants x 2 seeds; cce sits ``delta`` above native.

    With ``paper_gemm_err``, cce-paper runs too, 1 nat above, their probes that far off."""
    rng = np.random.default_rng(0)
    variants = [("native", 0.0, gemm_err), ("cce", delta, gemm_err)]
    if paper_gemm_err is not None:
        variants.append(("cce-paper", 1.0, paper_gemm_err))
    for corpus in ("text", "zipf"):
        for variant, offset, gemm_err in variants:
            for seed in (1, 2):
                lines = []
                for step in range(1, 101):
                    loss = 3.0 + 5.0 * np.exp(-step / 10) + offset + 0.001 * seed
                    record = {"step": step, "loss": loss + 1e-3 * rng.standard_normal(),
                              "step_s": 0.05}
                    if step % 25 == 0:
                        record.update(valid_loss=loss + 0.05, valid_unseen_loss=12.0,
                                      valid_unseen_targets=9)
                    if step in (1, 50, 100):
                        errors = {"gemm": {"input": gemm_err, "weight": gemm_err / 2},
                                  "tiles_paper": {"input": 0.3, "weight": 0.05}}
                        record["probe"] = {"grad_rel_err": errors, "unseen_mass": 1e-3}
                    lines.append(json.dumps(record))
                (out / f"{corpus}_{variant}_s{seed}.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("case, delta, gemm_err, failing", [
    ("equal", 0.002, 2e-3, []),
    ("loss apart", 0.02, 2e-3, ["final train loss", "final valid loss"]),
    ("gradient off", 0.002, 2e-2, ["grad rel. err"]),
], ids=["pass", "loss-fails", "grad-fails"])
def test_report_targets(tmp_path, case, delta, gemm_err, failing):
    _fake_logs(tmp_path, delta, gemm_err)
    runs = read_runs(tmp_path)
    assert len(runs) == 8 and runs[0].final_train_loss() == pytest.approx(
        np.mean([r["loss"] for r in runs[0].records[-5:]]))
    targets = load_experiment(DEFAULT_CONFIG).targets
    rows = summarize(runs, targets)
    cce = next(r for r in rows if r["corpus"] == "text" and r["variant"] == "cce")
    assert cce["valid_delta"] == pytest.approx(delta, abs=1e-9)
    assert cce["grad_err_tiles_paper_max"] == 0.3
    checks = check_targets(rows, runs, targets)
    assert len(checks) == 6  # 3 targets x 2 corpora
    failed = [line for ok, line in checks if not ok]
    assert len(failed) == 2 * len(failing), (case, checks)
    for phrase in failing:
        assert sum(phrase in line for line in failed) == 2, (case, failed)


def test_gradient_target_holds_along_the_trained_runs_only(tmp_path):
    """The paper filter's runs reach states the target does not cover: reported, not failed."""
    _fake_logs(tmp_path, paper_gemm_err=5e-2)
    runs = read_runs(tmp_path)
    targets = load_experiment(DEFAULT_CONFIG).targets
    checks = check_targets(summarize(runs, targets), runs, targets)
    assert [ok for ok, _ in checks] == [True, True, True, None] * 2, checks
    assert all("5.00e-02" in line for ok, line in checks if ok is None)


def test_cpu_smoke_run_and_report(tmp_path):
    out = tmp_path / "smoke"
    proc = _script("run", "--cpu-smoke", "--out", str(out), "--corpora", "zipf", "--variants",
                   "native,cce", "--seeds", "1", "--jobs", "2")
    assert "2/2 runs finished" in proc.stdout, proc.stdout
    runs = json.loads((out / "runs.json").read_text())["runs"]
    assert [r["returncode"] for r in runs] == [0, 0]
    for name in ("zipf_native_s1", "zipf_cce_s1"):
        records = read_records(out / f"{name}.jsonl")
        assert [r["step"] for r in records] == [1, 2, 3]
        assert [r["step"] for r in records if "valid_loss" in r] == [2, 3]
        assert [r["step"] for r in records if "probe" in r] == [1, 2, 3]

    report = _script("report", "--out", str(out), "--strict")
    assert "| zipf | cce | 1 | 3 |" in report.stdout
    assert report.stdout.count("PASS") == 3, report.stdout  # fp32 on the CPU: cce == native
    for png in ("loss_zipf.png", "grad_error.png", "unseen.png"):
        assert (out / png).stat().st_size > 10_000
    with open(out / "final.csv") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert abs(float(rows["cce"]["train_delta"])) < 1e-4
    assert float(rows["cce"]["grad_err_gemm_max"]) < 1e-5


def test_deltas_are_paired_by_seed(tmp_path):
    """A variant run on fewer seeds is compared with the reference on those seeds only."""
    _fake_logs(tmp_path, delta=0.004)
    # native seed 3 lies 0.3 above the rest: an unpaired mean would move by 0.1.
    far = [json.loads(line)
           for line in (tmp_path / "text_native_s1.jsonl").read_text().splitlines()]
    for record in far:
        record["loss"] += 0.3
        if "valid_loss" in record:
            record["valid_loss"] += 0.3
    (tmp_path / "text_native_s3.jsonl").write_text("\n".join(map(json.dumps, far)) + "\n")
    targets = load_experiment(DEFAULT_CONFIG).targets
    rows = summarize(read_runs(tmp_path), targets)
    cce = next(r for r in rows if r["corpus"] == "text" and r["variant"] == "cce")
    assert cce["paired_seeds"] == 2 and cce["seeds"] == "1,2"
    assert cce["valid_delta"] == pytest.approx(0.004, abs=1e-9)
    # Seeds 1 and 2 differ by the same amount: no spread.
    assert cce["valid_delta_se"] == pytest.approx(0.0, abs=1e-9)
