#!/usr/bin/env python
"""Every GPU case of the test suite on one machine, all its GPUs busy, within one time limit:

    python scripts/gpu_tests.py RESULTS_DIR [--limit 560]
    python scripts/gpu_tests.py RESULTS_DIR --list      # the jobs, nothing run (no GPU needed)

The multi-GPU cases (``requires_gpus``, NCCL) run as one pytest on every GPU from the start;
the one-GPU cases (``requires_cuda``) run beside them, a pytest per GPU at a time from a queue,
largest first, a file of many cases split into shards of at most ``--shard`` node ids. Files
are run one by one per GPU rather than in waves, because one file's cases take from seconds to
a quarter of an hour (tests/op/test_cce_at_scale.py: 163 cases, about 14 min on one H100, 3.5
min in four shards). Each job writes RESULTS_DIR/<job>.log; a line per job and the failures
follow on stdout. Exit status: 1 if any job failed or ran out of time.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

PYTEST = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]


def gpu_test_files(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("test_*.py")
                  if re.search(r"requires_cuda|requires_gpus", p.read_text()))


def one_gpu_ids(files: list[str]) -> dict[str, list[str]]:
    listed = subprocess.run(PYTEST + ["--collect-only", *files, "-m", "requires_cuda"],
                            capture_output=True, text=True).stdout
    ids: dict[str, list[str]] = {f: [] for f in files}
    for line in listed.splitlines():
        if "::" in line:
            ids.setdefault(line.split("::")[0], []).append(line.strip())
    return ids


def jobs_largest_first(ids: dict[str, list[str]], shard: int) -> list[tuple[str, list[str]]]:
    """(job name, pytest targets) a file, or a shard of a file's node ids, most cases first."""
    jobs = []
    for file, cases in ids.items():
        stem = Path(file).stem
        n = -(-len(cases) // shard)
        if n == 1:
            jobs.append((len(cases), stem, [file]))
        elif n > 1:
            jobs += [(len(cases[k::n]), f"{stem}_{k}", cases[k::n]) for k in range(n)]
    return [(name, targets) for _, name, targets in sorted(jobs, key=lambda job: -job[0])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--limit", type=float, default=560, help="seconds for everything")
    parser.add_argument("--shard", type=int, default=45, help="most one-GPU cases a job")
    parser.add_argument("--list", action="store_true", help="print the jobs, run nothing")
    args = parser.parse_args()
    files = gpu_test_files(Path("tests"))
    jobs = jobs_largest_first(one_gpu_ids(files), args.shard)
    if args.list:
        print("multi_gpu:", *files)
        for name, targets in jobs:
            print(f"one_gpu_{name}:", *targets)
        return 0
    import torch

    n_gpus = torch.cuda.device_count()
    if n_gpus == 0:
        parser.error("no CUDA GPU here")
    args.results.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    failed = []

    def run(name: str, command: list[str], env: dict) -> None:
        began = time.monotonic()
        log = args.results / f"{name}.log"
        with open(log, "w") as out:
            try:
                rc = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    timeout=max(10.0, args.limit - (began - start))).returncode
            except subprocess.TimeoutExpired:
                rc = "out of time"
        last = (log.read_text().strip().splitlines() or [""])[-1]
        if rc not in (0, 5):  # 5: no case selected
            failed.append(name)
        print(f"== {name}: {rc}, {time.monotonic() - began:.0f} s: {last}", flush=True)

    threads = []
    if n_gpus > 1:
        threads.append(threading.Thread(target=run, args=(
            "multi_gpu", PYTEST + files + ["-m", "requires_gpus"], dict(os.environ))))
    pending: queue.Queue = queue.Queue()
    for job in jobs:
        pending.put(job)

    def worker(gpu: int) -> None:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
        while True:
            try:
                name, targets = pending.get_nowait()
            except queue.Empty:
                return
            run(f"one_gpu_{name}", PYTEST + targets + ["-m", "requires_cuda"], env)

    threads += [threading.Thread(target=worker, args=(gpu,)) for gpu in range(n_gpus)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in failed:
        log = (args.results / f"{name}.log").read_text().splitlines()
        print(f"-- {name}", *[line for line in log if line.startswith(("FAILED", "ERROR"))],
              sep="\n")
    print(f"== all jobs in {time.monotonic() - start:.0f} s; failed or out of time: "
          f"{failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
