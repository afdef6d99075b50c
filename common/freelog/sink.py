"""The file a free log is written to: created new, appended to, never overwritten.

``LogFile`` is the writer's only contact with the file system, so that tests can put a
real subclass in its place (a file that fills up and gets space back). Its contract:

- ``write_all(data)`` writes every byte or raises ``WriteError`` saying how many bytes of
  ``data`` reached the file before the error (a short write then an error is how a full
  disk or a file-size limit shows itself);
- ``truncate(size)`` cuts the file back to ``size`` bytes (the writer's last record
  boundary), so that a record is never left half-written in the middle of the log;
- ``size`` is the number of bytes the file holds.

``LogFile.create`` never opens an existing file: a restarted process gets a new file
(``decode0.freelog``, then ``decode0.1.freelog``, ``decode0.2.freelog``, ...), so the log
of the process that died is kept for replay.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

MAX_INCARNATIONS = 10_000


class WriteError(OSError):
    """A write that failed after ``written`` bytes of its data reached the file."""

    def __init__(self, cause: OSError, written: int) -> None:
        super().__init__(cause.errno, cause.strerror)
        self.cause, self.written = cause, written


def describe(exc: BaseException) -> str:
    """``ENOSPC (No space left on device)`` for an OSError, else its text."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, exc.errno)} ({exc.strerror})"
    return f"{type(exc).__name__}: {exc}"


def incarnation_paths(path: str | os.PathLike):
    """``x.freelog``, ``x.1.freelog``, ``x.2.freelog``, ...: the names a log may take."""
    p = Path(path)
    yield p
    for n in range(1, MAX_INCARNATIONS):
        yield p.with_name(f"{p.stem}.{n}{p.suffix}") if p.suffix else p.with_name(f"{p.name}.{n}")


class LogFile:
    """An append-only file on a raw descriptor (no hidden buffer that could write twice)."""

    def __init__(self, fd: int, path: str, size: int = 0) -> None:
        self.fd, self.path, self.size = fd, path, size

    @classmethod
    def create(cls, path: str | os.PathLike) -> LogFile:
        """A new file at ``path``, or at the first free incarnation name after it.

        Raises:
            OSError: the folder cannot be made or no file can be created in it (read-only
                file system, permissions, full disk), with the path in the message.
        """
        folder = Path(path).absolute().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot create the free-log folder {folder}: "
                                     f"{describe(exc)}") from exc
        for candidate in incarnation_paths(path):
            try:
                fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND,
                             0o644)
            except FileExistsError:
                continue
            except OSError as exc:
                raise OSError(exc.errno, f"cannot create free log {candidate}: "
                                         f"{describe(exc)}") from exc
            return cls(fd, str(candidate))
        raise OSError(errno.EEXIST, f"{MAX_INCARNATIONS} free logs named like {path} exist")

    def write_all(self, data: bytes | bytearray | memoryview) -> None:
        done, error = 0, None
        with memoryview(data) as view:  # released here: the caller's buffer may grow again
            while done < len(view):
                try:
                    n = os.write(self.fd, view[done:])
                except OSError as exc:
                    error = exc.with_traceback(None)
                    break
                if n == 0:  # no progress and no error: treat like a full device
                    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    break
                done += n
        self.size += done
        if error is not None:
            raise WriteError(error, done)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        self.size = size

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
