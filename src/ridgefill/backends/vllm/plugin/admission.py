"""Admission-time checks of a request's RidgeFill options, through vLLM's own hook for them (imported only inside
vLLM processes).

vLLM runs every custom logits processor's `validate_params` when it admits a request (InputProcessor
._validate_params, in the API server for HTTP requests and in `LLM.generate` for Python ones); a ValueError there
is the request's error: HTTP 400 over the OpenAI API, an exception for `LLM.generate`. The plugin adds this class
to the engine's logits processors whenever it is configured (backends/vllm/plugin/entry.py). As a logits processor it does
nothing: it never changes a logit (`apply` returns them as they are) and says so (`is_argmax_invariant`), so greedy
steps skip it.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from ridgefill.backends.vllm.requests import check_request_args

QUALNAME = "ridgefill.backends.vllm.plugin.admission:RidgeFillRequestArgs"  # how vLLM's --logits-processors names it


class RidgeFillRequestArgs(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        check_request_args(getattr(sampling_params, "extra_args", None))

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass
