"""The optimizer's part of a checkpoint (``lce_train.checkpoint``): its state as
dist_checkpointing shards it, keyed by the model parameter each value belongs to, so that it
reloads at another parallel layout; and the loading back.

megatron-core's optimizers (chained, fp32, mixed-precision, distributed) describe their own
sharded state, the distributed optimizer's as ``fully_reshardable`` (gathered per parameter over
the data-parallel group); ``lce_train.optimizer.TorchAdamW`` is keyed here the same way (Adam's
moments and, for bf16 parameters, the fp32 main copies). Two gaps between megatron-core and
torch's Adam are bridged on the way: a state to load into before the first step, and the
per-parameter ``step`` that megatron-core 0.16.1's loader trips over.
"""

from __future__ import annotations

import torch

# Megatron-LM's metadata for sharded_state_dict: the distributed optimizer's state per parameter,
# gathered over DP (reshardable across TP, PP and DP).
SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                     "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (chained, fp32, mixed-precision, distributed) or
    our TorchAdamW."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for opt in chained for inner in _inner_optimizers(opt)]
    return [optimizer.optimizer]


def _allocate_adam_state(optimizer) -> None:
    """Give every parameter of the inner torch Adam(W)s a zero state before loading into it.

    torch creates Adam's state at the first step, and megatron's optimizers read it when they
    describe their sharded state (the distributed optimizer asserts one common step), so a run
    that resumes before its first step needs a state of the right shapes to load into.
    """
    for inner in _inner_optimizers(optimizer):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state.get(p):
                    inner.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def _keep_torch_adam_step() -> None:
    """Let megatron-core's distributed optimizer load a fully_reshardable state into torch's Adam.

    With torch's Adam (no apex / transformer-engine) each parameter's state holds a ``step``,
    which the loader sets from the checkpoint's param groups and then skips among the loaded
    tensors, but ``_set_main_param_and_optimizer_states`` copies every state key and fails on
    ``step`` (KeyError, megatron-core 0.16.1): hand it the step it already holds.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = getattr(DistributedOptimizer, "_set_main_param_and_optimizer_states", None)
    if original is None or getattr(original, "_lce_train", False):
        return

    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state.get(main, {}).get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    set_states._lce_train = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _torch_adamw_sharded_state(optimizer, model_sd, loading: bool) -> dict:
    """lce_train.optimizer.TorchAdamW's state keyed like megatron's optimizers' (Adam's moments
    and, for bf16 parameters, the fp32 main copies, each by its model parameter)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

    inner = optimizer.optimizer
    model_param = {id(m): p for p, m in zip(optimizer.params, optimizer.master)}
    mains = [m for group in inner.param_groups for m in group["params"]]
    id_to_sharded = get_param_id_to_sharded_param_map(model_sd,
                                                      (model_param[id(m)] for m in mains))
    state = inner.state_dict()
    steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
    optim_state_to_sharding_state(state, id_to_sharded, exclude_keys="step")
    if len(steps) > 1:
        raise RuntimeError(f"TorchAdamW parameters are at different steps {sorted(steps)}")
    main_values = [make_sharded_optimizer_tensor(id_to_sharded[i], m,
                                                 prefix="optimizer.state.fp32_param")
                   for i, m in enumerate(mains)]
    return {"optimizer": state, "common_step": steps.pop() if steps else 0.0,
            "fp32_param": main_values}


def _load_torch_adamw(optimizer, loaded: dict) -> None:
    inner = optimizer.optimizer
    state = loaded["optimizer"]
    for entry in state["state"].values():
        entry["step"] = torch.tensor(float(loaded["common_step"]), dtype=torch.float32)
    inner.load_state_dict(state)
    mains = [m for group in inner.param_groups for m in group["params"]]
    with torch.no_grad():
        for m, value in zip(mains, loaded["fp32_param"], strict=True):
            m.copy_(value)
        for p, m in zip(optimizer.params, optimizer.master):
            if p is not m:
                p.copy_(m)


def optimizer_sharded_state(optimizer, model_sd, loading: bool) -> dict:
    """The optimizer's sharded state keyed by the parameters of ``model_sd``: what a save writes,
    or (``loading``) the request that a load fills."""
    from lce_train.optimizer import TorchAdamW

    if loading:
        _allocate_adam_state(optimizer)
        _keep_torch_adam_step()
    if isinstance(optimizer, TorchAdamW):
        return _torch_adamw_sharded_state(optimizer, model_sd, loading)
    # megatron's optimizers take ``metadata`` (ChainedOptimizer through **kwargs) since 0.10.
    return optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=SHARDING_METADATA)


def load_optimizer(optimizer, loaded: dict) -> None:
    """Put a loaded sharded state (the filled request) into the optimizer."""
    from lce_train.optimizer import TorchAdamW

    if isinstance(optimizer, TorchAdamW):
        _load_torch_adamw(optimizer, loaded)
    else:
        optimizer.load_state_dict(loaded)
    _unshare_adam_steps(optimizer)


def _unshare_adam_steps(optimizer) -> None:
    """Give each parameter its own ``step`` tensor.

    The distributed optimizer's loader hands one step tensor to every parameter's state, and
    torch's Adam increments each parameter's step in place: shared, it would advance once per
    parameter per step (and Adam's bias correction with it).
    """
    for inner in _inner_optimizers(optimizer):
        for state in inner.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
