"""A request's own RidgeFill options (no vLLM import): what a client may send, how it is checked at admission, and
how the engine reads it.

A request sets its own tail or keep-first through vLLM's extra sampling arguments: `SamplingParams(extra_args=
{"ridgefill_tail": 512})` in Python, `"vllm_xargs": {"ridgefill_tail": 512}` over HTTP. Every `ridgefill_*` key
is checked when vLLM admits the request (backends/vllm/plugin/admission.py calls `check_request_args`, the serving
seam's: backends/serving.py): an unknown key, a value that is not an integer, or one out of range is refused with
one line (HTTP 400), so nothing a client sends reaches the engine unchecked. Inside the engine `request_rule` never raises: it clamps to the prompt.

A keep-first follows ridgefill's one rule (torchfill/rows.check_keep_first): an integer up to MAX_ROWS, refused
beyond (here: at admission, HTTP 400; in `generate`: one line, exit 2); past a prompt, the whole prompt runs in full
(exact), in the plugin as in torchfill.
"""

from __future__ import annotations

from typing import Mapping

# the options and their check are the serving seam's (the request guard checks them too); re-exported here
from ridgefill.backends.serving import (KEEP_FIRST_ARG, LARGEST, PREFIX, REQUEST_ARGS, TAIL_ARG,  # noqa: F401
                                       check_request_args)


def request_rule(params, prompt_len: int, tail: int, keep_first: int) -> tuple[int, int]:
    """(tail, keep_first) of one request, each clamped to 0..prompt_len (tail at least 1): its extra arguments
    override the served defaults. A request that asks for prompt log-probs (they need every prompt row's final
    hidden state) or is no sampling request runs exact (tail = prompt). Never raises: a value admission would have
    refused counts as absent."""
    if params is None or getattr(params, "prompt_logprobs", None) is not None:
        return max(1, prompt_len), min(keep_first, prompt_len)
    extra = getattr(params, "extra_args", None) or {}
    tail, keep_first = _value(extra, TAIL_ARG, tail), _value(extra, KEEP_FIRST_ARG, keep_first)
    return max(1, min(tail, prompt_len)), max(0, min(keep_first, prompt_len))


def _value(extra: Mapping, key: str, default: int) -> int:
    value = extra.get(key, default)
    return value if REQUEST_ARGS[key][0](value, LARGEST) else default
