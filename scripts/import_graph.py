#!/usr/bin/env python
"""The import graph of our installed packages, read from the source with ``ast``.

    python scripts/import_graph.py                 # mermaid, for docs/architecture.md
    python scripts/import_graph.py --format text   # one line per module: what it imports
    python scripts/import_graph.py --check         # the rules of docs/architecture.md
    python scripts/import_graph.py --update-doc docs/architecture.md   # redraw its graph

The packages and the folders they come from are read from setup.py (``packages`` and
``package_dir``), so a package added there is drawn without editing this file. Every import
counts, also one inside a function (the lazy imports that keep megatron and Triton optional);
the graph draws those dashed. The rules of docs/architecture.md live here, beside the reader;
tests/repo/test_import_graph.py checks them on every CI run.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A module's room is its longest matching prefix here; a package of setup.py not listed is a
# room of its own, named after the package (the training package, once it exists).
ROOMS = {
    "fused_lce": "op",
    "fused_lce.kernels": "kernels",
    "fused_lce.parallel": "parallel",
}

# Outside packages whose import the rules care about.
DISTRIBUTED = ("torch.distributed", "megatron")


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str  # importing module, e.g. "fused_lce.kernels.tiles_backward"
    target: str  # one of our modules, or the imported name of an outside package
    lazy: bool  # inside a function (or a class body), not at module level
    internal: bool  # ``target`` is one of our modules


def setup_packages(setup_py: Path = ROOT / "setup.py") -> dict[str, Path]:
    """``{package: folder}`` from the literal ``packages`` and ``package_dir`` of setup.py."""
    call = next(node for node in ast.walk(ast.parse(setup_py.read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords
            if kw.arg in ("packages", "package_dir")}
    dirs = args.get("package_dir", {})
    folders = {}
    for package in args["packages"]:
        # A package's folder is its own package_dir entry, else its parent's folder plus its name.
        parent, _, leaf = package.rpartition(".")
        if package in dirs:
            folders[package] = setup_py.parent / dirs[package]
        elif parent in folders:
            folders[package] = folders[parent] / leaf
        else:
            folders[package] = setup_py.parent / package.replace(".", "/")
    return folders


def module_files(packages: dict[str, Path]) -> dict[str, Path]:
    """``{module: file}`` for every .py file directly in each package's folder."""
    modules = {}
    for package, folder in packages.items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def room_of(module: str) -> str:
    matches = [prefix for prefix in ROOMS if module == prefix or module.startswith(prefix + ".")]
    return ROOMS[max(matches, key=len)] if matches else module.split(".")[0]


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest of our modules that ``name`` is or lies in, else None (an outside name)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    edges = set()
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        module_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, path.stem == "__init__", node)
                # ``from . import comm`` imports a module; ``from .api import f`` a name in one.
                names = [f"{base}.{alias.name}" for alias in node.names] if base else []
                names = [n if _resolve(n, modules) == n else base for n in names]
            else:
                continue
            for name in names:
                if name == "__future__":
                    continue
                target = _resolve(name, modules)
                if target != module:
                    edges.add(Edge(module, target or name, id(node) not in module_level,
                                   target is not None))
    return sorted(edges, key=lambda e: (e.source, e.target))


# ---------------------------------------------------------------------------------------------
# The rules (docs/architecture.md). Each returns the edges that break it.
# ---------------------------------------------------------------------------------------------


def _outside(edge: Edge, *names: str) -> bool:
    return not edge.internal and any(edge.target == n or edge.target.startswith(n + ".")
                                     for n in names)


def no_collectives_below_parallel(edges: list[Edge]) -> list[Edge]:
    """The op and its kernels never import torch.distributed or megatron: every collective and
    every megatron call lives in the parallel room (or the training package)."""
    return [e for e in edges if room_of(e.source) in ("op", "kernels")
            and _outside(e, *DISTRIBUTED)]


# The op's pure-torch modules that the kernels' host code shares with the chunked path. They
# import nothing of ours, so a kernel file that uses one still depends on nothing above it.
KERNEL_HELPERS = ("fused_lce.fp32_products", "fused_lce.softmax_merge")


def kernels_import_only_kernels(edges: list[Edge]) -> list[Edge]:
    """A kernel file imports torch, triton, other kernel files and the op's pure-torch helpers
    (``KERNEL_HELPERS``, which import nothing of ours), nothing of the layers above."""
    return [e for e in edges if e.internal and (
        (room_of(e.source) == "kernels" and room_of(e.target) != "kernels"
         and e.target not in KERNEL_HELPERS) or e.source in KERNEL_HELPERS)]


def op_never_imports_parallel(edges: list[Edge]) -> list[Edge]:
    """The single-device op knows nothing of ranks: it never imports the parallel room."""
    return [e for e in edges if room_of(e.source) in ("op", "kernels") and e.internal
            and room_of(e.target) == "parallel"]


