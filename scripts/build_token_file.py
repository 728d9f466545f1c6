#!/usr/bin/env python
"""Build a token file for scripts/pretrain_gpt.py --data-path from text already on this machine.

    python scripts/build_token_file.py --out data/stdlib                  # Python's stdlib, bytes

The command line of ``lce_train.build_token_file``, whose docstring (and ``--help``) says the rest.
"""

import sys

from lce_train.build_token_file import main

if __name__ == "__main__":
    sys.exit(main())
