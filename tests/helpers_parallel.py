"""Running the vocab-parallel layer on real process groups and checking each rank against fp64.

Used by test_parallel.py (gloo on the CPU, kernels under the Triton interpreter) and
test_parallel_nccl.py (NCCL, one process per GPU, the real kernels).

``run_on_ranks(world, suite, ...)`` spawns one process per rank, initialises one process group
(with a timeout, so a collective that some rank never joins fails instead of hanging), calls
``suite(rank, world, *args)`` on every rank and gathers what each returns: a list of error
messages. The parent fails the test listing every rank's messages.

``check_case(case, rank, world, ...)`` is one comparison: every rank draws the same problem,
keeps its weight shard (and with SP its sequence shard of the hidden states), runs
``vocab_parallel_linear_cross_entropy`` forward and backward, and compares with the float64
reference on the concatenated weight:

- the loss and (when returned, then also in the objective) the lse, and that both are bitwise
  the same on every rank;
- the input gradient: the whole input, or with SP this rank's sequence shard;
- the weight and bias gradients of this rank's shard, with padding rows exactly zero;
- where a case asks, that its problem tells global label smoothing from Megatron's per-shard
  smoothing, so that the loss matching the single-device one proves smoothing is global.

Tolerances are ``ATOL`` (relative) for fp32 and ``2 * err(torch in the same dtype) + ATOL`` for
16-bit inputs, as in helpers_lce.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import traceback
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import assert_close_rel, rel_err
from helpers_lce import ATOL, IGNORE_INDEX, SCALAR_UPSTREAM, make_problem, upstream_weights

from fused_lce import linear_cross_entropy
from fused_lce.options import LCEOptions
from fused_lce.reference import reference_linear_cross_entropy

# Options of the layer that change the math, and so go to the references too.
_MATH = ("reduction", "label_smoothing", "softcap", "z_loss")


# ---------------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world, port, backend, timeout_s, out_dir, suite, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the CPU references
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout,
                                device_id=torch.device("cuda", rank))
    else:
        torch.set_num_threads(1)  # up to 4 ranks share a small CI machine's cores
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    try:
        errors = suite(rank, world, *args)
    except Exception:
        errors = [f"tp={world} rank={rank} {suite.__name__} raised:\n{traceback.format_exc()}"]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(errors))
    from fused_lce.parallel import comm

    dist.barrier()
    comm.release_host_groups()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: after the cases that raise on every rank, gloo
    # aborted in it about 1 run in 10 ("terminate called without an active exception", no
    # Python frame left), after the results above were written. Open: docs/vocab_parallel.md.
    os._exit(0)


def run_on_ranks(world: int, suite, *args, out_dir: Path, backend: str = "gloo",
                 timeout_s: int = 60, interpret: bool | None = None) -> None:
    """Run ``suite(rank, world, *args) -> list[str]`` on ``world`` fresh processes; fail the
    test with every rank's messages.

    ``suite`` must be a module-level function (spawned processes import it by name).
    ``interpret`` sets TRITON_INTERPRET for the children, which inherit the environment and
    import Triton afresh (None: leave it as it is).
    """
    saved = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    elif interpret is not None:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        args = (world, free_port(), backend, timeout_s, str(out_dir), suite, args)
        mp.spawn(_worker, args=args, nprocs=world, join=True)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    errors = [e for r in range(world) for e in json.loads((out_dir / f"rank{r}.json").read_text())]
    if errors:
        pytest.fail(f"{len(errors)} mismatches:\n" + "\n".join(errors), pytrace=False)


def run_cases(rank: int, world: int, cases: list[dict], shape: tuple[int, int, int],
              device: str) -> list[str]:
    """``check_case`` for every case, in order; stops at the first exception, after which the
    ranks may disagree on which collective comes next. Each case's problem is seeded by its
    name, so adding a case changes no other."""
    errors = []
    for case in cases:
        seed = zlib.crc32(case["name"].encode()) % 100_000
        try:
            errors += check_case(case, rank, world, shape=shape, device=device, seed=seed)
        except Exception:
            errors.append(f"tp={world} rank={rank} {case['name']} raised:\n"
                          + traceback.format_exc())
            break
    return errors


def same_on_all_ranks(tensor: torch.Tensor, world: int) -> bool:
    """Whether every rank holds bitwise the same ``tensor`` (one all-gather of its bytes)."""
    local = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)
    return all(torch.equal(x, local) for x in everyone)


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


def case(name: str, impl: str, rows: int, *, dtype=torch.float32, regime="peaked", sp=False,
         ignore=0.1, bias=False, vocab_size=None, reversed_shards=False, return_lse=False,
         accumulate=False, smoothing_is_global=False, **options) -> dict:
    """One comparison: ``rows`` weight rows split near-evenly over the ranks (the first
    ``rows % TP`` ranks get one more), of which ``vocab_size`` (default all) are classes.

    ``reversed_shards``: rank r holds the (TP-1-r)-th shard and passes ``vocab_start_index``.
    ``accumulate``: the weight gradient goes into a ``weight_grad_accumulator`` (Megatron's fp32
    ``main_grad``) that already holds values; the weight then gets no ``.grad``.
    ``smoothing_is_global``: also check that on this problem Megatron's per-shard label smoothing
    would miss the single-device loss (by 10x the tolerance on some rank), so that the match
    proves smoothing is global; whether a problem tells them apart depends on its draw.
    ``options`` go to the layer (and those that change the math to the references).
    """
    return dict(name=f"{impl}-{name}", impl=impl, rows=rows, dtype=dtype, regime=regime, sp=sp,
                ignore=ignore, bias=bias, vocab_size=vocab_size, reversed_shards=reversed_shards,
                return_lse=return_lse, accumulate=accumulate,
                smoothing_is_global=smoothing_is_global, options=options)


def layout(case: dict, world: int) -> tuple[list[int], list[int]]:
    """(rows of each rank's shard, global index of each rank's first row)."""
    total = case["rows"]
    rows = [total // world + (1 if r < total % world else 0) for r in range(world)]
    ranks = list(range(world))
    if case["reversed_shards"]:
        rows, ranks = rows[::-1], ranks[::-1]
    starts = [0] * world
    offset = 0
    for r in ranks:
        starts[r] = offset
        offset += rows[r]
    return rows, starts


# ---------------------------------------------------------------------------------------------
# One case on one rank
# ---------------------------------------------------------------------------------------------


def objective(loss: torch.Tensor, lse: torch.Tensor | None, seed: int) -> torch.Tensor:
    """A scalar that depends on every per-token loss (and on the lse when given)."""
    if loss.dim() == 0:
        total = SCALAR_UPSTREAM * loss
    else:
        total = (loss * upstream_weights(tuple(loss.shape), seed).to(loss)).sum()
    if lse is not None:
        total = total + (lse * upstream_weights(tuple(lse.shape), seed + 1, 0.1).to(lse)).sum()
    return total


def full_run(problem, case: dict, n_classes: int, *, impl: str, dtype: torch.dtype,
             device="cpu", seed: int = 0, options: dict | None = None):
    """(loss, lse or None, {input, weight, bias grads}) on one device with the whole weight.

    ``impl``: "fp64" (the reference, ``reference_linear_cross_entropy``) or an impl of
    ``linear_cross_entropy`` (run in ``dtype`` on ``device``).
    """
    hidden, weight, target, bias = problem
    h, w, b = (None if x is None else x.detach().to(device, dtype).requires_grad_()
               for x in (hidden, weight, bias))
    target = target.to(device)
    opts = {k: v for k, v in (options or case["options"]).items() if k in _MATH}
    num_classes = None if n_classes == weight.shape[0] else n_classes
    if impl == "fp64":
        flat = target.reshape(-1)
        loss, lse = reference_linear_cross_entropy(
            h.reshape(-1, h.shape[-1]), w, flat, b,
            LCEOptions(ignore_index=IGNORE_INDEX, num_classes=num_classes, **opts),
        )
        lse = torch.where(flat != IGNORE_INDEX, lse, 0.0).reshape(target.shape)
        if loss.dim():
            loss = loss.reshape(target.shape)
    else:
        loss, lse = linear_cross_entropy(h, w, target, b, impl=impl, return_lse=True,
                                         num_classes=num_classes, **opts)
    lse = lse if case["return_lse"] else None
    objective(loss, lse, seed).backward()
    grads = {"input": h.grad, "weight": w.grad, "bias": None if b is None else b.grad}
    return loss.detach(), None if lse is None else lse.detach(), grads


def _compare(errors: list, label: str, name: str, actual, expected, tol: float) -> None:
    """assert_close_rel, NaN allowed exactly where the reference has NaN; collects failures."""
    if actual is None:
        errors.append(f"{label} {name}: missing (None)")
        return
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if tuple(actual.shape) != tuple(expected.shape):
        errors.append(f"{label} {name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
        return
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    if not torch.equal(nan_a, nan_e):
        errors.append(f"{label} {name}: NaN in {int(nan_a.sum())} entries, in the reference "
                      f"{int(nan_e.sum())}")
        return
    try:
        assert_close_rel(actual.masked_fill(nan_a, 0), expected.masked_fill(nan_e, 0), tol,
                         name=f"{label} {name}")
    except AssertionError as exc:
        errors.append(str(exc))


def _tolerances(problem, case, n_classes, ref, device, seed) -> dict[str, float]:
    """ATOL[dtype], or for 16-bit inputs 2 * err(torch in that dtype on ``device``) + ATOL."""
    dtype = case["dtype"]
    atol = ATOL[dtype]
    tols = dict.fromkeys(("loss", "lse", "input", "weight", "bias"), atol)
    if dtype not in (torch.bfloat16, torch.float16):
        return tols
    ref_loss, ref_lse, ref_grads = ref
    t_loss, t_lse, t_grads = full_run(problem, case, n_classes, impl="torch", dtype=dtype,
                                      device=device, seed=seed)
    pairs = [("loss", t_loss, ref_loss), ("lse", t_lse, ref_lse)]
    pairs += [(k, t_grads[k], ref_grads[k]) for k in ref_grads]
    for name, torch_value, ref_value in pairs:
        if ref_value is not None:
            tols[name] = 2.0 * rel_err(torch_value, ref_value) + atol
    if ref_loss.dim() == 0:
        # A mean or sum may cancel torch's per-token errors by luck: its per-token error is the
        # fair measure of what the dtype allows (as in helpers_lce).
        per_token = {**case["options"], "reduction": "none"}
        runs = [full_run(problem, case, n_classes, impl=impl, dtype=dt, device=dev,
                         options=per_token)[0]
                for impl, dt, dev in (("torch", dtype, device), ("fp64", torch.float64, "cpu"))]
        tols["loss"] = max(tols["loss"], 2.0 * rel_err(*runs) + atol)
    return tols


def check_case(case: dict, rank: int, world: int, *, shape: tuple[int, int, int],
               device="cpu", seed: int = 0) -> list[str]:
    """Run ``case`` on this rank and compare with the fp64 reference; returns the mismatches.

    ``shape``: (S, B, D), the input (S, B, D) and target (S, B); with SP each rank holds
    S / TP positions of the sequence.
    """
    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

    label = f"tp={world} rank={rank} {case['name']}"
    seq, batch, dim = shape
    rows, starts = layout(case, world)
    n_classes = case["vocab_size"] or case["rows"]
    dtype, sp = case["dtype"], case["sp"]
    # Drawn in the case's dtype (on the CPU, the same on every rank): the reference sees the
    # rounded values upcast, so only the computation's error is measured.
    problem = make_problem((seq, batch), case["rows"], dim, dtype, case["regime"], case["ignore"],
                           case["bias"], seed=seed, num_classes=n_classes)
    hidden, weight, target, bias = problem
    lo, hi = starts[rank], starts[rank] + rows[rank]
    s_lo, s_hi = rank * seq // world, (rank + 1) * seq // world

    h = (hidden[s_lo:s_hi] if sp else hidden).to(device).requires_grad_()
    w = weight[lo:hi].to(device).requires_grad_()
    b = None if bias is None else bias[lo:hi].to(device).requires_grad_()
    kwargs = dict(case["options"])
    if case["reversed_shards"]:
        kwargs["vocab_start_index"] = lo
    if case["vocab_size"] is not None:
        kwargs["vocab_size"] = case["vocab_size"]
    accumulator = None
    if case["accumulate"]:
        before = torch.randn(w.shape, generator=torch.Generator().manual_seed(seed))
        accumulator = before.clone().to(device)
        kwargs["weight_grad_accumulator"] = accumulator
    out = vocab_parallel_linear_cross_entropy(
        h, w, target.to(device), b, sequence_parallel=sp, impl=case["impl"],
        return_lse=case["return_lse"], ignore_index=IGNORE_INDEX, **kwargs,
    )
    loss, lse = out if case["return_lse"] else (out, None)
    objective(loss, lse, seed).backward()

    errors = []
    # Collectives first, in the same order on every rank; only local work after them.
    if not same_on_all_ranks(loss, world):
        errors.append(f"{label}: the loss differs between ranks")
    if lse is not None and not same_on_all_ranks(lse, world):
        errors.append(f"{label}: the lse differs between ranks")

    ref = full_run(problem, case, n_classes, impl="fp64", dtype=torch.float64, seed=seed)
    ref_loss, ref_lse, ref_grads = ref
    tols = _tolerances(problem, case, n_classes, ref, device, seed)
    _compare(errors, label, "loss", loss, ref_loss, tols["loss"])
    if lse is not None:
        _compare(errors, label, "lse", lse, ref_lse, tols["lse"])
    ref_input = ref_grads["input"][s_lo:s_hi] if sp else ref_grads["input"]
    _compare(errors, label, "input grad", h.grad, ref_input, tols["input"])
    d_weight = w.grad
    if accumulator is not None:
        if w.grad is not None:
            errors.append(f"{label}: the weight got a .grad besides the accumulator")
        d_weight = accumulator.cpu() - before
        if not torch.equal(accumulator.cpu()[n_real_rows(rows[rank], n_classes, lo):],
                           before[n_real_rows(rows[rank], n_classes, lo):]):
            errors.append(f"{label}: the accumulator's padding rows changed")
    _compare(errors, label, "weight grad", d_weight, ref_grads["weight"][lo:hi], tols["weight"])
    if b is not None:
        _compare(errors, label, "bias grad", b.grad, ref_grads["bias"][lo:hi], tols["bias"])

    # Exact zeros: the padding rows' gradients, the ignored tokens' input gradient.
    n_real = n_real_rows(rows[rank], n_classes, lo)
    for name, grad in (("weight", w.grad), ("bias", None if b is None else b.grad)):
        if grad is not None and torch.count_nonzero(grad[n_real:]):
            errors.append(f"{label}: {name} gradient of padding rows {lo + n_real}..{hi - 1} "
                          "is not exactly zero")
    local_target = (target[s_lo:s_hi] if sp else target).to(device)
    if h.grad is not None and torch.count_nonzero(h.grad[local_target == IGNORE_INDEX]):
        errors.append(f"{label}: ignored tokens have a nonzero input gradient")

    if case["smoothing_is_global"] and world > 1:
        # Megatron smooths over each shard's own classes, so its loss differs per rank; ours
        # must be the single-device loss (checked above), and this problem must tell the two
        # apart on some rank's shard.
        gap = max(
            rel_err(per_shard_smoothing_loss(problem, case, n_classes, start,
                                             min(start + n, n_classes)), ref_loss)
            for start, n in zip(starts, rows) if start < n_classes
        )
        if gap < 10 * tols["loss"]:
            errors.append(f"{label}: per-shard smoothing differs from global smoothing by only "
                          f"{gap:.2e} on this problem: the case cannot tell them apart")
    return errors


def n_real_rows(rows: int, n_classes: int, start: int) -> int:
    """How many of a shard's ``rows`` starting at global row ``start`` are classes."""
    return max(0, min(rows, n_classes - start))


def per_shard_smoothing_loss(problem, case: dict, n_classes: int, lo: int, hi: int):
    """The loss (fp64) with label smoothing over classes [lo, hi) only, Megatron's convention:
    each rank smooths over the classes of its own shard."""
    hidden, weight, target, bias = (None if x is None else x.double() if x.is_floating_point()
                                    else x for x in problem)
    opts = case["options"]
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight[:n_classes].t()
    if bias is not None:
        logits = logits + bias[:n_classes]
    if opts.get("softcap"):
        logits = opts["softcap"] * torch.tanh(logits / opts["softcap"])
    flat = target.reshape(-1)
    valid = flat != IGNORE_INDEX
    lse = torch.logsumexp(logits, dim=1)
    nll = lse - logits.gather(1, flat.clamp_min(0)[:, None]).squeeze(1)
    ls = opts["label_smoothing"]
    loss = (1 - ls) * nll + ls * (lse - logits[:, lo:hi].mean(dim=1))
    loss = loss + opts.get("z_loss", 0.0) * lse**2
    loss = torch.where(valid, loss, 0.0)
    reduction = opts.get("reduction", "mean")
    if reduction == "none":
        return loss.reshape(target.shape)
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()
