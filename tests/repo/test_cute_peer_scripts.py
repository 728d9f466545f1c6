"""The code that brings the CuTe-DSL peers (QuACK, Liger's CuTe paths) to a GPU benchmark, on
the CPU: scripts/pack_cute_peers.py's patch of QuACK's compile-cache keyer and its split of the
packed compiler, and the benchmark's names for the peers where they are not installed
(lce_train.bench_lce_providers)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from lce_train import bench_lce_providers

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

# The lines of quack-kernels 0.6.5's quack/gemm_runtime/identity.py around the refusal.
IDENTITY = '''def semantic_value_key(value, seen):
    if value is None:
        return value
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return ("torch.dtype", str(value))
    raise TypeError(
        f"epilogue fn depends on {value!r} (type {type(value).__module__}."
        "that changes whenever the traced math would."
    )
'''


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _identity_module(path: Path):
    spec = importlib.util.spec_from_file_location("identity_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quack_patch_keys_unknown_values_by_identity(tmp_path):
    pack = _script("pack_cute_peers")
    identity = tmp_path / "quack" / "gemm_runtime" / "identity.py"
    identity.parent.mkdir(parents=True)
    identity.write_text(IDENTITY)
    with pytest.raises(TypeError, match="epilogue fn depends on"):
        _identity_module(identity).semantic_value_key(object(), set())

    pack.patch_quack(tmp_path)
    pack.patch_quack(tmp_path)  # a second call changes nothing
    assert identity.read_text().count(pack.QUACK_BY_IDENTITY) == 1
    keyer = _identity_module(identity).semantic_value_key
    value = object()
    assert keyer(value, set()) == ("opaque", "builtins", "object", id(value))
    assert keyer(value, set()) != keyer(object(), set())
    assert keyer(None, set()) is None  # what it could key stays keyed as before


def test_quack_patch_refuses_another_keyer(tmp_path):
    pack = _script("pack_cute_peers")
    identity = tmp_path / "quack" / "gemm_runtime" / "identity.py"
    identity.parent.mkdir(parents=True)
    identity.write_text("def semantic_value_key(value, seen):\n    return value\n")
    with pytest.raises(RuntimeError, match="not there once"):
        pack.patch_quack(tmp_path)


def test_split_halves_join_back(tmp_path):
    pack = _script("pack_cute_peers")
    data = bytes(range(256)) * 41 + b"odd"
    pack.split(data, tmp_path, part_mib=1)
    joined = (tmp_path / "cu13.part1").read_bytes() + (tmp_path / "cu13.part2").read_bytes()
    assert joined == data
    with pytest.raises(RuntimeError, match="carry limits"):
        pack.split(bytes(3 << 20), tmp_path, part_mib=1)


@pytest.mark.parametrize("name", ["quack", "quack-scaled-exp@8192", "liger-cute",
                                  "liger-cutedsl"])
def test_bench_skips_cute_peers_that_do_not_import(name, monkeypatch, capsys):
    # Whatever is installed here, these imports fail as on a machine without the DSL.
    for module in ("quack", "quack.linear_cross_entropy", "liger_kernel.ops.cutedsl",
                   "liger_kernel.ops.cutedsl.ops",
                   "liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90",
                   "liger_kernel.ops.fused_linear_cross_entropy"):
        monkeypatch.setitem(sys.modules, module, None)
    assert bench_lce_providers.providers([name, "torch"]).keys() == {"torch"}
    assert name in capsys.readouterr().out


def test_bench_refuses_unknown_cute_peer():
    with pytest.raises(ValueError, match="unknown CuTe peer"):
        bench_lce_providers.cute_peer("quack-fast")
