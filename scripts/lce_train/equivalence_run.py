"""The training-equivalence experiment's ``run``: every (corpus, variant, seed) of the matrix as
one launcher run (``torchrun --nproc-per-node 1 -m lce_train.training``), at most one per
visible GPU at a time, each writing ``<out>/<name>.jsonl`` and ``.log``; ``<out>/runs.json``
records the commands, exit codes and wall times (:func:`cmd_run`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from lce_train.equivalence_config import CHECKOUT, Experiment, Job, Targets, load_experiment
from lce_train.equivalence_logs import read_records

# The installed launcher's module, so that a wheel runs the matrix as a checkout does.
LAUNCHER = ("-m", "lce_train.training")
DEFAULT_BASE_PORT = 29610


def as_flags(mapping: dict) -> list[str]:
    """{"seq-length": 1024, "bf16": True, "x": None} -> ["--seq-length", "1024", "--bf16"]."""
    out = []
    for key, value in mapping.items():
        if value is None or value is False:
            continue
        out.append(f"--{key}")
        if value is not True:
            out.append(str(value))
    return out


def launcher_flags(exp: Experiment, job: Job, steps: int, data: dict[str, tuple[str, str]],
                   log_json: Path, overrides: dict) -> list[str]:
    """The launcher's flags of one run: common, corpus, variant, then seed, steps and logs."""
    corpus = dict(exp.corpora[job.corpus])
    prefix = corpus.pop("data", None)
    if prefix is not None:
        train, valid = data[job.corpus]
        corpus.update({"data-path": train, "valid-data-path": valid})
    return as_flags({**exp.launcher, **corpus, **exp.variants[job.variant], **overrides,
                     "seed": job.seed, "train-iters": steps, "log-json": str(log_json)})


def prepare_data(exp: Experiment, corpora: list[str], data_dir: Path,
                 cache: Path) -> dict[str, tuple[str, str]]:
    """(train, valid) prefixes of each file corpus, unpacking .bin.xz files into ``cache``."""
    from lce_train import build_token_file

    out = {}
    for name in corpora:
        prefix = exp.corpora[name].get("data")
        if prefix is None:
            continue
        pair = []
        for split in ("train", "valid"):
            path = data_dir / f"{prefix}_{split}"
            if not path.with_name(path.name + ".json").exists():
                raise SystemExit(
                    f"corpus {name}: {path}.json not found; build it (docs/training_equivalence"
                    f".md, 'Data') or pass --data-dir / --corpora")
            pair.append(str(build_token_file.unpack(path, cache)))
        out[name] = (pair[0], pair[1])
    return out


