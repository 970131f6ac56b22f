"""`python -m hyperdraft` runs the command line (see hyperdraft.cli)."""

import sys

from hyperdraft.cli import main

if __name__ == "__main__":
    sys.exit(main())
