"""Host milliseconds per forward + backward of the loss, the GPU held busy so the host never waits.

    python scripts/bench_host.py                                   # one GPU
    torchrun --nproc-per-node 2 scripts/bench_host.py --tp         # TP2 over NCCL

A sleep kernel of about a second is queued first; the calls are then timed on the host. A call
that reads the device waits for the sleep and shows as ~1000 ms. Then the wall ms per call of
back-to-back calls. One GPU: fused_lce's defaults (the forward replayed from its CUDA graph),
fused_lce without graphs, beside torch eager (F.linear + F.cross_entropy) and torch.compile of
the same, at the shapes of a TP8 rank of Llama-3, Phi-3.5 and Llama-3 whole. TP2: the vocab-
parallel layer's defaults and the Megatron adapter's call, with and without graphs, beside
megatron-core's fused vocab-parallel loss with its matmul (``--cross-entropy-loss-fusion``),
needing megatron-core. Medians of 7 rounds of 5 calls, after 3 warm-up calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

SINGLE_SHAPES = {"llama3-tp8-rank": (4096, 16032, 4096), "phi3.5": (4096, 32064, 3072),
                 "llama3": (8192, 128256, 4096)}
TP_SHAPE = (4096, 32064, 4096)  # N, V per rank, D


def host_ms(step, calls: int = 5, rounds: int = 7) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(int(2e9))  # about a second of GPU work ahead of the calls
        start = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - start) * 1e3 / calls)
        torch.cuda.synchronize()
    return statistics.median(times)


def step_ms(step, calls: int = 10, rounds: int = 5) -> float:
    """Wall milliseconds per call of back-to-back calls (GPU and host together)."""
    for _ in range(3):
        step()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return statistics.median(times)


def _problem(n, v, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = (torch.randn(v, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
    target = torch.randint(0, v, (n,), device="cuda", generator=gen)
    return hidden.requires_grad_(), weight.requires_grad_(), target


def single_device() -> None:
    import fused_lce

    def torch_loss(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    def eager_lce(h, w, t):
        return fused_lce.linear_cross_entropy(h, w, t, cuda_graphs=False)

    compiled = torch.compile(torch_loss)
    providers = {"fused_lce defaults": fused_lce.linear_cross_entropy,
                 "fused_lce cuda_graphs=False": eager_lce, "torch eager": torch_loss,
                 "torch.compile": compiled}
    print("host ms per forward + backward (GPU held busy), then wall ms per call back to back")
    print("| shape (N x V x D) | " + " | ".join(providers) + " |")
    print("|---|" + "---|" * len(providers))
    for name, (n, v, d) in SINGLE_SHAPES.items():
        h, w, t = _problem(n, v, d)
        host, wall = [], []
        for fn in providers.values():
            def step(fn=fn, h=h, w=w, t=t):
                fn(h, w, t).backward()
                h.grad = w.grad = None

            host.append(host_ms(step))
            wall.append(step_ms(step))
        print(f"| {name} {n} x {v} x {d}, host | " + " | ".join(f"{x:.2f}" for x in host) + " |")
        print(f"| {name} {n} x {v} x {d}, wall | " + " | ".join(f"{x:.2f}" for x in wall) + " |")


def tensor_parallel() -> None:
    import torch.distributed as dist

    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    n, v, d = TP_SHAPE
    h, w, t = _problem(n, v, d)
    mask = torch.ones(n, device="cuda")
    start = rank * v

    def ours():
        vocab_parallel_linear_cross_entropy(h, w, t).backward()

    def adapter():
        loss = vocab_parallel_linear_cross_entropy(
            h, w, t, reduction="none", loss_mask=mask, check_targets=False,
            agree_every_call=False, vocab_start_index=start)
        (loss * mask).sum().backward()

    def adapter_eager():
        loss = vocab_parallel_linear_cross_entropy(
            h, w, t, reduction="none", loss_mask=mask, check_targets=False,
            agree_every_call=False, vocab_start_index=start, cuda_graphs=False)
        (loss * mask).sum().backward()

    providers = {"fused_lce layer, defaults": ours, "fused_lce, the Megatron adapter's call":
                 adapter, "the adapter's call, cuda_graphs=False": adapter_eager}
    try:
        from megatron.core import parallel_state
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
        group = parallel_state.get_tensor_model_parallel_group()

        def megatron_fused():
            logits = torch.matmul(h, w.t())
            loss = fused_vocab_parallel_cross_entropy(logits[:, None], t[:, None], group)
            (loss * mask[:, None]).sum().backward()

        providers["megatron fused (with its matmul)"] = megatron_fused
    except ImportError as exc:
        if rank == 0:
            print(f"megatron-core not importable ({exc}): its fused loss is not timed")
    results = {}
    for name, step in providers.items():
        def cleared(step=step):
            step()
            h.grad = w.grad = None

        results[name] = (host_ms(cleared), step_ms(cleared))
    if rank == 0:
        print(f"| TP{dist.get_world_size()}, {n} x {v} x {d} per rank | host ms (GPU busy) | "
              "wall ms back to back |")
        print("|---|---|---|")
        for name, (host, wall) in results.items():
            print(f"| {name} | {host:.2f} | {wall:.2f} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", action="store_true", help="the TP2 table (under torchrun)")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.tp:
        tensor_parallel()
    else:
        single_device()


if __name__ == "__main__":
    main()
