"""``python -m prefill_node ...`` is ``pdkv prefill ...``."""

from __future__ import annotations

import sys

from deploy.cli import main

if __name__ == "__main__":
    sys.exit(main(["prefill", *sys.argv[1:]]))
