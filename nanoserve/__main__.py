"""`python -m nanoserve ...`: the same command line as the `nanoserve` script (nanoserve.cli)."""

from __future__ import annotations

import sys

from nanoserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
