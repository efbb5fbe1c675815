"""The shared fixtures: the tiny models' fixtures (tests/tiny_models.py builds them), the fitted tiny checkpoint, the
tiny GGUF files, the vLLM fixtures; and how the suite runs (the fast tier, xdist groups, CPU binding)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tiny_models import DENSE_FAMILIES, save_tiny_checkpoint, tiny_model, training_text, write_corpus


@pytest.fixture(params=DENSE_FAMILIES)
def dense_model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def long_docs(tmp_path_factory) -> Path:
    """A .jsonl corpus of documents of ~700 tokens; about one in five is an evaluation document."""
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    lines = training_text(1200, seed=5)
    docs = [" ".join(lines[i : i + 48]) for i in range(0, len(lines), 48)]
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama-family checkpoint folder, shared by the whole test session (treat it as read-only)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama")

# the vLLM tests' shared fixtures, registered here once: a session fixture imported into several test modules is a
# fixture of each module, built once per module
from vllm_fixtures import (workers, smollm2_tuned, vllm_hybrid, vllm_lookback, vllm_tiny,  # noqa: E402,F401
                           vllm_tuned)
from served_vllm import vllm_server  # noqa: E402,F401  (one vLLM server for its tests and the conformance suite)


@dataclass(frozen=True)
class Fitted:
    """The tiny checkpoint calibrated and fitted once: its corpus, the statistics at splits 2 and 3, and maps fitted
    at each split (maps[2], maps[3]). Read-only: a test that changes a file works on a copy."""

    text: Path
    stats: Path
    maps: dict


@pytest.fixture(scope="session")
def tiny_fitted(tiny_checkpoint, tmp_path_factory) -> Fitted:
    """`ridgefill calibrate` (splits 2 and 3, 2,048 tokens of 128) and `ridgefill fit` (once per split) on the tiny
    checkpoint, through the command line, once per session."""
    from typer.testing import CliRunner

    from ridgefill.cli import app

    root = tmp_path_factory.mktemp("tiny-fitted")
    text, stats = write_corpus(root / "text.txt", seed=3, lines_per_document=12), root / "stats.safetensors"
    runner = CliRunner()
    r = runner.invoke(app, ["calibrate", "--model", str(tiny_checkpoint), "--data", str(text), "--split", "2,3",
                            "--tokens", "2048", "--seq-len", "128", "--out", str(stats), "--holdout", "0.25"])
    assert r.exit_code == 0, r.output
    maps = {split: root / f"maps-s{split}.safetensors" for split in (2, 3)}
    for split, path in maps.items():
        r = runner.invoke(app, ["fit", "--stats", str(stats), "--out", str(path), "--split", str(split)])
        assert r.exit_code == 0, r.output
    return Fitted(text, stats, maps)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, above all on a shared, busy CPU (a module opts in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_ggufs(tmp_path_factory):
    """The tiny GGUF files of every llama.cpp test module: family -> (transformers model, its GGUF file), written
    once per session and worker (tests/backends/llamacpp/tiny_gguf.py, importable once such a module is)."""
    import tiny_gguf

    folder = tmp_path_factory.mktemp("gguf")
    return {family: tiny_gguf.build(family, folder / f"tiny-{family}.gguf") for family in tiny_gguf.ARCH}


# --- running in parallel (pytest-xdist: `make test` runs two workers) ----------------------------------------------
# The tests that start vLLM workers, or use the session fixtures that fit maps for them (tests/vllm_fixtures.py), go
# to groups (`--dist loadgroup`), each run on one worker: the worker-pool tests (the pool's workers start once, in
# one process) and, for each other module, its vLLM tests (a module fixture, such as test_vllm_server.py's server,
# starts once). xdist sends the largest group first, the pool, and balances the rest over the workers. vLLM's
# automatic CPU binding is deterministic (here: 2 cores, one kept for its scheduler), so two vLLM workers side by side
# would get the same core and run slower than one group alone (measured); each xdist worker's vLLM workers and servers
# get cores of their own instead (vllm_cores), and torch in each xdist worker runs on its share of the cores
# (pytest_configure: two threads per worker kept four spinning OpenMP threads on the two cores). The session fixtures
# are built once per run (vllm_fixtures.built_once).
VLLM_FIXTURES = {"vllm_tiny", "vllm_lookback", "vllm_hybrid", "smollm2_tuned", "workers", "vllm_tuned"}


def vllm_cores(worker: str, workers: int, cpus: list[int]) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for xdist worker `worker` ("gw0", ...) of `workers`: its contiguous share of `cpus`
    ("0", "2,3"), or None when there are fewer cores than workers (vLLM's own binding then)."""
    if workers < 2 or len(cpus) < workers:
        return None
    index = int(worker.removeprefix("gw"))
    share = cpus[index * len(cpus) // workers:(index + 1) * len(cpus) // workers]
    return ",".join(map(str, share))


def pytest_configure(config):
    """In an xdist worker, torch runs on the worker's share of the cores (two workers on two cores each ran two
    threads, four spinning threads on two cores), and vLLM workers and servers started from it bind to that
    worker's cores (unless the environment already says how: an operator's VLLM_CPU_OMP_THREADS_BIND wins)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    workers, cpus = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), sorted(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, min(torch.get_num_threads(), len(cpus) // workers)))
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = vllm_cores(worker, workers, cpus)
    if cores is not None:
        os.environ.update(VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_NUM_OF_RESERVED_CPU="0")


# --- the fast tier (`make test-fast`, pytest --fast): what a developer runs first --------------------------------
# Left out: every test that starts a vLLM worker or server or runs llama.cpp (their fixtures, their folders and
# modules), and the modules whose tests start ridgefill processes or whole pipelines (tens of seconds each).
ENGINE_FIXTURES = VLLM_FIXTURES | {"tiny_ggufs"}
SLOW_MODULES = {"test_serve", "test_serve_process", "test_processes", "test_recipes", "test_tune", "test_stock",
                "test_cli", "test_fourth_engine", "test_fourth_server", "test_lm_eval_model", "test_longbench",
                "test_splice"}


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true", help="the fast tier: no vLLM or llama.cpp, no test that starts "
                     "processes or pipelines (tests/conftest.py: SLOW_MODULES)")


def slow(item) -> bool:
    """A test the fast tier leaves out."""
    parts = set(item.path.parts)
    return bool(ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))) or "llamacpp" in parts or \
        "vllm" in parts or "vllm" in item.path.stem or item.path.stem in SLOW_MODULES or \
        any(item.iter_markers("slow"))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the marks (it names the groups from them)
def pytest_collection_modifyitems(config, items):
    if config.getoption("fast"):
        left_out = [item for item in items if slow(item)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not slow(item)]
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if VLLM_FIXTURES & fixtures:
            group = "vllm-pool" if "workers" in fixtures else "vllm-server" if "vllm_server" in fixtures else \
                f"vllm-{item.path.stem}"
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session):
    """Under --dist loadgroup, every grouped test must carry its group in its nodeid (pytest-xdist routes by it):
    a pytest that ignores xdist's rewrite would silently spread the vLLM tests over every worker."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in session.items if any(i.iter_markers("xdist_group")) and "@" not in i.nodeid]
    if lost:
        pytest.exit(f"pytest-xdist's --dist loadgroup did not group {lost[0]} (pytest {pytest.__version__}): install "
                    "the pytest that pyproject.toml's dev extra pins", returncode=3)

