"""Exceptions raised by the KV memory core."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """The pool cannot satisfy an allocation now; nothing was changed. Retry later."""


class RangeError(ValueError):
    """A range passed to ``free_kv_row`` or ``pin`` breaks the contract; nothing was changed."""
