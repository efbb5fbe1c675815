"""Every vLLM attribute ridgefill's vLLM plugin patches, one checked class each (backends/vllm/plugin/patch.Patch), and the one
list the plugin applies (`PATCHES`; docs/serving.md lists the surface). The wrappers' bodies live with the code
they serve: the model runner's in backends/vllm/plugin/runner.py, the prefix cache's in backends/vllm/plugin/prefix.py,
detokenize's in backends/vllm/plugin/tokens.py."""

from __future__ import annotations

from ridgefill.method.fill import FillSettings
from ridgefill.backends.vllm.fill import fill_from_env
from ridgefill.backends.vllm.plugin.patch import Patch
from ridgefill.backends.vllm.config import check_vllm_config
from ridgefill.backends.vllm.plugin.prefix import cut_cache_hit, salted_request
from ridgefill.backends.vllm.plugin.runner import model_forward
from ridgefill.backends.vllm.plugin.tokens import checked_detokenize


class EngineConfigPatch(Patch):
    module, owner, attribute = "vllm.engine.arg_utils", "EngineArgs", "create_engine_config"
    params = ("self", "usage_context", "headless")
    why = ("adds the admission check of requests' RidgeFill options to the logits processors, and refuses an "
           "engine configuration the fill cannot run under before any engine process starts")

    def wrap(self, original):
        def create_engine_config(engine_args, *args, **kwargs):
            from ridgefill.backends.vllm.plugin.admission import QUALNAME

            processors = list(engine_args.logits_processors or [])
            if QUALNAME not in processors:
                engine_args.logits_processors = [*processors, QUALNAME]
            config = original(engine_args, *args, **kwargs)
            fill = fill_from_env()
            if fill is not None:
                check_vllm_config(config, fill)
            return config

        return create_engine_config


class ModelForwardPatch(Patch):
    module, owner, attribute = "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward"
    params = ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs")
    why = "tells the model which tokens of each step are filled and counts what it filled (V1's runner; CPU too)"

    def wrap(self, original):
        def _model_forward(runner, *args, **kwargs):
            return model_forward(original, runner, *args, **kwargs)

        return _model_forward


class RequestSaltPatch(Patch):
    module, owner, attribute = "vllm.v1.request", "Request", "from_engine_core_request"
    params = ("cls", "request", "block_hasher")
    is_classmethod = True
    why = "gives a filled request the cache salt of its fill, so it reads only blocks filled the same way"

    def wrap(self, original):
        fill = self.fill

        def from_engine_core_request(cls, request, block_hasher):
            return salted_request(original, cls, request, block_hasher, fill)

        return from_engine_core_request


class CacheHitPatch(Patch):
    module, owner, attribute = "vllm.v1.core.kv_cache_manager", "KVCacheManager", "get_computed_blocks"
    params = ("self", "request")
    why = "cuts a filled request's prefix-cache hit to the blocks before its tail, which it computes itself"

    def wrap(self, original):
        fill = self.fill

        def get_computed_blocks(manager, request):
            return cut_cache_hit(original, manager, request, fill)

        return get_computed_blocks


class DetokenizePatch(Patch):
    module, owner, attribute = "vllm.entrypoints.serve.tokenize.serving", "ServingTokenization", "create_detokenize"
    params = ("self", "request", "raw_request")
    why = "refuses token ids outside the vocabulary with a 400 (vLLM detokenizes them to an empty text)"

    def wrap(self, original):
        async def create_detokenize(serving, request, raw_request):
            return await checked_detokenize(original, serving, request, raw_request)

        return create_detokenize


PATCHES = (EngineConfigPatch, ModelForwardPatch, RequestSaltPatch, CacheHitPatch, DetokenizePatch)


def plugin_patches(fill: FillSettings) -> list[Patch]:
    """The plugin's patches for the served `fill`, in the order they are applied."""
    return [patch(fill) for patch in PATCHES]
