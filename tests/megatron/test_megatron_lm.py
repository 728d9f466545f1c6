"""Megatron-LM's own argument parsing with the plugin (fused_lce.parallel.megatron_lm), on the CPU.

Megatron-LM is not on any package registry for Python 3.11, and the megatron-core 0.16.1 wheel
CI installs ships megatron/core only. So tests/data/megatron_lm/core_v0.16.1 holds verbatim
copies of the five Megatron-LM files its parser needs (tag core_v0.16.1, the release that pairs
with megatron-core 0.16.1; hashes and licence beside them, checked below), and
tests/data/megatron_lm/stub two small stand-ins of ours for the modules that would pull in the
whole training package (utils: print helpers; global_vars: the global arguments). Where a real
``megatron.training`` is installed (the megatron-core 0.19 wheel on the GPU machines), the tests
run against it instead and the copies are not used.

Each test runs a stand-in for pretrain_gpt.py (tests/data/megatron_lm/standin_pretrain_gpt.py) in
a fresh process: Megatron-LM's parse without a provider (as inprocess_restart does), the script's
own parse and validate_args, then core_transformer_config_from_args.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

DATA = Path(__file__).parents[1] / "data" / "megatron_lm"
COPIES = DATA / "core_v0.16.1"
STANDIN = DATA / "standin_pretrain_gpt.py"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
        "--train-iters", "3", "--vocab-size", "1000", "--tokenizer-type", "NullTokenizer",
        "--mock-data", "--lr", "1e-4", "--transformer-impl", "local"]
CCE = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl"]


def _real_megatron_training() -> bool:
    try:
        return importlib.util.find_spec("megatron.training.arguments") is not None
    except ImportError:
        return False


def _environment() -> dict:
    env = dict(os.environ)
    if _real_megatron_training():
        return env
    from megatron.core import package_info

    if not package_info.__version__.startswith("0.16."):
        pytest.skip(f"the Megatron-LM copies are core_v0.16.1's; megatron-core is "
                    f"{package_info.__version__} and ships no megatron.training")
    paths = [str(DATA / "stub"), str(COPIES), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _run(command: list[str], extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**_environment(), **(extra_env or {})}
    return subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True,
                          timeout=300)


def _seen(result: subprocess.CompletedProcess) -> dict:
    lines = [line for line in result.stdout.splitlines() if line.startswith("STANDIN ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("STANDIN "))


def _plugin(*flags: str) -> subprocess.CompletedProcess:
    return _run(["-m", "fused_lce.parallel.megatron_lm", str(STANDIN), *TINY, *flags])


def test_copies_match_their_recorded_hashes():
    manifest = json.loads((COPIES / "SOURCE.json").read_text())
    assert manifest["tag"] == "core_v0.16.1"
    for path, digest in manifest["sha256"].items():
        assert hashlib.sha256((COPIES / path).read_bytes()).hexdigest() == digest, path
    copied = {p.relative_to(COPIES).as_posix() for p in COPIES.rglob("*.py")}
    assert copied == {p for p in manifest["sha256"] if p.endswith(".py")}


def test_megatron_lm_alone_refuses_cce():
    """The bug this module exists for, reproduced: no provider in the first parse."""
    result = _run([str(STANDIN), *TINY, *CCE, "cce"])
    assert result.returncode == 2
    assert "invalid choice: 'cce'" in result.stderr


@pytest.mark.parametrize("impl", ["cce", "linear"])
def test_python_m_route_reaches_every_parse_and_the_config(impl):
    seen = _seen(_plugin(*CCE, impl, "--cce-softcap", "30", "--cce-keep-logits",
                         "--cce-filter-eps", "none", "--cce-backward", "gemm"))
    assert seen["first_parse"] == seen["validated"] == seen["with_provider"] == impl
    assert seen["config"] == [True, impl] and seen["wants_cce"]
    assert seen["options"] == {"softcap": 30.0, "keep_logits": True, "filter_eps": None,
                               "backward": "gemm"}
    assert seen["gpt_patched"]


@pytest.mark.parametrize("launch", [[], ["-m", "fused_lce.parallel.megatron_lm"]],
                         ids=["plain", "and-python-m"])
def test_one_line_install_route(launch):
    """The script's own install() call; under python -m too, installing twice."""
    seen = _seen(_run([*launch, str(STANDIN), *TINY, *CCE, "cce", "--cce-z-loss", "1e-4",
                       "--cce-scratch-mb", "16"], {"STANDIN_INSTALL": "1"}))
    assert seen["first_parse"] == seen["validated"] == seen["with_provider"] == "cce"
    assert seen["options"] == {"z_loss": 1e-4, "scratch_mb": 16.0} and seen["gpt_patched"]


