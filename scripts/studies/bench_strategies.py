"""Where each cce strategy is the best choice: one GPU, named shapes, budgets and workloads.

    python scripts/studies/bench_strategies.py --out RESULTS_DIR

Every strategy the op keeps must win somewhere (or provide a feature nothing else does); this
script times them side by side, with torch.compile as the yardstick, in two workloads:

- ``mean``: the mean loss, what pretraining runs. The default computes the gradients in the
  forward (``in_forward``); under a memory budget the planner picks between it and the
  recomputing ``gemm`` backward, whose buffers go in the weight gradient's storage
  (``borrowed``) or walk token chunks (``token_chunks``). ``tiles`` is the paper's fused
  backward, timed with and without its gradient filter.
- ``weighted``: per-token losses times per-token weights that are not a multiple of the loss
  mask (RL advantages, importance weights). The forward's gradients then do not apply, the
  default recomputes them (six GEMMs), and the recomputing (``gemm``, four GEMMs) and
  ``keep_logits=True`` (``kept``, three GEMMs at a bf16 logits tensor's memory) backwards
  are the ones to compare. When the weights are known before the forward, passing them as
  ``loss_mask`` lets the default keep its forward's gradients (the row ``weights as
  loss_mask``); ``kept`` is for an upstream gradient the forward cannot know.

Shapes: the three models at TP=1, and one TP=8 rank's work (its V/8 vocabulary shard, every
token: with sequence parallelism the hidden states are gathered) for the two big vocabularies.
The collectives of TP are a few N-float all-reduces, not timed here.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import warnings
from pathlib import Path

import torch

import fused_lce.backward_plan as backward_plan
from fused_lce import linear_cross_entropy
from fused_lce.options import LEAN_SCRATCH_MB
from lce_train.bench_lce_inputs import Case, make_inputs
from lce_train.bench_lce_providers import torch_loss
from lce_train.bench_lce_timing import gemm_ceiling, measure
from lce_train.configs import load_model_config

SHAPES = {  # name: (model config, tensor-parallel ranks)
    "gemma2_2b": ("gemma2_2b", 1),
    "llama3_8b": ("llama3_8b", 1),
    "phi3_5_mini": ("phi3_5_mini", 1),
    "gemma2_2b_tp8": ("gemma2_2b", 8),
    "llama3_8b_tp8": ("llama3_8b", 8),
}


def _cce(**options):
    return lambda h, w, t: linear_cross_entropy(h, w, t, impl="cce", **options)


def _without_borrowing(fn):
    """``fn`` with the gemm planner's borrowed strategy off, so a budget walks token chunks."""
    def call(h, w, t):
        original = backward_plan.plan_weight_buffer
        backward_plan.plan_weight_buffer = lambda *args, **kwargs: None
        try:
            return fn(h, w, t)
        finally:
            backward_plan.plan_weight_buffer = original
    return call


def mean_strategies() -> dict:
    """The mean loss: each strategy and budget the planner can take."""
    compiled = torch.compile(torch_loss)
    lean = _cce(scratch_mb=LEAN_SCRATCH_MB)
    return {
        "torch.compile": compiled,
        "in_forward (default)": _cce(),
        "in_forward, check_targets=False": _cce(check_targets=False),
        "auto, 512 MiB": _cce(scratch_mb=512),
        "auto, 512 MiB, bf16 weight-grad sum": _cce(scratch_mb=512, fp32_weight_grad=False),
        "gemm, 512 MiB": _cce(scratch_mb=512, backward="gemm"),
        "lean (auto: gemm, borrowed where it fits)": lean,
        "lean, token_chunks only": _without_borrowing(lean),
        "kept": _cce(keep_logits=True),
        "tiles, safe filter": _cce(backward="tiles"),
        "tiles, no filter": _cce(backward="tiles", filter_eps=None),
        "chunked (PyTorch, vocab chunks)": lambda h, w, t: linear_cross_entropy(
            h, w, t, impl="chunked"),
    }


