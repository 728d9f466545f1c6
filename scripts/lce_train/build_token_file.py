"""Build a Megatron indexed dataset (.bin + .idx) for the launcher's --data-path
(lce-pretrain-gpt) from text already on this machine.

    lce-build-token-file --out data/stdlib                  # Python's stdlib, bytes
    lce-build-token-file --out data/stdlib_words --tokenizer word --vocab-size 8192
    lce-build-token-file --source /usr/share/doc --ext .txt .md --out data/docs
    lce-build-token-file --tokenizer bpe --vocab-size 131072 --valid-fraction 0.04 \\
        --source "$STDLIB" --source "$STDLIB/site-packages" --order hash --max-mb 100 --out data/py

    torchrun --nproc-per-node 2 -m lce_train.training --data-path data/stdlib --vocab-size 257 ...

Reads the files under each ``--source`` (default: Python's standard library, the folder of
``os.py``; folders named site-packages, dist-packages, __pycache__ or .git are never entered, so
site-packages is read only when given as a source itself) whose names end in one of ``--ext``.
A file's name is ``<source folder name>/<path inside the source>``. Files are taken in sorted name
order (``--order path``) or in the order of a hash of the name (``--order hash``: a fixed
pseudo-random sample across packages), skipping empty, non-UTF-8, over-large (``--max-file-kb``)
and duplicate files (the same content seen earlier), until the training text reaches ``--max-mb``.

With ``--valid-fraction F`` each file goes to the validation split when a hash of its name falls
below F (deterministic: a file's split does not depend on what else is read), and the vocabulary
(word, bpe) is built from the training files only. Outputs, with PREFIX = OUT, or OUT_train and
OUT_valid when splitting:

    PREFIX.bin    Megatron's indexed dataset, written by megatron-core's IndexedDatasetBuilder:
    PREFIX.idx    one document per file, its tokens followed by the end-of-document id, uint16
                  (vocabulary < 65500) or int32, as Megatron-LM's tools/preprocess_data.py
                  --append-eod writes them; PREFIX.bin.xz instead of PREFIX.bin with --xz
    PREFIX.json   {"vocab_size", "dtype", "num_tokens", "tokenizer", "eod_id", "files",
                   "text_bytes", "sources", "sha256" (of the uncompressed .bin), "split", ...}:
                  what the launcher checks (the vocabulary) and decode() needs; Megatron-LM
                  itself reads only .bin + .idx
    OUT_files.tsv the manifest: split, bytes, sha1 and name of every file used, in order
    OUT_tokenizer.json   (bpe) the HuggingFace tokenizer

Tokenizers (all decodable):

    byte   the UTF-8 bytes: ids 0-255, end of document 256; vocabulary 257.
    word   ids 0-255 are bytes, 256 is end of document, 257... are the most frequent "pieces"
           up to --vocab-size. Text is cut into pieces by the regular expression below (a word
           with its leading space, a run of punctuation with its leading space, or whitespace);
           a piece in the vocabulary is one id, any other piece is spelled as its UTF-8 bytes.
    bpe    byte-level BPE (GPT-2's pre-tokenizer and byte alphabet) trained with HuggingFace
           tokenizers to --vocab-size ids (min. pair frequency 2); id 0 is the end-of-document
           token <|endoftext|>, which a literal "<|endoftext|>" in the text never produces.
           Needs `pip install 'fused_lce[data]'` (tokenizers, at the pinned version).

Writing needs megatron-core (`pip install 'fused_lce[megatron]'`).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import lzma
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PIECE = re.compile(r" ?\w+| ?[^\w\s]+|\s+")
EOD = 256
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}
BPE_EOD_TOKEN = "<|endoftext|>"
TOKENIZERS_HINT = ("--tokenizer bpe needs HuggingFace tokenizers: "
                   "pip install 'fused_lce[data]' (or pip install tokenizers==0.23.3)")
# Documents per encode_batch call: bounds the memory of the tokenizer's intermediate objects.
BPE_BATCH = 256


@dataclass(frozen=True)
class Doc:
    name: str
    """``<source folder name>/<path inside it>``: the same on every machine."""
    text: str
    sha1: str


def default_source() -> str:
    return os.path.dirname(os.__file__)


def _unit_hash(salt: str, name: str) -> float:
    """A fixed pseudo-random number in [0, 1) for ``name``; ``salt`` makes independent ones."""
    digest = hashlib.sha1(f"{salt}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_valid_file(name: str, valid_fraction: float) -> bool:
    return _unit_hash("split", name) < valid_fraction


def list_files(sources: list[str], exts: tuple[str, ...], order: str) -> list[tuple[str, str]]:
    """(name, path) of every matching file under ``sources``, in ``order`` ("path" or "hash")."""
    files = []
    for source in sources:
        source = os.path.normpath(source)
        for root, dirs, names in os.walk(source):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            for f in names:
                if f.endswith(exts):
                    path = os.path.join(root, f)
                    rel = os.path.relpath(path, source).replace(os.sep, "/")
                    files.append((f"{os.path.basename(source)}/{rel}", path))
    if order == "hash":
        return sorted(files, key=lambda f: (_unit_hash("order", f[0]), f[0]))
    return sorted(files, key=lambda f: f[1])


def collect(sources: list[str], exts: tuple[str, ...], max_bytes: int, *, order: str = "path",
            max_file_bytes: int | None = None,
            valid_fraction: float = 0.0) -> tuple[list[Doc], list[Doc]]:
    """(train, valid) documents, read in ``order`` until the training text reaches ``max_bytes``."""
    train, valid, seen, train_bytes = [], [], set(), 0
    for name, path in list_files(sources, exts, order):
        try:
            if max_file_bytes is not None and os.path.getsize(path) > max_file_bytes:
                continue
            text = Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        sha1 = hashlib.sha1(text.encode("utf-8")).hexdigest()
        if not text.strip() or sha1 in seen:
            continue
        seen.add(sha1)
        doc = Doc(name, text, sha1)
        if is_valid_file(name, valid_fraction):
            valid.append(doc)
            continue
        train.append(doc)
        train_bytes += len(text.encode("utf-8"))
        if train_bytes >= max_bytes:
            break
    return train, valid


# ----------------------------------------------------------------------------------------------
# Tokenizers: each is a (fit on the training documents, encode documents) pair
# ----------------------------------------------------------------------------------------------


def encode_bytes(docs: list[Doc]) -> np.ndarray:
    out: list[int] = []
    for doc in docs:
        out += doc.text.encode("utf-8")
        out.append(EOD)
    return np.asarray(out, dtype=np.int64)


def build_word_vocab(docs: list[Doc], vocab_size: int) -> list[str]:
    counts = collections.Counter()
    for doc in docs:
        counts.update(p for p in PIECE.findall(doc.text) if len(p.encode("utf-8")) > 1)
    keep = vocab_size - (EOD + 1)
    # Ties broken by the piece itself, so the vocabulary does not depend on hash order.
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [piece for piece, _ in ranked[:keep]]


def encode_words(docs: list[Doc], words: list[str]) -> np.ndarray:
    ids = {w: EOD + 1 + i for i, w in enumerate(words)}
    out: list[int] = []
    for doc in docs:
        for piece in PIECE.findall(doc.text):
            token = ids.get(piece)
            if token is None:
                out += piece.encode("utf-8")
            else:
                out.append(token)
        out.append(EOD)
    return np.asarray(out, dtype=np.int64)


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise SystemExit(TOKENIZERS_HINT) from None
    return tokenizers


def train_bpe(docs: list[Doc], vocab_size: int):
    """A byte-level BPE tokenizer with ``vocab_size`` ids (fewer if the text has too few pairs)."""
    tk = _import_tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[BPE_EOD_TOKEN],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    return _text_only(tokenizer)


def _text_only(tokenizer):
    # Source code that mentions "<|endoftext|>" (tokenizer code does) must stay text: only the
    # builder inserts the end-of-document id.
    tokenizer.encode_special_tokens = True
    return tokenizer


def load_bpe(path: str | Path):
    return _text_only(_import_tokenizers().Tokenizer.from_file(str(path)))


def encode_bpe(docs: list[Doc], tokenizer) -> np.ndarray:
    eod = np.asarray([tokenizer.token_to_id(BPE_EOD_TOKEN)], dtype=np.int64)
    parts = []
    for start in range(0, len(docs), BPE_BATCH):
        texts = [d.text for d in docs[start: start + BPE_BATCH]]
        for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False):
            parts += [np.asarray(encoding.ids, dtype=np.int64), eod]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def decode(tokens, meta: dict) -> str:
    """Inverse of the encoders (documents separated by a newline).

    For bpe, ``meta`` must come from :func:`load_meta` (which locates the tokenizer file).
    """
    tokens = [int(t) for t in tokens]
    if meta["tokenizer"] == "bpe":
        tokenizer = load_bpe(meta["tokenizer_path"])
        docs, current = [], []
        for t in tokens:
            if t == meta["eod_id"]:
                docs.append(tokenizer.decode(current, skip_special_tokens=False) + "\n")
                current = []
            else:
                current.append(t)
        if current:
            docs.append(tokenizer.decode(current, skip_special_tokens=False))
        return "".join(docs)
    words = meta.get("words", [])
    raw = bytearray()
    for t in tokens:
        if t < 256:
            raw.append(t)
        elif t == EOD:
            raw += b"\n"
        else:
            raw += words[t - EOD - 1].encode("utf-8")
    return raw.decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


def load_meta(prefix: str | Path) -> dict:
    """PREFIX.json, with "bin" (the .bin or .bin.xz path) and, for bpe, "tokenizer_path"."""
    prefix = Path(prefix)
    meta = json.loads(prefix.with_name(prefix.name + ".json").read_text())
    raw = prefix.with_name(prefix.name + ".bin")
    meta["bin"] = str(raw if raw.exists() else raw.with_name(raw.name + ".xz"))
    if "tokenizer_file" in meta:
        meta["tokenizer_path"] = str(prefix.parent / meta["tokenizer_file"])
    return meta


def read_tokens(prefix: str | Path) -> np.ndarray:
    """All tokens of PREFIX.bin (documents in order), or of PREFIX.bin.xz when only the compressed
    file exists."""
    meta = load_meta(prefix)
    path = Path(meta["bin"])
    data = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    return np.frombuffer(data, dtype=np.dtype(meta["dtype"]))


def unpack(prefix: str | Path, into: str | Path) -> Path:
    """Decompress PREFIX.bin.xz (checked against its sha256) into ``into``, beside copies of
    PREFIX.idx and PREFIX.json; returns the new prefix. A prefix whose .bin exists is returned as
    it is."""
    prefix = Path(prefix)
    if prefix.with_name(prefix.name + ".bin").exists():
        return prefix
    meta = json.loads(prefix.with_name(prefix.name + ".json").read_text())
    out = Path(into) / prefix.name
    target = out.with_name(out.name + ".bin")
    if not (target.exists() and _sha256(target.read_bytes()) == meta["sha256"]):
        data = lzma.decompress(prefix.with_name(prefix.name + ".bin.xz").read_bytes())
        if _sha256(data) != meta["sha256"]:
            raise SystemExit(f"{prefix}.bin.xz does not match the sha256 in {prefix}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    out.with_name(out.name + ".json").write_text(json.dumps(meta))
    index = prefix.with_name(prefix.name + ".idx").read_bytes()
    out.with_name(out.name + ".idx").write_bytes(index)
    return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _indexed_dataset_builder():
    try:
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    except ImportError as err:
        raise SystemExit(f"writing Megatron's indexed format needs megatron-core ({err}): "
                         "pip install 'fused_lce[megatron]'") from None
    return DType, IndexedDatasetBuilder


def write_documents(prefix: Path, tokens: np.ndarray, eod_id: int, vocab_size: int) -> int:
    """PREFIX.bin + PREFIX.idx through megatron-core's IndexedDatasetBuilder: one document per
    run of tokens ending in ``eod_id``. Returns the number of documents."""
    dtype_enum, builder_cls = _indexed_dataset_builder()
    builder = builder_cls(str(prefix.with_name(prefix.name + ".bin")),
                          dtype=dtype_enum.optimal_dtype(vocab_size))
    ends = (np.flatnonzero(tokens == eod_id) + 1).tolist()
    if not ends or ends[-1] != len(tokens):
        ends.append(len(tokens))
    start = 0
    for end in ends:
        if end > start:
            builder.add_document(tokens[start:end], [end - start])
        start = end
    builder.finalize(str(prefix.with_name(prefix.name + ".idx")))
    return len(ends)


def write_token_file(prefix: Path, tokens: np.ndarray, meta: dict, compress: bool) -> dict:
    dtype_enum, _ = _indexed_dataset_builder()
    documents = write_documents(prefix, tokens, meta["eod_id"], meta["vocab_size"])
    raw = prefix.with_name(prefix.name + ".bin")
    data = raw.read_bytes()
    meta = {**meta, "dtype": np.dtype(dtype_enum.optimal_dtype(meta["vocab_size"])).name,
            "num_tokens": int(tokens.size), "documents": documents, "sha256": _sha256(data),
            "format": "megatron indexed dataset (.bin + .idx)"}
    if compress:
        data = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
        meta["compressed"] = "xz"
        raw.with_name(raw.name + ".xz").write_bytes(data)
        raw.unlink()
    meta["stored_bytes"] = len(data)
    prefix.with_name(prefix.name + ".json").write_text(json.dumps(meta))
    return meta


def write_manifest(path: Path, splits: dict[str, list[Doc]]) -> None:
    lines = ["split\tbytes\tsha1\tname"]
    for split, docs in splits.items():
        lines += [f"{split}\t{len(d.text.encode('utf-8'))}\t{d.sha1}\t{d.name}" for d in docs]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--source", action="append", default=None,
                   help="folder to read (repeatable); default: " + default_source())
    p.add_argument("--ext", nargs="+", default=[".py", ".md", ".rst", ".txt"])
    p.add_argument("--out", required=True,
                   help="output prefix: writes OUT.bin, OUT.idx and OUT.json")
    p.add_argument("--tokenizer", choices=("byte", "word", "bpe"), default="byte")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="word (default 8192) and bpe (default 131072) tokenizers")
    p.add_argument("--max-mb", type=float, default=16.0,
                   help="stop once the training text reaches this much")
    p.add_argument("--max-file-kb", type=float, default=None, help="skip larger files")
    p.add_argument("--order", choices=("path", "hash"), default="path",
                   help="read files in sorted path order, or in the order of a hash of the name")
    p.add_argument("--valid-fraction", type=float, default=0.0,
                   help="send this fraction of files (by a hash of the name) to OUT_valid")
    p.add_argument("--xz", action="store_true", help="store the token files xz-compressed")
    args = p.parse_args(argv)
    sources = args.source or [default_source()]
    vocab_size = args.vocab_size or {"word": 8192, "bpe": 131072}.get(args.tokenizer, EOD + 1)
    if args.tokenizer == "word" and vocab_size <= EOD + 1:
        p.error(f"--vocab-size must exceed {EOD + 1} (bytes + end of document)")
    if args.tokenizer == "bpe":
        _import_tokenizers()  # fail before reading anything
        if vocab_size <= 257:
            p.error("--vocab-size must exceed 257 (256 bytes + end of document) for bpe")
    if not 0.0 <= args.valid_fraction < 1.0:
        p.error("--valid-fraction must be in [0, 1)")

    max_file = None if args.max_file_kb is None else int(args.max_file_kb * 1024)
    train, valid = collect(sources, tuple(args.ext), int(args.max_mb * 2**20), order=args.order,
                           max_file_bytes=max_file, valid_fraction=args.valid_fraction)
    if not train:
        p.error(f"no readable {args.ext} files under {sources} (for the training split)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer": args.tokenizer, "sources": sources, "exts": args.ext,
            "order": args.order, "valid_fraction": args.valid_fraction}
    if args.tokenizer == "byte":
        meta.update(vocab_size=EOD + 1, eod_id=EOD)
        encode = encode_bytes
    elif args.tokenizer == "word":
        words = build_word_vocab(train, vocab_size)
        meta.update(vocab_size=EOD + 1 + len(words), eod_id=EOD, words=words)
        encode = lambda docs: encode_words(docs, words)
    else:
        tokenizer = train_bpe(train, vocab_size)
        tokenizer_path = out.with_name(out.name + "_tokenizer.json")
        tokenizer.save(str(tokenizer_path))
        meta.update(vocab_size=tokenizer.get_vocab_size(),
                    eod_id=tokenizer.token_to_id(BPE_EOD_TOKEN),
                    tokenizer_file=tokenizer_path.name)
        encode = lambda docs: encode_bpe(docs, tokenizer)

    splits = {"train": train, "valid": valid} if args.valid_fraction > 0 else {"all": train}
    write_manifest(out.with_name(out.name + "_files.tsv"), splits)
    for split, docs in splits.items():
        prefix = out if split == "all" else out.with_name(f"{out.name}_{split}")
        text_bytes = sum(len(d.text.encode("utf-8")) for d in docs)
        written = write_token_file(prefix, encode(docs), {**meta, "split": split,
                                                          "files": len(docs),
                                                          "text_bytes": text_bytes}, args.xz)
        n = written["num_tokens"]
        print(f"{prefix}.bin{'.xz' if args.xz else ''}: {n:,} tokens ({written['dtype']}, "
              f"{written['stored_bytes'] / 2**20:.1f} MiB stored) from {len(docs)} files, "
              f"{text_bytes / 2**20:.1f} MiB of text, {args.tokenizer} tokenizer, vocabulary "
              f"{meta['vocab_size']} ({n / max(1, text_bytes):.3f} tokens/byte)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
