"""Benchmark the vocab-parallel loss layer across tensor-parallel ranks, ours beside Megatron's.

    torchrun --nproc-per-node 4 -m lce_train.bench_parallel --models gemma2_2b llama3_8b \
        --tokens 8192 --out docs/benchmarks/parallel_run.csv

``torchrun --no-python --nproc-per-node 4 lce-bench-parallel ...`` runs the same.

For every model shape (``lce_train.configs``), number of tokens per TP group, TP size (default: 1
and the world size), sequence parallelism (off and on; TP=1 runs without) and provider it
measures, per rank, in bf16:

- forward and forward+backward time: the median of ``--iters`` iterations after ``--warmup``,
  each timed with CUDA events after a barrier of all ranks (so every rank starts together and a
  rank's time includes waiting for the slowest peer in the collectives);
- extra peak memory: ``torch.cuda.max_memory_allocated`` during one forward+backward minus what
  was allocated before it (the inputs) and the gradient buffers it leaves (input, weight).

The table and CSV give the slowest rank's time and the largest rank's memory, and for TP > 1
the speedup over TP=1 of the same provider and its efficiency (speedup / TP). The world is split
into groups of TP consecutive ranks that run the same problem side by side (at TP=1, one copy
per GPU), so every GPU works during every measurement.

Providers:
- ``ours``: ``fused_lce.parallel.vocab_parallel_linear_cross_entropy`` (``--impl``, default
  "cce"), its default: the gradients computed in the forward, a token chunk of each shard's
  logits at a time (one all-reduce MAX and one packed SUM of the chunk's statistics), three
  GEMMs; the backward only scales and reduces the input gradient. Called as the megatron
  adapter calls it: the even shard layout given and no target range check (no device sync; the
  per-call agreement of the ranks is one small all-gather on the host, parallel/agreement.py).
- ``ours-masked``: the same as Megatron's loss function calls it: ``reduction="none"`` with the
  loss mask (every token) as ``loss_mask``, then ``sum(losses * mask) / sum(mask)``; the backward
  checks that the upstream gradient is the assumed one (one small all-reduce, one host read).
- ``ours-gemm``: the same with ``backward="gemm"``: statistics in the forward, each shard's
  logits recomputed in the backward (four GEMMs; the default before 2026-11-23).
- ``ours-lean``: the same with ``scratch_mb=12``, the op's lean mode.
- ``ours-kept``: the same with ``keep_logits=True``: the forward keeps each shard's logits
  as 16-bit exponentials (N x V_local x 2 bytes) and the backward does not recompute them.
- ``collectives``: only the collectives of ``ours``, with its sizes, dtypes and token chunks and
  no compute (TP > 1): the most that overlapping them with compute could save. (Before
  2026-11-27 it timed the budget of the statistics-then-backward path: one chunk of N rows,
  and with SP the backward's re-gather of the input.)
- ``megatron-fused`` (when megatron-core is installed): megatron's fastest loss, what
  ``--cross-entropy-loss-fusion --cross-entropy-fusion-impl native`` runs: the input enters as
  for ``megatron`` below, logits = hidden @ weight_shard.T stay in bf16, then
  ``fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy`` over the TP group. A
  softcap, which megatron-core does not have, is applied to the bf16 logits: compare with
  ``--no-softcap``.
- ``megatron`` (when megatron-core is installed): megatron's unfused loss, what
  ColumnParallelLinear followed by its default loss does: the input enters through
  ``copy_to_tensor_model_parallel_region`` (backward: all-reduce of its gradient) or, with SP,
  ``gather_from_sequence_parallel_region`` (all-gather in, reduce-scatter out); logits =
  hidden @ weight_shard.T in bf16; then
  ``tensor_parallel.vocab_parallel_cross_entropy(logits.float(), target)`` after
  ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)``.
- ``torch-logits-vp``: the same algorithm written here with torch.distributed: full per-rank
  fp32 logits, an all-reduce MAX, an all-reduce SUM of the target logit and one of the sum of
  exponentials, the backward from the saved softmax.

Models with a final-logit softcap (Gemma-2) run with it: ours takes ``softcap=``, the baselines
apply ``cap * tanh(logits / cap)`` to the fp32 logits first (``--no-softcap`` turns it off).
The vocabulary is padded to a multiple of ``--vocab-multiple`` times the largest TP, as Megatron
pads it, and every provider treats the padded rows as classes (so their losses agree); targets
are drawn from the real classes. Inputs: hidden ~ N(0, 1), weight ~ N(0, 0.02^2), the same on
every rank and at every TP.

``--cpu-smoke`` checks the script without GPUs: gloo on the CPU, tiny shapes, the kernels under
the Triton interpreter, wall-clock timers and no memory figures
(``torchrun --nproc-per-node 2 -m lce_train.bench_parallel --cpu-smoke``).

The baselines are written in ``lce_train.bench_parallel_baselines``, the per-rank timers and the
``collectives`` provider in ``lce_train.bench_parallel_timing``; this module builds the problems
and the groups, runs the grid and writes the table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fused_lce.options import LEAN_SCRATCH_MB
from lce_train.bench_parallel_baselines import (
    megatron_available,
    megatron_destroy,
    megatron_fused_loss,
    megatron_init,
    megatron_loss,
    torch_logits_vp_loss,
)
from lce_train.bench_parallel_timing import measure, measure_collectives, worst_over_ranks
from lce_train.configs import known_models, load_model_config

PROVIDERS = ("ours", "ours-masked", "ours-gemm", "ours-lean", "ours-kept", "megatron-fused",
             "megatron", "torch-logits-vp", "collectives")
# Shapes of --cpu-smoke: (tokens, hidden size, vocabulary before padding).
SMOKE_SHAPE = (48, 32, 1003)


# ---------------------------------------------------------------------------------------------
# Problems, groups and providers
# ---------------------------------------------------------------------------------------------


def tp_group(tp: int):
    """This rank's group of ``tp`` consecutive ranks (every rank creates every group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, tp):
        group = dist.new_group(list(range(first, first + tp)))
        if first <= rank < first + tp:
            mine = group
    return mine


