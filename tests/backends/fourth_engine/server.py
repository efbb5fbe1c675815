"""The fourth engine's server, as a new serving engine would come: a backends/serving.Server in its own folder, named
in backends.SERVERS (one line), whose OpenAI-compatible server is a tiny one of the test's own (app.py: completions,
streamed or not, from torchfill's greedy decoding, one request at a time). Its log speaks its own dialect: a failure
line `FourthError: ...`, a fix named for one reason, and its own fix for a server that came up without RidgeFill."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from ridgefill.backends.counters import MARKER
from ridgefill.backends.serving import GuardDialect, Launch, LogDialect, Server, health_url
from ridgefill.errors import RidgefillError

KEY_ENV = "FOURTH_API_KEY"
CONTEXT = "--context"
HERE = Path(__file__).resolve().parent


class FourthServer(Server):
    name = "fourth"
    title = "Fourth"
    guard = GuardDialect(options_field="", key_env=KEY_ENV)
    log = LogDialect(fixes=((re.compile(r"no room for the model"), "give the fourth engine more room"),),
                     fill_fix="install the fourth engine's RidgeFill")

    def check(self, c, own: list[str]) -> None:
        context_of(c.server_args)

    def served_dtype(self, dtype: str, model: str) -> str:
        return "fp32"

    def launch(self, c, fill, scratch: Path, guard: str | None, env: dict) -> Launch:
        spec = {"model": c.model, "fill": fill.describe() if fill is not None else None, "host": c.host,
                "port": c.port, "context": context_of(c.server_args)}
        path = scratch / ("fourth.json" if fill is not None else "fourth-stock.json")
        path.write_text(json.dumps(spec, default=str))
        argv = [sys.executable, "-m", "fourth_engine.app", str(path), *(["--guard", guard] if guard else [])]
        paths = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return Launch(argv, {**os.environ, "PYTHONPATH": paths, **env}, health_url(c.host, c.port),
                      "one request at a time", Path(), MARKER if fill is not None else None, title=self.title,
                      dialect=self.log)

    def context_args(self, tokens: int) -> list[str]:
        return [CONTEXT, str(tokens)]

    def drive(self, base: str, model: str, tokenizer, prompts: list[list[int]], rate: float, output_tokens: int,
              seed: int, time_limit: float, salt: str = "") -> list[dict]:
        from ridgefill.backends.load import drive_completions

        return drive_completions(base, model, [tokenizer.decode(p) for p in prompts], rate, output_tokens, seed,
                                 time_limit)


def context_of(args: list[str]) -> int:
    """The server's context (--context N, else 512); anything else is refused in one line."""
    if not args:
        return 512
    if len(args) != 2 or args[0] != CONTEXT or not args[1].isdigit():
        raise RidgefillError(f"{' '.join(args)}: the fourth engine's server takes {CONTEXT} N only")
    return int(args[1])


SERVER = FourthServer()
