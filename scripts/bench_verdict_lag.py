"""The Megatron adapter's loss step (reduction "none" with the loss mask, upstream_mismatch="nan",
no target check) in a loop, with the backward's verdict read one op call later (lag 1: what
every call did before 2026-11-27's seventh session) and two calls later (``VERDICT_LAG_CALLS``,
the default). One GPU.

    python scripts/bench_verdict_lag.py [--cases phi3_5_mini:4096 llama3_8b:8192:8]

For each case (model:tokens[:tensor-parallel ranks], the shard a rank holds) and each call (the
single-device op, and the vocab-parallel layer on a one-rank NCCL group: the adapter's own call),
it prints ms per step (CUDA events over 20 back-to-back steps, median of 5 rounds, the lags
interleaved) and the host's ms to queue a step with the GPU asleep (the verdicts' reads put off
past the measurement: behind a sleeping GPU any lag waits once the host is that many steps
ahead). With lag 1 each call waits for the previous step's backward, so the host cannot queue
ahead of the GPU: the step is then about the host's time plus the GPU's, where it should be the
larger of the two.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _script(name: str):
    """A sibling script as a module (scripts import no other script by name)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


host_breakdown = _script("host_breakdown")

from fused_lce import forward_grad  # noqa: E402


def step_ms(step, steps: int = 20) -> float:
    """ms per step over ``steps`` back-to-back steps, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+",
                        default=["phi3_5_mini:4096", "gemma2_2b:4096:4", "llama3_8b:8192:8"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, default lag "
          f"{forward_grad.VERDICT_LAG_CALLS}", flush=True)
    print("| case | call | lag 1: ms/step | lag 2: ms/step | lag 1 / lag 2 | host ms/step |")
    print("|---|---|---|---|---|---|")
    default_lag = forward_grad.VERDICT_LAG_CALLS
    for spec in args.cases:
        model, tokens, *tp = spec.split(":")
        shards = int(tp[0]) if tp else 1
        for label, layer in (("op", False), ("layer, 1 rank", True)):
            step = host_breakdown.make_adapter_step(model, int(tokens), shards, layer)
            times = {1: [], 2: []}
            try:
                for _ in range(args.rounds):
                    for lag in (1, 2):
                        forward_grad.VERDICT_LAG_CALLS = lag
                        step()  # lets the previous lag's verdicts fall due
                        times[lag].append(step_ms(step))
                # Behind a sleeping GPU even lag 2 waits (for the step two back): the host's
                # own time is read with the reads put off past the measurement.
                forward_grad.VERDICT_LAG_CALLS = 1000
                host_ms = host_breakdown.host_steady_ms(step)
            finally:
                forward_grad.VERDICT_LAG_CALLS = default_lag
            one, two = statistics.median(times[1]), statistics.median(times[2])
            print(f"| {spec} | {label} | {one:.2f} | {two:.2f} | {one / two:.3f} | "
                  f"{host_ms:.2f} |", flush=True)
            del step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
