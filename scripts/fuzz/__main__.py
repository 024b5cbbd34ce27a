"""``python scripts/fuzz`` (or ``python -m fuzz`` in scripts/): the fuzzer's command line, ``fuzz.cli``."""

import sys
from pathlib import Path

if not __package__:  # run as a directory: scripts/, not scripts/fuzz/, goes first, so the package imports by name
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from fuzz.cli import main

if __name__ == "__main__":
    sys.exit(main())
