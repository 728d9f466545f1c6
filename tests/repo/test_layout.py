"""The package layout rules, read from the source with ``ast``, in about a second.

The op (``fused_lce/``, and ``parallel/`` installed as ``fused_lce.parallel``) never imports the
training package ``lce_train`` (``scripts/lce_train/``), and its single-device part imports no
``torch.distributed`` and no megatron; scripts/*.py are command lines that import library code,
never one another; tests import packages, never scripts/ through ``sys.path``; every model
config is shipped in the wheel; and nothing imports megatron-core at import time.
"""

from __future__ import annotations

import ast
import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` statement of ``path`` names, wherever it stands (lazy imports
    inside functions count); relative imports are left out (they stay inside their package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _python_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def _named(modules: set[str], *roots: str) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in roots or m in roots
                  or any(m.startswith(r + ".") for r in roots))


@pytest.mark.parametrize("folder", ["fused_lce", "parallel"])
def test_the_op_never_imports_the_training_package(folder):
    offenders = {str(p.relative_to(ROOT)): _named(_imported_modules(p), "lce_train", "configs")
                 for p in _python_files(ROOT / folder)}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_single_device_op_imports_no_distributed_code():
    offenders = {str(p.relative_to(ROOT)): _named(_imported_modules(p), "megatron",
                                                   "torch.distributed", "fused_lce.parallel")
                 for p in _python_files(ROOT / "fused_lce")}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_scripts_import_no_other_script():
    scripts = sorted(SCRIPTS.glob("*.py"))
    stems = {p.stem for p in scripts}
    assert {"pretrain_gpt", "bench_lce", "demo_lce"} <= stems
    offenders = {p.name: sorted(_imported_modules(p) & stems) for p in scripts}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def _touches_sys_path(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "path" \
                and isinstance(node.value, ast.Name) and node.value.id == "sys":
            return True
    return False


def test_tests_import_packages_not_scripts():
    tests = _python_files(ROOT / "tests")
    script_stems = {p.stem for p in SCRIPTS.glob("*.py")}
    assert not [p.name for p in tests if _touches_sys_path(p)]
    offenders = {p.name: sorted(_imported_modules(p) & script_stems) for p in tests}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def _setup_keyword(name: str):
    """A keyword argument of setup.py's ``setup(...)`` call, as a literal."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for keyword in node.keywords:
                if keyword.arg == name:
                    return ast.literal_eval(keyword.value)
    raise AssertionError(f"setup.py's setup() has no {name}=")


def test_every_config_file_is_package_data():
    """A YAML file under configs/ that the package data patterns miss would be absent from a
    wheel: ``known_models()`` would not list it there."""
    package_dir = _setup_keyword("package_dir")
    patterns = _setup_keyword("package_data")["lce_train.configs"]
    assert package_dir["lce_train.configs"] == "configs"
    assert package_dir["lce_train"] == "scripts/lce_train"
    configs = ROOT / "configs"
    files = [p.relative_to(configs).as_posix() for p in configs.rglob("*")
             if p.is_file() and p.suffix in (".yaml", ".yml")]
    assert files
    missed = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)]
    assert not missed, f"configs/ files outside setup.py's package_data {patterns}: {missed}"


def test_known_models_lists_every_model_file():
    from lce_train.configs import CONFIG_DIR, known_models, load_model_config

    names = known_models()
    assert names == sorted(p.stem for p in (ROOT / "configs" / "models").glob("*.yaml"))
    assert CONFIG_DIR.resolve() == (ROOT / "configs").resolve()
    assert load_model_config("tiny").vocab_size > 0


def test_everything_imports_without_megatron():
    """Importing the op pulls in neither the training package nor megatron-core; every module
    of the training package imports without megatron-core (it is an extra, imported where it is
    used)."""
    modules = sorted(p.stem for p in (SCRIPTS / "lce_train").glob("*.py") if p.stem != "__init__")
    code = f"""
import sys
sys.modules["megatron"] = None  # importing megatron now raises ImportError
import fused_lce, fused_lce.parallel, fused_lce.parallel.megatron
assert not [m for m in sys.modules if m.startswith("lce_train")], "the op imported lce_train"
import importlib
for name in {modules!r}:
    importlib.import_module("lce_train." + name)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
