"""`python -m app.cli`: the `steprecord` command."""

import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
