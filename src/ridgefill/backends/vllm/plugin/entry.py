"""ridgefill's vLLM general plugin (entry point `vllm.general_plugins`: ridgefill = this module's `register`).

vLLM calls `register()` in every process it starts (API server, engine core, workers), possibly more than once.
Unconfigured (RIDGEFILL_MAPS unset) it does nothing: vLLM runs exactly as stock. Configured, it
1. refuses any vLLM other than the release it was written for (backends/vllm/config.VLLM_VERSION), and checks that
   the private vLLM state it reads and the internals it calls are there, as it reads and calls them
   (backends/vllm/plugin/private.check_reads, the table every such read goes through) and that every attribute it patches
   exists with the signature it was written against (backends/vllm/plugin/patch.Patch): a vLLM that changed one fails
   start-up with one line naming it, before anything is patched;
2. makes vLLM use its V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0 unless set), the one the plugin hooks;
3. registers RidgeFill's Llama / Qwen2 / Qwen3 / Qwen3-Next classes (backends/vllm/plugin/model.py) for those architectures;
4. applies its patches, from one list (backends/vllm/plugin/patches.PATCHES): the model runner's forward call learns which
   tokens of each step are filled (backends/vllm/plugin/runner.py); prefix caching is made safe (backends/vllm/plugin/prefix.py:
   filled requests get a cache salt of their fill, and their cache hits end before their tail); the creation of
   the engine's configuration adds the admission check of requests' RidgeFill options (backends/vllm/plugin/admission.py)
   to the logits processors and refuses, with one line, a configuration the fill cannot run under (LoRA, KV
   connectors, micro-batching, Model Runner V2, ...: vllm_config.REFUSED) before any engine process starts.
Each step is idempotent: a patch already applied in the process is left as it is.
"""

from __future__ import annotations

import os

from ridgefill.backends.vllm.fill import V2_RUNNER, fill_from_env
from ridgefill.backends.vllm.plugin.patch import apply_patches
from ridgefill.backends.vllm.plugin.patches import plugin_patches
from ridgefill.backends.vllm.plugin.private import check_reads
from ridgefill.backends.vllm.config import ARCHITECTURES, check_vllm_version


def register() -> None:
    fill = fill_from_env()
    if fill is None:
        return
    import vllm
    from vllm import ModelRegistry

    check_vllm_version(vllm.__version__)
    check_reads()
    apply_patches(plugin_patches(fill))  # every target checked before the first is patched
    os.environ.setdefault(V2_RUNNER, "0")  # inherited by every process vLLM starts from here
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, f"ridgefill.backends.vllm.plugin.model:RidgeFill{arch}")
