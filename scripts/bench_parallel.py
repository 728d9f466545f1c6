#!/usr/bin/env python
"""Benchmark the vocab-parallel loss layer across tensor-parallel ranks, ours beside Megatron's.

    torchrun --nproc-per-node 4 scripts/bench_parallel.py --models gemma2_2b llama3_8b \
        --tokens 8192 --out docs/benchmarks/parallel_run.csv
    torchrun --nproc-per-node 2 scripts/bench_parallel.py --cpu-smoke    # no GPUs: gloo

The command line of ``lce_train.bench_parallel``, whose docstring (and ``--help``) says the rest.
"""

import os
import sys

# Import the installed lce_train, not its source folder beside this file: the install maps the
# top-level configs/ in as lce_train.configs, which that folder lacks (a wheel would break).
HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

from lce_train.bench_parallel import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
