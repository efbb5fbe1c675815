"""torchfill, ridgefill's own torch engine, behind the seam (torchfill/prefill.Runner on the model loaded in this
process): every variant, kept rows, filled windows, lookback and key-scale maps, logits of any row, and the timings
of its fill projection and of transformers' own forward beside exact. `runner` and `session` are its own: splice and
longbench, which read, copy and splice the runner's caches, run on torchfill alone."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ridgefill.backends.base import REFERENCE, Backend, Capabilities, Generation, Timed
from ridgefill.torchfill import Stopwatch
from ridgefill.torchfill.fill_plan import FillTally
from ridgefill.method.fill import FILLS


class TorchfillBackend(Backend):
    name = "torchfill"
    title = ""
    caps = Capabilities(variants=FILLS, keep_rows=True, filled_window=True, lookback=True, key_scale=True,
                        logprobs=True, batching=True, projection=True, reference_forward=True)

    @classmethod
    def provenance(cls) -> dict:
        """torch and transformers compute torchfill's results (transformers' model code, torch's kernels), and
        triton where it is installed (torch's compiled kernels)."""
        from ridgefill.runtime.provenance import versions

        triton = versions(("triton",))["triton"]
        return {**super().provenance(), **({"triton": triton} if triton else {})}

    def __init__(self, config, projection: str = "auto") -> None:
        super().__init__(config, projection)
        if getattr(config, "threads", 0):  # EngineOptions.threads (a command without --engine has none)
            torch.set_num_threads(config.threads)
        self.session = config.open(projection)  # runtime/session.Session: the model loaded, with its runner
        self.runner = self.session.runner
        self.model = self.session.facts()
        self._prompt, self._ids = None, None

    @classmethod
    def over(cls, runner, plans: dict | None = None, session=None) -> "TorchfillBackend":
        """A backend over a runner built elsewhere (tests, tools): `plans` by variant name (exact: None); `session`:
        the loaded model the runner runs, where the caller has one."""
        self = cls.__new__(cls)
        Backend.__init__(self, None)
        self.session, self.runner, self._prompt, self._ids = session, runner, None, None
        self.model = None if session is None else session.facts()
        return self.use({name: None for name in plans or {}}, plans or {})

    @property
    def chunk(self) -> int:
        return self.runner.chunk

    def generate(self, name: str, prompt: list[int], max_new_tokens: int, eos: int | None) -> Generation:
        out = self.runner.generate(torch.tensor([prompt]), max_new_tokens, self.plans[name], eos)
        return Generation(out.tokens[0], out.ttft_s)  # Runner.generate reads the one clock (ridgefill/clock.py)

    def first_token(self, name: str, prompt: list[int], tag: str) -> Timed:
        ids = self._device_ids(prompt)  # moved once per prompt, before the clock
        device = self.runner.device
        baseline = _reset_peak(device)
        seconds, token = self.timed(self._runner(name, ids))
        return Timed(seconds, token, _peak(device, baseline))

    def sync_device(self) -> torch.device:
        return self.runner.device

    def nll(self, name: str, ids, rows: list[int], targets):
        logits = self.runner.prefill(ids, fill=self.plans.get(name), logits_at=rows).logits  # [B, R, V]
        return F.cross_entropy(logits.float().transpose(1, 2), targets.to(logits.device), reduction="none")

    def tally(self, name: str) -> FillTally:
        plan = self.plans[name]
        return FillTally() if plan is None else plan.tally  # counted by the runner's prefill

    def device_info(self) -> dict:
        return {"device": str(self.runner.device), "dtype": str(self.runner.dtype).replace("torch.", ""),
                "routes": self.runner.routes.describe()}  # the attention, window, projection and delta-rule routes

    def fused_kv_bytes(self, split: int) -> int:
        return self.runner.fused_kv_bytes(split)

    def projection_time(self, name: str, prompt: list[int]) -> dict:
        """One more filled run on a runner whose fill projection is timed (a Stopwatch)."""
        device = self.runner.device
        timer = Stopwatch(device)
        ids = self._device_ids(prompt)
        runner = self.session.timed_runner(timer)
        plan = self.plans[name]
        seconds, _ = self.timed(lambda: int(runner.prefill(ids, fill=plan, capacity=ids.shape[1] + 1).logits[0, -1]
                                            .argmax()))
        return {"projection_s": timer.elapsed_s, "projection_share": timer.elapsed_s / seconds,
                "instrumented_run_s": seconds}

    def _device_ids(self, prompt: list[int]) -> torch.Tensor:
        if prompt is not self._prompt:
            self._prompt, self._ids = prompt, torch.tensor([prompt]).to(self.runner.device)
        return self._ids

    def _runner(self, name: str, ids: torch.Tensor):
        if name == REFERENCE:
            model = self.session.model

            def transformers_forward() -> int:
                with torch.inference_mode():
                    logits = model(ids, use_cache=True, logits_to_keep=1).logits  # [1, 1, V]
                return int(logits[0, -1].argmax())

            return transformers_forward
        plan, runner = self.plans[name], self.runner

        def runner_prefill() -> int:
            return int(runner.prefill(ids, fill=plan, capacity=ids.shape[1] + 1).logits[0, -1].argmax())

        return runner_prefill


def _reset_peak(device: torch.device) -> int | None:
    """Reset the peak-memory mark; returns the memory in use now (bytes). CUDA: allocated tensors; CPU: the
    process's resident set (Linux: /proc/self/clear_refs resets its high-water mark)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _proc_status("VmRSS")
    except OSError:
        return None


def _peak(device: torch.device, baseline: int | None) -> dict:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = _proc_status("VmHWM") if baseline is not None else None
    return {"peak_bytes": peak, "increase_bytes": None if peak is None or baseline is None else peak - baseline}


def _proc_status(field: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


BACKEND = TorchfillBackend
