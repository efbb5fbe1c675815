"""bench-serve's load for any OpenAI-compatible server (an engine's `drive` where it has no benchmark client of its
own: llama.cpp's): a seeded Poisson stream of streamed completions on loopback, each request's time to first token,
latency and generated tokens measured here, the way vLLM's benchmark client measures them (vLLM's own drive:
backends/vllm/load.py).

Request i is sent at the i-th arrival of a Poisson process of `rate` requests/s (exponential gaps from a generator
seeded with `seed`: the same arrivals for every variant; rate inf sends them all at once). Its time to first token is
from its send to the first streamed chunk that carries text; its latency to the end of its stream; its generated
tokens are `output_tokens` when the server reports it stopped at the length limit (finish_reason "length"), else
the chunks that carried text. A request that fails (a status other than 200, a broken stream) fails the run: one
line with the first error.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np

from ridgefill.errors import RidgefillError


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of `count` requests at `rate` requests/s (Poisson; inf: all at 0)."""
    if not np.isfinite(rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


async def _one(client, url: str, body: dict, at: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
    start = time.perf_counter()
    ttft, chunks, finish = None, 0, None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", "replace")
            return {"error": f"HTTP {response.status_code}: {text[:200]}"}
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            choice = (json.loads(data).get("choices") or [{}])[0]
            if choice.get("text"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
            finish = choice.get("finish_reason") or finish
    latency = time.perf_counter() - start
    if ttft is None:
        return {"error": "the stream carried no text"}
    tokens = body["max_tokens"] if finish == "length" else chunks
    return {"ttft": ttft, "latency": latency, "output_tokens": tokens, "start": start - t0}


async def _stream(base: str, bodies: list[dict], times: list[float]) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 1)
    async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        return await asyncio.gather(*(_one(client, f"{base}/v1/completions", body, at, t0)
                                      for body, at in zip(bodies, times)), return_exceptions=True)


def drive_completions(base: str, model: str, prompts: list[str], rate: float, output_tokens: int, seed: int,
                      time_limit: float, extra_body: dict | None = None) -> list[dict]:
    """The stream of `prompts` (text) at `rate` against the server at `base`: per request its ttft, latency,
    output_tokens and start (seconds), in the order of `prompts`. Greedy (temperature 0), `output_tokens` each at
    most; `extra_body` joins every request's body (e.g. a logit bias that keeps end-of-sequence out)."""
    bodies = [{"model": model, "prompt": p, "max_tokens": output_tokens, "temperature": 0.0, "stream": True,
               **(extra_body or {})} for p in prompts]
    outputs = bounded(_stream(base, bodies, arrivals(len(prompts), rate, seed)), rate, time_limit)
    check_failures([o if isinstance(o, BaseException) else o.get("error") for o in outputs], rate)
    return list(outputs)


def bounded(run, rate: float, time_limit: float):
    """The result of coroutine `run` (one rate's stream), or one line when it takes over `time_limit` seconds."""
    try:
        return asyncio.run(asyncio.wait_for(run, time_limit))
    except asyncio.TimeoutError:
        raise RidgefillError(f"the run at {rate:g} requests/s took over --time-limit {time_limit:g} s: lower "
                             "--requests or the rates, or raise --time-limit") from None


def check_failures(errors: list, rate: float) -> None:
    """One line when any request of a rate failed (`errors`: per request its error, falsy when it succeeded)."""
    failed = [e for e in errors if e]
    if failed:
        first = str(failed[0]).strip().splitlines()[0][:200] if str(failed[0]).strip() else type(failed[0]).__name__
        raise RidgefillError(f"{len(failed)} of {len(errors)} requests failed at {rate:g} requests/s (the first: "
                             f"{first}): see the server's log")