def _full_iteration_flags() -> list[str]:
    """Megatron-LM's whole-iteration CUDA graphs, as this megatron spells them."""
    from megatron.core import package_info

    major, minor = (int(x) for x in package_info.__version__.split(".")[:2])
    flags = (["--cuda-graph-impl", "full_iteration"] if (major, minor) >= (0, 19)
             else ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"])
    return [*flags, "--no-check-for-nan-in-loss-and-grad"]


@pytest.mark.parametrize("graphs", ["none", "full_iteration", "layers"])
def test_the_ops_own_graphs_are_off_under_full_iteration_graphs(graphs):
    """Megatron's graph replays the loss too: graphs of the op's own would only hold memory.
    Megatron's per-layer graphs leave the loss outside, where the op's own graphs help."""
    flags = {"none": [], "full_iteration": _full_iteration_flags(),
             "layers": ["--cuda-graph-impl", "local"]}[graphs]
    seen = _seen(_plugin(*CCE, "cce", "--cce-softcap", "30", *flags))
    expected = {"softcap": 30.0}
    if graphs == "full_iteration":
        expected["cuda_graphs"] = False
    assert seen["options"] == expected


def test_native_runs_unchanged_under_the_plugin():
    seen = _seen(_plugin(*CCE, "native"))
    assert seen["config"] == [True, "native"] and not seen["wants_cce"]
    assert seen["options"] == {}


@pytest.mark.parametrize("flags, message", [
    ([*CCE, "cce", "--cce-softcap", "-1"], "--cce-softcap -1.0: softcap must be"),
    ([*CCE, "cce", "--cce-keep-logits", "--cce-backward", "tiles"],
     "--cce-keep-logits needs the gemm backward"),
    ([*CCE, "native", "--cce-z-loss", "1e-4"], "--cce-z-loss: these act on fused_lce's loss"),
    ([*CCE, "cce", "--cce-impl", "fast"], "argument --cce-impl: invalid choice"),
])
def test_bad_cce_flags_fail_at_the_first_parse(flags, message):
    result = _plugin(*flags)
    assert result.returncode != 0 and "STANDIN" not in result.stdout
    assert message in result.stderr, result.stderr[-2000:]
    assert "end of arguments" not in result.stdout  # refused before validate_args ran


def test_usage_without_a_script():
    result = subprocess.run([sys.executable, "-m", "fused_lce.parallel.megatron_lm"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "usage: python -m fused_lce.parallel.megatron_lm" in \
        result.stdout


def _log(losses, peak_by_rank, times=None):
    lines = ["> building NullTokenizer tokenizer ..."]
    for step, loss in enumerate(losses, 1):
        ms = (times or {}).get(step, 150.0)
        lines.append(f" [2026-11-23 12:00:{step:02d}] iteration {step:8d}/{len(losses):8d} | "
                     f"consumed samples: {2 * step:12d} | elapsed time per iteration (ms): "
                     f"{ms:.1f} | learning rate: 3.000000E-04 | global batch size: 2 | "
                     f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: 1.234 |")
    for rank, mib in peak_by_rank.items():
        lines.append(f"[Rank {rank}] (after {len(losses)} iterations) memory (MB) | allocated: "
                     f"100.00 | max allocated: {mib:.2f} | reserved: 9.00 | max reserved: 9.00")
    return "\n".join(lines) + "\n"


def test_gpu_run_report_reads_megatron_log_lines(tmp_path, capsys):
    from lce_train import megatron_lm_report as report

    cce = [11.0 - 0.1 * i for i in range(30)]
    (tmp_path / "tp2_cce.log").write_text(_log(cce, {0: 5000.0, 1: 5120.0}, {1: 9000.0}))
    (tmp_path / "tp2_unfused.log").write_text(_log([c + 0.01 for c in cce], {0: 6144.0}))
    (tmp_path / "tp2_native.log").write_text("Traceback: out of memory\n")
    report.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "### tp2" in out
    assert "| cce | 30 | 8.10000 | 8.55000 | -0.01000 | 5.00 | 150.0 |" in out
    assert "| native | no result (see tp2_native.log)" in out
    assert "| unfused | 30 | 8.11000 | 8.56000 | +0.00000 | 6.00 | 150.0 |" in out


def test_gpu_run_script_is_valid_bash():
    script = Path(__file__).parents[2] / "scripts" / "megatron_lm_gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_step_report_reads_rounds_and_compares_graphs_with_eager(tmp_path, capsys):
    """scripts/megatron_lm_step.sh's table: per-round medians past --skip, the peak of any rank,
    and a graphed run's largest loss difference from the eager run of its round."""
    from lce_train import megatron_lm_report as report

    losses = [11.0 - 0.1 * i for i in range(20)]
    eager = _log(losses, {0: 2646.0}, {i: 900.0 if i <= 10 else 130.0 for i in range(1, 21)})
    graphs = _log([x + (0.25 if i == 15 else 0.0) for i, x in enumerate(losses)],
                  {0: 2735.0, 1: 2700.0}, {i: 48.0 for i in range(1, 21)})
    (tmp_path / "tp4__cce__r1.log").write_text(eager)
    (tmp_path / "tp4__cce_graphs__r1.log").write_text(graphs)
    report.main([str(tmp_path), "--step", "--skip", "10"])
    out = capsys.readouterr().out
    assert "| native | no result (tp4__native__r*.log)" in out
    assert "| cce | 130.0 | 130.0 | 130.0-130.0 | 2646 |" in out
    assert "| cce_graphs | 48.0 | 48.0 | 48.0-48.0 | 2735 |" in out
    assert out.rstrip().endswith("| 2.50e-01 |")


def test_step_report_lists_cce_without_its_graphs_only_where_run(tmp_path, capsys):
    """LOSSES="... cce_eager" (--cce-no-cuda-graphs) gets its own row, after cce's; a results
    folder without such logs gets none."""
    from lce_train import megatron_lm_report as report

    losses = [11.0 - 0.1 * i for i in range(20)]
    times = {i: 130.0 for i in range(1, 21)}
    (tmp_path / "tp4__cce__r1.log").write_text(_log(losses, {0: 2646.0}, times))
    report.main([str(tmp_path), "--step", "--skip", "10"])
    assert "cce_eager" not in capsys.readouterr().out
    slower = {i: 140.0 for i in range(1, 21)}
    (tmp_path / "tp4__cce_eager__r1.log").write_text(_log(losses, {0: 2646.0}, slower))
    report.main([str(tmp_path), "--step", "--skip", "10"])
    rows = [line.split(" |")[0] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| cce")]
    assert rows == ["| cce", "| cce_graphs", "| cce_eager"]


def test_step_script_is_valid_bash():
    script = Path(__file__).parents[2] / "scripts" / "megatron_lm_step.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_full_iteration_batches_are_copies_get_batch_may_edit():
    """Under full-iteration graphs megatron-core 0.19's get_batch sets the fields a pipeline
    stage does not use to None in the dict the static loader hands it; the loader's buffer must
    keep its tensors for the next step's copy."""
    from fused_lce.parallel import megatron_lm

    buffer = {"tokens": torch.arange(4), "labels": torch.arange(4)}
    load = megatron_lm._handing_out_batch_copies(lambda inputs, stage, microbatch: buffer)
    batch = load({}, "training", 0)
    assert batch["labels"] is buffer["labels"]
    batch["labels"] = None  # as get_batch_on_this_tp_rank on the first stage
    assert buffer["labels"] is not None
