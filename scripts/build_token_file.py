#!/usr/bin/env python
"""Build a Megatron indexed dataset (.bin + .idx) for scripts/pretrain_gpt.py --data-path from
text already on this machine.

    python scripts/build_token_file.py --out data/stdlib                  # Python's stdlib, bytes

The command line of ``lce_train.build_token_file``, whose docstring (and ``--help``) says the rest.
"""

import os
import sys

# Import the installed lce_train, not its source folder beside this file: the install maps the
# top-level configs/ in as lce_train.configs, which that folder lacks (a wheel would break).
HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

from lce_train.build_token_file import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
