"""What the ranks' per-call agreement costs the vocab-parallel layer (parallel/agreement.py).

    python scripts/studies/bench_agreement.py                          # one GPU (TP=1)
    torchrun --nproc-per-node 2 scripts/studies/bench_agreement.py     # TP = the world size, NCCL
    torchrun --nproc-per-node 2 scripts/studies/bench_agreement.py --cpu-smoke   # gloo, tiny shapes

At the Gemma-2 shape (N=8192 tokens, D=2304, V=256000 padded to a multiple of 128 x TP, bf16,
softcap 30), called as the megatron adapter calls the layer (explicit layout), it measures on
every rank and prints the slowest rank's figures:

- ``agree``: the agreement alone (describing the call, the host all-gather, the verdict), host
  time: the first call (on NCCL this makes the gloo host group) and the median of later calls,
  with ``check_targets`` off and on (on: the targets' min and max are read from the GPU);
- ``step``: forward+backward of the layer, median over ``--iters`` after ``--warmup``, with the
  agreement and with it replaced by a stub that returns the layout without communicating (what
  the layer did before with an explicit layout), the two taken in turn: the difference is the
  agreement's cost;
- ``host blocked``: the GPU is kept busy (``torch.cuda._sleep``, ~``--busy-ms``) and the host
  time of one forward call is taken: a forward that waits for the GPU (a device synchronisation)
  takes about the busy time, one that does not returns in the time it takes to launch.

On a single GPU the all-gather is skipped (nothing to disagree with): the figures are the cost
of describing the call and of the target check.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

from fused_lce.parallel import agreement, vocab_parallel

GEMMA2 = dict(tokens=8192, hidden=2304, vocab=256000, softcap=30.0)
SMOKE = dict(tokens=48, hidden=32, vocab=1003, softcap=30.0)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--agree-iters", type=int, default=200,
                        help="timed calls of the agreement alone (median)")
    parser.add_argument("--busy-ms", type=float, default=50.0,
                        help="GPU time kept busy before the host-blocking probe")
    parser.add_argument("--impl", default="auto", choices=["auto", "cce", "chunked"])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="gloo on the CPU, tiny shapes, impl chunked (checks the script)")
    return parser.parse_args(argv)


def init(args) -> torch.device:
    timeout = datetime.timedelta(seconds=120)
    if "RANK" not in os.environ:  # a plain `python` run: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    if args.cpu_smoke:
        dist.init_process_group("gloo", timeout=timeout)
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timeout, device_id=device)
    return device


def problem(shape: dict, device, tp: int, rank: int, dtype):
    g = torch.Generator().manual_seed(0)
    multiple = 128 * tp
    rows = -(-shape["vocab"] // multiple) * multiple
    local = rows // tp
    hidden = torch.randn(shape["tokens"], shape["hidden"], generator=g).to(device, dtype)
    weight = (torch.randn(local, shape["hidden"], generator=g) * 0.02).to(device, dtype)
    target = torch.randint(0, shape["vocab"], (shape["tokens"],), generator=g).to(device)
    return hidden.requires_grad_(), weight.requires_grad_(), target, rows, rank * local


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_agreement(call, iters: int) -> tuple[float, float]:
    """(first call, median of the next ``iters``) host milliseconds of ``call()``."""
    t0 = time.perf_counter()
    call()
    first = (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return first, statistics.median(times)


def time_steps(steps: dict, device, iters: int, warmup: int) -> dict[str, float]:
    """Median ms of each of ``steps`` (name -> (setup, step)), taken in turn in every iteration
    so that drift (clocks, other jobs) falls on all of them alike."""
    times = {name: [] for name in steps}
    for i in range(warmup + iters):
        for name, (setup, step) in steps.items():
            with setup():
                dist.barrier()
                sync(device)
                t0 = time.perf_counter()
                step()
                sync(device)
                if i >= warmup:
                    times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def host_time_of_forward(forward, device, busy_ms: float) -> float:
    """Host ms of one forward launched while the GPU is busy for ~``busy_ms``."""
    sync(device)
    dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        torch.cuda.synchronize()
        cycles = int(1_000_000 * busy_ms / max(start.elapsed_time(end), 1e-3))
        dist.barrier()
        torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    forward()
    host = (time.perf_counter() - t0) * 1e3
    sync(device)
    return host


def slowest(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64,
                     device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main(argv=None) -> None:
    args = parse_args(argv)
    device = init(args)
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    shape = SMOKE if args.cpu_smoke else GEMMA2
    impl = "chunked" if args.cpu_smoke else args.impl
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    hidden, weight, target, rows, start = problem(shape, device, tp, rank, dtype)
    options = dict(group=group, vocab_start_index=start, vocab_size=rows, impl=impl,
                   softcap=shape["softcap"])

    layer_options = dict(ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         softcap=shape["softcap"], z_loss=0.0, impl=impl, backward="auto",
                         filter_eps="safe", vocab_sort=True, deterministic=False,
                         round_logits=False, keep_logits=False, vocab_chunk_size=None,
                         scratch_mb=None)

    def agree(check_targets: bool):
        """The layer's entry minus its local checks: describe, agree (the targets are checked
        on the device, in the forward, not here)."""
        facts = vocab_parallel._call_facts(
            hidden, weight, target, None, None, layer_options, sequence_parallel=False,
            vocab_size=rows, return_lse=False, check_targets=check_targets)
        agreement.agree_on_call(group, facts=facts, shard_rows=weight.shape[0],
                                vocab_start_index=start, vocab_size=rows, error=None)

    results = {}
    for check in (False, True):
        first, later = time_agreement(lambda check=check: agree(check), args.agree_iters)
        results[f"agree first call, check_targets={check}"] = first
        results[f"agree later calls, check_targets={check}"] = later

    def step(check_targets=False):
        loss = vocab_parallel.vocab_parallel_linear_cross_entropy(
            hidden, weight, target, check_targets=check_targets, **options)
        loss.backward()
        hidden.grad = weight.grad = None

    @contextlib.contextmanager
    def stubbed():
        """The agreement replaced by the layout it would return, without communicating (what
        the layer did before with an explicit layout)."""
        real = agreement.agree_on_call

        def stub(group, *, vocab_start_index, vocab_size, **_):
            return agreement.AgreedLayout(start=vocab_start_index, num_classes=vocab_size,
                                          total_rows=vocab_size)

        agreement.agree_on_call = stub
        try:
            yield
        finally:
            agreement.agree_on_call = real

    results.update(time_steps({"step with agreement": (contextlib.nullcontext, step),
                               "step without agreement (stub)": (stubbed, step)},
                              device, args.iters, args.warmup))

    for check in (False, True):
        def forward(check=check):
            with torch.no_grad():
                vocab_parallel.vocab_parallel_linear_cross_entropy(
                    hidden, weight, target, check_targets=check, **options)
        forward()
        results[f"host blocked: forward host ms, check_targets={check}"] = host_time_of_forward(
            forward, device, args.busy_ms)

    worst = {k: slowest(v, device) for k, v in results.items()}
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"# agreement cost: TP={tp} on {name}, backend {dist.get_backend()}, "
              f"N={shape['tokens']} D={shape['hidden']} V={shape['vocab']} (rows {rows}), "
              f"impl {impl}, torch {torch.__version__}; slowest rank, ms")
        if device.type == "cuda":
            print(f"# GPU kept busy ~{args.busy_ms} ms before the host-blocking probe")
        for key, value in worst.items():
            print(f"{key:55s} {value:10.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
