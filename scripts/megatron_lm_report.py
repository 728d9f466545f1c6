#!/usr/bin/env python
"""Side-by-side table of Megatron-LM ``pretrain_gpt.py`` runs, read from their logs.

    python scripts/megatron_lm_report.py RESULTS_DIR

The command line of ``lce_train.megatron_lm_report``; its docstring (and ``--help``) has the rest.
"""

import os
import sys

# Import the installed lce_train, not its source folder beside this file: the install maps the
# top-level configs/ in as lce_train.configs, which that folder lacks (a wheel would break).
HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

from lce_train.megatron_lm_report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
