"""Every documented command works from the wheel, and the checkout's scripts with it.

Fast checks read the source: each ``lce_train`` tool (a module with ``main``) runs as
``python -m lce_train.<tool>`` and has a console script in setup.py; each script that imports
``lce_train`` drops its own folder from ``sys.path``, where ``scripts/lce_train/`` (the source,
without the ``configs`` that the install maps in) would hide the installed package.

The slow part builds the wheel from a copy of the sources (``--no-deps``, and without network
where this environment's setuptools builds wheels: ``--no-build-isolation``), installs it alone
into a fresh virtual environment, then lends that environment this interpreter's site-packages
(torch, megatron-core) through a ``.pth`` file written after the install, so pip never sees the
checkout's own install. From a folder outside the checkout it runs each console script's
``--help``, the memory study on the tiny config, and the checkout's scripts that a review on
2026-11-26 found broken. About 40 s on two cores.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    return {"bin": venv / "bin", "python": str(python), "cwd": outside, "env": env}


def _run(wheel_env: dict, *cmd: str) -> str:
    proc = subprocess.run(list(cmd), cwd=wheel_env["cwd"], env=wheel_env["env"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_the_wheel_holds_the_packages_and_the_configs(wheel_env):
    out = _run(wheel_env, wheel_env["python"], "-c",
               "import fused_lce, lce_train, lce_train.configs as c; "
               "print(fused_lce.__file__, lce_train.__file__, len(c.known_models()))")
    op, train, models = out.split()
    assert "site-packages" in op and "site-packages" in train and str(ROOT) not in out
    assert int(models) == len(list((ROOT / "configs" / "models").glob("*.yaml")))


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(_console_scripts()))
def test_console_script_help(wheel_env, command):
    out = _run(wheel_env, str(wheel_env["bin"] / command), "--help")
    assert out.startswith("usage:"), out[:500]


@pytest.mark.slow
def test_the_memory_study_runs_from_the_wheel(wheel_env):
    csv = wheel_env["cwd"] / "study" / "tiny.csv"
    out = _run(wheel_env, wheel_env["python"], "-m", "lce_train.pp_memory_balance",
               "--config", "tiny", "--pipeline-model-parallel-size", "2", "--csv", str(csv))
    assert out.startswith("tiny: TP1 PP2"), out[:500]
    assert "rebalanced" in out and csv.read_text().startswith("loss,split,stage")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["pretrain_gpt", "pp_memory_balance", "compare_losses",
                                    "max_micro_batch", "training_equivalence", "bench_parallel"])
def test_checkout_scripts_run_with_the_wheel(wheel_env, script):
    out = _run(wheel_env, wheel_env["python"], str(ROOT / "scripts" / f"{script}.py"), "--help")
    assert out.startswith("usage:"), out[:500]
