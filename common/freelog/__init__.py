"""The free log: the recording writer, its health, the streaming reader and ``pdkv replay``."""

from common.freelog.cli import main as replay_main
from common.freelog.digests import DigestLedger, cross_check
from common.freelog.health import LogHealth, log_problems
from common.freelog.migrations import follow as follow_migrations
from common.freelog.reader import FreeLogReader, UnreadableLog
from common.freelog.replay import replay_file
from common.freelog.report import (
    EXIT_CLEAN,
    EXIT_INCOMPLETE,
    EXIT_UNREADABLE,
    EXIT_VIOLATIONS,
    ReplayReport,
    Violation,
    combined_exit,
)
from common.freelog.writer import FORMAT, VERSION, FreeLogWriter, configure, freelog_file

__all__ = ["EXIT_CLEAN", "EXIT_INCOMPLETE", "EXIT_UNREADABLE", "EXIT_VIOLATIONS", "FORMAT",
           "VERSION", "DigestLedger", "FreeLogReader", "FreeLogWriter", "LogHealth",
           "ReplayReport", "UnreadableLog", "Violation", "combined_exit", "configure",
           "cross_check", "follow_migrations", "freelog_file", "log_problems", "replay_file",
           "replay_main"]
