"""Where the time of one forward+backward goes: the GPU kernels by total time (torch.profiler).

    python scripts/profile_lce.py --model gemma2_2b --tokens 8192 [--scratch-mb 12]

Prints the top kernels with their share of the GPU time, for ``impl="cce"`` on random-init inputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fused_lce import linear_cross_entropy  # noqa: E402
from fused_lce.configs import load_model_config  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma2_2b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--scratch-mb", type=float, default=None)
    parser.add_argument("--backward", default="auto")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    cfg = load_model_config(args.model)
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda") * 0.02).bfloat16()
    hidden.requires_grad_()
    weight.requires_grad_()
    target = torch.randint(0, cfg.vocab_size, (args.tokens,), device="cuda")

    def step():
        hidden.grad = None
        weight.grad = None
        loss = linear_cross_entropy(hidden, weight, target, impl="cce",
                                    scratch_mb=args.scratch_mb, backward=args.backward)
        loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    print(f"# {args.model} N={args.tokens}: GPU time {total / 1e3:.2f} ms in "
          f"{sum(e.count for e in events)} kernel launches")
    for e in events[: args.top]:
        print(f"{e.device_time_total / 1e3:8.2f} ms {100 * e.device_time_total / total:5.1f}% "
              f"x{e.count:<5d} {e.key[:90]}")


if __name__ == "__main__":
    main()
