"""What the plugin does to vLLM's own configuration objects (EngineArgs -> VllmConfig), no engine started: on an
install where vLLM would pick Model Runner V2 (Triton usable, as on every CUDA install: simulated here), a configured
plugin makes it use V1, the runner it hooks, and refuses a configuration that still asks for V2; settings that break
the fill are refused with one line before any engine process starts; the admission check joins the logits
processors; prefix caching stays on (the plugin makes it safe). Each probe runs in a fresh process (the plugin's
hooks and vLLM's environment are per process): first as stock vLLM, then with the plugin registered."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


pytest.importorskip("vllm")

PROBE = r"""
import json, os, sys
import vllm.config.vllm as vllm_config_module
from vllm.engine.arg_utils import EngineArgs

vllm_config_module.HAS_TRITON = True  # as on a CUDA install: vLLM would pick Model Runner V2
from ridgefill.backends.vllm.fill import fill_from_env
from ridgefill.backends.vllm.config import check_vllm_config
from ridgefill.backends.vllm.plugin.entry import register


def make(env=None, after=None, **kwargs):
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        config = EngineArgs(model=sys.argv[1], max_model_len=512, **kwargs).create_engine_config()
        if after is not None:
            after(config)
            check_vllm_config(config, fill_from_env())
        return {"v2": config.use_v2_model_runner, "processors": config.model_config.logits_processors,
                "prefix_caching": config.cache_config.enable_prefix_caching}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def dbo(config):
    config.parallel_config.enable_dbo = True  # the CPU platform turns DBO off itself: set as a GPU would keep it


def context_parallel(kind):  # vLLM itself refuses more context-parallel ranks than this machine has: set after it
    def set_size(config):
        setattr(config.parallel_config, f"{kind}_context_parallel_size", 2)
    return set_size


cases = {
    "plain": lambda: make(),
    "v2-asked": lambda: make(env={"VLLM_USE_V2_MODEL_RUNNER": "1"}),
    "lora": lambda: make(enable_lora=True),
    "kv-offloading": lambda: make(kv_offloading_size=1.0),
    "kv-transfer": lambda: make(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}),
    "speculative": lambda: make(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                    "prompt_lookup_max": 2}),
    "dbo": lambda: make(after=dbo),
    "dcp": lambda: make(after=context_parallel("decode")),
    "pcp": lambda: make(after=context_parallel("prefill")),
    "weight-transfer": lambda: make(weight_transfer_config={"backend": "nccl"}),
    "dev-mode": lambda: make(env={"VLLM_SERVER_DEV_MODE": "1"}),
}
stock, wanted = sys.argv[3].split(",") if sys.argv[3] else [], sys.argv[4:] or list(cases)
before = {name: cases[name]() for name in stock}  # nothing registered, no RIDGEFILL_MAPS: stock vLLM
os.environ["RIDGEFILL_MAPS"] = sys.argv[2]
register()  # what vLLM does from the entry point in every process
print("RESULT " + json.dumps({"stock": before, "configured": {name: cases[name]() for name in wanted}}))
"""


def probe(folder, maps, cases: tuple[str, ...] = (), stock: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(the `stock` cases' results before the plugin is registered, the `cases`' results (all: empty) with the
    plugin registered and configured with `maps`), from one fresh process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RIDGEFILL_") and k != "VLLM_USE_V2_MODEL_RUNNER"}
    r = subprocess.run([sys.executable, "-c", PROBE, str(folder), str(maps), ",".join(stock), *cases],
                       capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    return result["stock"], result["configured"]


def test_a_configured_plugin_makes_vllm_use_the_runner_it_hooks_and_refuses_what_breaks_the_fill(vllm_tiny):
    folder, maps = vllm_tiny["llama"]
    unconfigured, cases = probe(folder, maps, stock=("plain", "lora", "dev-mode"))
    assert unconfigured["plain"]["v2"] is True  # without the plugin this install would run Model Runner V2
    assert unconfigured["lora"].get("error") is None  # and nothing is refused: the plugin does nothing
    assert unconfigured["dev-mode"].get("error") is None  # dev mode is refused only where the plugin fills
    plain = cases["plain"]
    assert plain["v2"] is False and plain["prefix_caching"] is True  # on, as vLLM's default (made safe)
    assert plain["processors"] == ["ridgefill.backends.vllm.plugin.admission:RidgeFillRequestArgs"]
    expected = {"v2-asked": "vLLM picked its Model Runner V2, which the RidgeFill plugin does not hook",
                "lora": "LoRA is not supported with RidgeFill", "kv-offloading": "KV-offloading connectors",
                "kv-transfer": "KV-transfer and KV-offloading connectors are not supported",
                "speculative": "speculative decoding is not supported", "dbo": "micro-batching (DBO / ubatching)",
                "dcp": "decode context parallelism is not supported with RidgeFill (each rank would hold part of a "
                       "request's K/V",
                "pcp": "prefill context parallelism is not supported with RidgeFill (each rank would prefill part of "
                       "a prompt",
                "weight-transfer": "weight updates are not supported with RidgeFill (the maps are pinned to the "
                                   "checkpoint's weights",
                "dev-mode": "VLLM_SERVER_DEV_MODE=1 is not supported with RidgeFill: vLLM's dev mode opens endpoints "
                            "that change the served weights"}
    for case, match in expected.items():
        error = cases[case].get("error", "")
        assert error.startswith("RidgefillError: ") and match in error and "\n" not in error, (case, cases[case])


def test_a_configured_plugin_refuses_prefix_caching_for_a_hybrid_model(vllm_hybrid):
    """vLLM turns prefix caching on for Qwen3-Next by default; the plugin refuses it there with one line (its rules
    cover attention K/V only), before any engine process starts."""
    folder, maps = vllm_hybrid
    error = probe(folder, maps, ("plain",))[1]["plain"].get("error", "")
    assert error.startswith("RidgefillError: prefix caching is not supported with RidgeFill on a hybrid model")
    assert "--no-enable-prefix-caching" in error and "\n" not in error
