"""A fourth engine behind the seam, as a new engine would come: a Backend subclass in its own folder, named in
backends.ENGINES. It runs torchfill inside (in this process, on the CPU), through the seam's methods
only, and reports its own first-token latency (as vLLM does) and its own settings (as every engine may)."""

from __future__ import annotations

from ridgefill.backends.base import Backend, Capabilities, Generation, Timed
from ridgefill.backends.torchfill import TorchfillBackend
from ridgefill.torchfill.fill_plan import FillTally


class FourthBackend(Backend):
    name = "fourth"
    title = "Fourth"
    caps = Capabilities(variants=("identity", "ridge", "mean"), logprobs=True, batching=True,
                        first_token_latency=True, devices=("cpu",), dtypes=("fp32",))

    def __init__(self, config, projection: str = "auto") -> None:
        super().__init__(config, projection)
        self.inner = TorchfillBackend(config, projection)
        self.model = self.inner.model
        self.started = 0

    def use(self, fills: dict, plans: dict) -> "FourthBackend":
        super().use(fills, plans)
        self.inner.use(fills, plans)
        return self

    def start(self, max_len: int) -> "FourthBackend":
        self.started = max_len
        self.inner.start(max_len)
        return self

    def close(self) -> None:
        self.inner.close()

    def generate(self, name: str, prompt: list[int], max_new_tokens: int, eos: int | None) -> Generation:
        return self.inner.generate(name, prompt, max_new_tokens, eos)

    def first_token(self, name: str, prompt: list[int], tag: str) -> Timed:
        done = self.inner.first_token(name, prompt, tag)
        return Timed(done.seconds, done.token, latency_s=done.seconds)

    def nll(self, name: str, ids, rows: list[int], targets):
        return self.inner.nll(name, ids, rows, targets)

    def tally(self, name: str) -> FillTally:
        return self.inner.tally(name)

    def describe(self) -> dict:
        return {name: {"runs": "torchfill", "max_len": self.started, "fill": plan is not None}
                for name, plan in self.plans.items()}

    def device_info(self) -> dict:
        return {"device": "cpu", "dtype": "float32", "routes": None}


BACKEND = FourthBackend
