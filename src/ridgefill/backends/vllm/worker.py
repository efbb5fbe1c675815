"""A vLLM worker (one `vllm.LLM` in a child process), stock or with RidgeFill: what `generate --engine vllm`,
`bench-ttft --engine vllm` and the tests drive.

Each VllmWorker is one Python process of its own holding one `vllm.LLM` (its engine core in the same process:
VLLM_ENABLE_V1_MULTIPROCESSING=0), so a stock worker and a RidgeFill worker can live side by side, each with
the plugin configured or not from its own environment, and this process never imports vLLM. On a CPU build the
workers fork from a server that has imported vLLM once (worker_context): a command's second and third workers do
not import it again (8 s each on 2 idle cores, about 20 s beside other work). Requests are
token ids; replies are token ids, the log-probs of the chosen tokens (and top-k), and the wall time of the
`generate` call. The child writes nothing to standard output (a command's stdout carries its results alone):
its stdout is its stderr, and vLLM logs warnings and errors only unless VLLM_LOGGING_LEVEL says otherwise.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from dataclasses import dataclass, field

from ridgefill.errors import RidgefillError
from ridgefill.method.fill import FillSettings
from ridgefill.backends.vllm.config import VLLM_DTYPES, read_model_config, served_prefix_caching, started_process_env
from ridgefill.backends.vllm.fill import fill_env
from ridgefill.backends.vllm.malloc import keep_freed_memory


def vllm_dtype(name: str) -> str:
    """ridgefill's dtype name (fp32, bf16, fp16; a command's auto is resolved before) as vLLM's."""
    return VLLM_DTYPES[name]


@dataclass(frozen=True)
class WorkerSettings:
    """How one vLLM worker is built (vLLM's own LLM(...) arguments, plus the fill and the CPU threads)."""

    model: str  # a local checkpoint folder
    fill: FillSettings | None = None  # None: stock vLLM (pinned with backends/vllm/fill.pin otherwise)
    plugin: bool = True  # False: no vLLM plugin is loaded at all (VLLM_PLUGINS=""), whatever is installed
    dtype: str = "float32"
    max_model_len: int | None = None
    threads: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0-1" (None: vLLM's default)
    kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE
    compiled: bool = True  # vLLM's default compilation (CUDA graphs on a GPU); False: enforce_eager, as tests do
    prefix_caching: bool | None = None  # None: as `ridgefill serve` runs it (on; off for a hybrid model)
    llm_args: dict = field(default_factory=dict)  # more LLM(...) keyword arguments
    env: dict = field(default_factory=dict)  # more environment variables of the worker's process

    @property
    def enable_prefix_caching(self) -> bool:
        """Prefix caching as the worker runs it (the plugin makes it safe for dense models; vllm_config says why
        hybrids run without it)."""
        if self.prefix_caching is not None:
            return self.prefix_caching
        return served_prefix_caching(read_model_config(self.model))

    def environment(self) -> dict[str, str]:
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
               "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": worker_log_level(os.environ)}
        if self.threads is not None:
            env.update(VLLM_CPU_OMP_THREADS_BIND=self.threads, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        if self.fill is not None:
            env.update(fill_env(self.fill))
        if not self.plugin:
            env["VLLM_PLUGINS"] = ""  # an allow-list that names no plugin
        env.update(started_process_env({**os.environ, **self.env}))  # the worker's and the processes it starts
        return {**env, **self.env}


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]  # of each chosen token
    top: list[dict[int, float]]  # per step: the top-k token ids -> log-prob (empty without logprobs)
    seconds: float  # wall time of the generate call that produced it (shared by a batch)
    first_token_s: float | None = None  # vLLM's own first-token latency of this request
    preemptions: int = 0  # times vLLM preempted (and later recomputed) this request


def worker_log_level(environ) -> str:
    """vLLM's log level in a worker: the operator's VLLM_LOGGING_LEVEL, else warnings and errors only."""
    return environ.get("VLLM_LOGGING_LEVEL", "WARNING")


# What the forkserver imports once for all its workers: vLLM's offline entry point and this module, and the CPU
# worker and its model runner, which every CPU worker imports as it starts (0.9 s each, on an idle core).
FORKSERVER_PRELOAD = ("vllm.entrypoints.llm", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
                      "ridgefill.backends.vllm.worker")


