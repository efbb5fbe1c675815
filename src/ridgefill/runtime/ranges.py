"""Inclusive integer ranges written on the command line: `--layers 16-29,20-29`, `--keep-rows 0-3,120`."""

from __future__ import annotations

import re

from ridgefill.errors import RidgefillError


def parse_ranges(text: str, flag: str, what: str, example: str) -> list[tuple[int, int]]:
    """'16-29,20-29,25' -> [(16, 29), (20, 29), (25, 25)]; anything else is a one-line error naming `flag`."""
    ranges = []
    for item in str(text).split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
        if m is None or int(m[2] or m[1]) < int(m[1]):
            raise RidgefillError(f"{flag} '{text}': '{item.strip()}' is not a {what} or an increasing range A-B "
                                 f"(e.g. {flag} {example})")
        ranges.append((int(m[1]), int(m[2] or m[1])))
    return ranges
