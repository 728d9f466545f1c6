"""Did NCCL's kernels run beside the walk's GEMMs? One kernel trace of the layer per variant of
the overlap experiment (overlap_experiment.patch beside this file, applied to 5eff19e), 2 ranks:

    git apply <this folder>/overlap_experiment.patch
    FUSED_LCE_TP_OVERLAP=dw torchrun --nproc-per-node 2 trace_overlap.py --label dw

Rank 0 prints, for two profiled fwd+bwd steps of the Llama-3 shape (N = 8192, TP = 2, no SP):
each NCCL kernel's time and the share of it that some other kernel ran beside; the GEMMs' time;
the steps' wall time on the GPU.
"""

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist

from fused_lce.parallel import vocab_parallel_linear_cross_entropy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shard = args.vocab // world
    hidden = torch.randn(args.tokens, args.hidden, device="cuda", generator=gen,
                         dtype=torch.bfloat16).requires_grad_()
    weight = (0.02 * torch.randn(shard, args.hidden, device="cuda", generator=gen)).to(
        torch.bfloat16).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=gen)

    def step():
        loss = vocab_parallel_linear_cross_entropy(hidden, weight, target, check_targets=False,
                                                   vocab_start_index=rank * shard,
                                                   vocab_size=args.vocab)
        loss.backward()
        hidden.grad = weight.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    if rank == 0:
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        summarize(json.load(open(path)), args.label)
    dist.barrier()
    dist.destroy_process_group()


def summarize(trace, label):
    kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
    nccl = [e for e in kernels if "nccl" in e["name"].lower()]
    others = [e for e in kernels if "nccl" not in e["name"].lower()]
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    print(f"== {label}: GPU span of 2 steps {(end - start) / 1e3:.2f} ms, "
          f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}")
    for e in nccl:
        lo, hi = e["ts"], e["ts"] + e["dur"]
        covered = sum(max(0.0, min(hi, o["ts"] + o["dur"]) - max(lo, o["ts"])) for o in others)
        beside = [o["name"][:40] for o in others
                  if min(hi, o["ts"] + o["dur"]) - max(lo, o["ts"]) > 0.2 * e["dur"]]
        print(f"  {e['name'][:48]:48s} at {(lo - start) / 1e3:7.3f} ms, {e['dur'] / 1e3:6.3f} ms, "
              f"{min(covered / e['dur'], 1.0):4.0%} beside other kernels: {sorted(set(beside))}")
    big = sorted(others, key=lambda e: -e["dur"])[:8]
    for e in sorted(big, key=lambda e: e["ts"]):
        print(f"  {e['name'][:48]:48s} at {(e['ts'] - start) / 1e3:7.3f} ms, "
              f"{e['dur'] / 1e3:6.3f} ms")


if __name__ == "__main__":
    main()
