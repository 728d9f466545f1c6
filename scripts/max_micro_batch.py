#!/usr/bin/env python
"""The largest micro-batch that trains without running out of GPU memory, for one launcher setup.

    torchrun --nproc-per-node 4 scripts/max_micro_batch.py --config gemma2_like --bf16 \\
        --tensor-model-parallel-size 4 --seq-length 4096 --cross-entropy-fusion-impl cce \\
        --out max_mbs_cce.json

The command line of ``lce_train.max_micro_batch``, whose docstring (and ``--help``) says the rest.
"""

import sys

from lce_train.max_micro_batch import main

if __name__ == "__main__":
    sys.exit(main())
