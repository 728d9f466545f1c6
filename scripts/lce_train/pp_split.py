"""Layer splits over pipeline stages: megatron-core's rules for the split its flags give, and a
recommender that picks the split whose largest stage peak (``lce_train.pp_memory``) is smallest.

Splits are lists of transformer layers per *virtual* stage, p v of them; virtual stage k lives on
rank k % p as model chunk k // p (Megatron's order). The recommender searches the splits that
megatron's flags express, the first and last virtual stage free and all others equal
(``--decoder-first/last-pipeline-num-layers``), and, without virtual stages, every split with at
least one layer per stage (a ``--pipeline-model-parallel-layout`` string). It also answers what a
memory budget allows: the fewest stages, the longest sequence, the largest micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from lce_train.configs import ModelConfig
from lce_train.pp_memory import Layout, Loss, peak, rank_memory

# ----------------------------------------------------------------------------------------------
# Megatron's layer split rules
# ----------------------------------------------------------------------------------------------


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None,
                       last: int | None = None, account_embedding: bool = False,
                       account_loss: bool = False) -> list[int]:
    """Transformer layers per pipeline stage, by megatron-core's rules (get_num_layers_to_build).

    Raises:
        ValueError: the split is impossible, with megatron's reason in words.
    """
    if pp == 1:
        if first is not None or last is not None:
            raise ValueError("--decoder-first/last-pipeline-num-layers need PP > 1")
        return [num_layers]
    if first is not None or last is not None:
        if account_embedding or account_loss:
            raise ValueError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                             "--account-for-embedding/loss-in-pipeline-split")
        rest, stages = num_layers, pp
        for given in (first, last):
            if given is not None:
                if given <= 0:
                    raise ValueError("first/last stage layer counts must be positive")
                rest, stages = rest - given, stages - 1
        if stages > 0:
            if rest < 0 or rest % stages:
                raise ValueError(f"{rest} layers left for {stages} middle stage(s): must divide")
            middle = rest // stages
        elif rest != 0:
            raise ValueError(f"first + last stage layers ({num_layers - rest}) != num_layers "
                             f"({num_layers})")
        else:
            middle = 0
        counts = [middle] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts
    units = num_layers + int(account_embedding) + int(account_loss)
    if units % pp:
        what = "num_layers" + (" + 1 (embedding)" if account_embedding else "") + \
            (" + 1 (loss)" if account_loss else "")
        raise ValueError(f"{what} = {units} is not divisible by PP = {pp}")
    counts = [units // pp] * pp
    if account_embedding:
        counts[0] -= 1
    if account_loss:
        counts[-1] -= 1
    if min(counts) < 0:
        raise ValueError("not enough layers for the embedding/loss stages")
    return counts


def layout_string(split: list[int]) -> str:
    """A ``--pipeline-model-parallel-layout`` string for a split over virtual stages, in
    megatron-core's syntax (``"Et*3|(tt|)*29,m|L"``): ``E`` the embedding, ``t`` a transformer
    layer, ``t*n`` n of them, ``L`` the loss, ``,`` between terms, ``|`` between stages."""
    parts = [f"t*{n}" if n > 1 else "t" * n for n in split]
    parts[0] = "E" + parts[0]
    parts[-1] = parts[-1] + ("," if parts[-1] else "") + "L"
    return "|".join(parts)


# ----------------------------------------------------------------------------------------------
# The recommender
# ----------------------------------------------------------------------------------------------


def even_split(cfg: ModelConfig, lay: Layout, account_embedding: bool = False,
               account_loss: bool = False) -> list[int]:
    """Megatron's default split over the virtual stages (raises ValueError where it has none)."""
    return stage_layer_counts(cfg.num_layers, lay.pp * lay.vpp, None, None, account_embedding,
                              account_loss)