def padded_vocab(vocab: int, multiple: int) -> int:
    return -(-vocab // multiple) * multiple


def make_problem(n_tokens, d, v_rows, n_classes, dtype, device, seed):
    """Full hidden (N, D), full weight (V_rows, D) and target (N,), the same on every rank."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n_tokens, d, generator=gen, device=device, dtype=dtype)
    weight = torch.empty(v_rows, d, device=device, dtype=dtype)
    for start in range(0, v_rows, 16384):  # in slices: no full fp32 copy of a 256k x D weight
        stop = min(start + 16384, v_rows)
        weight[start:stop] = 0.02 * torch.randn(stop - start, d, generator=gen, device=device)
    target = torch.randint(0, n_classes, (n_tokens,), generator=gen, device=device)
    return hidden, weight, target


def _masked_mean(loss_fn):
    """Megatron's loss function around per-token losses: sum(losses * mask) / sum(mask), the mask
    (every token counted) passed to ours as ``loss_mask``, as the megatron adapter passes it."""
    def masked(h, w, t):
        mask = torch.ones(t.shape, dtype=torch.float32, device=t.device)
        return (loss_fn(h, w, t, loss_mask=mask) * mask).sum() / mask.sum()
    return masked


def providers(names, args, *, group, vocab_start, v_rows, sp, softcap):
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    def ours(**extra):
        # As the megatron adapter calls it: the even layout is known and targets are not
        # range-checked (no device sync), as megatron's own loss does not.
        def loss(h, w, t, **more):
            return vocab_parallel_linear_cross_entropy(
                h, w, t, group=group, vocab_start_index=vocab_start, vocab_size=v_rows,
                sequence_parallel=sp, softcap=softcap, impl=args.impl, check_targets=False,
                **{**extra, **more})
        return loss

    table = {}
    if "ours" in names:
        table["ours"] = ours()
    if "ours-masked" in names:
        table["ours-masked"] = _masked_mean(ours(reduction="none", loss_mask=None))
    if "ours-gemm" in names:
        table["ours-gemm"] = ours(backward="gemm")
    if "ours-lean" in names:
        table["ours-lean"] = ours(scratch_mb=LEAN_SCRATCH_MB)
    if "ours-kept" in names:
        table["ours-kept"] = ours(keep_logits=True)
    # Megatron's sequence-parallel all-gather allocates on CUDA: no SP for it in --cpu-smoke.
    if "megatron-fused" in names and megatron_available() and not (sp and args.cpu_smoke):
        table["megatron-fused"] = lambda h, w, t: megatron_fused_loss(h, w, t, sp=sp,
                                                                      softcap=softcap)
    if "megatron" in names and megatron_available() and not (sp and args.cpu_smoke):
        table["megatron"] = lambda h, w, t: megatron_loss(h, w, t, sp=sp, softcap=softcap)
    if "torch-logits-vp" in names:
        table["torch-logits-vp"] = lambda h, w, t: torch_logits_vp_loss(
            h, w, t, group=group, vocab_start=vocab_start, sp=sp, softcap=softcap
        )
    return table


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Launch with torchrun, one process per GPU: torchrun --nproc-per-node 4 -m "
               "lce_train.bench_parallel ...; without GPUs, --cpu-smoke checks it on 2 CPU "
               "processes: torchrun --nproc-per-node 2 -m lce_train.bench_parallel --cpu-smoke",
    )
    parser.add_argument("--models", nargs="+", default=["gemma2_2b", "llama3_8b"],
                        help=f"model shapes from configs/models ({', '.join(known_models())})")
    parser.add_argument("--tokens", nargs="+", type=int, default=[8192],
                        help="tokens per TP group (the whole sequence x batch the group sees)")
    parser.add_argument("--tp", nargs="+", type=int, default=None,
                        help="TP sizes, each dividing the world size (default: 1 and the world)")
    parser.add_argument("--sp", nargs="+", choices=["off", "on"], default=["off", "on"],
                        help="sequence parallelism settings (TP=1 runs only 'off')")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--impl", default="cce", choices=["cce", "chunked", "auto"],
                        help="impl of ours")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (median)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--vocab-multiple", type=int, default=128,
                        help="pad the vocabulary to this times the largest TP (Megatron: 128)")
    parser.add_argument("--no-softcap", action="store_true",
                        help="ignore the models' final-logit softcap")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="CSV file to write (rank 0)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="gloo on the CPU with tiny shapes, to check the script without GPUs")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    for name in args.models:
        try:
            load_model_config(name)
        except ValueError as exc:
            parser.error(str(exc))
    return args


def init_distributed(args) -> torch.device:
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun, e.g. torchrun --nproc-per-node 4 "
                 "-m lce_train.bench_parallel ...")
    timeout = datetime.timedelta(minutes=10)
    if args.cpu_smoke:
        # Before fused_lce imports Triton: the kernels run under the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dist.init_process_group("gloo", timeout=timeout)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        sys.exit("needs CUDA GPUs (or --cpu-smoke)")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timeout, device_id=device)
    return device


def main(argv=None) -> None:
    args = parse_args(argv)
    device = init_distributed(args)
    world, rank = dist.get_world_size(), dist.get_rank()
    tp_sizes = args.tp or sorted({1, world})
    bad = [tp for tp in tp_sizes if tp < 1 or world % tp]
    if bad:
        sys.exit(f"TP sizes {bad} do not divide the world size {world}")
    dtype = getattr(torch, args.dtype)
    names = list(args.providers)
    megatron_names = [n for n in names if n in ("megatron", "megatron-fused")]
    if megatron_names and not megatron_available():
        if rank == 0:
            print(f"# megatron-core not installed: {', '.join(megatron_names)} skipped")
        names = [n for n in names if n not in megatron_names]
        megatron_names = []

    if rank == 0:
        import triton

        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"
        print(f"# {world} x {gpu}, torch {torch.__version__}, triton {triton.__version__}, "
              f"{args.dtype}, providers {', '.join(names)}", flush=True)

    rows = []
    for tp in tp_sizes:
        group = tp_group(tp)
        tp_rank = dist.get_rank(group)
        if megatron_names:
            megatron_init(tp)
        for model in args.models:
            cfg = load_model_config(model)
            n_classes, d = cfg.vocab_size, cfg.hidden_size
            token_counts = args.tokens
            if args.cpu_smoke:
                token_counts, d, n_classes = [SMOKE_SHAPE[0]], SMOKE_SHAPE[1], SMOKE_SHAPE[2]
            v_rows = padded_vocab(n_classes, args.vocab_multiple * max(tp_sizes))
            softcap = None if args.no_softcap else cfg.logit_softcap
            v_local = v_rows // tp
            vocab_start = tp_rank * v_local
            for n_tokens in token_counts:
                hidden, weight, target = make_problem(n_tokens, d, v_rows, n_classes, dtype,
                                                      device, args.seed)
                shard = weight[vocab_start:vocab_start + v_local].clone()
                del weight
                for sp in (["off"] if tp == 1 else args.sp):
                    if sp == "on" and n_tokens % tp:
                        continue
                    seq = n_tokens // tp
                    local = hidden[tp_rank * seq:(tp_rank + 1) * seq] if sp == "on" else hidden
                    local = local.clone()
                    chosen = providers(names, args, group=group, vocab_start=vocab_start,
                                       v_rows=v_rows, sp=sp == "on", softcap=softcap)
                    if "collectives" in names and tp > 1:
                        chosen["collectives"] = None
                    for name, fn in chosen.items():
                        if fn is None:
                            result = measure_collectives(n_tokens, d, v_local, dtype, group,
                                                         sp == "on", args, device)
                        else:
                            result = measure(fn, local, shard, target, args, device)
                        result = worst_over_ranks(result, device)
                        row = {"model": model, "tokens": n_tokens, "vocab_rows": v_rows,
                               "classes": n_classes, "hidden": d, "softcap": softcap,
                               "world": world, "tp": tp, "sp": sp, "provider": name,
                               **result}
                        rows.append(row)
                        if rank == 0:
                            print(f"{model:>12} N={n_tokens:<6} TP={tp} SP={sp:<3} "
                                  f"{name:>16}: fwd {result['fwd_ms']:8.2f} ms  fwd+bwd "
                                  f"{result['fwd_bwd_ms']:8.2f} ms  extra "
                                  f"{result['extra_mib']:9.1f} MiB  loss {result['loss']:.5f}",
                                  flush=True)
                    del local
                del hidden, shard, target
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if megatron_names:
            megatron_destroy()
        dist.barrier()

    if rank == 0:
        add_scaling(rows)
        print_table(rows)
        if args.out is not None:
            write_csv(rows, args.out)
    dist.destroy_process_group()


def add_scaling(rows: list[dict]) -> None:
    """Speedup and efficiency of each row over TP=1 of the same model, tokens and provider."""
    base = {(r["model"], r["tokens"], r["provider"]): r["fwd_bwd_ms"]
            for r in rows if r["tp"] == 1}
    for r in rows:
        t1 = base.get((r["model"], r["tokens"], r["provider"]))
        speedup = t1 / r["fwd_bwd_ms"] if t1 is not None else math.nan
        r["speedup_vs_tp1"] = speedup
        r["efficiency_vs_tp1"] = speedup / r["tp"]


def print_table(rows: list[dict]) -> None:
    header = (f"{'model':>12} {'tokens':>6} {'TP':>3} {'SP':>3} {'provider':>16} "
              f"{'fwd ms':>9} {'fwd+bwd ms':>11} {'extra MiB':>10} {'speedup':>8} "
              f"{'eff':>6} {'loss':>9}")
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['model']:>12} {r['tokens']:>6} {r['tp']:>3} {r['sp']:>3} {r['provider']:>16} "
              f"{r['fwd_ms']:>9.2f} {r['fwd_bwd_ms']:>11.2f} {r['extra_mib']:>10.1f} "
              f"{r['speedup_vs_tp1']:>8.2f} {r['efficiency_vs_tp1']:>6.2f} {r['loss']:>9.5f}")


def write_csv(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