def worker_context():
    """The multiprocessing context workers start from. On a CPU build: a forkserver (one per process, started at
    the first call) that has imported vLLM with the workers' log level (vLLM configures its logger at import); each
    worker still gets this process's environment as it is when it starts (_serve). Where CUDA is visible:
    spawn, so that no worker inherits a process that may have touched CUDA."""
    import torch
    from multiprocessing import forkserver

    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    level = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ["VLLM_LOGGING_LEVEL"] = worker_log_level(os.environ)
    try:
        forkserver.ensure_running()
    finally:
        if level is None:
            del os.environ["VLLM_LOGGING_LEVEL"]
    return ctx


class VllmWorker:
    """One vLLM worker in a process of its own, started from worker_context(). Use as a context manager; every
    call blocks until the reply. The worker's process sees this process's environment as it is now."""

    def __init__(self, settings: WorkerSettings, start_timeout: float = 600.0) -> None:
        self.settings = settings
        ctx = worker_context()
        self._conn, child = ctx.Pipe()
        # not daemonic: TP workers are its children
        self._proc = ctx.Process(target=_serve, args=(child, settings, dict(os.environ)))
        self._proc.start()
        child.close()
        self._reply(start_timeout, fatal=True)  # "ready", or the start-up error

    def generate(self, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None,
                 tails: list[int | None] | None = None, stop_at_eos: bool = False, cache_salt: str | None = None,
                 timeout: float = 1800.0) -> list[Completion]:
        """Greedy completions of `prompts` (token ids), submitted together (vLLM batches them); `tails` sets a
        per-request tail (None: the served default); without `stop_at_eos` every completion has max_tokens;
        `cache_salt`: the prompts' prefix-cache namespace (a fresh one: no cache hit)."""
        self._conn.send(("generate", prompts, max_tokens, logprobs, tails, stop_at_eos, cache_salt))
        return self._reply(timeout)

    def prompt_logprobs(self, prompts: list[list[int]], timeout: float = 1800.0) -> list[list[float | None]]:
        """Each prompt token's log-prob given the tokens before it (None for the first), submitted together. The
        plugin runs such requests exact (backends/vllm/requests.request_rule)."""
        self._conn.send(("prompt_logprobs", prompts))
        return self._reply(timeout)

    def token_logprobs(self, prompts: list[list[int]], tokens: list[int], tails: list[int | None],
                       timeout: float = 1800.0) -> list[float]:
        """The log-prob of tokens[i] as the token after prompts[i], each request with its tail (None: the served
        default), submitted together."""
        self._conn.send(("token_logprobs", prompts, tokens, tails))
        return self._reply(timeout)

    def tally(self) -> dict:
        """What the plugin did since the worker started (a FillTally as a dict: backends/counters.py; zeros for stock
        vLLM)."""
        self._conn.send(("tally",))
        return self._reply(60.0)

    def block_size(self) -> int:
        """Tokens per KV cache block (the unit of a prefix-cache hit)."""
        self._conn.send(("block_size",))
        return self._reply(60.0)

    def counters(self) -> dict[str, float]:
        """vLLM's counter metrics (e.g. vllm:num_preemptions); needs llm_args disable_log_stats=False."""
        self._conn.send(("counters",))
        return self._reply(60.0)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def __enter__(self) -> "VllmWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _reply(self, timeout: float, fatal: bool = False):
        """The worker's answer; its error as a RidgefillError (the worker is closed first when `fatal`: a start-up
        error; a request's error leaves it serving)."""
        if not self._conn.poll(timeout):
            self.close()
            raise RidgefillError(f"the vLLM worker did not answer within {timeout:.0f} s: see its log above")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self.close()
            raise RidgefillError(f"the vLLM worker process ended (exit code {self._proc.exitcode}): see its log "
                                 "above") from None
        if status == "error":
            if fatal:
                self.close()
            raise RidgefillError(value)
        return value


