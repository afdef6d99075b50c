"""``python -m decode_node ...`` is ``pdkv decode ...``."""

from __future__ import annotations

import sys

from deploy.cli import main

if __name__ == "__main__":
    sys.exit(main(["decode", *sys.argv[1:]]))
