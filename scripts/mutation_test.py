#!/usr/bin/env python
"""Mutation testing of the op's core functions: one small edit at a time, each run against the
fast CPU tests that cover its module. A mutant the tests still pass ("survived") is either a gap
in the tests or an edit that changes nothing observable; docs/testing.md lists each survivor with
the test that now kills it or why it is equivalent. Run before a release, not in CI:

    nice -n 10 python scripts/mutation_test.py                 # every module (docs/testing.md)
    python scripts/mutation_test.py --list                     # the mutants, nothing run
    python scripts/mutation_test.py --module engine --max 20   # one module, 20 mutants

The edits, each at one spot inside one function named in ``TARGETS``: a comparison swapped
(== !=, < <=, > >=, is / is not, in / not in), an arithmetic or augmented operator swapped
(+ -, * /, // *, ** *), ``and``/``or`` swapped, a ``not`` or unary minus dropped, a number
changed (n -> n + 1, 0.0 -> 1.0, x -> 2x), True/False swapped, an in-place tensor method dropped
(``x.mul_(s)`` -> ``x``), an expression statement removed. Nothing inside ``raise`` or an
f-string is edited: error messages are tested elsewhere.

The tree is copied to a temporary folder first and only the copy is edited, so the checkout is
never touched. Tests run with the copy first on PYTHONPATH; because the editable install maps
``fused_lce.parallel`` to the checkout's ``parallel/``, the copy gets a ``fused_lce/parallel``
link to its own ``parallel/`` (checked before any mutant runs).

Why our own script: mutmut 3 and cosmic-ray mutate whole modules (every operator of every
function, the Triton kernels included), which at the seconds a mutant costs under Triton's
interpreter is days on two cores; here the functions and the test subset are named per module.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each module's tests: the fast single-device and TP=2 checks against fp64 torch first, then the
# module's own tests. Chosen for speed: a survivor here may still die in the full suite.
_OP = tuple(f"tests/op/test_ignore_index_and_scale.py::test_{name}" for name in (
    "single_device_matches_torch", "every_term_and_the_lse_match_torch",
    "only_the_wanted_gradient"))
_TP2 = ("tests/op/test_ignore_index_and_scale.py::test_vocab_parallel_matches_torch",)
_FG = "tests/op/test_forward_grad.py::test_"
_PLANS = tuple(_FG + name for name in (
    "default_plan_halves_the_tokens_within_the_byte_cap", "explicit_budgets",
    "without_fp32_weight_grad_a_tight_budget_keeps_the_forward_mode",
    "plan_reads_the_scratch_budget_from_the_environment", "upstream_scale",
    "none_with_its_loss_mask_keeps_the_forward_gradients",
    "unexpected_upstream_gradients_are_recomputed_exactly",
    "two_chunks_sum_the_weight_gradient_in_its_dtype",
    "many_chunks_without_fp32_weight_grad_round_per_chunk"))


@dataclass(frozen=True)
class Target:
    functions: tuple[str, ...]  # "name" or "Class.method"
    tests: tuple[str, ...]  # pytest arguments, cheapest first (-x stops at the first failure)


TARGETS: dict[str, Target] = {
    "fused_lce/terms.py": Target(
        ("target_nll", "token_loss", "grad_coefficients", "reduce_tokens",
         "loss_gradient_per_token"),
        (*_OP, "tests/op/test_reference.py")),
    "fused_lce/shard.py": Target(
        ("flat_rows", "global_statistics"),
        (*_OP, *_TP2)),
    "fused_lce/engine.py": Target(
        ("_shard_inputs", "LCEFunction.forward", "LCEFunction.backward", "_partial_dtype"),
        (*_OP, *_TP2)),
    "fused_lce/api.py": Target(("single_device_loss",), (*_OP,)),
    "fused_lce/stored_gradients.py": Target(
        ("scale_stored_gradients", "scaled_gradients", "pad_rows"),
        (*_OP, *_TP2)),
    "fused_lce/token_walk.py": Target(
        ("token_walk_plan", "plan_forward_gradients", "exponentials_apply", "_tile_rows",
         "_chunks", "walk_token_chunks", "lse_nll", "_ChunkGradients.finish",
         "TritonGradientChunks.statistics", "TritonGradientChunks.gradients",
         "ExpGradientChunks.target_logits", "ExpGradientChunks.compute_logits",
         "ExpGradientChunks.gradients", "ExpGradientChunks._idle", "local_targets"),
        (*_OP, *_PLANS, *_TP2, _FG + "exponentials_for_bf16_without_label_smoothing",
         _FG + "rows_out_of_the_exponentials_range_are_recomputed",
         _FG + "one_leaf_alone_gets_its_gradient_from_the_exponentials")),
    "fused_lce/upstream.py": Target(
        ("assumed_token_grad", "upstream_scale"),
        (*_OP, *_PLANS)),
    "fused_lce/chunked.py": Target(
        ("_local_target", "_logit_grad_", "_fold_into_lse_", "vocab_statistics",
         "vocab_backward", "ChunkedShard.statistics", "ChunkedShard.backward",
         "ChunkedGradientChunks.statistics", "ChunkedGradientChunks.gradients",
         "ChunkedGradientChunks.finish"),
        (*_OP, "tests/op/test_chunked.py::test_all_tokens_ignored",
         "tests/op/test_chunked.py::test_num_classes_padding_rows_get_zero_grad", *_TP2)),
    "fused_lce/triton_shard.py": Target(
        ("prepare_rows",),
        (*_OP, *_PLANS[-2:], *_TP2)),
    "parallel/comm.py": Target(
        ("all_reduce_max_", "all_reduce_sum_", "all_gather_first_dim",
         "reduce_scatter_first_dim", "GroupReducer.gather_input",
         "GroupReducer.reduce_input_grad"),
        _TP2),
    "parallel/vocab_parallel.py": Target(
        ("vocab_parallel_linear_cross_entropy", "_check_call"),
        (*_TP2, "tests/parallel/test_parallel.py::test_bad_inputs_raise_on_every_rank",
         "tests/parallel/test_parallel.py::test_matches_single_device[tp2]")),
}

_COMPARE = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt,
            ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
            ast.In: ast.NotIn, ast.NotIn: ast.In}
_ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
          ast.FloorDiv: ast.Mult, ast.Pow: ast.Mult}


@dataclass
class Mutant:
    path: str
    function: str
    line: int
    before: str  # the original source of the edited node (its first line)
    after: str
    start: tuple[int, int]  # (line, col) of the node, 1-based line
    end: tuple[int, int]
    outcome: str = "not run"  # killed | survived | timeout
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------
# Finding mutants
# ---------------------------------------------------------------------------------------------


def _functions(tree: ast.Module, names: tuple[str, ...]) -> dict[str, ast.AST]:
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                qualname = f"{node.name}.{getattr(item, 'name', '')}"
                if qualname in names:
                    found[qualname] = item
    missing = set(names) - set(found)
    if missing:
        raise SystemExit(f"functions not found: {sorted(missing)}")
    return found


def _editable_nodes(function: ast.AST):
    """Nodes of ``function`` (nested functions included) outside raise statements, f-strings
    and docstrings."""
    skip = set()
    for node in ast.walk(function):
        if isinstance(node, (ast.Raise, ast.JoinedStr)):
            skip.update(id(n) for n in ast.walk(node))
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
            skip.update(id(n) for n in ast.walk(first))
    for node in ast.walk(function):
        if id(node) not in skip and node is not function:
            yield node


def _variants(node: ast.AST) -> list[ast.AST]:
    """The mutated copies of one node (empty for a node we do not edit)."""
    out = []

    def swapped(**fields):
        new = copy.deepcopy(node)
        for key, value in fields.items():
            setattr(new, key, value)
        return new

    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        out.append(swapped(ops=[_COMPARE[type(node.ops[0])]()]))
    elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _ARITH:
        out.append(swapped(op=_ARITH[type(node.op)]()))
    elif isinstance(node, ast.BoolOp):
        out.append(swapped(op=ast.Or() if isinstance(node.op, ast.And) else ast.And()))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        out.append(node.operand)
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        out.append(ast.Constant(not node.value))
    elif isinstance(node, ast.Constant) and isinstance(node.value, int):
        out.append(ast.Constant(node.value + 1))
    elif isinstance(node, ast.Constant) and isinstance(node.value, float):
        out.append(ast.Constant(1.0 if node.value == 0.0 else 2.0 * node.value))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr.endswith("_") and not node.func.attr.startswith("_")):
        out.append(node.func.value)  # x.mul_(s) -> x
    elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        out.append(ast.Pass())
    return out


def find_mutants(path: str, functions: tuple[str, ...], source: str) -> list[Mutant]:
    tree = ast.parse(source)
    lines = source.splitlines()
    mutants, seen = [], set()
    for name, function in _functions(tree, functions).items():
        for node in _editable_nodes(function):
            for new in _variants(node):
                text = ast.unparse(new)
                if not isinstance(node, ast.stmt):
                    text = f"({text})"
                key = (node.lineno, node.col_offset, text)
                if key in seen:
                    continue
                seen.add(key)
                before = lines[node.lineno - 1][node.col_offset:]
                if node.end_lineno == node.lineno:
                    before = before[: node.end_col_offset - node.col_offset]
                mutants.append(Mutant(path, name, node.lineno, before.strip(), text,
                                      (node.lineno, node.col_offset),
                                      (node.end_lineno, node.end_col_offset)))
    return mutants


def apply(source: str, mutant: Mutant) -> str:
    """``source`` with the mutant's node replaced by its new text."""
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))

    def offset(position):  # (1-based line, UTF-8 column) -> index into the text
        line, col = position
        return offsets[line - 1] + len(lines[line - 1].encode()[:col].decode())

    return source[: offset(mutant.start)] + mutant.after + source[offset(mutant.end):]


