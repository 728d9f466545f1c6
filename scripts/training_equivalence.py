#!/usr/bin/env python
"""The training-equivalence experiment: does pretraining from scratch with fused_lce's loss
train like megatron's own?

    python scripts/training_equivalence.py run --out out/equivalence       # the matrix, on GPUs
    python scripts/training_equivalence.py report --out out/equivalence    # plots, CSV, table

The command line of ``lce_train.training_equivalence``, whose docstring (and ``--help``) says
the rest.
"""

import sys

from lce_train.training_equivalence import main

if __name__ == "__main__":
    sys.exit(main())
