"""Streaming reader of free logs (format version 1, see docs/freelog.md).

The reader checks the header and then hands out the msgpack ``Unpacker`` itself as the
stream of records: a generator in between would cost a frame switch per event, and replay
speed is measured against a bare decode of the same file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import msgpack

from common.freelog.writer import FORMAT, VERSION

READ_SIZE = 1 << 20
# Errors msgpack raises on bytes that are not msgpack (FormatError and StackError are
# ValueErrors; invalid UTF-8 in a str is a UnicodeDecodeError, also a ValueError).
DECODE_ERRORS = (ValueError, msgpack.UnpackException)


class UnreadableLog(Exception):
    """The file is not a free log this reader understands (exit status 2 of replay)."""


@dataclass(frozen=True)
class PoolInfo:
    """One pool as the header describes it."""

    name: str
    num_pages: int
    page_size: int
    reserved: tuple[int, ...]


@dataclass(frozen=True)
class FreeLogHeader:
    """The first record of a free log."""

    node: str
    version: int
    pools: dict[str, PoolInfo]
    created_unix_ns: int | None
    extra: dict[str, Any] = field(default_factory=dict)


class FreeLogReader:
    """Opens a free log, validates its header and streams its events.

    Iterate ``records`` for the decoded event maps (unchecked: replay judges them).
    ``offset()`` is the byte offset just after the last record handed out.

    Raises:
        UnreadableLog: missing or unreadable file, not msgpack, or a wrong header.
    """

    def __init__(self, path: str | os.PathLike, read_size: int = READ_SIZE):
        self.path = os.fspath(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as exc:
            raise UnreadableLog(f"{self.path}: cannot open: {exc.strerror or exc}") from exc
        self.size = os.fstat(self._file.fileno()).st_size
        self.records = msgpack.Unpacker(self._file, read_size=read_size, raw=False)
        try:
            self.header = parse_header(self._first_record())
        except UnreadableLog as exc:
            self.close()
            raise UnreadableLog(f"{self.path}: {exc}") from None

    def offset(self) -> int:
        return self.records.tell()

    def scan_tail(self, start: int) -> tuple[int, str | None]:
        """Decode again from byte ``start`` (a record boundary) to the end of the file.

        Returns the offset just after the last complete record and the decode error that
        stopped the scan, if any. Replay calls it once, from its last checkpoint, to tell a
        torn last record (bytes left after the last record) from a clean end.
        """
        end, error = start, None
        with open(self.path, "rb") as f:
            f.seek(start)
            unpacker = msgpack.Unpacker(f, read_size=READ_SIZE, raw=False)
            try:
                for _ in unpacker:
                    end = start + unpacker.tell()
            except DECODE_ERRORS as exc:
                error = f"{type(exc).__name__}: {exc}"
        return end, error

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> FreeLogReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _first_record(self) -> Any:
        if self.size == 0:
            raise UnreadableLog("empty file, no free-log header")
        try:
            return next(self.records)
        except StopIteration:
            raise UnreadableLog("truncated free-log header") from None
        except DECODE_ERRORS as exc:
            raise UnreadableLog(f"not a msgpack free log ({type(exc).__name__})") from None


def parse_header(obj: Any) -> FreeLogHeader:
    """Validate the header map; unknown keys are kept in ``extra`` and otherwise ignored."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise UnreadableLog(f"not a free log: the first record is not a {FORMAT!r} header")
    version = obj.get("version")
    if version != VERSION or type(version) is not int:
        raise UnreadableLog(f"unsupported free-log version {version!r} "
                            f"(this reader understands version {VERSION})")
    pools = obj.get("pools")
    if not isinstance(pools, dict) or not pools:
        raise UnreadableLog("header has no 'pools' map")
    node = obj.get("node", "")
    created = obj.get("created_unix_ns")
    known = {"format", "version", "node", "pools", "created_unix_ns"}
    return FreeLogHeader(node=str(node), version=version,
                         pools={str(n): _parse_pool(n, p) for n, p in pools.items()},
                         created_unix_ns=created if type(created) is int else None,
                         extra={k: v for k, v in obj.items() if k not in known})


def _parse_pool(name: Any, info: Any) -> PoolInfo:
    if not isinstance(name, str) or not isinstance(info, dict):
        raise UnreadableLog(f"header pool {name!r} is not a name -> map entry")
    num_pages, page_size = info.get("num_pages"), info.get("page_size")
    reserved = info.get("reserved", [])
    if type(num_pages) is not int or num_pages <= 0 or num_pages >= 2**31:
        raise UnreadableLog(f"header pool {name!r}: bad num_pages {num_pages!r}")
    if type(page_size) is not int or page_size <= 0:
        raise UnreadableLog(f"header pool {name!r}: bad page_size {page_size!r}")
    if not isinstance(reserved, list) or not all(
            type(p) is int and 0 <= p < num_pages for p in reserved):
        raise UnreadableLog(f"header pool {name!r}: reserved must list page ids "
                            f"in [0, {num_pages})")
    return PoolInfo(name, num_pages, page_size, tuple(reserved))