# ---------------------------------------------------------------------------------------------
# Running them
# ---------------------------------------------------------------------------------------------


def make_copy(dest: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", ".ruff_cache",
                                    ".pytest_cache", "build")
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    link = dest / "fused_lce" / "parallel"
    if not link.exists():
        link.symlink_to("../parallel")
    return dest


def use_tree(tree: Path) -> None:
    """Make ``tree`` what this process (and every process it starts) imports."""
    paths = [str(tree), str(tree / "scripts")]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    sys.path[:0] = paths
    code = "import fused_lce, fused_lce.parallel; print(fused_lce.__file__, " \
           "fused_lce.parallel.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True,
                         text=True, check=True).stdout.split()
    if not all(Path(p).resolve().is_relative_to(tree.resolve()) for p in out):
        raise SystemExit(f"the copy is not what gets imported: {out}")


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float]:
    """pytest in a forked child (torch and Triton are imported once, here; the package is
    imported afresh in each child, from the mutated copy), killed with its process group
    after ``timeout`` seconds."""
    import pytest  # noqa: F401 -- with torch, what every child inherits ready

    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setpgid(0, 0)
            os.chdir(tree)
            log = os.open(tree.parent / "pytest.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-W", "ignore", *tests])
        finally:
            os._exit(int(code))
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            outcome = "survived" if os.waitstatus_to_exitcode(status) == 0 else "killed"
            return outcome, time.monotonic() - start
        if time.monotonic() - start > timeout:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.monotonic() - start
        time.sleep(0.2)


