"""The rich console the CLI's subcommands print with."""

from __future__ import annotations

import sys

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"  # the CLI's log lines


def make_console():
    """A rich console; plain wide lines when the output is not a terminal (logs, tests)."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200)
