#!/usr/bin/env python
"""Plots and tables for the results of scripts/gpu_suite.sh (run on the CPU, after the GPU run).

    python scripts/plot_gpu_suite.py parallel docs/benchmarks/vocab_parallel_h200x4_202611

The command line of ``lce_train.plot_gpu_suite``, whose docstring (and ``--help``) says the rest.
"""

import os
import sys

# Import the installed lce_train, not its source folder beside this file: the install maps the
# top-level configs/ in as lce_train.configs, which that folder lacks (a wheel would break).
HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

from lce_train.plot_gpu_suite import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