def _serve(conn, settings: WorkerSettings, environ: dict[str, str]) -> None:  # runs in the child process
    os.dup2(2, 1)  # nothing on the parent's stdout: vLLM's log lines (and any print) go to stderr
    os.environ.clear()  # the parent's environment (a forkserver's child would otherwise have the server's)
    os.environ.update(environ)
    keep_freed_memory({**os.environ, **settings.env})  # started without GLIBC_TUNABLES: backends/vllm/malloc.py
    os.environ.update(settings.environment())
    try:
        llm = _build(settings)
    except Exception as exc:  # reported to the parent as one line
        conn.send(("error", f"vLLM could not start ({type(exc).__name__}: {_first_line(exc)})"))
        traceback.print_exc()
        return
    conn.send(("ok", "ready"))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "stop":
            _stop(llm)
        try:
            if message[0] == "generate":
                conn.send(("ok", _generate(llm, *message[1:])))
            elif message[0] == "prompt_logprobs":
                conn.send(("ok", _prompt_logprobs(llm, *message[1:])))
            elif message[0] == "token_logprobs":
                conn.send(("ok", _token_logprobs(llm, *message[1:])))
            elif message[0] == "counters":
                conn.send(("ok", _counters(llm)))
            elif message[0] == "block_size":
                conn.send(("ok", int(llm.llm_engine.vllm_config.cache_config.block_size)))
            else:
                conn.send(("ok", _tally(llm)))
        except Exception as exc:
            traceback.print_exc()
            conn.send(("error", f"vLLM failed ({type(exc).__name__}: {_first_line(exc)})"))


def _stop(llm) -> None:
    """Shut the LLM down (its executor and any tensor-parallel workers) and run the exit handlers (which unlink
    the process's semaphores), then end the process without the interpreter's teardown of vLLM and torch, which
    took 2 s of a 2.8 s stop (measured on a tiny worker; the handlers 16 ms)."""
    import atexit
    import sys

    llm.llm_engine.engine_core.shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def _build(settings: WorkerSettings):
    if settings.plugin:
        from ridgefill.backends.vllm.plugin.entry import register

        register()  # vLLM also loads it from its entry point; registering twice is harmless
    elif settings.fill is not None:
        raise ValueError("a fill needs the plugin")
    from vllm import LLM

    return LLM(model=settings.model, dtype=settings.dtype, max_model_len=settings.max_model_len,
               enforce_eager=not settings.compiled, enable_prefix_caching=settings.enable_prefix_caching, seed=0,
               **{"disable_log_stats": False, **settings.llm_args})


def _generate(llm, prompts, max_tokens, logprobs, tails, stop_at_eos, cache_salt) -> list[Completion]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ridgefill.backends.vllm.requests import TAIL_ARG
    from ridgefill.clock import clocked

    tails = tails or [None] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=not stop_at_eos,
                             extra_args=None if t is None else {TAIL_ARG: t}) for t in tails]
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    requests = [TokensPrompt(prompt_token_ids=list(p), **salt) for p in prompts]
    # the one clock of time to first token (ridgefill/clock.py); nothing to synchronise: the outputs are here
    seconds, outputs = clocked(lambda: llm.generate(requests, params, use_tqdm=False))
    done = []
    for out in outputs:
        c = out.outputs[0]
        steps = c.logprobs or []
        chosen = [float(step[t].logprob) for step, t in zip(steps, c.token_ids)]
        top = [{int(k): float(v.logprob) for k, v in step.items()} for step in steps]
        stats = getattr(out, "metrics", None)
        done.append(Completion(list(c.token_ids), chosen, top, seconds,
                               getattr(stats, "first_token_latency", None) or None,
                               int(getattr(stats, "num_preemptions", 0) or 0)))
    return done


def _prompt_logprobs(llm, prompts) -> list[list[float | None]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return [[None if step is None else float(step[t].logprob) for step, t in zip(out.prompt_logprobs, p)]
            for out, p in zip(outputs, prompts)]


def _token_logprobs(llm, prompts, tokens, tails) -> list[float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ridgefill.backends.vllm.requests import TAIL_ARG

    params = [SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, logprob_token_ids=[t],
                             extra_args=None if tail is None else {TAIL_ARG: tail}) for t, tail in zip(tokens, tails)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return [float(out.outputs[0].logprobs[0][t].logprob) for out, t in zip(outputs, tokens)]


def _tally(llm) -> dict:
    return llm.apply_model(model_tally)[0]  # one per worker (tensor-parallel ranks see the same rows)


def model_tally(model) -> dict:
    """What the plugin did in one model (a module-level function: vLLM pickles it to its tensor-parallel workers)."""
    from ridgefill.backends.counters import FillCounters

    state = getattr(model, "ridgefill", None)
    return (FillCounters() if state is None else state.counters).to_dict()


def _counters(llm) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter

    totals: dict[str, float] = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter):  # one per label set (e.g. finish reason): summed by name
            totals[m.name] = totals.get(m.name, 0.0) + float(m.value)
    return totals
