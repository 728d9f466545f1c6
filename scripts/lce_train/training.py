"""The training loop of the launcher (scripts/pretrain_gpt.py): build, train, log, save.

:func:`train` is callable more than once in a process (lce_train.compare_losses runs it
once per loss implementation); :func:`main` is the command line.
"""

from __future__ import annotations

import importlib.util
import json
import resource
import time
from pathlib import Path

import torch

from lce_train import full_iteration, step_profile
from lce_train.arguments import describe, parse_args
from lce_train.checkpoint import load_checkpoint, save_checkpoint
from lce_train.data import training_data, validation_data
from lce_train.evaluation import (
    OutputLayerTap,
    SeenTokens,
    evaluate,
    observed,
    probe_line,
    run_probe,
)
from lce_train.model import (
    build_model,
    forward_step,
    init_distributed,
    quiet_known_warnings,
    transformer_config,
)
from lce_train.optimizer import build_optimizer, learning_rate
from lce_train.signatures import supported_kwargs


def _peak_memory() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _allocated_memory() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _per_stage_gib(value: int, device, pp_rank: int, pp: int) -> list[float]:
    """A memory figure (bytes on this rank) of each pipeline stage: the max over its ranks."""
    mine = torch.zeros(pp, dtype=torch.float64, device=device)
    mine[pp_rank] = value / 2**30
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    return mine.tolist()


def build_training(args):
    """The seeded model and its optimizer, wired to megatron's schedules (after
    :func:`init_distributed`). Returns (model, gpt, optimizer, optimizer name)."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import finalize_model_grads

    torch.manual_seed(args.seed)
    seed_fn = tensor_parallel.model_parallel_cuda_manual_seed
    # Graph-safe generators when the step is captured: the graph registers their states.
    seed_fn(args.seed, **supported_kwargs(
        seed_fn, force_reset_rng=True,
        use_cudagraphable_rng=args.cuda_graph_impl == "full_iteration"))
    config = transformer_config(args)
    model, gpt = build_model(args, config)
    optimizer, optimizer_name = build_optimizer(args, model, config)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    return model, gpt, optimizer, optimizer_name


def train(args, log=print) -> list[dict]:
    """Build everything from ``args`` (resolved), train, and return the per-step records.

    The records (step, loss, lr, grad_norm, tokens_per_s, step_s, per stage: peak_gib and
    resident_gib, what is allocated when a step starts) are
    returned on the reporting rank (last pipeline stage, TP rank 0, DP rank 0); other ranks
    return an empty list. Callable more than once in a process (lce_train.compare_losses).
    """
    from lce_train.megatron_cpu import applied, enable_cpu_mode

    quiet_known_warnings()
    cpu_mode = enable_cpu_mode()
    init_distributed(args)

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    last_stage = parallel_state.is_pipeline_last_stage()
    dp_rank = parallel_state.get_data_parallel_rank()
    # Loss sums and token counts add up over data- and context-parallel ranks.
    get_dp_group = parallel_state.get_data_parallel_group
    dp_cp_group = get_dp_group(**supported_kwargs(get_dp_group, with_context_parallel=True))
    reporter = (last_stage and parallel_state.get_tensor_model_parallel_rank() == 0
                and dp_rank == 0)
    say = log if reporter else (lambda *a, **k: None)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")

    model, gpt, optimizer, optimizer_name = build_training(args)

    say(describe(args))
    say(f"optimizer   {optimizer_name}")
    if cpu_mode:
        say(f"cpu mode    {len(applied())} megatron-core patches (lce_train.megatron_cpu)")

    start = 0
    if args.load:
        start = load_checkpoint(args, gpt, optimizer, log=say)
        say(f"resumed     from {args.load} at step {start}")

    data = training_data(args)
    valid = validation_data(args) if args.eval_interval else None
    seen = SeenTokens(args, device) if args.probe_interval and last_stage else None
    tap = OutputLayerTap(gpt) if args.probe_interval and reporter else None
    first_batch: dict = {}
    # The peak of training steps only: evaluation and probes forget theirs (on GPUs).
    training_peak = 0
    schedule = get_forward_backward_func()
    graphs = args.cuda_graph_impl == "full_iteration"
    forward_backward = full_iteration.graphed(schedule, args.cuda_graph_warmup_steps) \
        if graphs else schedule
    history = []
    json_log = None
    if args.log_json and reporter:
        Path(args.log_json).parent.mkdir(parents=True, exist_ok=True)
        json_log = open(args.log_json, "a")
    try:
        for step in range(start + 1, args.train_iters + 1):
            lr = learning_rate(args, step)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
                group["weight_decay"] = args.weight_decay * group.get("wd_mult", 1.0)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            profiler = step_profile.start() if step == args.profile_step else None
            t0 = time.perf_counter()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            resident = _allocated_memory()  # weights, gradient buffers, optimizer states
            probing = tap is not None and _due(step, args.probe_interval, args.train_iters, True)
            batches = data.microbatches(step, args, dp_rank, device)
            if probing:
                tap.arm()
            if seen is not None or probing:
                batches = observed(batches, seen, first_batch if probing else None)
            replayed_before = graphs and full_iteration.captured()
            reduced = forward_backward(**supported_kwargs(
                schedule,  # the graph wrapper takes the schedule's keywords
                forward_step_func=forward_step, data_iterator=batches, model=[model],
                num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                forward_only=False,
            ))
            graph_state = full_iteration.state(replayed_before) if graphs else None
            if graph_state == "captured":
                say(f"cuda graph  captured at step {step}, replayed from step {step + 1}")
            ok, grad_norm, _ = optimizer.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
            if profiler is not None:
                say(f"profile     {step_profile.finish(profiler, args.profile_dir, step, step_s)}")

            loss = float("nan")
            if last_stage:
                total = torch.stack([r["lm loss"] for r in reduced]).sum(0).to(device)
                torch.distributed.all_reduce(total, group=dp_cp_group)
                loss = (total[0] / total[1].clamp(min=1)).item()
            training_peak = max(training_peak, _peak_memory())
            pp = args.pipeline_model_parallel_size
            peaks = _per_stage_gib(training_peak, device, pp_rank, pp)
            resident = _per_stage_gib(resident, device, pp_rank, pp)
            record = {
                "step": step, "loss": loss, "lr": lr,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens_per_s": args.global_batch_size * args.seq_length / step_s,
                "step_s": step_s, "peak_gib": peaks, "resident_gib": resident,
                "skipped": not ok,
            }
            if graph_state is not None:
                record["cuda_graph"] = graph_state
            if profiler is not None:  # its step time includes the profiler's own cost
                record["profiled"] = True
            if valid is not None and _due(step, args.eval_interval, args.train_iters):
                t_eval = time.perf_counter()
                unseen = None if seen is None else seen.unseen()
                record.update(evaluate(args, model, valid, dp_rank, device, dp_cp_group, unseen))
                record["eval_s"] = time.perf_counter() - t_eval
                _forget_peak()
            if probing:
                record["probe"] = run_probe(args, tap, first_batch, seen)
                _forget_peak()
                say(probe_line(step, record["probe"]))
            if reporter:
                history.append(record)
                if json_log is not None:
                    json_log.write(json.dumps({**record, "impl": args.cross_entropy_fusion_impl})
                                   + "\n")
                    json_log.flush()
            if step % args.log_interval == 0 or step == args.train_iters:
                mem = " ".join(f"{g:.2f}" for g in peaks)
                valid_text = f" | valid {record['valid_loss']:.6f}" if "valid_loss" in record \
                    else ""
                say(f"step {step:>6}/{args.train_iters} | loss {loss:.6f}{valid_text} | "
                    f"lr {lr:.3e} | grad norm {record['grad_norm'] or 0:.3f} | "
                    f"{record['tokens_per_s']:,.0f} tok/s | {step_s:.3f} s | "
                    f"peak GiB per stage [{mem}]")
            if args.save and ((args.save_interval and step % args.save_interval == 0)
                              or step == args.train_iters):
                save_checkpoint(args, step, gpt, optimizer)
                say(f"saved       {args.save}/iter_{step:07d}")
    finally:
        if graphs:
            full_iteration.release()
        if json_log is not None:
            json_log.close()
        if tap is not None:
            tap.remove()
    return history


def _due(step: int, interval: int | None, last: int, at_first: bool = False) -> bool:
    """Whether a periodic action runs at ``step``: every ``interval`` steps and at the end (and
    at step 1 with ``at_first``)."""
    if not interval:
        return False
    return step % interval == 0 or step == last or (at_first and step == 1)


def _forget_peak() -> None:
    """Start the device's peak-memory counter afresh, so that buffers of evaluation and probes
    do not count as training memory (the CPU's peak RSS cannot be reset)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        print(describe(args))
        return
    if importlib.util.find_spec("megatron.core") is None:
        raise SystemExit(
            "lce-pretrain-gpt needs megatron-core (--cross-entropy-fusion-impl "
            f"{args.cross_entropy_fusion_impl}): pip install 'fused_lce[megatron]'"
        )
    train(args)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
