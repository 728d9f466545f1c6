"""The training-equivalence experiment's records: the runs' JSON-lines logs read back as
:class:`Run` objects (the final losses, the probes), and ``compact``, which writes a folder of
logs as one small gzipped file that :func:`read_runs` reads as it reads the folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lce_train.equivalence_config import Job, parse_run_name

TAIL_FRACTION = 0.05  # the final train loss averages the last 5% of steps


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Run:
    job: Job
    records: list[dict]

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the records that have ``key``."""
        rows = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
        steps, values = zip(*rows) if rows else ((), ())
        return np.asarray(steps), np.asarray(values, dtype=float)

    @property
    def probes(self) -> list[tuple[int, dict]]:
        """(step, probe) of the probes that ran (a failed probe holds only its "error")."""
        return [(r["step"], r["probe"]) for r in self.records
                if "grad_rel_err" in r.get("probe", {})]

    @property
    def failed_probes(self) -> list[tuple[int, str]]:
        return [(r["step"], r["probe"]["error"]) for r in self.records
                if "error" in r.get("probe", {})]

    def final_train_loss(self) -> float:
        _, loss = self.series("loss")
        tail = max(1, round(TAIL_FRACTION * len(loss)))
        return float(loss[-tail:].mean())

    def final(self, key: str) -> float:
        _, values = self.series(key)
        return float(values[-1]) if len(values) else float("nan")

    def final_probe(self, key: str) -> float:
        probes = self.probes
        return float(probes[-1][1].get(key, float("nan"))) if probes else float("nan")

    def worst_grad_error(self, variant: str) -> float:
        errors = [max(p["grad_rel_err"][variant].values()) for _, p in self.probes
                  if variant in p["grad_rel_err"]]
        return max(errors) if errors else float("nan")


def read_runs(out: Path) -> list[Run]:
    """The runs of a folder of logs, or of a compact file (``compact``) of them."""
    if out.is_file():
        return read_compact(out)
    runs = []
    for path in sorted(out.glob("*.jsonl")):
        job = parse_run_name(path.stem)
        records = read_records(path)
        if job is not None and records:
            runs.append(Run(job, records))
    return runs


# What ``report`` reads of a run's records besides the step, its loss and its time.
_VALID_KEYS = ("valid_loss", "valid_unseen_loss", "valid_unseen_targets")


def compact_line(run: Run) -> str:
    """One JSON line holding what ``report`` reads of ``run``: the train loss and step time of
    every step, the validation losses and the probes where they ran. The launcher logs float32
    losses as doubles: each is written at float32's shortest repr, and read back through
    float32, bit for bit."""
    records = run.records
    steps = [r["step"] for r in records]
    contiguous = steps == list(range(steps[0], steps[0] + len(steps)))
    for r in records:
        loss = r.get("loss")
        if loss is not None and float(np.float32(loss)) != loss:
            raise ValueError(f"{run.job.name} step {r['step']}: loss {loss!r} is no float32")
    losses = ",".join("null" if r.get("loss") is None else str(np.float32(r["loss"]))
                      for r in records)
    fields = {
        "run": run.job.name,
        "first_step" if contiguous else "step": steps[0] if contiguous else steps,
        "step_s": [r.get("step_s") for r in records],
        "valid": {key: [[r["step"], r[key]] for r in records if r.get(key) is not None]
                  for key in _VALID_KEYS},
        "probe": [[r["step"], {k: v for k, v in r["probe"].items()
                               if k in ("grad_rel_err", "unseen_mass", "error")}]
                  for r in records if "probe" in r],
    }
    head = json.dumps(fields)[:-1]
    return f'{head}, "loss": [{losses}]}}'


def read_compact(path: Path) -> list[Run]:
    """The runs of a file written by ``compact`` (plain or gzipped JSON lines)."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    runs = []
    with opener(path, "rt") as f:
        for line in f:
            fields = json.loads(line)
            if "run" not in fields:  # the header: how the runs were made
                continue
            losses = fields["loss"]
            steps = fields.get("step") or list(range(fields["first_step"],
                                                     fields["first_step"] + len(losses)))
            records = [{"step": step, "loss": None if loss is None else float(np.float32(loss)),
                        "step_s": step_s}
                       for step, loss, step_s in zip(steps, losses, fields["step_s"])]
            by_step = {r["step"]: r for r in records}
            for key, pairs in fields["valid"].items():
                for step, value in pairs:
                    by_step[step][key] = value
            for step, probe in fields["probe"]:
                by_step[step]["probe"] = probe
            runs.append(Run(parse_run_name(fields["run"]), records))
    return runs


def cmd_compact(args) -> int:
    """Folder of logs -> one gzipped JSON-lines file: a header line (each ``runs*.json``'s
    environment, overrides and wall time, and its runs' exit codes and wall times), then one
    line per run (``compact_line``)."""
    import gzip

    out = Path(args.out)
    runs = read_runs(out)
    if not runs:
        raise SystemExit(f"no <corpus>_<variant>_s<seed>.jsonl logs in {out}")
    batches = {}
    for path in sorted(out.glob("runs*.json")):
        batch = json.loads(path.read_text())
        batches[path.name] = {
            "environment": batch.get("environment"), "steps": batch.get("steps"),
            "overrides": batch.get("overrides"), "wall_s": batch.get("wall_s"),
            "runs": {r["name"]: {k: r.get(k) for k in ("returncode", "wall_s")}
                     for r in batch.get("runs", [])},
        }
    header = {"experiment": f"scripts/lce_train/training_equivalence.py run, {args.config}",
              "batches": batches}
    dest = Path(args.dest)
    with gzip.open(dest, "wt") as f:
        f.write(json.dumps(header) + "\n")
        for run in runs:
            f.write(compact_line(run) + "\n")
    print(f"wrote {len(runs)} runs to {dest} ({dest.stat().st_size / 2**20:.2f} MiB)")
    return 0
