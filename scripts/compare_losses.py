#!/usr/bin/env python
"""Train the same model with fused_lce's ``cce`` loss and with megatron-core's own, side by side.

    python scripts/compare_losses.py        # TP=2 over gloo on a CPU, 10 steps, about 15 s

The command line of ``lce_train.compare_losses``, whose docstring (and ``--help``) says the rest.
"""

import os
import sys

# Import the installed lce_train, not its source folder beside this file: the install maps the
# top-level configs/ in as lce_train.configs, which that folder lacks (a wheel would break).
HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

from lce_train.compare_losses import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
