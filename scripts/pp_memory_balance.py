#!/usr/bin/env python
"""Pipeline-stage memory balance with megatron's loss (``native``) and with Cut Cross-Entropy.

    python scripts/pp_memory_balance.py --config llama3_8b --tensor-model-parallel-size 2 \\
        --sequence-parallel --pipeline-model-parallel-size 4 --num-microbatches 8 \\
        --seq-length 8192 --csv out/llama.csv --png out/llama.png

The command line of ``lce_train.pp_memory_balance``, whose docstring (and ``--help``) says the rest.
"""

import os
import sys

# Import the installed lce_train, not its source folder beside this file: the install maps the
# top-level configs/ in as lce_train.configs, which that folder lacks (a wheel would break).
HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

from lce_train.pp_memory_balance import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