def visible_gpus() -> list[str]:
    ids = os.environ.get("CUDA_VISIBLE_DEVICES")
    if ids is not None:
        return [i for i in ids.split(",") if i.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def _torchrun(port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
            "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]


def order_jobs(jobs: list[Job], targets: Targets) -> list[Job]:
    """The reference and candidate runs first, corpus by corpus, then the other variants: with
    4 GPUs the first two waves hold the comparisons the targets need, should time run out."""
    primary = (targets.reference, targets.candidate)
    return sorted(jobs, key=lambda j: (j.variant not in primary, j.corpus,
                                       primary.index(j.variant) if j.variant in primary else 0,
                                       j.variant, j.seed))


def run_queue(jobs: list[tuple[Job, list[str]]], slots: list[str | None], out: Path,
              threads: int, timeout: float | None, deadline: float | None) -> list[dict]:
    """Run each (job, command), at most one per slot (a GPU id, or None on the CPU) at a time;
    returns one result per job in ``jobs`` order (returncode None: never started).

    A run is killed after ``timeout`` seconds; after ``deadline`` seconds from the start no run
    is started and running ones are killed (their logs so far remain).
    """
    pending = list(enumerate(jobs))
    running: dict[int, tuple[int, subprocess.Popen, float]] = {}  # slot -> (job index, ...)
    results: list[dict] = [{"name": job.name, "returncode": None, "wall_s": 0.0}
                           for job, _ in jobs]
    t_start = time.perf_counter()
    while pending or running:
        late = deadline is not None and time.perf_counter() - t_start > deadline
        if late and pending:
            print(f"deadline of {deadline:.0f} s: not starting "
                  f"{', '.join(jobs[i][0].name for i, _ in pending)}", flush=True)
            pending = []
        for slot, gpu in enumerate(slots):
            if slot in running or not pending:
                continue
            index, (job, command) = pending.pop(0)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            if gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpu
            log = open(out / f"{job.name}.log", "w")
            proc = subprocess.Popen(command, cwd=CHECKOUT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            running[slot] = (index, proc, time.perf_counter())
            print(f"[{time.perf_counter() - t_start:6.0f} s] start {job.name} on "
                  f"{'GPU ' + gpu if gpu is not None else 'CPU'}", flush=True)
        time.sleep(0.5)
        for slot, (index, proc, started) in list(running.items()):
            wall = time.perf_counter() - started
            if proc.poll() is None and (late or (timeout is not None and wall > timeout)):
                os.killpg(proc.pid, 9)  # the run's own process group (start_new_session)
                proc.wait()
            if proc.poll() is None:
                continue
            job = jobs[index][0]
            results[index] = {"name": job.name, "corpus": job.corpus, "variant": job.variant,
                              "seed": job.seed, "command": jobs[index][1],
                              "returncode": proc.returncode, "wall_s": wall,
                              "gpu": slots[slot]}
            del running[slot]
            print(f"[{time.perf_counter() - t_start:6.0f} s] done  {job.name}: "
                  f"{_outcome(out, job, proc.returncode)} ({wall:.0f} s)", flush=True)
    return results


def _outcome(out: Path, job: Job, returncode: int) -> str:
    if returncode != 0:
        tail = (out / f"{job.name}.log").read_text(errors="replace").splitlines()[-15:]
        return f"exit {returncode}; log tail:\n    " + "\n    ".join(tail)
    records = read_records(out / f"{job.name}.jsonl")
    if not records:
        return "no records"
    last = records[-1]
    valid = f", valid {last['valid_loss']:.4f}" if "valid_loss" in last else ""
    step_ms = 1e3 * float(np.median([r["step_s"] for r in records]))
    return f"step {last['step']}, loss {last['loss']:.4f}{valid}, median step {step_ms:.0f} ms"


def cmd_run(args) -> int:
    exp = load_experiment(args.config)
    if args.cpu_smoke:
        exp = exp.smoke()
    corpora = _pick(args.corpora, list(exp.corpora), "corpus")
    variants = _pick(args.variants, exp.matrix_variants, "variant", known=list(exp.variants))
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else exp.seeds
    steps = args.steps or exp.steps
    overrides = _parse_overrides(args.set)
    # Absolute paths: the runs start in the checkout's root (the current directory, installed),
    # and relative ones would land their logs there.
    out = Path(args.out).resolve()
    data_dir, data_cache = Path(args.data_dir).resolve(), Path(args.data_cache).resolve()
    out.mkdir(parents=True, exist_ok=True)

    if args.cpu_smoke:
        slots = [None] * args.jobs if args.jobs else [None]
    else:
        gpus = visible_gpus()
        if not gpus and not args.dry_run:
            raise SystemExit("no GPU visible: run on a GPU machine, or pass --cpu-smoke")
        slots = gpus[: args.jobs] if args.jobs else gpus
    data = {} if args.dry_run else prepare_data(exp, corpora, data_dir, data_cache)
    if args.dry_run:
        data = {c: (f"{data_dir}/{exp.corpora[c]['data']}_train",
                    f"{data_dir}/{exp.corpora[c]['data']}_valid")
                for c in corpora if "data" in exp.corpora[c]}

    jobs = []
    matrix = order_jobs([Job(c, v, s) for c in corpora for v in variants for s in seeds],
                        exp.targets)
    for index, job in enumerate(matrix):
        log_json = out / f"{job.name}.jsonl"
        command = [*_torchrun(args.base_port + index), *LAUNCHER,
                   *launcher_flags(exp, job, steps, data, log_json, overrides)]
        jobs.append((job, command))
    print(f"{len(jobs)} runs ({len(corpora)} corpora x {len(variants)} variants x "
          f"{len(seeds)} seeds), {steps} steps each, {len(slots)} at a time")
    if args.dry_run:
        for job, command in jobs:
            print(f"{job.name}: {' '.join(command)}")
        return 0
    for job, _ in jobs:
        (out / f"{job.name}.jsonl").unlink(missing_ok=True)  # the launcher appends

    threads = max(1, (os.cpu_count() or 1) // len(slots))
    t0 = time.perf_counter()
    results = run_queue(jobs, slots, out, threads, args.timeout, args.deadline)
    wall = time.perf_counter() - t0
    (out / "runs.json").write_text(json.dumps({
        "config": str(args.config), "cpu_smoke": args.cpu_smoke, "steps": steps,
        "experiment": dataclasses.asdict(exp), "overrides": overrides, "wall_s": wall,
        "environment": _environment(), "runs": results}, indent=1))
    failed = [r["name"] for r in results if r["returncode"] is not None and r["returncode"]]
    skipped = [r["name"] for r in results if r["returncode"] is None]
    if skipped:
        print(f"not run (deadline): {', '.join(skipped)}")
    done = len(results) - len(failed) - len(skipped)
    print(f"{done}/{len(results)} runs finished in {wall:.0f} s"
          + (f"; failed or killed: {', '.join(failed)}" if failed else ""))
    return 1 if failed or skipped else 0


def _parse_overrides(items: list[str]) -> dict:
    """["eval-interval=50", "bf16=false"] -> {"eval-interval": 50, "bf16": False} (YAML values)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects FLAG=VALUE, got {item!r}")
        out[key.removeprefix("--")] = yaml.safe_load(value)
    return out


def _pick(given: str | None, default: list[str], kind: str, known: list[str] | None = None):
    names = [n.strip() for n in given.split(",") if n.strip()] if given else default
    bad = [n for n in names if n not in (known or default)]
    if bad:
        raise SystemExit(f"unknown {kind} {bad}; known: {known or default}")
    return names


def _environment() -> dict:
    env = {"python": sys.version.split()[0]}
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
        from importlib.metadata import version

        env["megatron-core"] = version("megatron-core")
        env["triton"] = version("triton")
    except Exception as err:  # informative only: never fail a run over it
        env["error"] = f"{type(err).__name__}: {err}"
    return env
