"""The learning-rate schedule and the optimizer: megatron-core's, or plain AdamW where it
cannot run."""

from __future__ import annotations

import math

import torch

from lce_train.signatures import supported_kwargs


def learning_rate(args, step: int) -> float:
    """Linear warmup, then decay towards --min-lr; a pure function of the 1-based step, so a
    resumed run continues exactly. As in megatron's scheduler, step k decays by k - 1 steps:
    the first step after warmup runs at --lr, and --min-lr is reached after --lr-decay-iters."""
    if args.lr_warmup_iters and step <= args.lr_warmup_iters:
        return args.lr * step / args.lr_warmup_iters
    if args.lr_decay_style == "constant":
        return args.lr
    span = max(1, args.lr_decay_iters - args.lr_warmup_iters)
    frac = min(1.0, max(0.0, (step - 1 - args.lr_warmup_iters) / span))
    if args.lr_decay_style == "linear":
        coef = 1.0 - frac
    else:
        coef = 0.5 * (1.0 + math.cos(math.pi * frac))
    return args.min_lr + (args.lr - args.min_lr) * coef


class TorchAdamW:
    """Plain ``torch.optim.AdamW`` behind the interface the loop uses from megatron's optimizers.

    Used where megatron's optimizer cannot run (its bf16 path checks for ``torch.cuda.*Tensor``
    types). Gradients come from DDP's ``main_grad`` buffers; with bf16 parameters the optimizer
    keeps fp32 master copies. The gradient norm counts each parameter once across TP ranks
    (megatron's duplicate and shared-parameter rules) and is reduced over the model-parallel
    group, so clipping matches megatron's.
    """

    def __init__(self, args, model):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone() if p.dtype != torch.float32 else p
                       for p in self.params]
        decay = [i for i, p in enumerate(self.params) if p.dim() > 1]
        no_decay = [i for i, p in enumerate(self.params) if p.dim() <= 1]
        groups = [{"params": [self.master[i] for i in decay], "wd_mult": 1.0},
                  {"params": [self.master[i] for i in no_decay], "wd_mult": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=args.lr, weight_decay=args.weight_decay,
            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
        self.clip = args.clip_grad
        self.counted = [param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
                        for p in self.params]
        self.group = parallel_state.get_model_parallel_group()

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None

    def step(self):
        grads = []
        for p, m in zip(self.params, self.master):
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            m.grad = None if g is None else g.detach().float()
            grads.append(m.grad)
        sq = torch.zeros((), dtype=torch.float64, device=self.master[0].device)
        for g, counted in zip(grads, self.counted):
            if g is not None and counted:
                sq += g.double().pow(2).sum()
        torch.distributed.all_reduce(sq, group=self.group)
        norm = float(sq.sqrt())
        if self.clip > 0 and norm > self.clip:
            for g in grads:
                if g is not None:
                    g.mul_(self.clip / (norm + 1e-6))
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if p is not m:
                    p.copy_(m)
        return True, norm, None


def build_optimizer(args, model, config):
    """megatron's get_megatron_optimizer, or TorchAdamW where that is asked for or fails."""
    if args.optimizer_impl in ("auto", "megatron"):
        try:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            opt_config = OptimizerConfig(**supported_kwargs(
                OptimizerConfig,
                optimizer="adam", lr=args.lr, min_lr=args.min_lr,
                weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                bf16=args.bf16, params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                use_distributed_optimizer=args.use_distributed_optimizer,
            ))
            optimizer = get_megatron_optimizer(opt_config, [model])
            config.grad_scale_func = optimizer.scale_loss
            return optimizer, "megatron"
        except Exception as err:  # megatron's bf16 optimizer checks for torch.cuda tensor types
            if args.optimizer_impl == "megatron" or args.use_distributed_optimizer:
                raise
            reason = f"{type(err).__name__}: {err}".splitlines()[0][:160]
    else:
        reason = "--optimizer-impl torch"
    config.grad_scale_func = None
    return TorchAdamW(args, model), f"torch AdamW ({reason})"
