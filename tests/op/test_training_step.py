"""The op and the vocab-parallel layer in a training step on GPUs: no host sync, CUDA graphs.

For every option set below, on one GPU (``linear_cross_entropy``) and over NCCL at TP2 and TP4
with and without sequence parallelism (``vocab_parallel_linear_cross_entropy``, the Megatron
adapter's call among them):

- five training steps (forward and backward) run under ``torch.cuda.set_sync_debug_mode("error")``,
  which turns any synchronising call into an error, after one eager step that compiles;
- the bad cases (an out-of-range target, an upstream gradient that is not ``c * loss_mask``)
  make no sync either, return NaN, and ``fused_lce.raise_deferred_errors()`` then raises;
- ``torch.cuda.graph`` captures forward + backward once, and replays on new data (hidden states,
  targets, masks) give what eager calls give on that data.

Run on a GPU machine: ``python -m pytest -q tests/op/test_training_step.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from helpers_parallel import run_on_ranks

import fused_lce
from fused_lce import linear_cross_entropy

S, B, D = 256, 4, 384  # N = 1024 tokens
V = 50000
V_PADDED = 50048  # divisible by 2 and 4

# name: (options of the op, what the test builds: dtype, bias, mask, upstream weights)
CASES = {
    "bf16-mean": {},
    "bf16-sum-bias-softcap-zloss": dict(reduction="sum", softcap=30.0, z_loss=1e-4, bias=True),
    "bf16-smoothing-ignore": dict(label_smoothing=0.1, ignore_index=-1, ignored=True),
    "fp32-mean-padding": dict(dtype=torch.float32, num_classes=V - 7),
    "fp16-mean": dict(dtype=torch.float16),
    "bf16-none-loss-mask": dict(reduction="none", mask=True),
    "bf16-none-weighted-no-mask": dict(reduction="none", weights=True),
    "bf16-several-chunks": dict(token_chunk_size=256),
    "bf16-gemm": dict(backward="gemm"),
    "bf16-tiles": dict(backward="tiles"),
    "bf16-lean": dict(scratch_mb=12.0),
    "bf16-kept-logits": dict(keep_logits=True),
    "bf16-deterministic": dict(deterministic=True, backward="tiles"),
    "bf16-chunked": dict(impl="chunked"),
}
# The layer drops what is single-device only and adds its own.
LAYER_CASES = {
    **{k: v for k, v in CASES.items() if k != "fp32-mean-padding"},
    "fp32-mean-padding": dict(dtype=torch.float32, vocab_size=V - 7),
    # What the Megatron adapter passes (parallel/megatron_patch.py).
    "bf16-megatron-adapter": dict(reduction="none", mask=True, check_targets=False,
                                  agree_every_call=False),
}
TEST_KEYS = ("dtype", "bias", "mask", "weights", "ignored")


def _split(case: dict) -> tuple[dict, dict]:
    built = {k: case[k] for k in TEST_KEYS if k in case}
    options = {k: v for k, v in case.items() if k not in TEST_KEYS}
    return options, built


class Problem:
    """Static tensors of one case: what a graph reads and writes, refilled with new data."""

    def __init__(self, case: dict, rows: int, classes: int, device, n_tokens: int,
                 gen: torch.Generator):
        options, built = _split(case)
        self.options, self.built = options, built
        dtype = built.get("dtype", torch.bfloat16)
        # Targets are drawn below V; n_classes is where the op's range check ends.
        self.n_classes = options.get("num_classes") or options.get("vocab_size") or classes
        self.ignore_index = options.get("ignore_index", -100)
        self.hidden = torch.empty(n_tokens, D, device=device, dtype=dtype, requires_grad=True)
        self.weight = (torch.randn(rows, D, device=device, generator=gen) * 0.05).to(dtype)
        self.weight.requires_grad_()
        self.bias = None
        if built.get("bias"):
            self.bias = (torch.randn(rows, device=device, generator=gen) * 0.1).to(dtype)
            self.bias.requires_grad_()
        self.target = torch.empty(n_tokens, device=device, dtype=torch.int64)
        self.mask = torch.empty(n_tokens, device=device) if built.get("mask") else None
        self.weights = torch.empty(n_tokens, device=device) if built.get("weights") else None
        self.gen = gen

    def refill(self) -> None:
        """New values in the same tensors (as a graph's static inputs take them), drawn on the
        device: a copy from the host's pageable memory would be a sync."""
        n, gen = self.target.shape[0], self.gen
        device = self.target.device
        with torch.no_grad():
            self.hidden.copy_(torch.randn(n, D, device=device, generator=gen))
            target = torch.randint(0, min(self.n_classes, V), (n,), device=device, generator=gen)
            if self.built.get("ignored"):
                ignored = torch.rand(n, device=device, generator=gen) < 0.2
                target = torch.where(ignored, self.ignore_index, target)
            self.target.copy_(target)
            if self.mask is not None:
                self.mask.copy_((torch.rand(n, device=device, generator=gen) > 0.3).float())
            if self.weights is not None:
                self.weights.copy_(torch.rand(n, device=device, generator=gen) + 0.5)

    def leaves(self) -> list[torch.Tensor]:
        return [x for x in (self.hidden, self.weight, self.bias) if x is not None]

    def zero_grads(self) -> None:
        for leaf in self.leaves():
            leaf.grad = None

    def objective(self, loss: torch.Tensor) -> torch.Tensor:
        if self.mask is not None:
            return 0.5 * (loss * self.mask).sum()
        if self.weights is not None:
            return (loss * self.weights).sum()
        return loss.sum()


def _single_device_loss(problem: Problem, target=None) -> torch.Tensor:
    options = dict(problem.options)
    if problem.mask is not None:
        options["loss_mask"] = problem.mask
    return linear_cross_entropy(problem.hidden, problem.weight,
                                problem.target if target is None else target, problem.bias,
                                **options)


def _layer_loss(problem: Problem, group, sp: bool, target=None) -> torch.Tensor:
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    options = dict(problem.options)
    if problem.mask is not None:
        options["loss_mask"] = problem.mask
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    hidden = problem.hidden
    if sp:
        rows = hidden.shape[0] // world
        hidden = hidden[rank * rows:(rank + 1) * rows]
    return vocab_parallel_linear_cross_entropy(
        hidden, problem.weight, problem.target if target is None else target, problem.bias,
        group=group, sequence_parallel=sp, **options)


def _step(problem: Problem, loss_fn) -> torch.Tensor:
    loss = loss_fn(problem)
    problem.objective(loss).backward()
    return loss.detach()


@contextlib.contextmanager
def _no_sync_allowed():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_case(name: str, case: dict, loss_fn, rows: int, classes: int, device,
               n_tokens: int, seed: int) -> list[str]:
    """Sync-free steps, the bad cases and capture of one case; the mismatches found. ``rows``:
    of this rank's weight; ``classes``: of every rank's together."""
    errors: list[str] = []
    gen = torch.Generator(device=device).manual_seed(seed)
    problem = Problem(case, rows, classes, device, n_tokens, gen)
    problem.refill()
    _step(problem, loss_fn)  # compiles the kernels (may sync), makes the fault register
    problem.zero_grads()
    fused_lce.raise_deferred_errors()

    # Five steps with every synchronising call an error.
    with _no_sync_allowed():
        for _ in range(5):
            problem.refill()
            problem.zero_grads()
            loss = _step(problem, loss_fn)
    torch.cuda.synchronize()
    if not bool(loss.isfinite().all()):
        errors.append(f"{name}: non-finite loss in the sync-free steps")

    # Bad cases: no sync, NaN, and the error: from the call itself where the GPU got there
    # before the host's last look, else once asked for.
    if problem.options.get("check_targets", True):
        bad = problem.target.clone()
        bad[n_tokens // 3] = problem.n_classes + 3
        loss = None
        with pytest.raises(ValueError, match=f"target holds class {problem.n_classes + 3}"):
            with _no_sync_allowed():
                loss = loss_fn(problem, target=bad)
            fused_lce.raise_deferred_errors()
        if loss is not None and not bool(loss.isnan().all()):
            errors.append(f"{name}: a bad target's loss is not NaN")
    if problem.mask is not None:
        problem.zero_grads()
        with _no_sync_allowed():
            loss = loss_fn(problem)
            (loss * (problem.mask * 2.0 + 1.0)).sum().backward()  # not c * mask
        with pytest.raises(RuntimeError, match="loss_mask"):
            fused_lce.raise_deferred_errors()
        if not bool(problem.weight.grad.isnan().all()):  # (d_hidden: under SP, a shard's rows)
            errors.append(f"{name}: an unexpected upstream gradient left finite gradients")

    # Capture forward + backward; replays on new data against eager calls. No tensor of an
    # earlier step may keep its autograd graph alive: its gradient accumulators would stay on
    # the default stream, which the capture cannot depend on.
    loss = None
    problem.zero_grads()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            problem.zero_grads()
            _step(problem, loss_fn)
    torch.cuda.current_stream().wait_stream(side)
    problem.zero_grads()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _step(problem, loss_fn)
    for draw in range(2):
        problem.refill()
        graph.replay()
        replayed = [static_loss.clone()] + [leaf.grad.clone() for leaf in problem.leaves()]
        leaves = problem.leaves()
        saved_grads = [leaf.grad for leaf in leaves]
        problem.zero_grads()
        eager = [_step(problem, loss_fn)] + [leaf.grad for leaf in leaves]
        for leaf, grad in zip(leaves, saved_grads):
            leaf.grad = grad  # the graph's own gradient tensors, for its next replay
        for what, ours, theirs in zip(("loss", "d_hidden", "d_weight", "d_bias"),
                                      replayed, eager):
            tol = 1e-6 if ours.dtype == torch.float32 else 1e-2
            try:
                torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)
            except AssertionError as exc:
                errors.append(f"{name}: replay {draw} {what} differs from eager: {exc}")
    fused_lce.raise_deferred_errors()
    return errors


@pytest.mark.requires_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_single_device_step_is_sync_free_and_capturable(name):
    torch.manual_seed(0)
    errors = check_case(name, CASES[name], _single_device_loss, V, V, torch.device("cuda"),
                        S * B, seed=len(name))
    assert not errors, "\n".join(errors)


def layer_suite(rank: int, world: int, sp: bool) -> list[str]:
    group = dist.group.WORLD
    rows = V_PADDED // world
    errors = []
    for name, case in LAYER_CASES.items():
        def loss_fn(problem, target=None):
            return _layer_loss(problem, group, sp, target)

        try:
            errors += [f"tp={world} sp={sp} rank={rank} {e}"
                       for e in check_case(name, case, loss_fn, rows, V_PADDED,
                                           torch.device("cuda", rank), S * B, seed=len(name))]
        except Exception as exc:  # the ranks may now disagree on the next collective: stop
            errors.append(f"tp={world} sp={sp} rank={rank} {name} raised: {exc!r}")
            break
    return errors


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize(
    "world", [pytest.param(2, id="tp2", marks=pytest.mark.requires_gpus(2)),
              pytest.param(4, id="tp4", marks=pytest.mark.requires_gpus(4))])
def test_layer_step_is_sync_free_and_capturable_nccl(world, sp, tmp_path):
    run_on_ranks(world, layer_suite, sp, out_dir=tmp_path, backend="nccl", timeout_s=600,
                 interpret=False)
