"""The one clock for time to first token: `generate` and `bench-ttft` of every engine read it (torchfill's
Runner.generate and its backend, vLLM's measurement worker, llama.cpp's backend).

As gpt-fast's `device_sync` before every clock read: where the work runs on a device that queues it (CUDA), the
device is synchronised before the clock starts and before it stops, so the time is that of the work launched, not
of its launch; the garbage collector does not pause inside. A leaf module (torch imported only to synchronise).
"""

from __future__ import annotations

import gc
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def device_sync(device=None) -> None:
    """Wait for the work queued on `device` (a torch.device or its name; None or the CPU: nothing queues)."""
    if device is None:
        return
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        import torch

        torch.cuda.synchronize(device)


def clocked(run: Callable[[], T], device=None) -> tuple[float, T]:
    """(seconds, result) of run(), the device synchronised before each clock read, no garbage-collector pause
    inside."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        device_sync(device)
        t0 = time.perf_counter()
        result = run()
        device_sync(device)
        return time.perf_counter() - t0, result
    finally:
        if enabled:
            gc.enable()
