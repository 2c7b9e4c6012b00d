"""``python -m fxopt``: the same as the ``fxopt`` console script."""

import sys

from fxopt.cli import main

if __name__ == "__main__":
    sys.exit(main())
