"""Terminal output: progress bars and notes on stderr, tables via rich, results on stdout."""

from __future__ import annotations

import math
import os
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


LOG_WIDTH = 160  # columns when writing to a file or pipe: a results table stays whole in a log


def console(stderr: bool = False) -> Console:
    """A rich console; output that is not a terminal (a log, a pipe) gets LOG_WIDTH columns unless COLUMNS is set."""
    out = Console(stderr=stderr)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = LOG_WIDTH
    return out


@contextmanager
def progress_bar(description: str, total: int):
    """A rich progress bar on stderr; yields `advance(n=1)`."""
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=console(stderr=True), transient=False) as progress:
        task = progress.add_task(description, total=total)
        try:
            yield lambda n=1: progress.advance(task, n)
        except BaseException:
            progress.console.quiet = True  # a failed loop leaves only its error line, not the bar's last state
            raise


def table(title: str, columns: list[str], rows: list[list], stderr: bool = False) -> None:
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right" if c not in (columns[0],) else "left", overflow="fold")  # wrap, never cut
    for r in rows:
        t.add_row(*[cell(v) for v in r])
    console(stderr).print(t)


def cell(v) -> str:
    """A value as a table cell (terminal or markdown): floats to 4 significant digits, '–' for none or NaN."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def note(message: str) -> None:
    console(stderr=True).print(message, highlight=False, markup=False)
