"""vLLM behind the seam: exact is stock vLLM (no plugin loaded), each fill variant vLLM with ridgefill's plugin
configured for it (identity and mean fills through maps files written for the run). Each variant is one vLLM worker
in its own process (backends/vllm/worker.VllmWorker), all alive from `start` to `close`, built alike:
- as `ridgefill serve` runs them: vLLM's default compilation (CUDA graphs on a GPU) and prefix caching on (every
  timed run gets a cache salt of its own, so a repeated prompt never hits the cache);
- on the CPU vLLM's threads are bound to --threads cores with none reserved (without --threads: the binding an
  operator set in VLLM_CPU_OMP_THREADS_BIND, else all cores); on a GPU the workers split vLLM's memory budget
  (gpu_memory_utilization 0.85 / variants);
- a timed run is one request for one greedy token: the wall time of vLLM's generate call in the worker's process
  (scheduling, prefill, sampling; no tokenization, no IPC); vLLM's own first-token latency is kept beside it.
The model is read here without its weights (runtime/session.model_facts): its identity, shape and tokenizer.

Next-token NLL (loss): exact rows from stock vLLM's prompt log-probs, one request per run of consecutive targets;
a filled variant scores row r with a request of the prompt's rows 0..r, a per-request tail that keeps the plan's
filled rows filled, and the log-prob of the target token (vLLM's logprob_token_ids): the plugin runs prompt
log-prob requests exact, so the filled rows' cache is reached as a served request reaches it.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import ExitStack
from pathlib import Path

from ridgefill.backends.base import Backend, Capabilities, Generation, Timed
from ridgefill.torchfill.fill_plan import FillTally

KV_CACHE_GIB = 2


def worker_threads(threads: int, environ) -> str:
    """The cores the workers' OpenMP threads are bound to (VLLM_CPU_OMP_THREADS_BIND): --threads N binds 0..N-1;
    without it an operator's VLLM_CPU_OMP_THREADS_BIND is kept (two workers sharing cores spin against each other),
    else every core."""
    if threads:
        return f"0-{threads - 1}"
    return environ.get("VLLM_CPU_OMP_THREADS_BIND") or f"0-{(os.cpu_count() or 1) - 1}"


class VllmBackend(Backend):
    name = "vllm"
    title = "vLLM"
    caps = Capabilities(variants=("identity", "ridge", "mean"), lookback=True, key_scale=True, logprobs=True,
                        batching=True, first_token_latency=True)

    @classmethod
    def check_installed(cls) -> None:
        from ridgefill.backends.vllm.server import check_vllm

        check_vllm()  # installed, the plugin's release, and its entry point (tensor-parallel workers load it)

    @classmethod
    def cpu_only(cls) -> str | None:
        """vLLM's CPU build (vllm-cpu, or a vllm built for the CPU: a +cpu version) runs on the CPU whatever GPU is
        visible: a command's --device auto then resolves to cpu (and --dtype auto to fp32), --device cuda is
        refused."""
        import importlib.metadata

        for name in ("vllm-cpu", "vllm"):
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            if name == "vllm-cpu" or "+cpu" in version:
                return f"--engine vllm runs {name} {version}, a CPU build of vLLM"
        return None

    @classmethod
    def provenance(cls) -> dict:
        """vLLM computes the results: its version and distribution (`vllm`, or `vllm-cpu`, the CPU build; both None
        when neither is installed), beside torch (vLLM's kernels run on it) and transformers."""
        from ridgefill.runtime.provenance import versions

        found = versions(("vllm", "vllm-cpu"))
        distribution = next((name for name in ("vllm", "vllm-cpu") if found[name]), None)
        return {**super().provenance(), "vllm": found.get(distribution), "vllm_distribution": distribution}

    def __init__(self, config, projection: str = "auto") -> None:
        from ridgefill.runtime.models import model_folder
        from ridgefill.runtime.session import model_facts
        from ridgefill.backends.vllm.config import check_worker_dtype

        super().__init__(config, projection)
        self.folder = model_folder(config.model)
        check_worker_dtype(self.folder, config.dtype)
        self.model = model_facts(config.model)
        self._stack = ExitStack()
        self.workers, self.settings, self._base, self._final = {}, {}, {}, {}

    def start(self, max_len: int) -> "VllmBackend":
        import torch

        from ridgefill.backends.vllm.worker import VllmWorker, WorkerSettings, vllm_dtype
        from ridgefill.backends.vllm.fill import pin

        c, fills = self.config, self.fills
        scratch = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="ridgefill-vllm-")))
        threads = worker_threads(c.threads, os.environ)  # EngineOptions.threads
        args = {"max_num_batched_tokens": max(c.chunk, 256), "enable_chunked_prefill": True}
        if torch.cuda.is_available():  # the workers share one GPU: split vLLM's memory budget between them
            args["gpu_memory_utilization"] = round(0.85 / len(fills), 3)
        # vLLM wants room for the generated token; a prompt of the model's whole context computes no position past
        # it, so the longer limit is allowed for the run (VLLM_ALLOW_LONG_MAX_MODEL_LEN)
        context = self.model.context_length
        env = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"} if context and max_len > context else {}
        info = self.model.model_info
        for name, fill in fills.items():
            pinned = None if fill is None else pin(fill, self.model.shape.layers, info, scratch)
            self.settings[name] = WorkerSettings(self.folder, pinned, plugin=fill is not None,
                                                 dtype=vllm_dtype(c.dtype), max_model_len=max_len,
                                                 threads=threads, kv_cache_gib=KV_CACHE_GIB,
                                                 llm_args=args, env=env)
        for name, settings in self.settings.items():
            self.workers[name] = self._stack.enter_context(VllmWorker(settings))
            self._base[name] = self.workers[name].tally() if fills[name] is not None else None
        return self

    def close(self) -> None:
        """Stop the workers, keeping what each filled (tally and counters stay readable)."""
        if self.workers:
            self._final = {name: self.workers[name].tally() for name in self.workers if self._base.get(name)}
        self._stack.close()
        self.workers = {}

    def generate(self, name: str, prompt: list[int], max_new_tokens: int, eos: int | None) -> Generation:
        """Time to first token as bench-ttft times it (`first_token`: one request for one greedy token, on the
        worker's clock, a cache salt of its own), then the generation, a request of its own; the timing request's
        filled rows are left out of the tally."""
        before = self.workers[name].tally() if self._base.get(name) else None
        ttft = self.first_token(name, prompt, f"ridgefill-generate:{len(prompt)}").seconds
        if before is not None:
            after = self.workers[name].tally()
            self._base[name] = {k: v + after[k] - before[k] for k, v in self._base[name].items()}
        (done,) = self.workers[name].generate([prompt], max_new_tokens, stop_at_eos=eos is not None)
        return Generation(done.tokens, ttft)

    def first_token(self, name: str, prompt: list[int], tag: str) -> Timed:
        (done,) = self.workers[name].generate([prompt], 1, cache_salt=tag)
        return Timed(done.seconds, done.tokens[0], latency_s=done.first_token_s)

    def nll(self, name: str, ids, rows: list[int], targets):
        import torch

        plan = self.plans[name]
        out = torch.empty(len(ids), len(rows))
        if plan is None:
            requests = covering_prompts(ids.tolist(), rows, targets.tolist())
            scored = self.workers[name].prompt_logprobs([p for p, _ in requests])
            for (prompt, cells), logprobs in zip(requests, scored):
                for b, j, at in cells:
                    out[b, j] = -logprobs[at]
            return out
        n = ids.shape[1]
        prompts, tails, wanted = [], [], []
        for b, seq in enumerate(ids.tolist()):
            for j, row in enumerate(rows):
                prompts.append(seq[: row + 1])
                tails.append(max(1, row + 1 - (n - min(plan.tail, n))))  # the plan's filled rows stay filled
                wanted.append(int(targets[b, j]))
        found = self.workers[name].token_logprobs(prompts, wanted, tails)
        return -torch.tensor(found, dtype=torch.float32).view(len(ids), len(rows))

    def tally(self, name: str) -> FillTally:
        if self._base.get(name) is None:
            return FillTally()
        return FillTally(**self.counters(name))

    def counters(self, name: str) -> dict:
        """The plugin's counters of variant `name` since `start` (a FillTally's fields); after `close`, as they were
        then."""
        now = self.workers[name].tally() if name in self.workers else self._final[name]
        base = self._base[name]
        return {k: now[k] - base[k] for k in now}

    def describe(self) -> dict:
        return {name: {"plugin": s.plugin, "fill": s.fill.describe() if s.fill else None, "dtype": s.dtype,
                       "threads_bind": s.threads, "max_model_len": s.max_model_len, **s.llm_args,
                       "enforce_eager": not s.compiled, "enable_prefix_caching": s.enable_prefix_caching,
                       "env": s.env, **({"tally": self.counters(name)} if self._base.get(name) else {})}
                for name, s in self.settings.items()}

    def device_info(self) -> dict:
        import torch

        from ridgefill.runtime.models import DTYPES

        gpu = torch.cuda.is_available() and not self.cpu_only()
        return {"device": "cuda" if gpu else "cpu", "dtype": str(DTYPES[self.config.dtype]).replace("torch.", ""),
                "routes": None}  # vLLM picks its own kernels

    def unfilled_detail(self, name: str) -> tuple[str, str]:
        return unfilled_detail(self.counters(name))


