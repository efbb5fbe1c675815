"""The fourth engine's server process (`python -m fourth_engine.app SPEC [--guard CLASS]`): a tiny OpenAI-compatible
server of the test's own. /v1/completions (streamed or not; greedy, `max_tokens` tokens, the end of sequence never
stops it) runs the fill of SPEC (or exact without one) through torchfill's backend, one request at a time; /health;
/metrics with RidgeFill's counter where a fill runs; the front's guard mounted outermost when named. Environment
switches make it misbehave as a broken engine would: FOURTH_FAIL (a failure line, then exit 1 before it answers),
FOURTH_NO_COUNTERS (it comes up without RidgeFill's counter)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys

from ridgefill import backends

# this process's registry knows the fourth engine, as the test's does (the guard finds its dialect through it)
backends.ENGINES["fourth"] = ("fourth_engine.backend", "a test's fourth engine")
backends.SERVERS["fourth"] = ("fourth_engine.server", "--context N")


def runner(spec: dict):
    """torchfill's backend on the model of SPEC with its one variant, `served`: the fill, or exact."""
    from ridgefill.evals.generate import GenerateConfig
    from ridgefill.method.fill import FillSettings

    fill = FillSettings(**spec["fill"]) if spec["fill"] is not None else None
    config = GenerateConfig(model=spec["model"], engine="torchfill", prompt="-", exact=fill is None)
    backend = config.open_backend()
    plan = fill.plan(backend.model)[0] if fill is not None else None
    return backend.use({"served": fill}, {"served": plan}).start(spec["context"])


def build(spec: dict, guard: str | None):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    backend = runner(spec)
    tokenizer = backend.model.tokenizer
    lock = asyncio.Lock()

    async def completions(request):
        body = await request.json()
        ids = tokenizer(body["prompt"], add_special_tokens=True)["input_ids"]
        async with lock:
            done = await asyncio.to_thread(backend.generate, "served", ids, int(body.get("max_tokens", 16)), None)
        pieces = [tokenizer.decode([t]) for t in done.tokens]
        if not body.get("stream"):
            return JSONResponse({"object": "text_completion", "model": spec["model"], "choices": [
                {"index": 0, "text": "".join(pieces), "finish_reason": "length"}]})

        async def events():
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": piece or " ",
                                                          "finish_reason": "length" if last else None}]}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def metrics(request):
        filled = backend.tally("served").filled_tokens
        counted = spec["fill"] is not None and not os.environ.get("FOURTH_NO_COUNTERS")
        return PlainTextResponse(f"ridgefill_filled_tokens_total {filled}\n" if counted else "fourth_up 1\n")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health),
                            Route("/metrics", metrics)])
    if guard:
        module, _, name = guard.rpartition(".")
        app = getattr(importlib.import_module(module), name)(app)
    return app


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("--guard")
    args = parser.parse_args()
    if os.environ.get("FOURTH_FAIL"):
        print("INFO loading the fourth engine", flush=True)
        print(f"fourth_engine.FourthError: {os.environ['FOURTH_FAIL']}", flush=True)
        return 1
    with open(args.spec) as f:
        spec = json.load(f)
    import uvicorn

    uvicorn.run(build(spec, args.guard), host=spec["host"], port=spec["port"], log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
