"""scripts/import_graph.py: the rules of docs/architecture.md hold on our packages, and each rule
catches a break in a small package tree built to break it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "import_graph.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60)


def test_our_packages_keep_the_rules():
    result = _run("--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "NEW" not in result.stdout


def test_graph_shows_every_module_and_resolves_relative_imports():
    text = _run("--format", "text").stdout
    lines = dict(line.split(": ", 1) for line in text.splitlines())
    for module in ("fused_lce.api [op]", "fused_lce.kernels.lse_forward [kernels]",
                   "fused_lce.parallel.vocab_parallel [parallel]"):
        assert module in lines, text
    # `from . import comm` inside parallel/, installed as fused_lce.parallel.
    assert "fused_lce.parallel.comm" in lines["fused_lce.parallel.vocab_parallel [parallel]"]
    # A lazy import (inside a function) is marked as such.
    assert "fused_lce.triton_shard (lazy)" in lines["fused_lce.api [op]"]
    mermaid = _run().stdout
    assert mermaid.startswith("flowchart TD")
    assert mermaid.count("\n  end\n") == mermaid.count("subgraph ") >= 3
    assert "fused_lce_api -.-> fused_lce_triton_shard" in mermaid


# A tree that breaks every rule once; parallel/ is installed as fused_lce.parallel as ours is.
BROKEN_TREE = {
    "setup.py": (
        "from setuptools import setup\n"
        "setup(name='x', packages=['fused_lce', 'fused_lce.kernels', 'fused_lce.parallel',\n"
        "      'training'], package_dir={'fused_lce': 'fused_lce',\n"
        "      'fused_lce.parallel': 'parallel'})\n"),
    "fused_lce/__init__.py": "from .api import loss\n",
    "fused_lce/api.py": "import torch.distributed as dist\n\ndef loss():\n    pass\n",
    "fused_lce/first.py": "from . import second\n",
    "fused_lce/second.py": "from .first import thing\n",
    # A circle closed by a lazy import is a circle all the same.
    "fused_lce/third.py": "from . import fourth\n",
    "fused_lce/fourth.py": "def strategy():\n    from . import third\n",
    "fused_lce/kernels/__init__.py": "",
    "fused_lce/kernels/tile.py": "def launch():\n    from ..parallel import comm\n",
    "parallel/__init__.py": "",
    "parallel/comm.py": ("from fused_lce.api import loss\n\n"
                         "def send():\n    import training.launch\n"),
    "training/__init__.py": "",
    "training/launch.py": "import megatron.core\nfrom fused_lce.parallel import comm\n",
}


def test_each_rule_catches_its_break(tmp_path):
    for name, source in BROKEN_TREE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    result = _run("--check", "--setup", str(tmp_path / "setup.py"))
    assert result.returncode == 1, result.stdout + result.stderr
    want = {
        "no_collectives_below_parallel": "fused_lce.api -> torch.distributed: NEW",
        "kernels_import_only_kernels": "fused_lce.kernels.tile -> fused_lce.parallel.comm: NEW",
        "op_never_imports_parallel": "fused_lce.kernels.tile -> fused_lce.parallel.comm: NEW",
        "installed_op_never_imports_training": "fused_lce.parallel.comm -> training.launch: NEW",
        "parallel_uses_op_internals_not_front_door": "fused_lce.parallel.comm -> fused_lce.api",
        "no_import_cycles": "fused_lce.first -> fused_lce.second: NEW",
    }
    blocks = result.stdout.split("FAIL ")[1:]
    failed = {block.split("\n", 1)[0]: block for block in blocks}
    assert set(failed) == set(want), result.stdout
    for rule, line in want.items():
        assert line in failed[rule], result.stdout
    assert "fused_lce.fourth -> fused_lce.third: NEW" in failed["no_import_cycles"], \
        result.stdout
    # The training package may import megatron and the parallel layer (its one flag here is
    # the circle parallel/comm.py's lazy import closes).
    for rule, block in failed.items():
        assert rule == "no_import_cycles" or "training.launch ->" not in block, result.stdout


def test_architecture_page_shows_the_current_graph():
    page = (ROOT / "docs" / "architecture.md").read_text()
    drawn = page.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert drawn == _run().stdout, (
        "docs/architecture.md's graph is stale: run "
        "`python scripts/import_graph.py --update-doc docs/architecture.md` and check its "
        "paragraphs still describe the rooms")