def unfilled_detail(tally: dict) -> tuple[str, str]:
    """What ran instead of an unfilled variant (the plugin's counters), and what to check."""
    return (f" ({tally['full_tokens']} ran in full, {tally['stock_steps']} steps ran stock)",
            "check that ridgefill's vLLM plugin loads (VLLM_PLUGINS, VLLM_USE_V2_MODEL_RUNNER)")


def covering_prompts(batch: list[list[int]], rows: list[int], targets: list[list[int]]) -> list[tuple]:
    """Prompts whose prompt log-probs give every target: (prompt, [(b, j, position)]): target j of sequence b
    (predicted at row rows[j]) is the prompt's token at `position`. A prompt is a sequence's rows 0..r followed
    by a target; later targets that are the sequence's own next tokens share it."""
    out = []
    for b, seq in enumerate(batch):
        prompt, cells = None, []
        for j in sorted(range(len(rows)), key=lambda j: -rows[j]):
            r, t = rows[j], targets[b][j]
            if prompt is None or not (r + 1 < len(prompt) and prompt[r + 1] == t):
                if prompt is not None:
                    out.append((prompt, cells))
                prompt, cells = seq[: r + 1] + [t], []
            cells.append((b, j, r + 1))
        if prompt is not None:
            out.append((prompt, cells))
    return out


BACKEND = VllmBackend
