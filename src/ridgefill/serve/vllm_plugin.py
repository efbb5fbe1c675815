"""ridgefill's vLLM general plugin (entry point `vllm.general_plugins`: ridgefill = this module's `register`).

vLLM calls `register()` in every process it starts (API server, engine core, workers), possibly more than once.
Unconfigured (RIDGEFILL_MAPS unset) it does nothing: vLLM runs exactly as stock. Configured, it
1. refuses any vLLM other than the release it was written for (serve/vllm_config.VLLM_VERSION);
2. makes vLLM use its V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0 unless set), the one the plugin hooks;
3. registers RidgeFill's Llama / Qwen2 / Qwen3 / Qwen3-Next classes (serve/vllm_model.py) for those architectures;
4. wraps the model runner's forward call so the model learns which tokens of each step are filled
   (serve/vllm_runner.py);
5. makes prefix caching safe (serve/vllm_prefix.py): filled requests get a cache salt of their fill, and their
   cache hits end before their tail;
6. hooks the creation of the engine's configuration: the admission check of requests' RidgeFill options
   (serve/vllm_admission.py) joins the logits processors, and a configuration the fill cannot run under (LoRA, KV
   connectors, micro-batching, Model Runner V2, ...: vllm_config.REFUSED) is refused with one line before any
   engine process starts.
Each step is idempotent.
"""

from __future__ import annotations

import os

from ridgefill.method.fill import V2_RUNNER, FillSettings
from ridgefill.serve.vllm_config import ARCHITECTURES, check_engine_config, check_vllm_version
from ridgefill.serve.vllm_prefix import install_prefix_hooks
from ridgefill.serve.vllm_runner import HOOKED, install_runner_hook


def register() -> None:
    fill = FillSettings.from_env()
    if fill is None:
        return
    import vllm
    from vllm import ModelRegistry

    check_vllm_version(vllm.__version__)
    os.environ.setdefault(V2_RUNNER, "0")  # inherited by every process vLLM starts from here
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, f"ridgefill.serve.vllm_model:RidgeFill{arch}")
    install_runner_hook()
    install_prefix_hooks(fill)
    _install_config_hook()


def _install_config_hook() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, HOOKED, False):
        return
    stock = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        from ridgefill.serve.vllm_admission import QUALNAME

        processors = list(self.logits_processors or [])
        if QUALNAME not in processors:
            self.logits_processors = [*processors, QUALNAME]
        config = stock(self, *args, **kwargs)
        fill = FillSettings.from_env()
        if fill is not None:
            check_engine_config(config, fill)
        return config

    EngineArgs.create_engine_config = create_engine_config
    setattr(EngineArgs, HOOKED, True)
