"""Training and validation data: seeded mock tokens, or Megatron's indexed datasets.

``--data-path`` takes what Megatron-LM's ``--data-path`` takes: the prefix of an indexed dataset
(``PREFIX.bin`` + ``PREFIX.idx``, as written by Megatron-LM's tools/preprocess_data.py or by
lce_train.build_token_file), or a blend ``"w1 PREFIX1 w2 PREFIX2 ..."`` (one string or
several arguments). The samples come from megatron-core's own classes: ``IndexedDataset`` reads the
files, ``GPTDataset`` cuts shuffled windows of ``seq_length + 1`` tokens across documents and
``BlendedDataset`` mixes prefixes by weight, built by ``BlendedMegatronDatasetBuilder`` with
their index caches in ``--data-cache-path`` (megatron's default: ``cache/`` beside the data).

Both sources are step-addressed: the batch of step k on data-parallel rank r holds the global
samples ``(k - 1) * global_batch + ...`` in a fixed order, so a resumed run (at any layout with
the same global batch size) sees the batches an unbroken run would.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

# Generator seeds of the held-out (validation) windows start here, far above any training seed's
# stream (seed * 1_000_003 + sample index).
HELD_OUT_STREAM = 2**62
# The shuffle seed of validation datasets: the same held-out windows whatever --seed is.
HELD_OUT_SEED = 0

# The build of Megatron-LM's megatron/core/datasets/Makefile, which the wheel does not ship
# (checked: the command below builds a working helpers_cpp from 0.16.1's helpers.cpp).
HELPERS_HINT = (
    "megatron-core's compiled dataset helpers (megatron/core/datasets/helpers_cpp*.so, needed by "
    "GPTDataset and blends) are missing from this install. Build them from the helpers.cpp it "
    "ships, with this Python:\n  pip install pybind11 && cd $(python -c 'import os, "
    "megatron.core.datasets as d; print(os.path.dirname(d.__file__))') && c++ -O3 -Wall -shared "
    "-std=c++11 -fPIC $(python -m pybind11 --includes) helpers.cpp -o helpers_cpp$(python -c "
    "'import sysconfig; print(sysconfig.get_config_var(\"EXT_SUFFIX\"))')")


# ---------------------------------------------------------------------------------------------
# --data-path: prefixes and blends (pure Python: --dry-run checks them without megatron)
# ---------------------------------------------------------------------------------------------


def parse_blend(values: list[str] | str) -> tuple[list[str], list[float] | None]:
    """Megatron-LM's ``--data-path`` list: one prefix, or weight / prefix pairs.

    Returns:
        (prefixes, weights or None)
    """
    words = [w for v in ([values] if isinstance(values, str) else values) for w in shlex.split(v)]
    if len(words) == 1:
        return words, None
    if not words or len(words) % 2:
        raise SystemExit(f"--data-path {' '.join(words)}: expected one prefix or pairs "
                         "'WEIGHT PREFIX WEIGHT PREFIX ...'")
    try:
        weights = [float(w) for w in words[0::2]]
    except ValueError:
        raise SystemExit(f"--data-path {' '.join(words)}: in a blend every other word is a "
                         "weight (a number), as in '0.3 data/a 0.7 data/b'") from None
    if any(w <= 0 for w in weights):
        raise SystemExit(f"--data-path {' '.join(words)}: blend weights must be > 0")
    return words[1::2], weights


def describe_blend(values) -> str:
    prefixes, weights = parse_blend(values)
    if weights is None:
        return prefixes[0]
    total = sum(weights)
    return ", ".join(f"{w / total:.0%} {p}" for w, p in zip(weights, prefixes))


def dataset_meta(prefix: str) -> dict:
    """Check that PREFIX.bin and PREFIX.idx exist; returns PREFIX.json (written by
    lce_train.build_token_file: vocab_size, eod_id, tokenizer) or {} where there is none."""
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    json_path = Path(prefix + ".json")
    if not idx_path.exists():
        if bin_path.exists() and json_path.exists():
            raise SystemExit(f"--data-path {prefix}: {bin_path} has no {idx_path.name}: a token "
                             "file in the launcher's earlier flat format, which is not read any "
                             "more; rebuild it with lce-build-token-file (Megatron's "
                             "indexed format)")
        raise SystemExit(f"--data-path {prefix}: {idx_path} not found (an indexed dataset is "
                         "PREFIX.bin + PREFIX.idx, from Megatron-LM's tools/preprocess_data.py "
                         "or lce-build-token-file)")
    if not bin_path.exists():
        raise SystemExit(f"--data-path {prefix}: {bin_path} not found (beside {idx_path.name})")
    return json.loads(json_path.read_text()) if json_path.exists() else {}


def check_data_vocab(values, flag: str, model_vocab: int) -> None:
    """Each prefix exists; where its PREFIX.json states a vocabulary, it fits the model's."""
    for prefix in parse_blend(values)[0]:
        vocab = dataset_meta(prefix).get("vocab_size")
        if vocab is not None and vocab > model_vocab:
            raise SystemExit(f"{flag} {prefix}: token vocabulary {vocab} exceeds the model's "
                             f"{model_vocab}; pass --vocab-size {vocab}")


# ---------------------------------------------------------------------------------------------
# Step-addressed micro-batches
# ---------------------------------------------------------------------------------------------


class _StepAddressed:
    """``microbatches(step, ...)``: the samples of a global batch, split over DP ranks."""

    seq_length: int

    def batch(self, indices: range, device) -> dict:
        raise NotImplementedError

    def microbatches(self, step: int, args, dp_rank: int, device):
        """The micro-batches of ``step`` (1-based) on data-parallel rank ``dp_rank``."""
        mbs, dp = args.micro_batch_size, args.data_parallel_size
        base = (step - 1) * args.global_batch_size
        for m in range(args.num_microbatches):
            first = base + m * mbs * dp + dp_rank * mbs
            yield self.batch(range(first, first + mbs), device)