def first_last_splits(num_layers: int, stages: int):
    """Every split with the first and last stage free (>= 1 layer) and the others equal."""
    if stages == 1:
        yield [num_layers]
        return
    for first in range(1, num_layers):
        for last in range(1, num_layers - first + 1):
            rest = num_layers - first - last
            if stages == 2:
                if rest == 0:
                    yield [first, last]
            elif rest > 0 and rest % (stages - 2) == 0:
                yield [first] + [rest // (stages - 2)] * (stages - 2) + [last]


def stage_costs(cfg: ModelConfig, lay: Layout) -> list[list[float]]:
    """Without virtual stages: ``costs[i][n]``, stage i's peak when it holds n layers (a stage's
    peak depends only on its own layers)."""
    if lay.vpp != 1:
        raise ValueError("stage_costs handles one model chunk per rank")
    return [[rank_memory(cfg, lay, i, [n]).total for n in range(cfg.num_layers + 1)]
            for i in range(lay.pp)]


def best_first_last(cfg: ModelConfig, lay: Layout) -> list[int] | None:
    """The split of the first/last family with the smallest largest stage (ties: the one nearest
    to even), or None where the family is empty."""
    even = cfg.num_layers / (lay.pp * lay.vpp)
    if lay.vpp == 1:
        costs = stage_costs(cfg, lay)
        top = lambda sp: max(costs[i][n] for i, n in enumerate(sp))
    else:
        top = lambda sp: peak(cfg, lay, sp)
    key = lambda sp: (top(sp), sum(abs(n - even) for n in sp))
    return min(first_last_splits(cfg.num_layers, lay.pp * lay.vpp), key=key, default=None)


def best_any(cfg: ModelConfig, lay: Layout) -> list[int] | None:
    """The split (>= 1 layer per stage, no virtual stages) with the smallest largest stage.

    Each stage's peak grows with its own layers only, so adding the layers one at a time, each
    to the stage that stays lowest after it, minimises the largest stage.
    """
    if cfg.num_layers < lay.pp:
        return None
    costs = stage_costs(cfg, lay)
    split = [1] * lay.pp
    for _ in range(cfg.num_layers - lay.pp):
        i = min(range(lay.pp), key=lambda i: costs[i][split[i] + 1])
        split[i] += 1
    return split


@dataclass(frozen=True)
class Recommendation:
    loss: Loss
    split: list[int]
    """Layers per virtual stage, the chosen one."""
    flags: str | None
    """The launcher flags for it, where first/last flags express it (no virtual stages)."""
    layout: str
    """The ``--pipeline-model-parallel-layout`` string for it."""
    peak: float


def recommend(cfg: ModelConfig, lay: Layout) -> Recommendation | None:
    """The split with the smallest largest stage for ``lay.loss``: the best of megatron's
    first/last family and, without virtual stages, of every split; flags where they suffice."""
    candidates = [sp for sp in (best_first_last(cfg, lay),
                                best_any(cfg, lay) if lay.vpp == 1 else None) if sp]
    if not candidates:
        return None
    split = min(candidates, key=lambda sp: peak(cfg, lay, sp))
    flags = None
    if lay.vpp == 1 and lay.pp > 1 and split in list(first_last_splits(cfg.num_layers, lay.pp)):
        flags = (f"--decoder-first-pipeline-num-layers {split[0]} "
                 f"--decoder-last-pipeline-num-layers {split[-1]}")
    elif lay.pp == 1:
        flags = ""
    return Recommendation(lay.loss, split, flags, layout_string(split), peak(cfg, lay, split))


def rebalanced_peak(cfg: ModelConfig, lay: Layout) -> float:
    rec = recommend(cfg, lay)
    return float("inf") if rec is None else rec.peak


def fewest_stages(cfg: ModelConfig, lay: Layout, budget: float) -> int | None:
    """The smallest PP (same TP, DP, virtual stages, micro-batches) whose rebalanced peak fits."""
    for pp in range(1, cfg.num_layers // lay.vpp + 1):
        vpp = lay.vpp if pp > 1 else 1
        if rebalanced_peak(cfg, lay.replace(pp=pp, vpp=vpp)) <= budget:
            return pp
    return None


def largest(cfg: ModelConfig, lay: Layout, field: str, budget: float, step: int = 1,
            limit: int = 2**22) -> int | None:
    """The largest multiple of ``step`` for ``field`` (seq_length or micro_batch) whose
    rebalanced peak fits the budget (the peak grows with both)."""
    fits = lambda k: rebalanced_peak(cfg, lay.replace(**{field: k * step})) <= budget
    if not fits(1):
        return None
    lo, hi = 1, 2
    while hi * step <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit // step + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step
