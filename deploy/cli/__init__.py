"""pdkv's command line: every ``pdkv`` subcommand, the benchmarks' registered lazily."""

from deploy.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
