#!/usr/bin/env python
"""Pipeline-stage memory balance with megatron's loss (``native``) and with Cut Cross-Entropy.

    python scripts/pp_memory_balance.py --config llama3_8b --tensor-model-parallel-size 2 \\
        --sequence-parallel --pipeline-model-parallel-size 4 --num-microbatches 8 \\
        --seq-length 8192 --csv out/llama.csv --png out/llama.png

The command line of ``lce_train.pp_memory_balance``, whose docstring (and ``--help``) says the rest.
"""

import sys

from lce_train.pp_memory_balance import main

if __name__ == "__main__":
    sys.exit(main())
