"""``python -m fxad``: the command line interface (see :mod:`fxad.cli`)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
