"""Where the host's time goes in one step of the default bf16 walk, piece by piece, and what a
Triton launch costs through each of its three doors. One GPU.

    python scripts/host_breakdown.py --cases phi3_5_mini:4096 llama3_8b:8192:8

For each case (model:tokens[:tensor-parallel ranks], as scripts/profile_default.py reads them)
it prints the host's ms to enqueue one fwd+bwd step while a sleep kernel holds the GPU (median
of 7 steps, ``check_targets=False``; "alone": one step after the host idled, "back to back":
the mean over 8 steps in a row, warm caches), and the inclusive host ms per step of the op's
pieces: the functions of ``PIECES`` wrapped with timers (nested pieces count inside callers).

``--launches`` then times every Triton kernel the step launched, in microseconds per call with
the GPU asleep: through our wrapper's whole call (``wrapper``, from the pieces), through
``kernel[grid](...)`` with the wrapper's arguments (``jit``: triton's binder, specialisation,
cache lookup and launcher), and through the compiled kernel's own handle (``handle``: the
launcher alone). The difference says what a leaner launch path could save.

``--cprofile STEPS`` profiles STEPS back-to-back steps of each case (and of the Megatron
adapter's call through the vocab-parallel layer on a one-rank NCCL group, ``--parallel``) with
the GPU asleep, and prints where the host's time goes by function (own time) and by owner:
triton's launcher, torch's ops, this package, the rest.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib.util
import inspect
import math
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict
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


bench_lce = _script("bench_lce")
enqueue_us = _script("host_overhead").enqueue_us

import triton  # noqa: E402
from triton.runtime.jit import JITFunction, KernelInterface  # noqa: E402

from fused_lce import (  # noqa: E402
    api,
    engine,
    linear_cross_entropy,  # noqa: E402
    triton_shard,
)

# (module, attribute, label): what a step's host time is split into. The kernel wrappers are
# wrapped where triton_shard looks them up.
PIECES = (
    (api, "_dispatch", "whole forward (api._dispatch)"),
    (api, "validate", "  checks.validate"),
    (api, "single_device_loss", "  engine.single_device_loss"),
    (engine, "_walk_token_chunks", "    the walk"),
    (triton_shard.ExpGradientChunks, "__init__", "      chunks: buffers"),
    (triton_shard.ExpGradientChunks, "target_logits", "      target_logits"),
    (triton_shard.ExpGradientChunks, "compute_logits", "      compute_logits"),
    (triton_shard, "exp_logits", "        exp_logits (GEMM + row sums)"),
    (engine, "global_statistics", "      global_statistics"),
    (engine, "_lse_nll", "      _lse_nll"),
    (engine, "grad_coefficients", "      grad_coefficients"),
    (triton_shard.ExpGradientChunks, "gradients", "      gradients"),
    (triton_shard, "repair_exponentials", "        repair_exponentials"),
    (triton_shard, "row_scales", "        row_scales"),
    (triton_shard, "mm_into", "        mm_into (cuBLAS)"),
    (triton_shard, "accumulate_mm", "        accumulate_mm (cuBLAS)"),
    (triton_shard, "add_target_rows", "        add_target_rows"),
    (triton_shard, "finish_input_grad", "        finish_input_grad"),
    (triton_shard.ExpGradientChunks, "finish", "      chunks.finish"),
    (engine, "token_loss", "    token_loss"),
    (engine, "reduce_tokens", "    reduce_tokens"),
    (engine.LCEFunction, "backward", "whole backward (LCEFunction.backward)"),
    (engine, "_scaled_gradients", "  _scaled_gradients"),
)


class PieceTimer:
    """Inclusive host seconds per piece, summed over a step."""

    def __init__(self):
        self.totals = defaultdict(float)
        self._originals = []

    def install(self) -> None:
        for owner, name, label in PIECES:
            original = inspect.getattr_static(owner, name)
            function = original.__func__ if isinstance(original, staticmethod) else original
            timed = self._timed(label, function)
            setattr(owner, name, staticmethod(timed) if isinstance(original, staticmethod)
                    else timed)
            self._originals.append((owner, name, original, name in vars(owner)))

    def uninstall(self) -> None:
        for owner, name, original, own in reversed(self._originals):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # inherited: the base class's shows through again
        self._originals.clear()

    def _timed(self, label, function):
        totals = self.totals

        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start
        return timed


class LaunchRecorder:
    """The arguments of every Triton launch, as ``kernel[grid](...)`` and as the JIT function
    received them after its heuristics, with the compiled kernel they selected."""

    def __init__(self):
        self.entries = {}  # kernel name -> (interface, grid, args, kwargs)
        self.jit_calls = {}  # kernel name -> (jit function, args, kwargs, compiled kernel)
        self._getitem = KernelInterface.__getitem__
        self._run = JITFunction.run

    def install(self) -> None:
        recorder = self

        def getitem(interface, grid):
            def launch(*args, **kwargs):
                name = _kernel_name(interface)
                recorder.entries.setdefault(name, (interface, grid, args, dict(kwargs)))
                return interface.run(*args, grid=grid, warmup=False, **kwargs)
            return launch

        def run(jit, *args, grid, warmup, **kwargs):
            kernel = recorder._run(jit, *args, grid=grid, warmup=warmup, **kwargs)
            recorder.jit_calls.setdefault(jit.__name__, (jit, grid, args, dict(kwargs), kernel))
            return kernel

        KernelInterface.__getitem__ = getitem
        JITFunction.run = run

    def uninstall(self) -> None:
        KernelInterface.__getitem__ = self._getitem
        JITFunction.run = self._run


def _kernel_name(interface) -> str:
    while not isinstance(interface, JITFunction) and hasattr(interface, "fn"):
        interface = interface.fn
    return getattr(interface, "__name__", repr(interface))


def _handle_launch(jit, grid, args, kwargs, kernel):
    """A call that launches ``kernel`` through its compiled handle with the JIT call's
    arguments (every parameter of the signature, constexprs included, in order)."""
    values = dict(zip(jit.arg_names, args))
    values.update((k, v) for k, v in kwargs.items() if k in jit.arg_names)
    for param in jit.params:
        if param.name not in values:
            values[param.name] = param.default
    ordered = [values[name] for name in jit.arg_names]
    runner = kernel[tuple(grid) + (1,) * (3 - len(grid))]
    return lambda: runner(*ordered)


def make_step(model: str, n_tokens: int, tp: int, **options):
    cfg = bench_lce.load_model_config(model)
    vocab = math.ceil(cfg.vocab_size / tp)
    case = bench_lce.Case(model, n_tokens, vocab, cfg.hidden_size, "trained")
    hidden, weight, target = bench_lce.make_inputs(case, torch.bfloat16, "cuda")
    target = target % vocab
    h = hidden.requires_grad_()
    w = weight.requires_grad_()

    def step():
        h.grad = None
        w.grad = None
        linear_cross_entropy(h, w, target, impl="cce", check_targets=False,
                             **options).backward()
    return step


def make_adapter_step(model: str, n_tokens: int, tp: int, layer: bool = True):
    """A step of the Megatron adapter's call (parallel/megatron_patch.py: reduction "none" with
    the loss mask, no target check, the verdict left to the device, and for the layer agreement
    only on change): through the vocab-parallel layer on a one-rank NCCL group (the layer's
    host work without peers to wait for), or with ``layer=False`` through the op alone."""
    import torch.distributed as dist

    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    if layer and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
    cfg = bench_lce.load_model_config(model)
    vocab = math.ceil(cfg.vocab_size / tp)
    case = bench_lce.Case(model, n_tokens, vocab, cfg.hidden_size, "trained")
    hidden, weight, target = bench_lce.make_inputs(case, torch.bfloat16, "cuda")
    target = target % vocab
    mask = torch.ones(n_tokens, device="cuda")
    h = hidden.requires_grad_()
    w = weight.requires_grad_()
    options = dict(reduction="none", loss_mask=mask, check_targets=False,
                   upstream_mismatch="nan")

    def step():
        h.grad = None
        w.grad = None
        if layer:
            losses = vocab_parallel_linear_cross_entropy(h, w, target, agree_every_call=False,
                                                         **options)
        else:
            losses = linear_cross_entropy(h, w, target, impl="cce", **options)
        (losses * mask).sum().backward()
    return step


def _owner(filename: str) -> str:
    """Whose code a profiled function is: triton, torch, this project or the rest."""
    path = filename.replace(os.sep, "/")
    if "/triton/" in path:
        return "triton (binder, launcher, descriptors)"
    if "/torch/" in path or filename.startswith("<built-in method") or "torch._C" in filename:
        return "torch (ops, autograd, python)"
    if "/fused_lce/" in path or "/parallel/" in path:
        return "fused_lce + parallel (python)"
    return "other"


def cprofile_steps(step, steps: int, top: int = 30, rounds: int = 3) -> None:
    """Print the host's own time per function over ``rounds`` of ``steps`` back-to-back steps,
    the GPU asleep, and the totals by owner (``_owner``), in ms per step. A round is a few steps
    only: past about a thousand queued launches the launch queue is full and the host blocks."""
    step()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    for _ in range(rounds):
        torch.cuda._sleep(2_000_000_000)
        profile.enable()
        for _ in range(steps):
            step()
        profile.disable()
        torch.cuda.synchronize()
    steps *= rounds
    stats = pstats.Stats(profile)
    owners = defaultdict(float)
    rows = []
    for (filename, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        where = filename if filename != "~" else name
        owners[_owner(where)] += own
        rows.append((own, calls, cumulative, f"{Path(filename).name}:{line}({name})"))
    total = sum(owners.values())
    print(f"host ms per step under cProfile: {total / steps * 1e3:.2f}")
    for owner, seconds in sorted(owners.items(), key=lambda kv: -kv[1]):
        print(f"  {owner:<44} {seconds / steps * 1e3:7.3f}")
    print(f"  top {top} functions by own time: ms per step, calls per step, cumulative ms")
    for own, calls, cumulative, label in sorted(rows, reverse=True)[:top]:
        print(f"  {own / steps * 1e3:7.3f} {calls / steps:6.1f} {cumulative / steps * 1e3:8.3f}"
              f"  {label[:90]}")


def host_steps(step, timer: PieceTimer, steps: int = 7):
    """(median host ms of a step, {piece: median ms per step})."""
    step()
    torch.cuda.synchronize()
    walls, pieces = [], defaultdict(list)
    for _ in range(steps):
        torch.cuda._sleep(2_000_000_000)
        timer.totals.clear()
        start = time.perf_counter()
        step()
        walls.append((time.perf_counter() - start) * 1e3)
        for label, seconds in timer.totals.items():
            pieces[label].append(seconds * 1e3)
        torch.cuda.synchronize()
    return statistics.median(walls), {k: statistics.median(v) for k, v in pieces.items()}


def host_steady_ms(step, steps: int = 8) -> float:
    """Host ms per step over ``steps`` back-to-back steps enqueued behind a sleep kernel: the
    host's pace once its caches are warm, as in a training loop."""
    return enqueue_us(step, calls=steps, rounds=5, sleep_cycles=2_000_000_000) / 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=["phi3_5_mini:4096", "llama3_8b:8192:8"])
    parser.add_argument("--launches", action="store_true",
                        help="also time each kernel's launch through its three doors")
    parser.add_argument("--cprofile", type=int, default=0, metavar="STEPS",
                        help="profile STEPS back-to-back steps of each case by function")
    parser.add_argument("--parallel", action="store_true",
                        help="with --cprofile: also the Megatron adapter's call on one rank")
    args = parser.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    for spec in args.cases:
        model, tokens, *tp = spec.split(":")
        for chunks_label, options in (("default chunks", {}),
                                      ("one chunk", {"token_chunk_size": int(tokens)})):
            step = make_step(model, int(tokens), int(tp[0]) if tp else 1, **options)
            plain_ms, _ = host_steps(step, PieceTimer())
            steady_ms = host_steady_ms(step)
            timer = PieceTimer()
            timer.install()
            try:
                timed_ms, pieces = host_steps(step, timer)
            finally:
                timer.uninstall()
            print(f"\n## {spec}, {chunks_label}: host ms per step {plain_ms:.2f} alone "
                  f"({timed_ms:.2f} with the piece timers), {steady_ms:.2f} back to back")
            for _, _, label in PIECES:
                if label in pieces:
                    print(f"{label:<48} {pieces[label]:7.3f}")
            if args.cprofile:
                cprofile_steps(step, args.cprofile)
            del step
            torch.cuda.empty_cache()
        if args.cprofile and args.parallel:
            step = make_adapter_step(model, int(tokens), int(tp[0]) if tp else 1)
            print(f"\n## {spec}, the Megatron adapter's call on a one-rank NCCL group: "
                  f"host ms per step {host_steady_ms(step):.2f} back to back")
            cprofile_steps(step, args.cprofile)
            del step
            torch.cuda.empty_cache()
    if args.launches:
        model, tokens, *_ = args.cases[0].split(":")
        step = make_step(model, int(tokens), 1)
        recorder = LaunchRecorder()
        recorder.install()
        try:
            step()
        finally:
            recorder.uninstall()
        torch.cuda.synchronize()
        print(f"\n## launch cost per call, us ({args.cases[0]}): jit = kernel[grid](...), "
              "handle = the compiled kernel's launcher")
        for name, (interface, grid, call_args, kwargs) in recorder.entries.items():
            jit_us = enqueue_us(functools.partial(interface[grid], *call_args, **kwargs))
            jit, jgrid, jargs, jkwargs, kernel = recorder.jit_calls[name]
            handle_us = enqueue_us(_handle_launch(jit, jgrid, jargs, jkwargs, kernel))
            print(f"{name:<32} jit {jit_us:7.1f}   handle {handle_us:7.1f}", flush=True)


if __name__ == "__main__":
    main()
