"""`python -m rlfuse ...` (and `torchrun ... -m rlfuse ...`): the `rlfuse` command line."""

import sys

from rlfuse.cli import main

if __name__ == "__main__":
    sys.exit(main())
