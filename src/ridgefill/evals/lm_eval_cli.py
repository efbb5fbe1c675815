"""`ridgefill lm-eval ARGS...`: lm-evaluation-harness's own CLI with the `ridgefill` model registered
(evals/lm_eval_model.py). Every argument, --help included, goes to lm-eval:

    ridgefill lm-eval --model ridgefill --model_args pretrained=M,maps=MAPS,tail=256 --tasks T
    ridgefill lm-eval --model ridgefill --model_args pretrained=M,fill=identity,split=S --tasks T
    ridgefill lm-eval --model ridgefill --model_args pretrained=M --tasks T          # exact prefill

This module imports without lm-eval installed (so `ridgefill --help` lists the command); running it without
lm-eval is a one-line error.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ridgefill.commands import Command, Config, option


@dataclass
class LmEvalConfig(Config):
    args: list[str] = option([], "Arguments for lm-eval's own CLI (e.g. --model ridgefill --model_args ... "
                             "--tasks T).")


def run(config: LmEvalConfig) -> None:
    """lm-eval's own CLI on `args`, after the import that registers the `ridgefill` model, and, for that model,
    its model_args checked first (one line, before lm-eval starts)."""
    import importlib

    # registers the model; a one-line error without lm-eval
    lm_eval_model = importlib.import_module("ridgefill.evals.lm_eval_model")
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.utils import simple_parse_args_string

    if _value(config.args, "--model") == "ridgefill":
        lm_eval_model.preflight(simple_parse_args_string(_value(config.args, "--model_args") or ""))

    saved = sys.argv
    sys.argv = ["lm-eval", *config.args]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


def _value(args: list[str], name: str) -> str | None:
    """The value of option `name` among lm-eval's arguments (`--name v` or `--name=v`; the last one given)."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


COMMAND = Command("lm-eval", LmEvalConfig, run, passthrough=True)