def installed_op_never_imports_training(edges: list[Edge]) -> list[Edge]:
    """The op rooms never import the training package (nor scripts/, which is not installed)."""
    op_rooms = ("op", "kernels", "parallel")
    return [e for e in edges if room_of(e.source) in op_rooms and e.internal
            and room_of(e.target) not in op_rooms]


def parallel_uses_op_internals_not_front_door(edges: list[Edge]) -> list[Edge]:
    """The parallel layer builds on the op's engine (options, terms, function, chunked), not on
    its public front door ``fused_lce.api``."""
    return [e for e in edges if room_of(e.source) == "parallel" and e.target == "fused_lce.api"]


def no_import_cycles(edges: list[Edge]) -> list[Edge]:
    """Imports form no cycle, lazy ones (inside a function) included: a lazy import that points
    back up hides a circle a reader still has to walk."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.internal:
            graph.setdefault(e.source, set()).add(e.target)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    # A package's __init__ importing its own submodules is how packages work, not a cycle.
    return [e for e in edges if e.internal and reaches(e.target, e.source)
            and not e.target.startswith(e.source + ".")]


RULES = [
    no_collectives_below_parallel,
    kernels_import_only_kernels,
    op_never_imports_parallel,
    installed_op_never_imports_training,
    parallel_uses_op_internals_not_front_door,
    no_import_cycles,
]

# Edges that break a rule today, each with the reason; tests/repo/test_import_graph.py fails on any
# other. Remove an entry when its edge goes.
KNOWN_BREAKS: dict[tuple[str, str], str] = {}


def broken_rules(edges: list[Edge]) -> dict[str, list[Edge]]:
    return {rule.__name__: broken for rule in RULES if (broken := rule(edges))}


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def mermaid(modules: dict[str, Path], edges: list[Edge]) -> str:
    """A mermaid flowchart: one subgraph per room, dashed arrows for lazy imports, and the
    outside packages the rules watch (torch.distributed, megatron) as nodes of their own."""
    def node(name: str) -> str:
        return name.replace(".", "_")

    lines = ["flowchart TD"]
    for room in dict.fromkeys(room_of(m) for m in modules):
        lines.append(f"  subgraph {room}")
        lines += [f"    {node(m)}[{m}]" for m in modules if room_of(m) == room]
        lines.append("  end")
    arrows = []
    for e in edges:
        if e.internal or _outside(e, *DISTRIBUTED):
            arrow = "-.->" if e.lazy else "-->"
            target = e.target if e.internal else e.target.split(".")[0] + (
                ".distributed" if e.target.startswith("torch.distributed") else "")
            arrows.append(f"  {node(e.source)} {arrow} {node(target)}")
    return "\n".join(lines + list(dict.fromkeys(arrows)))  # one line per distinct arrow


def text(modules: dict[str, Path], edges: list[Edge]) -> str:
    lines = []
    for module in modules:
        mine = [e for e in edges if e.source == module]
        names = [e.target + (" (lazy)" if e.lazy else "") for e in mine]
        lines.append(f"{module} [{room_of(module)}]: " + (", ".join(names) or "-"))
    return "\n".join(lines)


def update_doc(path: Path, graph: str) -> bool:
    """Put ``graph`` into the first mermaid block of ``path``; whether anything changed."""
    text = path.read_text()
    start = text.index("```mermaid\n") + len("```mermaid\n")
    end = text.index("```", start)
    new = text[:start] + graph + "\n" + text[end:]
    path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=["mermaid", "text"], default="mermaid")
    parser.add_argument("--check", action="store_true",
                        help="print each rule's breaks; exit 1 on one not in KNOWN_BREAKS")
    parser.add_argument("--setup", type=Path, default=ROOT / "setup.py",
                        help="the setup.py whose packages to read (default: this repository's)")
    parser.add_argument("--update-doc", type=Path, default=None, metavar="MARKDOWN",
                        help="redraw the first mermaid block of this file")
    args = parser.parse_args(argv)
    modules = module_files(setup_packages(args.setup))
    edges = import_edges(modules)
    if args.update_doc:
        changed = update_doc(args.update_doc, mermaid(modules, edges))
        print(f"{args.update_doc}: {'redrawn' if changed else 'already current'}")
        return 0
    if not args.check:
        print(mermaid(modules, edges) if args.format == "mermaid" else text(modules, edges))
        return 0
    new = 0
    for rule in RULES:
        broken = rule(edges)
        print(f"{'ok  ' if not broken else 'FAIL'} {rule.__name__}")
        for e in broken:
            known = KNOWN_BREAKS.get((e.source, e.target))
            new += known is None
            print(f"       {e.source} -> {e.target}: {known or 'NEW'}")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
