"""The mean loss's error against float64 over many draws of the data, ours beside torch.compile.

    python scripts/studies/experiment_loss_seeds.py [--models phi3_5_mini ...] [--seeds 8]

One draw tells a bias from luck poorly: torch.compile's loss reads bf16-rounded logits, whose
per-token errors (about 3e-2 nats RMS) are large but random, so their mean over N tokens lands
anywhere within a few RMS / sqrt(N) of zero; ours reads the tensor cores' fp32 accumulation,
whose per-token errors are 200x smaller but biased (docs/benchmarks/single_gpu.md).
This draws ``--seeds`` data sets per shape (``lce_train.bench_lce_inputs.make_inputs``, as
scripts/bench_lce.py draws them) and prints each provider's signed relative error of the mean
loss per draw, then the median of its size and the mean of its sign over the draws. Forward
only: the loss is the same number either way.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from lce_train.bench_lce_inputs import Case, make_inputs
from lce_train.bench_lce_providers import providers
from lce_train.configs import load_model_config


def fp64_loss(hidden, weight, target, rows: int = 1024) -> float:
    """The mean cross-entropy in float64, token chunk by token chunk."""
    w = weight.double()
    total = 0.0
    for start in range(0, hidden.shape[0], rows):
        logits = hidden[start:start + rows].double() @ w.t()
        t = target[start:start + rows]
        total += (torch.logsumexp(logits, 1) - logits.gather(1, t[:, None]).squeeze(1)).sum()
    return float(total) / hidden.shape[0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["phi3_5_mini", "llama3_8b", "gemma2_2b"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--regime", default="trained", choices=["uniform", "trained"])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--providers", nargs="+", default=["cce", "torch.compile"])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    chosen = providers(args.providers)
    print(f"# {torch.cuda.get_device_name() if args.device == 'cuda' else args.device}, "
          f"N={args.tokens}, {args.regime}; signed relative error of the mean loss per draw",
          flush=True)
    for model in args.models:
        cfg = load_model_config(model)
        case = Case(model, args.tokens, cfg.vocab_size, cfg.hidden_size, args.regime)
        errors = {name: [] for name in chosen}
        for seed in range(args.seeds):
            hidden, weight, target = make_inputs(case, torch.bfloat16, args.device,
                                                           seed=seed)
            reference = fp64_loss(hidden, weight, target)
            with torch.no_grad():
                for name, fn in chosen.items():
                    errors[name].append((fn(hidden, weight, target).item() - reference)
                                        / reference)
            print(f"{model:>12} seed {seed}: loss {reference:.6f}  " + "  ".join(
                f"{name} {errs[-1]:+.2e}" for name, errs in errors.items()), flush=True)
            del hidden, weight, target
        for name, errs in errors.items():
            print(f"{model:>12} {name:>14}: median |error| "
                  f"{statistics.median(abs(e) for e in errs):.2e}, mean error "
                  f"{statistics.fmean(errs):+.2e}, largest |error| "
                  f"{max(abs(e) for e in errs):.2e} over {len(errs)} draws", flush=True)


if __name__ == "__main__":
    main()
