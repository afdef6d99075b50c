"""``python -m deploy.cli ...`` is ``pdkv ...``."""

from __future__ import annotations

import sys

from deploy.cli import main

if __name__ == "__main__":
    sys.exit(main())
