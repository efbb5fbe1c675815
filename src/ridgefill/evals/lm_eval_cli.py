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
    """lm-eval's own CLI on `args`, after the import that registers the `ridgefill` model."""
    import ridgefill.evals.lm_eval_model  # noqa: F401  (registers the model; a one-line error without lm-eval)
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *config.args]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


COMMAND = Command("lm-eval", LmEvalConfig, run, passthrough=True)
