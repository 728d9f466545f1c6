"""Every documented command works from the wheel, and the checkout's scripts with it.

Fast checks read the source: each ``lce_train`` tool (a module with ``main``) runs as
``python -m lce_train.<tool>`` and has a console script in setup.py, and each console script has
a job below; each script that imports ``lce_train`` drops its own folder from ``sys.path``, where
``scripts/lce_train/`` (the source, without the ``configs`` that the install maps in) would hide
the installed package.

The slow part builds the wheel from a copy of the sources (``--no-deps``, and without network
where this environment's setuptools builds wheels: ``--no-build-isolation``), installs it alone
into a fresh virtual environment, then lends that environment this interpreter's site-packages
(torch, megatron-core) through a ``.pth`` file written after the install, so pip never sees the
checkout's own install. From a folder outside the checkout, with relative paths where a user
would type them, it runs each console script's smallest real job on the CPU (``JOBS``), under
torchrun where the tool wants ranks, and the checkout's launcher script with the wheel. Jobs of
tools built on megatron-core skip where it is absent. About 2 minutes on two cores.
"""

from __future__ import annotations

import ast
import csv
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "scripts" / "lce_train"
SOURCES = ("setup.py", "fused_lce", "parallel", "configs", "scripts/lce_train")


def _console_scripts() -> dict[str, str]:
    """setup.py's ``console_scripts``: command name -> ``module:function``."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            entries = ast.literal_eval(node.value)["console_scripts"]
            return dict((part.strip() for part in e.split("=")) for e in entries)
    raise AssertionError("setup.py has no entry_points=")


def _tools() -> dict[str, ast.Module]:
    """lce_train modules that define a top-level ``main``, by module name."""
    tools = {}
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            tools[f"lce_train.{path.stem}"] = tree
    return tools


def _runs_as_main(tree: ast.Module) -> bool:
    last = tree.body[-1]
    return isinstance(last, ast.If) and "__main__" in ast.unparse(last.test)


def test_every_tool_runs_as_a_module_and_has_a_console_script():
    tools = _tools()
    assert {"lce_train.training", "lce_train.compare_losses", "lce_train.pp_memory_balance",
            "lce_train.build_token_file"} <= set(tools)
    assert not [m for m, tree in tools.items() if not _runs_as_main(tree)]
    targets = _console_scripts().values()
    assert all(t.endswith(":main") for t in targets), targets
    assert sorted(t.split(":")[0] for t in targets) == sorted(tools)


def _imports_lce_train(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lce_train":
            return True
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "lce_train"
                                                for a in node.names):
            return True
    return False


def _sys_path_edits(tree: ast.Module) -> set[str]:
    """``filter`` for an assignment to ``sys.path[:]``, else the ``sys.path`` method called."""
    edits = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "sys.path[:]":
            edits.add("filter")
        elif isinstance(node, ast.Call) and ast.unparse(node.func).startswith("sys.path."):
            edits.add(ast.unparse(node.func).removeprefix("sys.path."))
    return edits


def test_scripts_import_the_installed_packages():
    """A script importing lce_train with its own folder on sys.path would get the source folder,
    which has no ``configs``: with a wheel installed, ``No module named 'lce_train.configs'``;
    one putting the checkout's root first would get ``fused_lce`` without ``parallel``."""
    offenders = {}
    for path in sorted((ROOT / "scripts").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        wanted = {"filter"} if _imports_lce_train(tree) else set()
        if _sys_path_edits(tree) != wanted:
            offenders[path.name] = sorted(_sys_path_edits(tree))
    assert not offenders


def _builds_wheels_here() -> bool:
    """Whether this environment's setuptools can build the wheel without fetching a build
    environment: setuptools 70.1+ has ``bdist_wheel``, older ones need the ``wheel`` package."""
    try:
        from setuptools.command import bdist_wheel  # noqa: F401
    except ImportError:
        return importlib.util.find_spec("wheel") is not None
    return True


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory) -> dict:
    """A fresh virtual environment holding only our wheel, plus this interpreter's packages."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    offline = ["--no-build-isolation"] if _builds_wheels_here() else []
    subprocess.run([*pip, "wheel", "--no-deps", *offline, "-q", "-w", str(tmp / "dist"),
                    str(source)], check=True, timeout=300)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    (wheel,) = (tmp / "dist").glob("fused_lce-*.whl")
    subprocess.run([*pip, "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, timeout=300)
    lent = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "lent_packages.pth").write_text("\n".join(dict.fromkeys(lent)) + "\n")
    outside = tmp / "elsewhere"
    outside.mkdir()
    # TRITON_INTERPRET off: a tool that runs the kernels on the CPU must ask for the interpreter
    # itself (lce-bench-parallel --cpu-smoke does), as it must for a user who never heard of it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["OMP_NUM_THREADS"] = "1"
    return {"bin": venv / "bin", "python": str(python), "cwd": outside, "env": env}


def _run(wheel_env: dict, *cmd: str, expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=wheel_env["cwd"], env=wheel_env["env"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, (f"{' '.join(map(str, cmd))}: exit {proc.returncode}\n"
                                       f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def _script(wheel_env: dict, command: str, *args: str, expect: int = 0
            ) -> subprocess.CompletedProcess:
    return _run(wheel_env, wheel_env["bin"] / command, *args, expect=expect)


def _torchrun(wheel_env: dict, ranks: int, command: str, *args: str
              ) -> subprocess.CompletedProcess:
    """The console script under torchrun (``--no-python``: the script is the program), as its
    help tells a user to start it. torchrun's own console script is not in this environment (torch
    is lent), so its module runs it."""
    return _run(wheel_env, wheel_env["python"], "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(ranks), "--no-python", wheel_env["bin"] / command, *args)


def _needs_megatron() -> None:
    pytest.importorskip("megatron.core", reason="the tool is built on megatron-core (the "
                        "[megatron] extra)")


def _job_pretrain_gpt(env: dict) -> None:
    """Two CPU steps of the tiny model on a token file built by lce-build-token-file."""
    _needs_megatron()
    text = env["cwd"] / "text"
    text.mkdir()
    for i in range(4):
        (text / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1  # {'ab' * i}\n")
    built = _script(env, "lce-build-token-file", "--source", "text", "--ext", ".py",
                    "--out", "tokens/text").stdout
    assert "from 4 files" in built and "byte tokenizer" in built, built
    _torchrun(env, 1, "lce-pretrain-gpt", "--config", "tiny", "--train-iters", "2",
              "--data-path", "tokens/text", "--vocab-size", "257", "--seq-length", "16",
              "--micro-batch-size", "2", "--cross-entropy-fusion-impl", "cce",
              "--log-json", "pretrain.jsonl")
    records = [json.loads(line) for line in (env["cwd"] / "pretrain.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2] and all(r["impl"] == "cce" for r in records)
    assert all(0 < r["loss"] < 10 for r in records), records


def _job_build_token_file(env: dict) -> None:
    """A byte-level token file of a small folder: .bin, .idx and the .json the launcher reads."""
    _needs_megatron()
    text = env["cwd"] / "notes"
    text.mkdir()
    (text / "a.txt").write_text("hello wheel\n")
    (text / "b.txt").write_text("a second file\n")
    out = _script(env, "lce-build-token-file", "--source", "notes", "--ext", ".txt",
                  "--out", "notes_tokens").stdout
    assert "from 2 files" in out, out
    meta = json.loads((env["cwd"] / "notes_tokens.json").read_text())
    assert (meta["vocab_size"], meta["files"], meta["tokenizer"]) == (257, 2, "byte")
    assert (env["cwd"] / "notes_tokens.bin").stat().st_size == 2 * meta["num_tokens"]


def _job_compare_losses(env: dict) -> None:
    """Its own two gloo processes: cce, native and unfused over two steps agree."""
    _needs_megatron()
    out = _script(env, "lce-compare-losses", "--steps", "2", "--json", "losses.json").stdout
    assert "(tolerance 1e-04): OK" in out, out
    losses = json.loads((env["cwd"] / "losses.json").read_text())["losses"]
    assert sorted(losses) == ["cce", "native", "unfused"]
    assert all(len(v) == 2 for v in losses.values())


def _job_pp_memory_balance(env: dict) -> None:
    """The predicted study on the tiny config, its CSV and its figure."""
    pytest.importorskip("matplotlib", reason="--png draws with matplotlib (the [plot] extra)")
    out = _script(env, "lce-pp-memory-balance", "--config", "tiny",
                  "--pipeline-model-parallel-size", "2", "--csv", "study/tiny.csv",
                  "--png", "study/tiny.png").stdout
    assert out.startswith("tiny: TP1 PP2"), out[:500]
    assert "rebalanced" in out
    assert (env["cwd"] / "study" / "tiny.csv").read_text().startswith("loss,split,stage")
    assert (env["cwd"] / "study" / "tiny.png").stat().st_size > 10_000


def _job_max_micro_batch(env: dict) -> None:
    """The search over two gloo ranks; the CPU has no peak-memory counter, so the tool must say
    so and leave the figures unset, not report 0 GiB."""
    _needs_megatron()
    out = _torchrun(env, 2, "lce-max-micro-batch", "--config", "tiny",
                    "--tensor-model-parallel-size", "2", "--seq-length", "16",
                    "--cross-entropy-fusion-impl", "cce", "--max-micro-batch", "3",
                    "--out", "mmb.json").stdout
    assert "peak memory not measured on the CPU" in out and "0.00 GiB" not in out, out
    result = json.loads((env["cwd"] / "mmb.json").read_text())
    assert (result["max_micro_batch"], result["capped"]) == (3, True)
    assert result["peak_gib"] is None and result["capacity_gib"] is None


def _job_training_equivalence(env: dict) -> None:
    """``run --cpu-smoke`` on the zipf corpus, one seed of the reference and the candidate side
    by side (the launcher as ``-m lce_train.training``: no checkout needed), into a relative
    folder, then ``report --strict`` on it."""
    _needs_megatron()
    pytest.importorskip("matplotlib", reason="report draws with matplotlib")
    run = _script(env, "lce-training-equivalence", "run", "--cpu-smoke", "--corpora", "zipf",
                  "--variants", "native,cce", "--seeds", "1", "--jobs", "2",
                  "--out", "equivalence").stdout
    assert "2/2 runs finished" in run, run
    out = env["cwd"] / "equivalence"
    for name in ("zipf_native_s1", "zipf_cce_s1"):
        steps = [json.loads(line)["step"] for line in (out / f"{name}.jsonl").open()]
        assert steps == [1, 2, 3], name
    for record in json.loads((out / "runs.json").read_text())["runs"]:
        assert "lce_train.training" in record["command"], record["command"]
    report = _script(env, "lce-training-equivalence", "report", "--out", "equivalence",
                     "--strict").stdout
    assert report.count("PASS") == 3 and "FAIL" not in report, report
    assert (out / "final.csv").exists() and (out / "loss_zipf.png").stat().st_size > 10_000
    # The text corpus's token files are looked for in ./.data by default: a wheel has no
    # checkout, and its install folder is no place for data.
    dry = _script(env, "lce-training-equivalence", "run", "--dry-run", "--corpora", "text",
                  "--variants", "cce", "--seeds", "1", "--out", "dry").stdout
    assert f"--data-path {env['cwd'] / '.data'}/" in dry, dry


def _job_bench_parallel(env: dict) -> None:
    """--cpu-smoke on two gloo ranks, the tiny model only and one timed iteration (the smoke's
    own defaults take every model and provider: many minutes under the interpreter), with the
    kept-logits provider beside the default."""
    _torchrun(env, 2, "lce-bench-parallel", "--cpu-smoke", "--models", "tiny", "--providers",
              "ours", "ours-kept", "--iters", "1", "--warmup", "0", "--out", "bench.csv")
    with open(env["cwd"] / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["provider"], r["tp"], r["sp"]) for r in rows} == {
        (p, tp, sp) for p in ("ours", "ours-kept") for tp, sp in (("1", "off"), ("2", "off"),
                                                                  ("2", "on"))}
    losses = [float(r["loss"]) for r in rows]
    assert max(losses) - min(losses) < 1e-4 * max(losses), losses


def _job_megatron_lm_report(env: dict) -> None:
    """The table of a folder holding one layout's logs, in Megatron-LM's own line format."""
    logs = env["cwd"] / "megatron_lm"
    logs.mkdir()
    for loss, base in (("cce", 11.0), ("native", 11.0)):
        lines = [f" [2026-11-23 12:00:{step:02d}] iteration {step:8d}/{12:8d} | consumed "
                 f"samples: {2 * step:12d} | elapsed time per iteration (ms): 150.0 | learning "
                 f"rate: 3.000000E-04 | global batch size: 2 | lm loss: "
                 f"{base - 0.1 * step:.6E} | loss scale: 1.0 | grad norm: 1.234 |"
                 for step in range(1, 13)]
        lines.append("[Rank 0] (after 12 iterations) memory (MB) | allocated: 100.00 | max "
                     "allocated: 5120.00 | reserved: 9.00 | max reserved: 9.00")
        (logs / f"tp2_{loss}.log").write_text("\n".join(lines) + "\n")
    out = _script(env, "lce-megatron-lm-report", "megatron_lm").stdout
    assert "### tp2" in out and "| cce | 12 | 9.80000 |" in out, out
    assert "| unfused | no result" in out, out


def _job_plot_gpu_suite(env: dict) -> None:
    """A committed 4-GPU result folder (copied: the plot lands beside its CSV) plots; an empty
    folder is a usage error (exit 2) that says what it expected."""
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the [plot] extra)")
    folder = env["cwd"] / "vocab_parallel"
    shutil.copytree(ROOT / "docs" / "benchmarks" / "vocab_parallel_h200x4_202611", folder)
    out = _script(env, "lce-plot-gpu-suite", "parallel", "vocab_parallel").stdout
    assert "| llama3_8b | 4 |" in out, out[-1000:]
    assert (folder / "time_and_memory.png").stat().st_size > 10_000
    (env["cwd"] / "empty").mkdir()
    err = _script(env, "lce-plot-gpu-suite", "parallel", "empty", expect=2).stderr
    assert "no parallel results: expected bench_parallel.csv or runs.csv" in err, err
    assert "Traceback" not in err


# Each console script's smallest real job on the CPU, by command.
JOBS = {
    "lce-pretrain-gpt": _job_pretrain_gpt,
    "lce-build-token-file": _job_build_token_file,
    "lce-compare-losses": _job_compare_losses,
    "lce-pp-memory-balance": _job_pp_memory_balance,
    "lce-max-micro-batch": _job_max_micro_batch,
    "lce-training-equivalence": _job_training_equivalence,
    "lce-bench-parallel": _job_bench_parallel,
    "lce-megatron-lm-report": _job_megatron_lm_report,
    "lce-plot-gpu-suite": _job_plot_gpu_suite,
}


def test_every_console_script_has_a_job():
    assert sorted(JOBS) == sorted(_console_scripts())


@pytest.mark.slow
def test_the_wheel_holds_the_packages_and_the_configs(wheel_env):
    out = _run(wheel_env, wheel_env["python"], "-c",
               "import fused_lce, lce_train, lce_train.configs as c; "
               "print(fused_lce.__file__, lce_train.__file__, len(c.known_models()))").stdout
    op, train, models = out.split()
    assert "site-packages" in op and "site-packages" in train and str(ROOT) not in out
    assert int(models) == len(list((ROOT / "configs" / "models").glob("*.yaml")))


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(JOBS))
def test_console_script_job(wheel_env, command, tmp_path):
    """Each job in a folder of its own outside the checkout (relative paths resolve there)."""
    env = {**wheel_env, "cwd": tmp_path}
    JOBS[command](env)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["pretrain_gpt"])
def test_checkout_scripts_run_with_the_wheel(wheel_env, script):
    out = _run(wheel_env, wheel_env["python"], str(ROOT / "scripts" / f"{script}.py"),
               "--help").stdout
    assert out.startswith("usage:"), out[:500]
