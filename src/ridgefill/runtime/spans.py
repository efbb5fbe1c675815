"""Character spans of a text as token rows (through a fast tokenizer's offsets): which rows hold a piece of text."""

from __future__ import annotations

import bisect


def token_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """Token [first, last+1) of the tokens that overlap chars [start, end)."""
    ends = [o[1] for o in offsets]
    first = bisect.bisect_right(ends, start)
    last = first
    while last < len(offsets) and offsets[last][0] < end:
        last += 1
    return first, max(last, first + 1)
