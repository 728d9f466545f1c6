"""Show the op on this machine: the same loss and gradients as full logits, without the logits.

    python scripts/demo_lce.py                  # CUDA if present, else CPU
    python scripts/demo_lce.py --tokens 4096 --vocab 64000 --hidden 512

Runs one forward and backward with each implementation on one random problem and prints the
loss, the gradients' agreement with full logits, the wall time and the extra memory: on CUDA the
allocator's peak above inputs and gradients, on the CPU the growth of the process's peak resident
memory (implementations run leanest first, so each growth is that implementation's own).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from fused_lce import linear_cross_entropy

MIB = 2**20


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def run(impl: str, hidden, weight, target, device) -> dict:
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        # The gradient buffers are results, not overhead.
        base = torch.cuda.memory_allocated(device) + h.numel() * h.element_size()
        base += w.numel() * w.element_size()
    else:
        base = peak_bytes(device)
    start = time.perf_counter()
    loss = linear_cross_entropy(h, w, target, impl=impl)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    extra = max(peak_bytes(device) - base, 0)
    return {"loss": loss.item(), "grads": (h.grad, w.grad), "seconds": seconds, "extra": extra}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    weight = (torch.randn(args.vocab, args.hidden, device=device) * 0.05).to(dtype)
    target = torch.randint(0, args.vocab, (args.tokens,), device=device)
    target[::10] = -100  # some ignored tokens, as padding would give

    impls = ["cce", "chunked", "torch"] if device.type == "cuda" else ["chunked", "torch"]
    logits_mib = args.tokens * args.vocab * 4 / MIB
    print(f"device {device}, {dtype}, N={args.tokens} tokens, V={args.vocab}, D={args.hidden}: "
          f"full fp32 logits take {logits_mib:.0f} MiB")
    results = {impl: run(impl, hidden, weight, target, device) for impl in impls}
    oracle = results["torch"]["grads"]
    for impl, r in results.items():
        agree = max(
            ((g.float() - o.float()).norm() / o.float().norm()).item()
            for g, o in zip(r["grads"], oracle)
        )
        print(f"{impl:>8}: loss {r['loss']:.6f}  grad rel. diff vs torch {agree:.1e}  "
              f"{r['seconds'] * 1e3:8.1f} ms  extra memory {r['extra'] / MIB:8.1f} MiB")


if __name__ == "__main__":
    main()
