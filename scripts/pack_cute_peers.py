"""Carry the CuTe-DSL peers (QuACK, Liger's CuTe path) to a GPU machine with no internet.

    python scripts/pack_cute_peers.py --pack .qk          # here: download, pack, split
    python scripts/pack_cute_peers.py --patch-quack /tmp/site   # there, after the install

The device tool carries 64 MiB a call and nvidia-cutlass-dsl's compiler wheel (libs-cu13) is
88 MiB, so ``--pack`` unpacks it, packs the tree with ``xz -9`` (about 8 minutes on 2 cores) and
splits that in two parts: ``scripts/gpu_single.sh``'s ``cute-keep`` stage keeps the first on the
machine with the other wheels (small, in DIR/w), ``cute-setup`` joins it with the second on the
next call. Versions are those ../shared/NOTES.md found to work together: quack-kernels 0.6.5
does not import with nvidia-cutlass-dsl 4.8.1.

``--patch-quack``: QuACK 0.6.5 keys its compile cache by a fingerprint of every value an
epilogue depends on and raises on values it cannot fingerprint (with 4.7.1, a ``logging.Logger``).
For benchmarking, such a value is keyed by its identity instead: within one process that reuses
a kernel only for the very same object.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CUTLASS = "4.7.1"
WHEELS = [
    "quack-kernels==0.6.5",
    f"nvidia-cutlass-dsl=={CUTLASS}",
    f"nvidia-cutlass-dsl-libs-core=={CUTLASS}",
    f"nvidia-cutlass-dsl-libs-base=={CUTLASS}",
    "apache-tvm-ffi==0.1.15.post2",
    "torch-c-dlpack-ext==0.1.5",
]
COMPILER = f"nvidia-cutlass-dsl-libs-cu13=={CUTLASS}"
# The GPU machines: CPython 3.12 on x86-64 (the device tool's README).
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
            "--no-deps"] + [arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                            "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                                            "manylinux2014_x86_64")
                            for arg in ("--platform", tag)]

QUACK_REFUSAL = '    raise TypeError(\n        f"epilogue fn depends on'
QUACK_BY_IDENTITY = (
    "    return (\"opaque\", type(value).__module__, type(value).__qualname__, id(value))\n"
)


def download(specs: list[str], into: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", *PLATFORM, "-d", str(into),
                    *specs], check=True)


def pack(out: Path, part_mib: int = 36) -> None:
    out.mkdir(parents=True, exist_ok=True)
    download(WHEELS, out / "w")
    with tempfile.TemporaryDirectory() as tmp:
        download([COMPILER], Path(tmp))
        (wheel,) = Path(tmp).glob("*.whl")
        tree = Path(tmp) / "tree"
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(tree)
        packed = Path(tmp) / "cu13.tar.xz"
        with open(packed, "wb") as sink:
            tar = subprocess.Popen(["tar", "cf", "-", "-C", str(tree), "nvidia_cutlass_dsl"],
                                   stdout=subprocess.PIPE)
            subprocess.run(["xz", "-9", "-T0"], stdin=tar.stdout, stdout=sink, check=True)
            if tar.wait() != 0:
                raise RuntimeError("tar failed")
        split(packed.read_bytes(), out, part_mib)


def split(data: bytes, out: Path, part_mib: int) -> None:
    half = (len(data) + 1) // 2
    if half > part_mib << 20:
        raise RuntimeError(f"each half is {half >> 20} MiB, over {part_mib}: carry limits")
    (out / "cu13.part1").write_bytes(data[:half])
    (out / "cu13.part2").write_bytes(data[half:])


def patch_quack(site: Path) -> None:
    identity = site / "quack" / "gemm_runtime" / "identity.py"
    source = identity.read_text()
    if QUACK_BY_IDENTITY in source:
        return
    if source.count(QUACK_REFUSAL) != 1:
        raise RuntimeError(f"{identity}: the refusal to patch is not there once; another QuACK?")
    identity.write_text(source.replace(QUACK_REFUSAL, QUACK_BY_IDENTITY + QUACK_REFUSAL))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--pack", type=Path, metavar="DIR", help="download and pack into DIR")
    action.add_argument("--patch-quack", type=Path, metavar="SITE",
                        help="key QuACK's compile cache by identity where it would refuse")
    args = parser.parse_args(argv)
    if args.pack is not None:
        pack(args.pack)
    else:
        patch_quack(args.patch_quack)


if __name__ == "__main__":
    main()
