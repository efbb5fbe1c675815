"""JSON and JSON Lines that a user hands in (data files, RULER records, LongBench records): every way the text can
fail to be JSON, including nesting too deep for the parser (a RecursionError) and integers too long to convert, is a
one-line RidgefillError naming the file, the line and the fix."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator

from ridgefill.errors import RidgefillError


def parse_json(text: str, where: str, fix: str):
    """`text` parsed as JSON; `where` names it in the error (a file, or FILE:LINE), `fix` says what to do."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        at = f"line {exc.lineno} column {exc.colno}" if exc.lineno > 1 else f"column {exc.colno}"
        raise RidgefillError(f"{where}: not valid JSON ({exc.msg} at {at}): {fix}") from None
    except RecursionError:
        raise RidgefillError(f"{where}: JSON nested too deeply to read: {fix}") from None
    except ValueError:  # the only other one: an integer of more digits than Python converts
        raise RidgefillError(f"{where}: not valid JSON (an integer of more than {sys.get_int_max_str_digits()} "
                             f"digits): {fix}") from None


def json_lines(text: str, path: str | Path, fix: str) -> Iterator[tuple[int, object]]:
    """(line number, record) for each non-blank line of JSON Lines `text` read from `path`."""
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            yield number, parse_json(line, f"{path}:{number}", fix)
