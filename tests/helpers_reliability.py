"""Problems for the reliability tests: confident tokens, and arguments that are strided views.

``confident_problem`` draws rows whose softmax is peaked at the target, as a trained model's are
on most tokens: logits of 40 to 100 with the target 10 to 24 above the rest, so per-token losses
run from about 1e-5 to 0.5. There the loss is a small difference of two numbers near the row
maximum, which is what fp32 must not lose (fused_lce.terms).

``strided`` gives a view of the same values with every stride doubled, the other half of its
storage filled with decoys, so a kernel that assumes unit strides reads the decoys.
"""

from __future__ import annotations

import math

import torch
from helpers import rel_err


def confident_problem(
    n: int, v: int, d: int, *, seed: int = 0, bias: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(hidden (n, d), weight (v, d), target (n,) int64, bias (v,) or None), fp32 on the CPU.

    Every weight row is a class-specific part orthogonal to a shared direction ``u`` plus ``u``;
    each hidden state is ``a u`` (a in [40, 90]: the logits' level) plus ``s`` times its target's
    part scaled to give that class's logit ``s`` more (s in [10, 24]: the confidence).
    """
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    u = torch.randn(d, generator=gen, dtype=f64)
    u /= u.norm()
    own = torch.randn(v, d, generator=gen, dtype=f64) / math.sqrt(d)
    own -= (own @ u)[:, None] * u
    weight = own + u
    target = torch.randint(0, v, (n,), generator=gen)
    toward_target = own[target] / own[target].norm(dim=1, keepdim=True) ** 2
    level = 40.0 + 50.0 * torch.rand(n, 1, generator=gen, dtype=f64)
    confidence = 10.0 + 14.0 * torch.rand(n, 1, generator=gen, dtype=f64)
    hidden = level * u + confidence * toward_target
    bias_t = 0.5 * torch.randn(v, generator=gen, dtype=f64) if bias else None
    return (
        hidden.float(),
        weight.float(),
        target,
        None if bias_t is None else bias_t.float(),
    )


def strided(x: torch.Tensor, decoy: torch.Tensor | float) -> torch.Tensor:
    """``x``'s values in a view whose strides are all doubled; the skipped storage holds
    ``decoy`` (broadcast to ``x``'s shape)."""
    storage = torch.empty((*x.shape, 2), dtype=x.dtype, device=x.device)
    storage[..., 0] = x
    storage[..., 1] = decoy
    view = storage[..., 0]
    assert view.dim() == 0 or all(s % 2 == 0 and s > 0 for s in view.stride())
    return view


def transposed(x: torch.Tensor) -> torch.Tensor:
    """A 2-D ``x`` stored column-major: the same values, strides (1, rows)."""
    return x.t().contiguous().t()


STRIDED_ARGUMENTS = ("input", "weight", "weight-column-major", "target", "bias",
                     "input-one-row-broadcast", "bias-broadcast")


def with_strided_argument(which: str, hidden, weight, target, bias, n_classes: int):
    """The problem with one argument (``which``, of STRIDED_ARGUMENTS) replaced by a strided or
    broadcast view of the same values."""
    if which == "input":
        hidden = strided(hidden, 1e4)
    elif which == "weight":
        weight = strided(weight, -1e4)
    elif which == "weight-column-major":
        weight = transposed(weight)
    elif which == "target":
        # As `target = pairs[:, 0]`: the decoys are other, valid classes.
        target = strided(target, (target + 1) % n_classes)
    elif which == "bias":
        bias = strided(bias, 1e4)
    elif which == "input-one-row-broadcast":
        hidden = hidden[3].expand(hidden.shape)  # stride 0 between rows
    elif which == "bias-broadcast":
        bias = bias[:1].expand(bias.shape)  # stride 0
    else:
        raise ValueError(f"unknown argument view {which!r}")
    return hidden, weight, target, bias


# The precision bound of confident tokens: 10x torch's fp32 error against float64, plus what no
# fp32 computation can beat.
PRECISION_FACTOR = 10.0
FP32_FLOOR = 1e-7


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest relative error of any entry (of any row's norm, for 2-D tensors)."""
    actual = actual.detach().to("cpu", torch.float64)
    expected = expected.detach().to("cpu", torch.float64)
    if expected.dim() <= 1:
        return ((actual - expected).abs() / expected.abs()).max().item()
    return ((actual - expected).norm(dim=1) / expected.norm(dim=1)).max().item()


def upstream(loss: torch.Tensor) -> torch.Tensor:
    """A scalar of the loss with a different weight per token (a scalar loss: times 2, so that a
    gradient left unscaled by the upstream gradient shows)."""
    if loss.dim() == 0:
        return 2.0 * loss
    weights = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype, device=loss.device)
    return (loss * weights).sum()


def cross_entropy_run(hidden, weight, target, bias, dtype, reduction, device="cpu"):
    """torch's ``F.cross_entropy`` on full logits in ``dtype``: {loss, lse, d_input, d_weight}."""
    h, w = (x.to(device, dtype).clone().requires_grad_() for x in (hidden, weight))
    logits = h @ w.t()
    if bias is not None:
        logits = logits + bias.to(device, dtype)
    loss = torch.nn.functional.cross_entropy(logits, target.to(device), reduction=reduction)
    upstream(loss).backward()
    lse = torch.logsumexp(logits.detach(), 1)
    return {"loss": loss.detach(), "lse": lse, "d_input": h.grad, "d_weight": w.grad}


def precision_failures(ours: dict, exact: dict, fp32: dict) -> list[str]:
    """Quantities of ``ours`` (None: not computed) less precise than PRECISION_FACTOR x torch's
    fp32 run against the fp64 one; the weight gradient by its norm, the rest per token."""
    failures = []
    for name, value in ours.items():
        if value is None:
            continue
        measure = rel_err if name == "d_weight" else max_rel_err
        err, base = measure(value, exact[name]), measure(fp32[name], exact[name])
        if not err <= PRECISION_FACTOR * base + FP32_FLOOR:
            failures.append(f"{name}: relative error {err:.2e}, torch fp32 {base:.2e}")
    return failures


def hopper_forward_ptxas_report(tma: bool, softcap: bool, bias: bool) -> str:
    """ptxas's register report of the forward kernel (target pick on) compiled for sm_90 at its
    tuned Hopper config, or a line starting "SKIP" where this triton cannot. Call it without
    TRITON_INTERPRET set."""
    import inspect
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import fused_lce.kernels.lse_forward as forward

    function = forward._lse_forward_kernel
    while hasattr(function, "fn"):
        function = function.fn
    cfg = forward._CONFIGS["hopper-tma" if tma else "hopper"]
    ints = ("n_rows", "n_vocab", "d_model", "vocab_per_split", "vocab_start")
    signature = {}
    for name in inspect.signature(function).parameters:
        if name.isupper():
            signature[name] = "constexpr"
        elif name.startswith("stride") or name in ints:
            signature[name] = "i32"
        else:
            signature[name] = "*fp32"
    signature.update(
        e_ptr=f"tensordesc<bf16[{cfg.block_n}, {cfg.block_d}]>" if tma else "*bf16",
        c_ptr=f"tensordesc<bf16[{cfg.block_v}, {cfg.block_d}]>" if tma else "*bf16",
        row_order_ptr="*i32", n_valid_ptr="*i32", row_valid_ptr="*i8", target_ptr="*i64",
        softcap="fp32",
    )
    constants = dict(BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d,
                     DOT_FP32=False, DOT_PRECISION="tf32", HAS_BIAS=bias, HAS_SOFTCAP=softcap,
                     ROW_SUM=False, COL_SUM=False, KEEP=False, TARGET=True, ROUND=0,
                     USE_TMA=tma)
    absent_pointers = ("row_sum_ptr", "col_sum_ptr", "keep_ptr", "keep_max_ptr")
    for absent in absent_pointers + (() if bias else ("bias_ptr",)):
        signature[absent], constants[absent] = "constexpr", None
    from triton.backends import backends

    if "nvidia" not in backends:
        return "SKIP this triton build has no nvidia backend"
    # No except: a compile error is a failure of the kernel, not a missing dependency.
    compiled = triton.compile(
        ASTSource(fn=triton.runtime.jit.JITFunction(function), signature=signature,
                  constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return "SKIP no ptxas in this triton build"
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "forward.ptx")
        with open(source, "w") as file:
            file.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", source, "-o", os.devnull],
                                capture_output=True, text=True, check=True)
    return report.stderr + report.stdout
