"""Faces that import their torch-bound modules on first use.

Importing any module of a package runs the package's face first, so a face that imported
everything eagerly made every import of ``common`` cost torch (1.5-2 s of CPU): the
router, ``pdkv keys`` and ``pdkv replay`` need none of it. A face imports its light
modules as usual and names the heavy ones here; each such name is imported the first
time it is read, then kept on the face like any other.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_names(face: str, names: dict[str, str]) -> Callable[[str], object]:
    """The ``__getattr__`` of the face ``face``: ``names`` maps each lazy name to its module
    (``"module"``, or ``"module:attr"`` for a name the face renames)."""

    def __getattr__(name: str) -> object:
        target = names.get(name)
        if target is None:
            raise AttributeError(f"module {face!r} has no attribute {name!r}")
        module, _, attr = target.partition(":")
        value = getattr(importlib.import_module(module), attr or name)
        setattr(sys.modules[face], name, value)  # read once: the next read is plain
        return value

    return __getattr__
