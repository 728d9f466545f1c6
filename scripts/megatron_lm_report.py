#!/usr/bin/env python
"""Side-by-side table of Megatron-LM ``pretrain_gpt.py`` runs, read from their logs.

    python scripts/megatron_lm_report.py RESULTS_DIR

The command line of ``lce_train.megatron_lm_report``; its docstring (and ``--help``) has the rest.
"""

import sys

from lce_train.megatron_lm_report import main

if __name__ == "__main__":
    sys.exit(main())
