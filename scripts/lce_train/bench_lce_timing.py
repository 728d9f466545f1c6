"""How the single-GPU benchmark (scripts/bench_lce.py) and the studies beside it time a loss on
one GPU: back-to-back calls between CUDA events, the extra memory of one forward+backward, and
the cuBLAS GEMM rate of the same run as the ceiling the TFLOP/s figures sit under.
"""

from __future__ import annotations

import gc

import torch

from lce_train.bench_lce_inputs import Case

MIB = 2**20


def looped_median(fn, rep_ms: int, windows: int = 5) -> float:
    """Median over ``windows`` of the mean time of back-to-back calls (CUDA events around each
    window, about ``rep_ms`` long), after two warm-up calls.

    Why not ``triton.testing.do_bench``: it times every call alone between events, after an L2
    flush, and at 40-50 ms per call takes the median of 3 calls. There our gradient-in-forward
    mode read 6-11 ms slower for fwd+bwd than for fwd alone (Gemma-2 2B, H100), while plain loops
    and the profiler showed the same 44.9 ms GPU span for both: an artefact of the timer. Back-to-
    back calls are how training runs; every provider is timed the same way.
    """
    fn()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(1, round(rep_ms / max(start.elapsed_time(end), 1e-3)))
    means = []
    for _ in range(windows):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        means.append(start.elapsed_time(end) / calls)
    return sorted(means)[len(means) // 2]


def steps_median_ms(step, steps: int = 10, windows: int = 5) -> float:
    """Median over ``windows`` of the mean time of ``steps`` back-to-back calls (CUDA events),
    after one warm-up call: ``looped_median`` with a fixed window, for studies that compare whole
    training-like steps (scripts/studies/profile_default.py, scripts/studies/lean_roofline.py).
    """
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return sorted(times)[len(times) // 2]


def measure(fn, hidden, weight, target, rep_ms: int, timer: str = "loop") -> dict:
    """Forward, backward and forward+backward ms of ``fn`` and its extra MiB.

    ``timer``: ``loop`` (``looped_median``) or ``do_bench`` (triton's, per call).
    """
    from triton.testing import do_bench

    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    grad_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()

    def fwd():
        return fn(h, w, target)

    def fwd_bwd():
        h.grad = None
        w.grad = None
        fn(h, w, target).backward()

    fwd_bwd()  # compile / warm up
    torch.cuda.synchronize()
    h.grad = None
    w.grad = None
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - grad_bytes

    # The backward alone is the difference: some providers (torch.compile) cannot run their
    # backward twice on one graph.
    time_ms = looped_median if timer == "loop" else (
        lambda f, rep: do_bench(f, warmup=25, rep=rep, return_mode="median"))
    t_fwd = time_ms(fwd, rep_ms)
    t_both = time_ms(fwd_bwd, rep_ms)
    loss = fn(h, w, target).item()
    h.grad = None
    w.grad = None
    return {"fwd_ms": t_fwd, "bwd_ms": t_both - t_fwd, "fwd_bwd_ms": t_both,
            "extra_mib": extra / MIB, "loss": loss}


def gemm_ceiling(case: Case, dtype, rep_ms: int) -> float:
    """TFLOP/s of cuBLAS's (N, D) x (D, V) GEMM at the case's shape."""
    from triton.testing import do_bench

    a = torch.randn(case.n_tokens, case.hidden, device="cuda", dtype=dtype)
    b = torch.randn(case.vocab, case.hidden, device="cuda", dtype=dtype)
    ms = do_bench(lambda: a @ b.t(), warmup=25, rep=rep_ms, return_mode="median")
    return 2 * case.n_tokens * case.vocab * case.hidden / ms / 1e9
