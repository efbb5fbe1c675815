"""A request's RidgeFill options (backends/serving.py, backends/vllm/requests.py; the request guard's own checks are in
tests/serve/test_guard.py), what a step's accounting counts and warns about (backends/vllm/plugin/runner.account,
backends/counters.py), and serve's
start-up pieces that need no server: the KV cache plan and the one line a failed start becomes (no vLLM needed)."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ridgefill.errors import RidgefillError
from ridgefill.serve import serve
from ridgefill.backends.vllm import kv_sizing
from ridgefill.backends.vllm import server as vserving
from ridgefill.backends.counters import FillCounters
from ridgefill.torchfill.fill_plan import FillTally
from ridgefill.backends.vllm.requests import LARGEST, check_request_args, request_rule
from ridgefill.backends.vllm.plugin.runner import Step, StepLog, account


@pytest.mark.parametrize("extra", [
    None, {}, {"ridgefill_tail": 1}, {"ridgefill_tail": LARGEST}, {"ridgefill_keep_first": 0},
    {"ridgefill_tail": 64, "ridgefill_keep_first": 3}, {"other_key": "anything", "RIDGEFILL_TAIL": "x"},
])
def test_valid_options_pass(extra):
    check_request_args(extra)


@pytest.mark.parametrize("extra, match", [
    ({"ridgefill_tail": 2**63}, "ridgefill_tail=9223372036854775808 is not valid: give an integer in 1..2147483647"),
    ({"ridgefill_tail": 0}, "ridgefill_tail=0 is not valid"),
    ({"ridgefill_tail": LARGEST + 1}, "ridgefill_tail=2147483648 is not valid: give an integer in 1..2147483647 (last "
                                      "prompt tokens that run the full model)"),
    ({"ridgefill_keep_first": -1}, "ridgefill_keep_first=-1 is not valid: give an integer in 0..2147483647"),
    ({"ridgefill_tail": True}, "ridgefill_tail=True"),
    ({"ridgefill_tail": 64.0}, "ridgefill_tail=64.0"),
    ({"ridgefill_tail": "64"}, "ridgefill_tail='64'"),
    ({"ridgefill_tail": [64]}, "ridgefill_tail=[64]"),
    ({"ridgefill_tail": None}, "ridgefill_tail=None"),
    ({"ridgefill_tail": {"a": [1] * 100}}, "ridgefill_tail={'a': [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, ... is not "
                                           "valid"),  # long values are cut: one short line
    ({"ridgefill_tial": 5}, "unknown RidgeFill request option 'ridgefill_tial': use ridgefill_tail or "
                            "ridgefill_keep_first"),
    ({"ridgefill_": 5}, "unknown RidgeFill request option 'ridgefill_'"),
])
def test_bad_options_are_one_line_naming_the_key_and_range(extra, match):
    with pytest.raises(ValueError) as caught:
        check_request_args(extra)
    message = str(caught.value)
    assert match in message and "\n" not in message and len(message) < 200


def test_the_engine_reads_a_request_clamped_and_never_raises():
    def params(**extra):
        return SimpleNamespace(prompt_logprobs=None, extra_args=extra)

    assert request_rule(params(), 100, 24, 1) == (24, 1)  # the served defaults
    assert request_rule(params(ridgefill_tail=50, ridgefill_keep_first=4), 100, 24, 1) == (50, 4)
    assert request_rule(params(ridgefill_tail=2**31 - 1), 100, 24, 1) == (100, 1)  # clamped to the prompt
    assert request_rule(params(ridgefill_keep_first=500), 100, 24, 1) == (24, 100)
    assert request_rule(params(), 10, 24, 1) == (10, 1)
    for bad in (2**64, -3, 0, True, "9", 1.5, None):  # admission refuses these; the engine never raises on them
        assert request_rule(params(ridgefill_tail=bad), 100, 24, 1) == (24, 1)
    assert request_rule(SimpleNamespace(prompt_logprobs=2, extra_args={}), 100, 24, 1) == (100, 1)  # exact
    assert request_rule(None, 100, 24, 1) == (100, 1)


class FakeState:
    def __init__(self):
        self.counters = FillCounters()

    def count(self, **added):
        self.counters.count(**added)


def two_requests(prompt_a: int, prompt_b: int, first_a: int, n_a: int, first_b: int, n_b: int, tail: int):
    """A step with n_a tokens of request a from position first_a and n_b of b; keep-first 1."""
    positions = torch.cat([torch.arange(first_a, first_a + n_a), torch.arange(first_b, first_b + n_b)])
    request = torch.tensor([0] * n_a + [1] * n_b)
    prompt = torch.tensor([prompt_a, prompt_b])
    from ridgefill.backends.vllm.plugin.rows import full_tokens

    full = full_tokens(positions, request, prompt, torch.tensor([tail, tail]), torch.tensor([1, 1]))
    in_prompt = positions < prompt[request]
    last = in_prompt & (positions == prompt[request] - 1)
    return Step(["a", "b"], prompt, [tail, tail], [1, 1], request, positions, in_prompt, last, full, max_runs=8)


def test_account_counts_and_warns_for_a_request_that_filled_nothing(caplog):
    state, book = FakeState(), StepLog()
    step = two_requests(100, 50, 0, 60, 0, 50, tail=10)  # a: its first 60 tokens; b: all 50 (it ends here)
    filled = ~step.full & step.in_prompt
    filled[60:] = False  # b's rows were not filled (as when the fill ran nowhere)
    batch = SimpleNamespace(filled=filled, outliers=torch.zeros_like(filled), unwindowed=torch.zeros_like(filled))
    with caplog.at_level(logging.WARNING, logger="ridgefill.vllm"):
        account(state, step, batch, book)
    assert state.counters.tally() == FillTally(filled_tokens=59, full_tokens=51, cached_prompt_tokens=0,
                                               recomputed_prompt_tokens=0, run_bound_full_tokens=0, stock_steps=0)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "request b (50 prompt tokens, tail 10, keep-first 1) filled none of its 39" in \
        warnings[0]
    assert book.requests["b"].warned and not book.requests["a"].warned  # b ended; a's prefill goes on
    caplog.clear()
    rest = two_requests(100, 50, 60, 40, 50, 1, tail=10)  # a's last 40 prompt tokens; b's first decode token
    filled = ~rest.full & rest.in_prompt
    with caplog.at_level(logging.WARNING, logger="ridgefill.vllm"):
        account(state, rest, SimpleNamespace(filled=filled, outliers=None, unwindowed=None), book)
    assert not caplog.records and book.requests["a"].filled == 89  # a filled 89 rows: no warning
    assert state.counters.to_dict()["filled_tokens"] == 59 + 30  # a's positions 60..89
    assert state.counters.to_dict()["full_tokens"] == 51 + 10  # a's tail (b's token is a decode token)


def test_a_step_the_model_did_not_fill_counts_its_prompt_tokens_as_full():
    state, book = FakeState(), StepLog()
    step = two_requests(30, 20, 0, 30, 0, 20, tail=64)  # every row in the tail: nothing to fill
    account(state, step, None, book)
    assert state.counters.totals["full_tokens"] == 50 and state.counters.totals["filled_tokens"] == 0
    assert book.requests["a"].rule == book.requests["b"].rule == 0


# --- serve's start-up ------------------------------------------------------------------------------------------
CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
          "max_position_embeddings": 8192}  # SmolLM2-135M: 45 KiB of K and V per token in fp32


def plan(args=(), available=20 << 30, cpu=True, environ=None, **options):
    c = serve.ServeConfig(maps="m.safetensors", server_args=list(args), **options)
    return kv_sizing.kv_cache_plan(c, CONFIG, available, cpu, environ or {})


def test_the_cpu_kv_cache_holds_the_expected_requests_within_half_the_free_memory():
    per_token = 2 * 30 * 3 * 64 * 4
    assert kv_sizing.kv_bytes_per_token(CONFIG, "fp32") == per_token == 46080
    assert kv_sizing.kv_bytes_per_token(CONFIG, "bf16") == per_token // 2
    assert plan().args == ["--kv-cache-memory-bytes", str(4 * 8192 * per_token)]  # 4 requests of 8,192 tokens
    assert plan(["--max-model-len", "2k"]).args == ["--kv-cache-memory-bytes", str(4 * 2000 * per_token)]
    assert plan(["--max_model_len=1K"], concurrency=2).args[1] == str(2 * 1024 * per_token)
    assert plan(available=2 << 30).args[1] == str(1 << 30)  # capped at half of what is free
    assert "half the free memory" in plan(available=2 << 30).summary
    assert plan(kv_cache_gib=0.5).args[1] == str(1 << 29)
    for sized in (plan(cpu=False), plan(["--kv-cache-memory-bytes", "123"]), plan(["--gpu-memory-utilization=0.5"]),
                  plan(environ={"VLLM_CPU_KVCACHE_SPACE": "3"})):
        assert sized.args == [] and "sized by vLLM" in sized.summary  # vLLM's own rule, or the user's


@pytest.mark.parametrize("kwargs, match", [
    ({"available": 400 << 20}, "one request of 8,192 tokens needs 0.35 GiB of KV cache, but only 0.4 GiB of memory "
                               "is free"),
    ({"kv_cache_gib": 0.1}, "--kv-cache-gib 0.1 holds 2,330 tokens, less than one request of 8,192 tokens"),
    ({"args": ["--max-model-len", "100000"]}, "--max-model-len 100,000 exceeds the model's context of 8,192 tokens"),
])
def test_a_kv_cache_that_cannot_hold_one_request_is_refused(kwargs, match):
    with pytest.raises(RidgefillError, match=match):
        plan(**kwargs)


VLLM_LOG = """(APIServer pid=1) INFO 12-02 16:20:03 [utils.py:1] vLLM API server version 0.32.0
(EngineCore pid=2) ERROR 12-02 16:20:40 [core.py:1] EngineCore failed to start.
(EngineCore pid=2) ERROR 12-02 16:20:40 [core.py:1] Traceback (most recent call last):
(EngineCore pid=2) ERROR 12-02 16:20:40 [core.py:1]   File "core.py", line 1, in run
(EngineCore pid=2) ERROR 12-02 16:20:40 [core.py:1] ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`.
Traceback (most recent call last):
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""
PYDANTIC_LOG = """Traceback (most recent call last):
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (100000) is greater than the derived max_model_len (8192). [type=value_error, input_value=ArgsKwargs((), {})]
"""
OURS_LOG = """(APIServer pid=1) INFO starting
ridgefill.errors.RidgefillError: LoRA is not supported with RidgeFill (filled rows ...): drop --enable-lora
"""


def test_a_failed_start_is_one_line_with_its_root_cause_and_the_fix(tmp_path):
    from ridgefill.serve.process import startup_error as front_error

    def startup_error(text, code, path):  # as serve reads a vLLM server's log: in vLLM's dialect
        return front_error(text, code, path, vserving.SERVER.log)

    log = tmp_path / "vllm.log"
    line = startup_error(VLLM_LOG, 1, log)
    assert line == ("the server could not start (ValueError: No available memory for the cache blocks. Try increasing "
                    "`gpu_memory_utilization`.): lower --max-model-len or --kv-cache-gib, or free memory (the server's log: "
                    f"{log})")
    assert startup_error(PYDANTIC_LOG, 1, log).startswith(
        "the server could not start (ValidationError: User-specified max_model_len (100000) is greater than the derived "
        "max_model_len (8192).): lower --max-model-len (the server's log:")
    assert startup_error(OURS_LOG, 1, log) == (
        f"LoRA is not supported with RidgeFill (filled rows ...): drop --enable-lora (the server's log: {log})")
    assert startup_error("INFO nothing useful\n", -9, log) == (
        f"the server exited with code -9 before it answered: see its log, {log}")
    assert all("\n" not in startup_error(text, 1, log) for text in (VLLM_LOG, PYDANTIC_LOG, OURS_LOG))


LORA = "LoRA is not supported with RidgeFill (filled rows would take the base model's K/V, full rows the adapter's)"
SPECULATIVE = "speculative decoding is not supported with RidgeFill: drop it"


@pytest.mark.parametrize("arg, message", [
    ("--enable-lora", f"--enable-lora: {LORA}: merge the adapter into the checkpoint and fit maps for it"),
    ("--enable_lora", f"--enable_lora: {LORA}: merge the adapter into the checkpoint and fit maps for it"),
    ("--kv-transfer-config={}", "--kv-transfer-config={}: KV-transfer connectors are not supported with RidgeFill "
                                "(they share cached blocks across prompts): drop it"),
    ("--enable-dbo", "--enable-dbo: micro-batching (DBO) is not supported with RidgeFill: drop it"),
    ("--speculative-config", f"--speculative-config: {SPECULATIVE}"),
    ("-sc", f"-sc: {SPECULATIVE}"),
    ("-pp", "-pp: pipeline parallelism is not supported with RidgeFill: use --tensor-parallel-size"),
    ("--quantization", "--quantization: quantization is not supported with RidgeFill (the fill reads the layers' "
                       "K/V weights): serve an unquantized checkpoint"),
    ("-q", "-q: quantization is not supported with RidgeFill: serve an unquantized checkpoint"),
    ("--kv-offloading-size", "--kv-offloading-size: KV offloading is not supported with RidgeFill (it shares cached "
                             "blocks across prompts): drop it"),
    ("--kv-sharing-fast-prefill", "--kv-sharing-fast-prefill: --kv-sharing-fast-prefill skips layers for prompt rows "
                                  "itself: drop it"),
])
def test_vllm_options_that_break_the_fill_are_refused(arg, message):
    """Each option's own refusal, whole (every refusal names its option: matching the name alone tells nothing)."""
    with pytest.raises(RidgefillError, match=f"^{re.escape(message)}$"):
        serve.ServeConfig(maps="m.safetensors", server_args=["--max-model-len", "512", arg, "1"]).check()


def test_exposed_hosts_without_a_key_are_warned_about(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setattr(serve, "check_port", lambda host, port: None)  # 10.1.2.3 is no address of this machine
    for host, args, warned in [("127.0.0.1", [], False), ("localhost", [], False), ("::1", [], False),
                               ("0.0.0.0", [], True), ("10.1.2.3", [], True), ("0.0.0.0", ["--api-key", "k"], False)]:
        serve.ready(serve.ServeConfig(maps="m", host=host, server_args=args), vserving.SERVER, tmp_path / "log")
        err = capsys.readouterr().err
        assert (err.startswith("warning: --host") and err.count("\n") == 1) == warned, (host, args, err)
    assert vserving.health_url("0.0.0.0", 8000) == "http://127.0.0.1:8000/health"
    assert vserving.health_url("::", 8000) == "http://[::1]:8000/health"


# --- hybrid models (Qwen3-Next) --------------------------------------------------------------------------------
HYBRID_CONFIG = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 8, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 128, "max_position_embeddings": 4096,
                 "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                 + ["full_attention"], "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                 "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
                 "torch_dtype": "bfloat16"}


def test_a_hybrid_kv_cache_counts_attention_layers_per_token_and_linear_states_per_request():
    assert kv_sizing.kv_bytes_per_token(HYBRID_CONFIG, "bf16") == 2 * 2 * 2 * 64 * 2  # 2 attention layers
    conv, recurrent = (2 * 128 + 256) * 3, 4 * 64 * 64
    assert kv_sizing.state_bytes_per_request(HYBRID_CONFIG, "bf16") == 6 * (conv + recurrent) * 2
    assert kv_sizing.state_bytes_per_request(CONFIG, "fp32") == 0
    c = serve.ServeConfig(maps="m.safetensors", dtype="bf16", server_args=["--max-model-len", "1000"])
    one = 1000 * kv_sizing.kv_bytes_per_token(HYBRID_CONFIG, "bf16") + kv_sizing.state_bytes_per_request(HYBRID_CONFIG,
                                                                                                "bf16")
    assert kv_sizing.kv_cache_plan(c, HYBRID_CONFIG, 20 << 30, True, {}).args[1] == str(4 * one)


def test_a_hybrid_is_served_in_bf16_without_prefix_caching_on_a_cpu(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HYBRID_CONFIG))
    monkeypatch.setattr(vserving, "on_cpu", lambda: True)
    c = serve.ServeConfig(maps="m.safetensors", dtype="bf16")
    vserving.check_hybrid(c, HYBRID_CONFIG)
    assert "--no-enable-prefix-caching" in vserving.vllm_command(c, str(folder))
    with pytest.raises(RidgefillError, match=r"^a hybrid model \(Qwen3NextForCausalLM\) runs in vLLM on a CPU in bf16 "
                                             r"only .*: pass --dtype bf16$"):
        vserving.check_hybrid(serve.ServeConfig(maps="m.safetensors", dtype="fp32"), HYBRID_CONFIG)
    default = serve.ServeConfig(maps="m.safetensors")
    assert default.dtype == "auto" and vserving.served_dtype(default.dtype, HYBRID_CONFIG, True) == "bf16"
    vserving.check_hybrid(replace(default, dtype="bf16"), HYBRID_CONFIG)  # serve's default, resolved on a CPU
    for args in (["--enable-prefix-caching"], ["--no-enable-prefix-caching", "--enable-prefix-caching=true"]):
        with pytest.raises(RidgefillError, match="^--enable-prefix-caching: prefix caching is not supported with "
                                                 "RidgeFill on a hybrid model"):
            vserving.check_hybrid(serve.ServeConfig(maps="m.safetensors", dtype="bf16", server_args=args), HYBRID_CONFIG)
    vserving.check_hybrid(serve.ServeConfig(maps="m.safetensors", dtype="bf16",
                                         server_args=["--enable-prefix-caching", "--no-enable-prefix-caching"]),
                       HYBRID_CONFIG)
    dense = {**CONFIG, "architectures": ["LlamaForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(dense))
    assert "--no-enable-prefix-caching" not in vserving.vllm_command(serve.ServeConfig(maps="m.safetensors"),
                                                                   str(folder))


def test_a_hybrid_with_layers_the_plugin_does_not_know_is_refused():
    from ridgefill.backends.vllm.config import check_architecture

    check_architecture(["Qwen3NextForCausalLM"], "qwen3_next", "m", HYBRID_CONFIG["layer_types"])
    with pytest.raises(RidgefillError, match=r"^m has layers of kind sliding_attention, which ridgefill's vLLM plugin "
                                             r"does not fill .*: serve this model with stock vLLM"):
        check_architecture(["Qwen3NextForCausalLM"], "qwen3_next", "m", ["linear_attention", "sliding_attention"])
