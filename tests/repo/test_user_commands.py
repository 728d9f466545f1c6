"""What a user reads from our commands: their help, their errors, their documented examples.

Each test holds one point a new user tripped over: the examples in scripts/pretrain_gpt.sh's header
pass the launcher's own checks; ``python -m fused_lce.parallel.megatron_lm --help`` lists its
flags; a negated ``--cce-no-*`` flag's help says what the flag sets; a module that Megatron-LM's
``megatron.training`` imports and that is missing is named as such.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fused_lce.parallel import megatron_flags, megatron_lm

ROOT = Path(__file__).resolve().parents[2]


def _header_examples(path: Path) -> list[str]:
    """The commands of a shell script's header comment that run the script itself, one per
    example, continuation lines joined, trailing comments dropped; those eliding flags with
    "..." are left out."""
    header = []
    for line in path.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        header.append(line[1:].strip())
    commands, current = [], ""
    for line in header:
        current += line
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if path.name in current and "..." not in current and "torchrun" not in current:
            commands.append(current.split("  #")[0].strip())
        current = ""
    return commands


def test_pretrain_gpt_sh_examples_pass_their_checks():
    script = ROOT / "scripts" / "pretrain_gpt.sh"
    examples = _header_examples(script)
    assert len(examples) >= 3, examples
    env = {k: v for k, v in os.environ.items() if k not in ("NGPU", "CONFIG", "NNODES")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    for example in examples:
        words = shlex.split(example)
        settings = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
        args = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]
        assert args[0] == "./scripts/pretrain_gpt.sh", example
        proc = subprocess.run(["bash", str(script), *args[1:]], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env={**env, **settings, "DRY_RUN": "1"})
        assert proc.returncode == 0, f"{example}\n{proc.stderr[-2000:]}"
        assert "parallel    world" in proc.stdout, proc.stdout


def test_megatron_lm_help_lists_the_flags():
    proc = subprocess.run([sys.executable, "-m", "fused_lce.parallel.megatron_lm", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "::" not in proc.stdout
    assert proc.stdout.startswith("usage: python -m fused_lce.parallel.megatron_lm SCRIPT.py")
    flags = set(re.findall(r"--cce-[a-z0-9-]+", proc.stdout))
    assert "--cross-entropy-fusion-impl" in proc.stdout
    assert {megatron_flags.cce_flag(name) for name in megatron_flags._option_fields()} <= flags


def test_megatron_lm_without_arguments_prints_usage_and_fails():
    proc = subprocess.run([sys.executable, "-m", "fused_lce.parallel.megatron_lm"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout.startswith("usage:"), proc.stderr


def test_negated_flags_say_what_they_set():
    parser = megatron_flags.add_cce_arguments(argparse.ArgumentParser())
    helps = {flag: action.help for action in parser._actions for flag in action.option_strings}
    negated = [megatron_flags.cce_flag(name) for name, option in
               megatron_flags._option_fields().items() if option.type is bool and option.default]
    assert {"--cce-no-fp32-weight-grad", "--cce-no-cuda-graphs"} <= set(negated)
    for flag in negated:
        name = flag.removeprefix("--cce-no-").replace("-", "_")
        assert helps[flag].startswith(f"Sets {name}=False (default True)."), helps[flag]
        assert parser.parse_args([flag]).__dict__["cce_" + name] is False


@pytest.mark.parametrize("missing, said", [
    ("six", "Megatron-LM's megatron.training imports 'six', which is not installed"),
    ("megatron.training", "needs Megatron-LM's megatron.training"),
])
def test_megatron_lm_names_the_missing_module(tmp_path, monkeypatch, missing, said):
    """A Megatron-LM checkout whose arguments.py imports a module that is not installed."""
    import types

    training = tmp_path / "megatron" / "training"
    training.mkdir(parents=True)
    (training / "arguments.py").write_text("import six\n")
    package = types.ModuleType("megatron.training")
    package.__path__ = [str(training)]
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.delitem(sys.modules, "megatron.training.arguments", raising=False)
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(ImportError, match=re.escape(said)):
        megatron_lm.install()


def test_readme_quick_start_is_two_commands_and_ci_runs_the_second():
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start\n", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^```bash\n(.*?)^```", quick_start, flags=re.S | re.M)
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text()
    (test_command,) = re.findall(r'^TEST_CMD="(.*)"$', ci, flags=re.M)
    assert commands[1].strip().endswith("&& " + test_command)
    assert 'eval "$TEST_CMD"' in ci