def select(mutants: list[Mutant], limit: int | None, seed: int) -> list[Mutant]:
    """At most ``limit`` of them, a seeded sample in source order."""
    if limit is None or len(mutants) <= limit:
        return mutants
    picked = random.Random(seed).sample(range(len(mutants)), limit)
    return [mutants[i] for i in sorted(picked)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--module", action="append", default=None,
                   help="a module of TARGETS by stem or path (repeatable; default: all)")
    p.add_argument("--max", type=int, default=60, help="mutants per module at most (a seeded "
                   "sample; 0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--at", action="append", default=None, metavar="PATH:LINE",
                   help="only the mutants on this line, e.g. fused_lce/engine.py:328 "
                        "(repeatable; to rerun survivors)")
    p.add_argument("--tests", nargs="+", default=None,
                   help="pytest arguments instead of the module's (e.g. a survivor against "
                        "more of the suite)")
    p.add_argument("--list", action="store_true", help="print the mutants and exit")
    p.add_argument("--json", type=Path, default=None, help="write every mutant's outcome here")
    p.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = p.parse_args(argv)

    modules = [m for m in TARGETS
               if args.module is None or any(m == s or Path(m).stem == s for s in args.module)]
    if not modules:
        p.error(f"--module must name one of {list(TARGETS)}")
    plan = {}
    for module in modules:
        source = (ROOT / module).read_text()
        found = find_mutants(module, TARGETS[module].functions, source)
        plan[module] = select(found, args.max or None, args.seed)
        if args.at:
            plan[module] = [m for m in found if f"{m.path}:{m.line}" in args.at]
        print(f"{module}: {len(plan[module])} of {len(found)} mutants")
    if args.list:
        for mutants in plan.values():
            for m in mutants:
                print(f"  {m.path}:{m.line} {m.function}: {m.before}  ->  {m.after}")
        return 0

    tree = make_copy(Path(tempfile.mkdtemp(prefix="mutation-")) / "tree")
    results = []
    try:
        use_tree(tree)
        import torch  # noqa: F401 -- imported once, before the children fork
        import triton  # noqa: F401
        for module, mutants in plan.items():
            tests, target = tuple(args.tests or TARGETS[module].tests), tree / module
            original = target.read_text()
            outcome, baseline = run_tests(tree, tests, timeout=1800)
            if outcome != "survived":
                log = (tree.parent / "pytest.log").read_text()[-3000:]
                raise SystemExit(f"{module}: the tests fail without a mutant ({outcome}):\n{log}")
            timeout = max(60.0, 3.0 * baseline)
            print(f"{module}: tests pass in {baseline:.0f} s; mutant timeout {timeout:.0f} s")
            for i, m in enumerate(mutants, 1):
                mutated = apply(original, m)
                try:
                    compile(mutated, module, "exec")
                except SyntaxError:
                    m.outcome = "invalid"
                    continue
                target.write_text(mutated)
                try:
                    m.outcome, m.seconds = run_tests(tree, tests, timeout)
                finally:
                    target.write_text(original)
                mark = "SURVIVED " if m.outcome == "survived" else ""
                print(f"  [{i}/{len(mutants)}] {mark}{m.outcome} {m.seconds:.0f}s "
                      f"{module}:{m.line} {m.before} -> {m.after}", flush=True)
            results += mutants
    finally:
        if args.keep:
            print(f"copy kept at {tree}")
        else:
            shutil.rmtree(tree.parent, ignore_errors=True)

    print("\nmodule                         killed  timeout  survived")
    for module in plan:
        counts = {k: sum(m.outcome == k for m in plan[module])
                  for k in ("killed", "timeout", "survived")}
        print(f"{module:30} {counts['killed']:6} {counts['timeout']:8} {counts['survived']:9}")
    survivors = [m for m in results if m.outcome == "survived"]
    for m in survivors:
        print(f"survived: {m.path}:{m.line} ({m.function}) {m.before}  ->  {m.after}")
    if args.json:
        args.json.write_text(json.dumps([asdict(m) for m in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