class TokenWindows(_StepAddressed):
    """Mock data: seeded windows of ``seq_length + 1`` tokens; sample i depends only on (seed, i).

    Independent tokens with Zipf frequencies (p(rank r) ~ 1 / r) over a seeded permutation of the
    vocabulary, like word frequencies in text: the loss falls from ln(V) towards the
    distribution's entropy within tens of steps.

    ``held_out=True`` draws the validation windows: sample i then depends only on i (the same
    windows in every run, whatever its seed), from a generator stream that training never uses;
    they keep the seed's vocabulary permutation, so they follow the training distribution.
    """

    def __init__(self, seq_length: int, vocab_size: int, seed: int, held_out: bool = False):
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.stream = HELD_OUT_STREAM if held_out else seed * 1_000_003
        ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
        self.zipf = (1.0 / ranks) / (1.0 / ranks).sum()
        self.zipf_ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.stream + index)
        n = self.seq_length + 1
        return self.zipf_ids[torch.multinomial(self.zipf, n, replacement=True, generator=gen)]

    def batch(self, indices: range, device) -> dict:
        windows = to_device(torch.stack([self.sample(i) for i in indices]), device)
        n = len(indices)
        return {
            "tokens": windows[:, :-1].contiguous(),
            "labels": windows[:, 1:].contiguous(),
            "loss_mask": torch.ones(n, self.seq_length, dtype=torch.float32, device=device),
            "position_ids": torch.arange(self.seq_length, device=device).repeat(n, 1),
        }


def to_device(batch: torch.Tensor, device) -> torch.Tensor:
    """``batch`` on ``device`` without waiting for the GPU: a copy from pageable memory makes the
    host wait until the GPU has run everything queued before it, once per micro-batch, so the
    host cannot queue the next micro-batch while the GPU runs this one. From pinned memory the
    copy queues like a kernel (as Megatron-LM's loader pins and copies with non_blocking)."""
    if torch.device(device).type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


class IdsOnlyTokenizer:
    """What megatron's GPTDataset asks of a tokenizer when the data are already token ids: the
    end-of-document id (for its optional masks), the vocabulary size, and a cache identity."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size = vocab_size
        self.eod = eod
        self.unique_identifiers = {"class": "lce_train.IdsOnlyTokenizer",
                                   "vocab_size": vocab_size, "eod": eod}


class IndexedWindows(_StepAddressed):
    """Megatron's GPTDataset (or BlendedDataset) over indexed files: sample i is ``dataset[i]``.

    Built on every rank (rank 0 first, writing the index cache the others read).
    """

    def __init__(self, values, seq_length: int, vocab_size: int, seed: int, num_samples: int,
                 cache_path: str | None = None):
        self.seq_length = seq_length
        self.dataset = build_gpt_dataset(values, seq_length, vocab_size, seed, num_samples,
                                         cache_path)

    def batch(self, indices: range, device) -> dict:
        samples = [self.dataset[i] for i in indices]
        out = {key: to_device(torch.stack([s[key] for s in samples]), device)
               for key in ("tokens", "labels", "loss_mask", "position_ids")}
        out["loss_mask"] = out["loss_mask"].float()
        return out


def _import_dataset_classes():
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        raise SystemExit(HELPERS_HINT) from None
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    return BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig


def build_gpt_dataset(values, seq_length: int, vocab_size: int, seed: int, num_samples: int,
                      cache_path: str | None = None):
    """megatron-core's dataset of at least ``num_samples`` windows of ``values`` (a prefix or
    a blend), shuffled with ``seed``."""
    from lce_train.signatures import supported_kwargs

    builder_cls, gpt_cls, config_cls = _import_dataset_classes()
    prefixes, weights = parse_blend(values)
    eod = next((m["eod_id"] for m in map(dataset_meta, prefixes) if "eod_id" in m), 0)
    config = config_cls(**supported_kwargs(
        config_cls,
        random_seed=seed, sequence_length=seq_length, blend=(prefixes, weights),
        split="100,0,0", path_to_cache=cache_path,
        tokenizer=IdsOnlyTokenizer(vocab_size, eod),
        # Documents are concatenated as they are, and every token counts: the launcher's model
        # takes no attention mask (causal attention).
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,
    ))
    train, _, _ = builder_cls(gpt_cls, [num_samples, 0, 0], lambda: True, config).build()
    return train


def training_data(args):
    """The training samples of ``args``: mock windows, or the --data-path datasets."""
    if args.data_path is None:
        return TokenWindows(args.seq_length, args.model.vocab_size, args.seed)
    return IndexedWindows(args.data_path, args.seq_length, args.model.vocab_size, args.seed,
                          args.train_iters * args.global_batch_size, args.data_cache_path)


def validation_data(args):
    """The held-out samples: the same windows in every run, whatever its seed."""
    if args.valid_data_path is None:
        return TokenWindows(args.seq_length, args.model.vocab_size, args.seed, held_out=True)
    return IndexedWindows(args.valid_data_path, args.seq_length, args.model.vocab_size,
                          HELD_OUT_SEED, args.eval_iters * args.global_batch_size,
                          args.data_cache_path)


def token_counts(values, vocab: int):
    """How often each id occurs in the --data-path files (all of a blend's), as int64 (vocab,)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    counts = np.zeros(vocab, dtype=np.int64)
    for prefix in parse_blend(values)[0]:
        dtype = IndexedDataset(prefix).index.dtype
        tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
        counts += np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab)[:vocab]
    return torch.from_numpy(counts)
