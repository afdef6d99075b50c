"""The free log: the recording writer, the streaming reader and ``pdkv replay``."""

from common.freelog.cli import main as replay_main
from common.freelog.reader import FreeLogReader, UnreadableLog
from common.freelog.replay import replay_file
from common.freelog.report import ReplayReport, Violation
from common.freelog.writer import FORMAT, VERSION, FreeLogWriter

__all__ = ["FORMAT", "VERSION", "FreeLogReader", "FreeLogWriter", "ReplayReport",
           "UnreadableLog", "Violation", "replay_file", "replay_main"]
