"""serve's plan of vLLM's server (VllmServer.launch through serve.serve_plan, vLLM's lookups replaced, no vLLM
process): the API key by environment, never on its command line; the default log private; RidgeFill's counter
looked for; abbreviations of serve's own options refused; the stock baseline as plain vLLM; the dtype resolved;
settings that break the fill refused before vLLM starts."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from helpers import free_port
from ridgefill.backends.vllm import server as vserving
from ridgefill.backends.vllm.args import split_api_key
from ridgefill.backends.vllm.config import VLLM_VERSION, check_dev_mode
from ridgefill.errors import RidgefillError
from ridgefill.serve import serve


# --- serve's plan: the key, the default log, the plugin's counter ------------------------------------------------
@pytest.fixture
def plan_of(tiny_checkpoint, tmp_path, monkeypatch):
    """serve_plan for `ridgefill serve --model <tiny> --split 3 ARGS` (identity fill), vLLM's lookups replaced."""
    monkeypatch.setattr(vserving, "installed_vllm_version", lambda: VLLM_VERSION)
    monkeypatch.setattr(vserving, "plugin_installed", lambda: True)
    for name in ("VLLM_PLUGINS", "VLLM_API_KEY", "VLLM_SERVER_DEV_MODE", "RIDGEFILL_MAX_REQUEST_BYTES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))

    def plan(*args: str, config: bool = False):
        c = serve.ServeConfig(model=str(tiny_checkpoint), split=3, port=free_port(), server_args=list(args))
        c.check()
        return (serve.serve_plan(c, tmp_path), c) if config else serve.serve_plan(c, tmp_path)

    return plan


@pytest.mark.parametrize("given", [["--api-key", "s3cret"], ["--api-key=s3cret"], ["--api_key", "s3cret"]])
def test_the_api_key_goes_to_vllm_by_environment_never_on_its_command_line(given, plan_of):
    plan = plan_of("--max-model-len", "256", *given, "--seed", "3")
    assert not any("s3cret" in arg for arg in plan.argv), plan.argv
    assert plan.env["VLLM_API_KEY"] == "s3cret"
    assert plan.argv[-4:] == ["--max-model-len", "256", "--seed", "3"]  # every other option as given


def test_serve_plans_a_private_log_and_looks_for_ridgefills_counter(plan_of, tmp_path):
    plan = plan_of()
    assert plan.log.parent == tmp_path / "state" / "ridgefill" and plan.log.name.startswith("serve-")
    assert stat.S_IMODE(plan.log.parent.stat().st_mode) == 0o700 and f"the server's log: {plan.log}" in plan.banner
    assert plan.marker == "ridgefill_filled_tokens_total" and "VLLM_API_KEY" not in plan.env


@pytest.mark.parametrize("args, match", [
    (["--api-key"], "--api-key needs a key: give --api-key KEY, or set VLLM_API_KEY"),
    (["--api-key", "a", "b"], "--api-key gives 2 keys: serve hands vLLM one key, through VLLM_API_KEY"),
    (["--api-key", "--seed", "3"], "--api-key needs a key"),
])
def test_an_api_key_serve_cannot_hand_on_is_refused(args, match):
    with pytest.raises(RidgefillError, match=f"^{match}"):
        serve.ServeConfig(maps="m.safetensors", server_args=args).check()
    assert split_api_key(["--seed", "3", "--api-key", "k", "--enforce-eager"]) == (["--seed", "3", "--enforce-eager"],
                                                                                   "k")


API_K = ("an abbreviation of serve's --api-key: write --api-key in full: serve takes the key off vLLM's command line, "
         "which every local user can read, only then")


@pytest.mark.parametrize("args, line", [
    (["--api-k", "s3cret"], f"--api-k: {API_K}"),
    (["--api-k=s3cret"], f"--api-k=s3cret: {API_K}"),
    (["--api", "s3cret"], f"--api: {API_K}"),
    (["--seed", "3", "--api_k", "s3cret"], f"--api_k: {API_K}"),
    (["--log-f", "x.log"], "--log-f: an abbreviation of serve's --log-file: write it in full"),
    (["--kv-cache-g", "2"], "--kv-cache-g: an abbreviation of serve's --kv-cache-gib: write it in full"),
    (["--ke", "2"], "--ke: an abbreviation of serve's --keep-first: write it in full"),
])
def test_an_abbreviation_of_serves_own_options_is_refused_naming_the_option(args, line, plan_of):
    """vLLM's parser reads `--api-k K` as --api-key (tests/backends/vllm/test_vllm_cli.py): the key would land on vLLM's
    command line. Refused in one line, before anything starts; split_api_key refuses it too."""
    with pytest.raises(RidgefillError) as refused:
        plan_of(*args)
    assert str(refused.value) == line
    if line.endswith("only then"):
        with pytest.raises(RidgefillError) as split:
            split_api_key(args)
        assert str(split.value) == line
    assert split_api_key(["--api-server-count", "1", "--seed", "3"]) == (["--api-server-count", "1", "--seed", "3"],
                                                                         None)


def test_an_abbreviated_api_key_is_one_line_through_the_command(tmp_path, monkeypatch, capfd):
    from ridgefill import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ridgefill", "serve", "--split", "3", "--api-k", "s3cret"])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2 and capfd.readouterr().err == f"error: --api-k: {API_K}\n"
    assert not any(tmp_path.iterdir())


def test_the_stock_baseline_is_plain_vllm(plan_of, tmp_path):
    """bench-serve's "stock vLLM" (serve.stock_plan: VllmServer.launch without a fill) runs the same command with
    nothing of RidgeFill's: no guard (its request checks and body parsing), no plugin (VLLM_PLUGINS empty: none of
    its refusals), no RIDGEFILL_* setting, no marker looked for; the rest of the command line is the served one's."""
    plan, c = plan_of("--max-model-len", "256", "--middleware", "my.Middleware", config=True)
    stock = serve.stock_plan(c, tmp_path, tmp_path / "stock.log")
    ours = plan.argv.index(serve.GUARD)
    assert plan.argv[ours - 1] == "--middleware"
    assert stock.argv == plan.argv[:ours - 1] + plan.argv[ours + 1:]  # the user's own middleware stays
    assert not any("ridgefill" in arg.lower() for arg in stock.argv[1:]), stock.argv
    assert stock.env["VLLM_PLUGINS"] == "" and not any(k.startswith("RIDGEFILL_") for k in stock.env)
    assert any(k.startswith("RIDGEFILL_") for k in plan.env) and stock.marker is None and stock.log == tmp_path / \
        "stock.log"
    assert "stock vLLM" in stock.banner and "RidgeFill" not in stock.banner


@pytest.mark.parametrize("cuda, native_bf16, want", [(False, False, "fp32"), (True, True, "bf16"),
                                                     (True, False, "fp32")])
def test_serve_defaults_to_dtype_auto_resolved_as_every_command(cuda, native_bf16, want, plan_of, monkeypatch):
    """serve and bench-serve default to --dtype auto, like every other command: fp32 on a CPU build, bf16 where vLLM
    runs on a CUDA GPU with bf16 units (runtime/device.py's rule); vLLM gets the resolved dtype, and the banner says
    it. A hybrid model on a CPU resolves to bf16, the one dtype vLLM's CPU Gated DeltaNet kernel runs."""
    from ridgefill.evals.bench_serve import BenchServeConfig
    from ridgefill.runtime import device
    from ridgefill.backends.vllm.config import served_dtype

    assert serve.ServeConfig().dtype == "auto" and BenchServeConfig(out=Path("o.json")).dtype == "auto"
    monkeypatch.setattr(vserving, "on_cpu", lambda: not cuda)
    monkeypatch.setattr(device, "native_bf16", lambda: native_bf16)
    plan = plan_of("--max-model-len", "256")
    at = plan.argv.index("--dtype")
    assert plan.argv[at + 1] == vserving.DTYPES[want] and f"; dtype {want}; " in plan.banner
    hybrid = {"architectures": ["Qwen3NextForCausalLM"]}
    assert served_dtype("auto", hybrid, cpu=not cuda) == ("bf16" if not cuda else want)
    assert served_dtype("fp16", hybrid, cpu=True) == "fp16" and served_dtype("fp32", {}, cpu=False) == "fp32"


# --- refused: context parallelism, weight updates, dev mode ------------------------------------------------------
@pytest.mark.parametrize("arg, match", [
    ("--decode-context-parallel-size", "context parallelism is not supported with RidgeFill (each rank would hold "
                                       "part of a request's K/V"),
    ("-dcp", "decode context parallelism is not supported with RidgeFill"),
    ("--prefill_context_parallel_size=2", "context parallelism is not supported with RidgeFill (each rank would "
                                          "prefill part of a prompt"),
    ("-pcp", "prefill context parallelism is not supported with RidgeFill"),
    ("--weight-transfer-config", "weight updates are not supported with RidgeFill (the maps are pinned to the "
                                 "checkpoint's weights"),
])
def test_context_parallelism_and_weight_updates_are_refused(arg, match):
    with pytest.raises(RidgefillError) as refused:
        serve.ServeConfig(maps="m.safetensors", server_args=["--max-model-len", "512", arg, "2"]).check()
    assert str(refused.value).startswith(f"{arg}: {match}"), refused.value


@pytest.mark.parametrize("value", ["0", "-5", "8MiB", "1e6"])
def test_a_bad_request_body_bound_is_refused_before_vllm_starts(plan_of, monkeypatch, value):
    """In vLLM's process the middleware would read it at the first request and answer every request 500."""
    monkeypatch.setenv("RIDGEFILL_MAX_REQUEST_BYTES", value)
    with pytest.raises(RidgefillError, match=rf"^RIDGEFILL_MAX_REQUEST_BYTES='{value}' is not a positive number of "
                                             r"bytes: set it to e\.g\. \d+ or unset it$"):
        plan_of()


def test_vllms_dev_mode_is_refused_before_vllm_starts(plan_of, monkeypatch):
    check_dev_mode({"VLLM_SERVER_DEV_MODE": "0"})
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with pytest.raises(RidgefillError, match=r"^VLLM_SERVER_DEV_MODE=1 is not supported with RidgeFill: vLLM's dev "
                                             r"mode opens endpoints that change the served weights .*: unset "
                                             r"VLLM_SERVER_DEV_MODE$"):
        plan_of()
