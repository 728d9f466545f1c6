"""Training and validation data: seeded random windows of mock tokens or of a token file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

# Generator seeds of the held-out (validation) windows start here, far above any training seed's
# stream (seed * 1_000_003 + sample index).
HELD_OUT_STREAM = 2**62


def token_file_meta(prefix: str) -> dict:
    path = Path(prefix)
    if path.suffix in (".bin", ".json"):
        path = path.with_suffix("")
    meta_path = path.with_suffix(".json")
    if not meta_path.exists() or not path.with_suffix(".bin").exists():
        raise SystemExit(f"--data-path {prefix}: expected {path}.bin and {path}.json "
                         "(see scripts/build_token_file.py)")
    meta = json.loads(meta_path.read_text())
    meta["bin"] = str(path.with_suffix(".bin"))
    return meta


class TokenWindows:
    """Seeded random windows of ``seq_length + 1`` tokens; sample i depends only on (seed, i).

    Mock data (no file): independent tokens with Zipf frequencies (p(rank r) ~ 1 / r) over a
    seeded permutation of the vocabulary, like word frequencies in text: the loss falls from
    ln(V) towards the distribution's entropy within tens of steps. File data: a window at a
    random offset of the token file.

    ``held_out=True`` draws the validation windows: sample i then depends only on i (the same
    windows in every run, whatever its seed), from a generator stream that training never uses;
    mock data keep the seed's vocabulary permutation, so they follow the training distribution.
    """

    def __init__(self, seq_length: int, vocab_size: int, seed: int, data_path: str | None,
                 held_out: bool = False):
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.stream = HELD_OUT_STREAM if held_out else seed * 1_000_003
        self.tokens = None
        ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
        self.zipf = (1.0 / ranks) / (1.0 / ranks).sum()
        self.zipf_ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
        if data_path is not None:
            meta = token_file_meta(data_path)
            self.tokens = np.memmap(meta["bin"], dtype=np.dtype(meta["dtype"]), mode="r")
            if len(self.tokens) <= seq_length + 1:
                raise SystemExit(f"{meta['bin']}: {len(self.tokens)} tokens, fewer than one "
                                 f"window of {seq_length + 1}")

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.stream + index)
        n = self.seq_length + 1
        if self.tokens is None:
            return self.zipf_ids[torch.multinomial(self.zipf, n, replacement=True,
                                                   generator=gen)]
        offset = int(torch.randint(len(self.tokens) - n, (1,), generator=gen))
        return torch.from_numpy(self.tokens[offset: offset + n].astype(np.int64))

    def microbatches(self, step: int, args, dp_rank: int, device):
        """The micro-batches of ``step`` (1-based) on data-parallel rank ``dp_rank``."""
        mbs, dp = args.micro_batch_size, args.data_parallel_size
        base = (step - 1) * args.global_batch_size
        positions = torch.arange(self.seq_length, device=device).repeat(mbs, 1)
        for m in range(args.num_microbatches):
            first = base + m * mbs * dp + dp_rank * mbs
            windows = torch.stack([self.sample(first + k) for k in range(mbs)]).to(device)
            yield {
                "tokens": windows[:, :-1].contiguous(),
                "labels": windows[:, 1:].contiguous(),
                "loss_mask": torch.ones(mbs, self.seq_length, dtype=torch.float32,
                                        device=device),
                "position_ids": positions,
            }
