"""llama.cpp behind the seam: the GGUF file of --model (an embedded alias or a .gguf path) run by llama-cpp-python
built with ridgefill's patch (driver.py). Exact is the same build's prefill with the fill off (llama.cpp's stock
code path: fill mode is never entered); a fill variant (identity, ridge, mean) is the same context with its maps
copied into llama.cpp and its prompts prefilled by the fill rule of its plan (torchfill.FillPlan: keep-first, the
tail, kept rows and the outlier factor, per chunk of --chunk rows as torchfill judges outliers).

The model's identity, shape and tokenizer come from the GGUF's Hugging Face conversion (runtime/models.py converts
it once), so maps fitted with `calibrate` and `fit` on that conversion are checked against it and run unchanged;
prompts are tokenized by it too, so every engine runs the same token ids. llama.cpp runs on the CPU with
--threads threads (0: all cores), the weights in the GGUF's own types, an F16 K/V cache and flash attention.
"""

from __future__ import annotations

import dataclasses

import os
from pathlib import Path

import numpy as np
import torch

from ridgefill.backends.base import Backend, Capabilities, Generation, Timed, refuse
from ridgefill.torchfill.fill_plan import FillTally
from ridgefill.backends.llamacpp import driver, library
from ridgefill.backends.llamacpp.gguf_header import check_family
from ridgefill.backends.llamacpp.maps import Maps, maps_of
from ridgefill.errors import RidgefillError
from ridgefill.method.maps_gguf import is_gguf

N_UBATCH = 512  # llama.cpp's default ubatch


class LlamaCppBackend(Backend):
    name = "llamacpp"
    title = "llama.cpp"
    caps = Capabilities(variants=("identity", "ridge", "mean"), keep_rows=True, key_scale=True, logprobs=True,
                        devices=("cpu",), dtypes=("fp32",))

    @classmethod
    def check_installed(cls) -> None:
        library.check_installed()

    @classmethod
    def cpu_only(cls) -> str | None:
        return "--engine llamacpp runs llama.cpp on the CPU (GPU offload is not supported)"

    @classmethod
    def provenance(cls) -> dict:
        """The llama.cpp build computes the results (library.build_info: llama-cpp-python's version, the patch
        compiled in, the instruction sets it was built for), beside transformers (the tokenizer) and torch (scores
        of llama.cpp's logits). Without a usable build it is the driver's one line naming `make install`."""
        return {**super().provenance(), **library.build_info()}

    def __init__(self, config, projection: str = "auto") -> None:
        from ridgefill.runtime.models import ALIASES, gguf_file
        from ridgefill.runtime.session import model_facts

        super().__init__(config, projection)
        self.gguf = gguf_file(config.model)
        if self.gguf is None:
            raise RidgefillError(f"--engine llamacpp runs GGUF files, not {config.model}: give --model a .gguf file or "
                                 f"an embedded alias ({', '.join(ALIASES)})")
        check_family(self.gguf)
        self.model = model_facts(config.model)
        self.threads = config.threads or os.cpu_count() or 1  # EngineOptions.threads
        self.n_batch = max(1, config.chunk)  # rows per llama_decode call
        self.n_ubatch = min(N_UBATCH, self.n_batch)
        self.lc: driver.LlamaCpp | None = None
        self.maps: dict[str, Maps] = {}
        self._tallies: dict[str, FillTally] = {}
        self._current: str | None = None  # the variant whose maps llama.cpp holds

    def use(self, fills: dict, plans: dict) -> "LlamaCppBackend":
        super().use(fills, plans)
        self.maps = {}
        for name, plan in self.plans.items():
            if plan is not None:
                try:
                    self.maps[name] = maps_of(plan.filler)
                except ValueError as exc:
                    raise refuse(self, f"the {name} variant ({exc})", "use identity, ridge or mean") from None
                fill = self.fills.get(name)
                if fill is not None and fill.variant == "ridge" and is_gguf(fill.maps):
                    # libllama reads the adapter as llama-server does (its matrices as stored: F16 by default)
                    self.maps[name] = dataclasses.replace(self.maps[name], adapter=Path(fill.maps))
        self._tallies = {name: FillTally() for name in self.plans}
        return self

    def start(self, max_len: int) -> "LlamaCppBackend":
        self.lc = driver.LlamaCpp(self.gguf, n_ctx=max_len, threads=self.threads, n_batch=self.n_batch,
                                  n_ubatch=self.n_ubatch)
        self._current = None
        return self

    def close(self) -> None:
        if self.lc is not None:
            self.lc.close()
            self.lc = None

    # --- runs -----------------------------------------------------------------------------------------------------
    def _prefill(self, name: str, prompt: list[int], outputs: list[int]) -> driver.Prefill:
        if self.lc is None:
            raise RidgefillError("llama.cpp is not started: use the backend inside `with backend.start(...)`")
        plan = self.plans[name]
        if plan is None:
            return self.lc.prefill(prompt, outputs=outputs)
        if self._current != name:
            self.lc.set_maps(self.maps[name])
            self._current = name
        rows = driver.Rows(plan.tail, plan.keep_first, tuple(plan.keep_rows))  # llama.cpp's plan runs the rule
        done = self.lc.prefill(prompt, full=rows, outputs=outputs, outlier_factor=plan.outlier_factor,
                               chunk=self.config.chunk)
        tally = self._tallies[name]
        tally.filled_tokens += done.filled
        tally.outlier_tokens += done.outliers
        return done

    def generate(self, name: str, prompt: list[int], max_new_tokens: int, eos: int | None) -> Generation:
        ttft, first = self.timed(lambda: int(np.argmax(self._prefill(name, prompt, [len(prompt) - 1]).logits[-1]
                                                        .numpy())))
        if max_new_tokens <= 1 or first == eos:
            return Generation([first][:max(max_new_tokens, 1)], ttft)
        rest = self.lc.greedy(self.lc.step(first), max_new_tokens - 1, eos)
        return Generation([first, *rest], ttft)

    def first_token(self, name: str, prompt: list[int], tag: str) -> Timed:
        def run() -> int:
            return int(self._prefill(name, prompt, [len(prompt) - 1]).logits[-1].argmax())

        seconds, token = self.timed(run)
        return Timed(seconds, token)

    def nll(self, name: str, ids, rows: list[int], targets):
        out = torch.empty(len(ids), len(rows))
        for b, seq in enumerate(ids.tolist()):
            logits = self._prefill(name, seq, list(rows)).logits  # [R, V] float32
            out[b] = torch.nn.functional.cross_entropy(logits, targets[b].long().cpu(), reduction="none")
        return out

    def tally(self, name: str) -> FillTally:
        return self._tallies.get(name, FillTally())

    def describe(self) -> dict:
        return {name: {"gguf": str(self.gguf), "llama_cpp_python": library.VERSION, "patch": library.patch_id(),
                       "threads": self.threads, "n_batch": self.n_batch, "n_ubatch": self.n_ubatch,
                       "kv_type": "f16", "flash_attn": True,
                       "fill": None if name not in self.maps else {"split": self.maps[name].split,
                                                                   "rank": self.maps[name].rank or None}}
                for name in self.plans}

    def device_info(self) -> dict:
        return {"device": "cpu", "dtype": "GGUF weights, F16 K/V", "routes": None}  # --dtype is torchfill's

    def store_scope(self) -> dict:
        return {"gguf": str(self.gguf)}  # the build (its patch included) is in the provenance


BACKEND = LlamaCppBackend