def weighted_strategies(n_tokens: int) -> dict:
    """Per-token weights not proportional to the mask: the forward's gradients do not apply."""
    seeded = torch.Generator(device="cuda").manual_seed(5)
    weights = torch.rand(n_tokens, device="cuda", generator=seeded)

    def weighted(**options):
        def call(h, w, t):
            losses = linear_cross_entropy(h, w, t, impl="cce", reduction="none", **options)
            return (losses * weights).sum()
        return call

    def weights_as_loss_mask(h, w, t):
        # Weights known before the forward, handed over: the forward's gradients then apply.
        losses = linear_cross_entropy(h, w, t, impl="cce", reduction="none", loss_mask=weights)
        return (losses * weights).sum()

    def torch_weighted(h, w, t):
        losses = torch.nn.functional.cross_entropy((h @ w.t()).float(), t, reduction="none")
        return (losses * weights).sum()

    return {
        "torch.compile": torch.compile(torch_weighted),
        "in_forward (default; recomputes)": weighted(),
        "in_forward, weights as loss_mask": weights_as_loss_mask,
        "gemm": weighted(backward="gemm"),
        "kept": weighted(keep_logits=True),
    }


def run(shapes: list[str], n_tokens: int, regime: str, rep_ms: int,
        workloads: tuple[str, ...] = ("mean", "weighted"), only: str | None = None) -> list[dict]:
    rows = []
    for shape in shapes:
        model, tp = SHAPES[shape]
        cfg = load_model_config(model)
        vocab = math.ceil(cfg.vocab_size / tp)
        case = Case(shape, n_tokens, vocab, cfg.hidden_size, regime)
        hidden, weight, target = make_inputs(case, torch.bfloat16, "cuda")
        target = target % vocab  # a shard's targets fall in its shard (the rest is the same work)
        ceiling = gemm_ceiling(case, torch.bfloat16, rep_ms)
        floor_ms = 3 * 2 * n_tokens * vocab * cfg.hidden_size / ceiling / 1e9
        print(f"# {shape} N={n_tokens} V={vocab} D={cfg.hidden_size} {regime}: cuBLAS "
              f"{ceiling:.0f} TFLOP/s, 3-GEMM floor {floor_ms:.2f} ms", flush=True)
        tables = {"mean": mean_strategies, "weighted": lambda: weighted_strategies(n_tokens)}
        for workload in workloads:
            table = tables[workload]()
            for name, fn in table.items():
                if only is not None and not any(part in name for part in only.split("|")):
                    continue
                try:
                    result = measure(fn, hidden, weight, target, rep_ms)
                except Exception as exc:  # noqa: BLE001  (out of memory, a refused budget)
                    print(f"# {shape} {workload} {name}: {type(exc).__name__}: {exc}"[:300])
                    result = {"fwd_bwd_ms": math.nan, "extra_mib": math.nan}
                    torch.cuda.empty_cache()
                row = {"shape": shape, "tokens": n_tokens, "vocab": vocab,
                       "hidden": cfg.hidden_size, "regime": regime, "workload": workload,
                       "strategy": name, "fwd_bwd_ms": result["fwd_bwd_ms"],
                       "extra_mib": result["extra_mib"], "floor_ms": floor_ms}
                rows.append(row)
                print(f"{shape:>15} {workload:>8} {name:>42}: {row['fwd_bwd_ms']:8.2f} ms "
                      f"{row['extra_mib']:9.1f} MiB", flush=True)
        del hidden, weight, target
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--regime", default="trained", choices=["uniform", "trained"])
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--workloads", nargs="+", default=["mean", "weighted"],
                        choices=["mean", "weighted"])
    parser.add_argument("--only", default=None, metavar="A|B",
                        help="time only the strategies whose name contains one of these")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    # The default's recompute warning is the point of the weighted workload, not news.
    warnings.filterwarnings("ignore", message=".*upstream gradient is not a multiple.*")
    rows = run(args.shapes, args.tokens, args.regime, args.rep_ms, tuple(args.workloads),
               args.only)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "results.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
