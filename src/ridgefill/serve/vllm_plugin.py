"""ridgefill's vLLM general plugin (entry point `vllm.general_plugins`: ridgefill = this module's `register`).

vLLM calls `register()` in every process it starts (API server, engine core, workers), possibly more than once.
Unconfigured (RIDGEFILL_MAPS unset) it does nothing: vLLM runs exactly as stock. Configured, it
1. refuses any vLLM other than the release it was written for (serve/vllm_config.VLLM_VERSION);
2. registers RidgeFill's Llama / Qwen2 / Qwen3 classes (serve/vllm_model.py) for those architectures;
3. wraps the model runner's forward call so the model learns which tokens of each step are filled
   (serve/vllm_runner.py);
4. turns prefix caching off with a warning when the engine's configuration is created: a cached block of a
   filled prompt holds predicted K/V in its late layers, and whether a row is filled depends on the length of
   the prompt it was part of, so a block cannot be shared between prompts. (The model refuses to load if
   prefix caching is on anyway.)
Each step is idempotent.
"""

from __future__ import annotations

import logging

from ridgefill.serve.vllm_config import ARCHITECTURES, check_vllm_version, fill_from_env

log = logging.getLogger("ridgefill.vllm")
HOOKED = "_ridgefill_hooked"


def register() -> None:
    fill = fill_from_env()
    if fill is None:
        return
    import vllm
    from vllm import ModelRegistry

    check_vllm_version(vllm.__version__)
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, f"ridgefill.serve.vllm_model:RidgeFill{arch}")
    from ridgefill.serve.vllm_runner import install_runner_hook

    install_runner_hook()
    _install_config_hook()


def _install_config_hook() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, HOOKED, False):
        return
    stock = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        if self.enable_prefix_caching is not False:
            log.warning("ridgefill: prefix caching turned off (a cached block of a filled prompt holds predicted "
                        "K/V in its late layers); pass --no-enable-prefix-caching to silence this")
            self.enable_prefix_caching = False
        return stock(self, *args, **kwargs)

    EngineArgs.create_engine_config = create_engine_config
    setattr(EngineArgs, HOOKED, True)
