"""A stopwatch for the parts of a run that are timed from inside (the fill projection's share of a prefill)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch


class Stopwatch:
    """Adds up the wall time of the spans it times in `elapsed_s`. On CUDA each span synchronises the device at
    both ends, so the time is that of the GPU work launched inside it (which makes it slower: time only an
    instrumented run, not the one that is measured)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.elapsed_s = 0.0

    @contextmanager
    def span(self) -> Iterator[None]:
        t0 = self._clock()
        yield
        self.elapsed_s += self._clock() - t0

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
