#!/usr/bin/env python
"""The largest micro-batch that trains without running out of GPU memory, for one launcher setup.

    torchrun --nproc-per-node 4 scripts/max_micro_batch.py --config gemma2_like --bf16 \\
        --tensor-model-parallel-size 4 --seq-length 4096 --cross-entropy-fusion-impl cce \\
        --out max_mbs_cce.json

The command line of ``lce_train.max_micro_batch``, whose docstring (and ``--help``) says the rest.
"""

import os
import sys

# Import the installed lce_train, not its source folder beside this file: the install maps the
# top-level configs/ in as lce_train.configs, which that folder lacks (a wheel would break).
HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

from lce_train.max_micro_batch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
