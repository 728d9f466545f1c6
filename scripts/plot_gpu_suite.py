#!/usr/bin/env python
"""Plots and tables for the results of scripts/gpu_suite.sh (run on the CPU, after the GPU run).

    python scripts/plot_gpu_suite.py parallel docs/benchmarks/vocab_parallel_h200x4_202611

The command line of ``lce_train.plot_gpu_suite``, whose docstring (and ``--help``) says the rest.
"""

import sys

from lce_train.plot_gpu_suite import main

if __name__ == "__main__":
    sys.exit(main())
