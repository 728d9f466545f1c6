#!/usr/bin/env python
"""Build a token file for scripts/pretrain_gpt.py --data-path from text already on this machine.

    python scripts/build_token_file.py --out data/stdlib                  # Python's stdlib, bytes
    python scripts/build_token_file.py --out data/stdlib_words --tokenizer word --vocab-size 8192
    python scripts/build_token_file.py --source /usr/share/doc --ext .txt .md --out data/docs

    torchrun --nproc-per-node 2 scripts/pretrain_gpt.py --data-path data/stdlib --vocab-size 257 ...

Reads the files under each ``--source`` (default: Python's standard library, the folder of
``os.py``, without ``site-packages``) whose names end in one of ``--ext``, in sorted path order,
up to ``--max-mb`` of text, and writes

    OUT.bin   every file's tokens followed by the end-of-document id, as one flat array of
              uint16 (vocabulary <= 65536) or uint32
    OUT.json  {"vocab_size", "dtype", "num_tokens", "tokenizer", "eod_id", "files", "sources",
              and for the word tokenizer "words"}

Tokenizers (both decodable, both documented here in full):

    byte   the UTF-8 bytes: ids 0-255, end of document 256; vocabulary 257.
    word   ids 0-255 are bytes, 256 is end of document, 257... are the most frequent "pieces"
           up to --vocab-size. Text is cut into pieces by the regular expression below (a word
           with its leading space, a run of punctuation with its leading space, or whitespace);
           a piece in the vocabulary is one id, any other piece is spelled as its UTF-8 bytes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

PIECE = re.compile(r" ?\w+| ?[^\w\s]+|\s+")
EOD = 256
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


def default_source() -> str:
    return os.path.dirname(os.__file__)


def collect(sources: list[str], exts: tuple[str, ...], max_bytes: int) -> list[tuple[str, str]]:
    """(path, text) of the matching files, sorted by path, until ``max_bytes`` of text."""
    paths = []
    for source in sources:
        for root, dirs, files in os.walk(source):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            paths += [os.path.join(root, f) for f in files if f.endswith(exts)]
    docs, total = [], 0
    for path in sorted(paths):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        docs.append((path, text))
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    return docs


def encode_bytes(docs) -> list[int]:
    out: list[int] = []
    for _, text in docs:
        out += text.encode("utf-8")
        out.append(EOD)
    return out


def build_word_vocab(docs, vocab_size: int) -> list[str]:
    counts = collections.Counter()
    for _, text in docs:
        counts.update(p for p in PIECE.findall(text) if len(p.encode("utf-8")) > 1)
    keep = vocab_size - (EOD + 1)
    # Ties broken by the piece itself, so the vocabulary does not depend on hash order.
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [piece for piece, _ in ranked[:keep]]


def encode_words(docs, words: list[str]) -> list[int]:
    ids = {w: EOD + 1 + i for i, w in enumerate(words)}
    out: list[int] = []
    for _, text in docs:
        for piece in PIECE.findall(text):
            token = ids.get(piece)
            if token is None:
                out += piece.encode("utf-8")
            else:
                out.append(token)
        out.append(EOD)
    return out


def decode(tokens, meta: dict) -> str:
    """Inverse of the encoders (documents separated by a newline)."""
    words = meta.get("words", [])
    raw = bytearray()
    for t in tokens:
        t = int(t)
        if t < 256:
            raw.append(t)
        elif t == EOD:
            raw += b"\n"
        else:
            raw += words[t - EOD - 1].encode("utf-8")
    return raw.decode("utf-8", errors="replace")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--source", action="append", default=None,
                   help="folder to read (repeatable); default: " + default_source())
    p.add_argument("--ext", nargs="+", default=[".py", ".md", ".rst", ".txt"])
    p.add_argument("--out", required=True, help="output prefix: writes OUT.bin and OUT.json")
    p.add_argument("--tokenizer", choices=("byte", "word"), default="byte")
    p.add_argument("--vocab-size", type=int, default=8192, help="word tokenizer only")
    p.add_argument("--max-mb", type=float, default=16.0, help="stop after this much text")
    args = p.parse_args(argv)
    sources = args.source or [default_source()]
    if args.tokenizer == "word" and args.vocab_size <= EOD + 1:
        p.error(f"--vocab-size must exceed {EOD + 1} (bytes + end of document)")

    docs = collect(sources, tuple(args.ext), int(args.max_mb * 2**20))
    if not docs:
        p.error(f"no readable {args.ext} files under {sources}")
    meta = {"tokenizer": args.tokenizer, "eod_id": EOD, "sources": sources, "files": len(docs)}
    if args.tokenizer == "byte":
        tokens = encode_bytes(docs)
        meta["vocab_size"] = EOD + 1
    else:
        words = build_word_vocab(docs, args.vocab_size)
        tokens = encode_words(docs, words)
        meta["vocab_size"] = EOD + 1 + len(words)
        meta["words"] = words
    dtype = np.uint16 if meta["vocab_size"] <= 2**16 else np.uint32
    array = np.asarray(tokens, dtype=dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    array.tofile(out.with_suffix(".bin"))
    meta.update(dtype=np.dtype(dtype).name, num_tokens=int(array.size))
    out.with_suffix(".json").write_text(json.dumps(meta))
    text_mb = sum(len(t.encode("utf-8")) for _, t in docs) / 2**20
    print(f"{out}.bin: {array.size:,} tokens ({meta['dtype']}) from {len(docs)} files, "
          f"{text_mb:.1f} MiB of text, {args.tokenizer} tokenizer, vocabulary "
          f"{meta['vocab_size']} ({array.size / max(1, text_mb * 2**20):.2f} tokens/byte)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
