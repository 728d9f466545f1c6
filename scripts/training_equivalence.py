#!/usr/bin/env python
"""The training-equivalence experiment: does pretraining from scratch with fused_lce's loss
train like megatron's own?

    python scripts/training_equivalence.py run --out out/equivalence       # the matrix, on GPUs
    python scripts/training_equivalence.py report --out out/equivalence    # plots, CSV, table

The command line of ``lce_train.training_equivalence``, whose docstring (and ``--help``) says
the rest.
"""

import os
import sys

# Import the installed lce_train, not its source folder beside this file: the install maps the
# top-level configs/ in as lce_train.configs, which that folder lacks (a wheel would break).
HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

from lce_train.training_equivalence import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
