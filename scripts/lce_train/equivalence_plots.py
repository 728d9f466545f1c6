"""The training-equivalence experiment's figures: the loss curves of each corpus and their
differences to the reference (loss_<corpus>.png), the probes' gradient errors (grad_error.png)
and the measures on tokens unseen in training (unseen.png). matplotlib is imported where a
figure is drawn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lce_train.equivalence_config import Targets
from lce_train.equivalence_logs import Run


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    sums = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (sums[idx] - sums[lo]) / (idx - lo)


def _band(ax, curves: list[tuple[np.ndarray, np.ndarray]], label: str, color) -> None:
    """Mean over seeds with a min-max band, on the steps all curves share."""
    common = curves[0][0]
    for steps, _ in curves[1:]:
        common = np.intersect1d(common, steps)
    if len(common) == 0:
        return
    stack = np.stack([values[np.isin(steps, common)] for steps, values in curves])
    ax.plot(common, stack.mean(0), label=label, color=color, lw=1.2)
    if len(curves) > 1:
        ax.fill_between(common, stack.min(0), stack.max(0), color=color, alpha=0.2, lw=0)


def _by_variant(runs: list[Run], corpus: str) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {}
    for run in runs:
        if run.job.corpus == corpus:
            out.setdefault(run.job.variant, []).append(run)
    return out


def plot_losses(runs: list[Run], corpus: str, targets: Targets, path: Path) -> None:
    import matplotlib.pyplot as plt

    groups = _by_variant(runs, corpus)
    steps = max(r.records[-1]["step"] for g in groups.values() for r in g)
    window = max(1, steps // 50)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    reference = {r.job.seed: r for r in groups.get(targets.reference, [])}
    for i, (variant, group) in enumerate(sorted(groups.items())):
        color = colors[i % len(colors)]
        train = [(s, moving_average(v, window)) for s, v in (r.series("loss") for r in group)]
        valid = [r.series("valid_loss") for r in group]
        _band(axes[0], train, variant, color)
        _band(axes[1], [c for c in valid if len(c[0])], variant, color)
        if variant == targets.reference:
            continue
        # Paired by seed: the same initialisation and data, only the loss layer differs.
        for key, style, smooth in (("loss", "-", True), ("valid_loss", "--", False)):
            diffs = []
            for run in group:
                ref = reference.get(run.job.seed)
                if ref is None:
                    continue
                (s1, v1), (s2, v2) = run.series(key), ref.series(key)
                if smooth:
                    v1, v2 = moving_average(v1, window), moving_average(v2, window)
                common, i1, i2 = np.intersect1d(s1, s2, return_indices=True)
                diffs.append((common, v1[i1] - v2[i2]))
            if diffs:
                _band(axes[2], diffs, f"{variant} ({'train' if smooth else 'valid'})", color)
                axes[2].lines[-1].set_linestyle(style)
    axes[0].set_title(f"{corpus}: train loss (moving average of {window} steps)")
    axes[1].set_title(f"{corpus}: validation loss")
    axes[2].set_title(f"difference to {targets.reference} (same seed), nats")
    axes[2].axhspan(-targets.loss_nats, targets.loss_nats, color="grey", alpha=0.15, lw=0)
    axes[2].axhline(0.0, color="black", lw=0.6)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _zoom_on_tail(axes[0])
    _zoom_on_tail(axes[1])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _zoom_on_tail(ax) -> None:
    """Loss curves start at ln(V) and fall fast: show the range of their second half."""
    tails = [line.get_ydata()[len(line.get_ydata()) // 2:] for line in ax.get_lines()]
    tails = [t for t in tails if len(t)]
    if tails:
        lo = min(float(np.min(t)) for t in tails)
        hi = max(float(np.max(t)) for t in tails)
        pad = 0.5 * (hi - lo) + 1e-3
        ax.set_ylim(lo - pad, hi + 4 * pad)


def plot_grad_errors(runs: list[Run], targets: Targets, path: Path) -> None:
    import matplotlib.pyplot as plt

    corpora = sorted({r.job.corpus for r in runs})
    fig, axes = plt.subplots(len(corpora), 2, figsize=(12, 3.8 * len(corpora)), squeeze=False)
    for row, corpus in enumerate(corpora):
        worst: dict[str, dict[int, dict[str, float]]] = {}
        for run in runs:
            if run.job.corpus != corpus:
                continue
            for step, probe in run.probes:
                for name, errs in probe["grad_rel_err"].items():
                    cell = worst.setdefault(name, {}).setdefault(step, {})
                    for part, err in errs.items():
                        cell[part] = max(cell.get(part, 0.0), err)
        for col, part in enumerate(("input", "weight")):
            ax = axes[row][col]
            for name, by_step in sorted(worst.items()):
                steps = sorted(by_step)
                ax.plot(steps, [by_step[s][part] for s in steps], marker="o", ms=3, label=name)
            ax.axhline(targets.grad_rel_err, color="grey", ls="--", lw=0.8, label="target")
            ax.set_yscale("log")
            ax.set_title(f"{corpus}: d{part} relative error vs fp32 (max over runs)")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_unseen(runs: list[Run], path: Path) -> None:
    import matplotlib.pyplot as plt

    corpora = sorted({r.job.corpus for r in runs})
    fig, axes = plt.subplots(2, len(corpora), figsize=(6.5 * len(corpora), 8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for col, corpus in enumerate(corpora):
        for i, (variant, group) in enumerate(sorted(_by_variant(runs, corpus).items())):
            color = colors[i % len(colors)]
            mass = []
            for run in group:
                steps = np.asarray([s for s, p in run.probes if "unseen_mass" in p])
                values = np.asarray([p["unseen_mass"] for _, p in run.probes
                                     if "unseen_mass" in p])
                mass.append((steps, values))
            if mass and len(mass[0][0]):
                _band(axes[0][col], mass, variant, color)
            unseen_loss = [c for c in (r.series("valid_unseen_loss") for r in group) if len(c[0])]
            if unseen_loss:
                _band(axes[1][col], unseen_loss, variant, color)
        axes[0][col].set_yscale("log")
        axes[0][col].set_title(f"{corpus}: probability on tokens unseen in training")
        axes[1][col].set_title(f"{corpus}: validation loss on unseen targets")
        for ax in axes[:, col]:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
