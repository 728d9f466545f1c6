"""Checkpoints: one ``torch.save`` file per rank holding the model, the optimizer, the RNG
states and the step; resuming needs the same parallel layout."""

from __future__ import annotations

from pathlib import Path

import torch


def rng_state():
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _layout(args) -> dict:
    return {"world": args.world_size, "tp": args.tensor_model_parallel_size,
            "pp": args.pipeline_model_parallel_size, "cp": args.context_parallel_size}


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (chained, fp32, mixed-precision, distributed) or
    our TorchAdamW; their parameters are this rank's fp32 main parameters (or shards)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for opt in chained for inner in _inner_optimizers(opt)]
    return [optimizer.optimizer]


def _optimizer_state(optimizer) -> list[dict]:
    """Per rank: each inner optimizer's state and its main parameters' values.

    Checkpoints here are per rank and need the same layout to resume, so the rank's own shard of
    the optimizer is saved as is; megatron's distributed optimizer would otherwise gather it.
    """
    return [{"state": inner.state_dict(),
             "main_params": [p.detach().clone() for g in inner.param_groups for p in g["params"]]}
            for inner in _inner_optimizers(optimizer)]


def _load_optimizer_state(optimizer, saved: list[dict]) -> None:
    inners = _inner_optimizers(optimizer)
    if len(inners) != len(saved):
        raise SystemExit(f"checkpoint holds {len(saved)} optimizer(s), this run has {len(inners)}")
    for inner, entry in zip(inners, saved):
        inner.load_state_dict(entry["state"])
        params = [p for g in inner.param_groups for p in g["params"]]
        with torch.no_grad():
            for p, value in zip(params, entry["main_params"], strict=True):
                p.copy_(value)


def save_checkpoint(args, step, gpt, optimizer) -> None:
    rank = torch.distributed.get_rank()
    folder = Path(args.save) / f"iter_{step:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({
        "step": step,
        "layout": _layout(args),
        "model": gpt.state_dict(),
        "optimizer": _optimizer_state(optimizer),
        "rng": rng_state(),
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))},
    }, folder / f"rank_{rank:05d}.pt")
    torch.distributed.barrier()
    if rank == 0:
        (Path(args.save) / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
    torch.distributed.barrier()


def load_checkpoint(args, gpt, optimizer) -> int:
    """Restore model, optimizer and RNG from ``--load``; returns the step to continue after."""
    root = Path(args.load)
    step = args.ckpt_step
    if step is None:
        tracker = root / "latest_checkpointed_iteration.txt"
        if not tracker.exists():
            raise SystemExit(f"--load {root}: no latest_checkpointed_iteration.txt")
        step = int(tracker.read_text().strip())
    path = root / f"iter_{step:07d}" / f"rank_{torch.distributed.get_rank():05d}.pt"
    if not path.exists():
        raise SystemExit(f"--load: {path} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["layout"] != _layout(args):
        raise SystemExit(f"{path} was saved with layout {state['layout']}, this run is "
                         f"{_layout(args)}: resume with the same parallel layout")
    gpt.load_state_dict(state["model"])
    _load_optimizer_state(optimizer, state["optimizer"])
    set_rng_state(state["rng"])
    return int(state["step"])
