"""Comparison helpers for tests: relative errors in float64 and failures that show where.

Import as ``from helpers import rel_err, assert_close_rel`` (pyproject puts tests/ on the path).
"""

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error ||actual - expected|| / ||expected||, computed in float64.

    When ``expected`` has zero norm the relative error is undefined, so the absolute norm
    ||actual - expected|| is returned instead.
    """
    a = torch.as_tensor(actual).detach().to(device="cpu", dtype=torch.float64)
    b = torch.as_tensor(expected).detach().to(device="cpu", dtype=torch.float64)
    diff_norm = torch.linalg.vector_norm(a - b).item()
    ref_norm = torch.linalg.vector_norm(b).item()
    return diff_norm if ref_norm == 0.0 else diff_norm / ref_norm


def assert_close_rel(
    actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str = "tensor"
) -> None:
    """Asserts ``rel_err(actual, expected) <= tol``.

    On failure the message lists the five entries with the largest absolute difference, with
    their indices, so a bad row or a stray NaN is visible at once. NaN anywhere fails.
    """
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected)
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    err = rel_err(actual, expected)
    if err <= tol:  # False for NaN, so NaN fails
        return

    a = actual.detach().to(device="cpu", dtype=torch.float64)
    b = expected.detach().to(device="cpu", dtype=torch.float64)
    diff = (a - b).abs().flatten()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    k = min(5, int((diff > 0).sum()))
    worst = torch.topk(diff, k).indices
    lines = [
        f"{name}: relative error {err:.3e} > tol {tol:.3e} "
        f"(shape {tuple(actual.shape)}, {actual.dtype} vs {expected.dtype})",
        f"worst {k} mismatching entries:",
    ]
    flat_a, flat_b = a.flatten(), b.flatten()
    for i in worst.tolist():
        index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), actual.shape))
        lines.append(
            f"  {index}: actual {flat_a[i].item():.6g}, expected {flat_b[i].item():.6g}, "
            f"|diff| {abs(flat_a[i].item() - flat_b[i].item()):.3e}"
        )
    raise AssertionError("\n".join(lines))


def logits64(hidden, weight, bias=None, softcap=None):
    """softcap(hidden @ weight.T + bias) in float64: the logits every kernel test checks against."""
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits
