"""lce_train.build_token_file: the file split, the byte-level BPE and the compressed form.

A tiny corpus in a temporary folder (40 small generated files plus a duplicate, an empty file, a
non-UTF-8 file and one that mentions the end-of-document token) is tokenized in well under a
second. The outputs are Megatron indexed datasets (.bin + .idx, read back with megatron-core's
IndexedDataset: one document per file). The BPE tests skip where HuggingFace tokenizers is not
installed (`pip install -e .[data]`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from lce_train import build_token_file as btf

WORDS = ("alpha", "beta", "gamma", "delta", "kernel", "tensor", "vocab", "softmax", "gradient",
         "layer", "token", "shard")
# Appears only in a validation file: a tokenizer trained on the training split cannot know it.
VALID_ONLY_WORD = "zqxjvw"


def _write_corpus(root: Path) -> list[str]:
    """Files under root/src; returns the names (``src/<file>``) of the distinct, readable ones."""
    src = root / "src"
    (src / "pkg").mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = []
    for i in range(40):
        words = rng.choice(WORDS, size=60)
        text = f"# file {i}\n" + " ".join(words) + f"\nvalue_{i} = {i * 7}  # ü ∑\n"
        sub = "pkg/" if i % 3 == 0 else ""
        (src / f"{sub}f{i:02d}.py").write_text(text, encoding="utf-8")
        names.append(f"src/{sub}f{i:02d}.py")
    (src / "pkg" / "copy.py").write_text((src / "f01.py").read_text())  # duplicate: skipped
    (src / "empty.txt").write_text("  \n")  # skipped
    (src / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8: skipped
    (src / "eot.md").write_text("the end: <|endoftext|> is only text here\n")
    names.append("src/eot.md")
    return names


def _valid_name(names: list[str], fraction: float) -> str:
    return next(n for n in names if btf.is_valid_file(n, fraction))


def _build(tmp_path: Path, *flags: str) -> Path:
    out = tmp_path / "out" / "corpus"
    btf.main(["--source", str(tmp_path / "src"), "--out", str(out), *flags])
    return out


def test_split_is_deterministic_per_file(tmp_path):
    names = _write_corpus(tmp_path)
    train, valid = btf.collect([str(tmp_path / "src")], (".py", ".md", ".txt"), 2**30,
                               order="hash", valid_fraction=0.3)
    got = {d.name for d in train + valid}
    # Of two identical files the one read first is kept; empty and non-UTF-8 files are skipped.
    assert len(got & {"src/f01.py", "src/pkg/copy.py"}) == 1
    assert got - {"src/pkg/copy.py"} == set(names) - {"src/f01.py"} | (got & {"src/f01.py"})
    assert {d.name for d in valid} == {n for n in got if btf.is_valid_file(n, 0.3)}
    assert 0 < len(valid) < len(names)
    # A file's split depends on its name only, not on which other files are read.
    only_pkg, only_pkg_valid = btf.collect([str(tmp_path / "src")], (".py",), 2**30,
                                           valid_fraction=0.3)
    twins = {"src/f01.py", "src/pkg/copy.py"}  # which twin is kept depends on the order
    assert {d.name for d in only_pkg_valid} - twins <= {d.name for d in valid}
    assert {d.name for d in only_pkg} - twins <= {d.name for d in train}
    # The cap counts training text; reading in hash order is a fixed permutation.
    capped, _ = btf.collect([str(tmp_path / "src")], (".py",), 1000, order="hash",
                            valid_fraction=0.3)
    full_order = [d.name for d in train if d.name.endswith(".py")]
    assert [d.name for d in capped] == full_order[:len(capped)] and len(capped) < len(full_order)


def _documents(prefix: Path) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    # Copies: the arrays are views of a memory map that closes with the dataset.
    return [np.array(dataset[i]) for i in range(len(dataset))]


def test_byte_split_without_tokenizers(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    _write_corpus(tmp_path)
    out = _build(tmp_path, "--valid-fraction", "0.3", "--ext", ".py", ".md")
    for split in ("train", "valid"):
        prefix = out.with_name(f"corpus_{split}")
        meta = btf.load_meta(prefix)
        tokens = btf.read_tokens(prefix)
        assert meta["split"] == split and meta["num_tokens"] == len(tokens)
        assert int((tokens == btf.EOD).sum()) == meta["files"]
        # Megatron's format: one document per file, each ending in the end-of-document id.
        docs = _documents(prefix)
        assert len(docs) == meta["files"] == meta["documents"]
        assert all(doc[-1] == btf.EOD and btf.EOD not in doc[:-1] for doc in docs)
        assert np.array_equal(np.concatenate(docs), tokens)
    with pytest.raises(SystemExit, match=r"pip install 'fused_lce\[data\]'"):
        _build(tmp_path, "--tokenizer", "bpe")


def test_bpe_round_trip_vocab_and_split(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("megatron.core")
    names = _write_corpus(tmp_path)
    fraction = 0.3
    valid_file = tmp_path / "src" / _valid_name(names, fraction).removeprefix("src/")
    valid_file.write_text(valid_file.read_text() + f" {VALID_ONLY_WORD}" * 50 + "\n")
    out = _build(tmp_path, "--tokenizer", "bpe", "--vocab-size", "400", "--valid-fraction",
                 str(fraction), "--order", "hash", "--xz")
    manifest = out.with_name("corpus_files.tsv").read_text().splitlines()[1:]
    by_split = {"train": [], "valid": []}
    for line in manifest:
        split, _, _, name = line.split("\t")
        by_split[split].append(name)
    train_docs, valid_docs = btf.collect([str(tmp_path / "src")], (".py", ".md", ".rst", ".txt"),
                                         2**30, order="hash", valid_fraction=fraction)
    assert by_split == {"train": [d.name for d in train_docs],
                        "valid": [d.name for d in valid_docs]}

    tokenizer = btf.load_bpe(out.with_name("corpus_tokenizer.json"))
    for split, docs in (("train", train_docs), ("valid", valid_docs)):
        prefix = out.with_name(f"corpus_{split}")
        meta = btf.load_meta(prefix)
        tokens = btf.read_tokens(prefix)
        assert meta["tokenizer"] == "bpe" and meta["dtype"] == "uint16"
        assert meta["vocab_size"] == tokenizer.get_vocab_size() <= 400
        assert meta["vocab_size"] > 257, "the tiny corpus has enough pairs to merge"
        assert int(tokens.max()) < meta["vocab_size"] and meta["num_tokens"] == len(tokens)
        assert meta["eod_id"] == 0 and int((tokens == 0).sum()) == len(docs)
        assert btf.decode(tokens, meta) == "".join(d.text + "\n" for d in docs), split
    # Trained on the training split only: the validation-only word was never merged.
    assert len(tokenizer.encode(VALID_ONLY_WORD * 2).ids) >= 6
    assert len(tokenizer.encode(" gradient").ids) == 1
    # The literal end-of-document string in a file is text, not the id.
    assert 0 not in tokenizer.encode("<|endoftext|>").ids

    # The compressed file unpacks to the same tokens (sha256 checked), once.
    unpacked = btf.unpack(out.with_name("corpus_train"), tmp_path / "unpacked")
    assert np.array_equal(btf.read_tokens(unpacked), btf.read_tokens(out.with_name("corpus_train")))
    assert json.loads(unpacked.with_name("corpus_train.json").read_text())["num_tokens"] > 0
    assert np.array_equal(np.concatenate(_documents(unpacked)), btf.read_tokens(unpacked))
    assert btf.unpack(unpacked, tmp_path / "elsewhere") == unpacked
