"""Goals of a benchmark: the figure, its baseline from the same run, the ratio, the verdict.

Every ``pdkv bench`` states its goals through one ``Goals`` object, so that each prints the
baseline and the ratio it judges, and all exit the same way::

    goals = Goals("allocator")
    goals.at_least("free_kv_row page 16 vs torch", pdkv_rate / torch_rate, 1.0,
                   baseline=f"torch {torch_ms:.3f} ms", measured=f"pdkv {pdkv_ms:.3f} ms")
    goals.print()                      # one line per goal, then the verdict
    return goals.exit_status(args)     # 0 all met (or --report-only), 1 a goal missed

The shared flags (``add_bench_flags``) have the same names on every bench: ``--quick``
(small sizes, seconds to a minute), ``--repeats N`` (runs per figure; medians are quoted),
``--json`` (one JSON object, with a ``goals`` list) and ``--report-only`` (print the
verdict but exit 0 when a goal is missed: for exploratory runs on loaded machines).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TextIO

EXIT_MISSED = 1
"""Exit status of a bench that missed a goal it printed (without ``--report-only``)."""


@dataclass(frozen=True)
class Goal:
    """One judged figure: ``ratio`` against ``target`` (``at_least`` or at most)."""

    name: str
    ratio: float
    target: float
    at_least: bool = True
    baseline: str = ""
    """The baseline's own figure from the same run, e.g. ``torch 1.20 ms``."""
    measured: str = ""
    """pdkv's figure, e.g. ``pdkv 0.80 ms``."""

    @property
    def met(self) -> bool:
        return self.ratio >= self.target if self.at_least else self.ratio <= self.target

    def line(self) -> str:
        op = ">=" if self.at_least else "<="
        figures = ", ".join(f for f in (self.measured, self.baseline) if f)
        where = f" ({figures})" if figures else ""
        verdict = "met" if self.met else "MISSED"
        return f"{self.name}: {self.ratio:.3g}x{where}; goal {op} {self.target:g}x: {verdict}"

    def to_dict(self) -> dict:
        return {**asdict(self), "met": self.met}


class Goals:
    """The goals one bench run judged, in the order it judged them."""

    def __init__(self, bench: str) -> None:
        self.bench = bench
        self.items: list[Goal] = []

    def at_least(self, name: str, ratio: float, target: float, *, baseline: str = "",
                 measured: str = "") -> Goal:
        """Judge ``ratio >= target`` (speedups, fractions of a baseline's rate)."""
        return self._add(Goal(name, float(ratio), float(target), True, baseline, measured))

    def at_most(self, name: str, ratio: float, target: float, *, baseline: str = "",
                measured: str = "") -> Goal:
        """Judge ``ratio <= target`` (overheads, slowdowns)."""
        return self._add(Goal(name, float(ratio), float(target), False, baseline, measured))

    def _add(self, goal: Goal) -> Goal:
        self.items.append(goal)
        return goal

    @property
    def missed(self) -> list[Goal]:
        return [g for g in self.items if not g.met]

    @property
    def all_met(self) -> bool:
        return not self.missed

    def to_dict(self) -> dict:
        """``{"goals": [...], "goals_met": bool}``, to merge into a bench's JSON."""
        return {"goals": [g.to_dict() for g in self.items], "goals_met": self.all_met}

    def format(self) -> str:
        lines = [f"goal {g.line()}" for g in self.items]
        if self.missed:
            lines.append(f"pdkv bench {self.bench}: {len(self.missed)} of {len(self.items)} "
                         f"goal(s) MISSED: {', '.join(g.name for g in self.missed)}")
        else:
            lines.append(f"pdkv bench {self.bench}: all {len(self.items)} goal(s) met")
        return "\n".join(lines)

    def print(self, stream: TextIO | None = None) -> None:
        print(self.format(), file=stream or sys.stdout, flush=True)

    def exit_status(self, args: argparse.Namespace | None = None, *,
                    report_only: bool | None = None) -> int:
        """0 when every goal is met or only a report was asked for; else ``EXIT_MISSED``."""
        if report_only is None:
            report_only = bool(getattr(args, "report_only", False))
        if self.all_met or report_only:
            return 0
        return EXIT_MISSED


def paired_ratio(baseline_s: list[float], measured_s: list[float]) -> float:
    """Median over runs of baseline time / measured time (measured rate / baseline rate),
    each measured run paired with the baseline run timed beside it: drift between distant
    runs cancels, and one lucky run of either side does not decide the figure."""
    return statistics.median(b / m for b, m in zip(baseline_s, measured_s))


def add_bench_flags(parser: argparse.ArgumentParser, *, quick: str, repeats: str) -> None:
    """The flags every bench shares, with the same names and meanings.

    Args:
        quick: what ``--quick`` does for this bench (its help text).
        repeats: the default number of repeats, for the help text.
    """
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--repeats", type=int, metavar="N",
                        help=f"runs per figure; medians are quoted (default {repeats})")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (figures and a 'goals' list)")
    parser.add_argument("--report-only", action="store_true",
                        help="report missed goals but exit 0 (default: exit 1 when a goal "
                             "this bench prints is missed)")


EPILOG = ("exit status: 0 every goal met (or --report-only), 1 a goal it printed was missed, "
          "2 bad arguments.")


def run_as_script(add_command: Callable[[argparse._SubParsersAction], None],
                  argv: list[str] | None = None) -> int:
    """``python -m benchmarks.NAME ...``: the bench's own ``add_command`` parses ``argv``
    exactly as ``pdkv bench NAME ...`` would, without the command line above it."""
    parser = argparse.ArgumentParser(prog="pdkv bench")
    add_command(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args([_only_command(parser), *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


def _only_command(parser: argparse.ArgumentParser) -> str:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    (name,) = sub.choices
    return name
