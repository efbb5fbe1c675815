"""Tiny random-init models of every supported family, built in the test process (no downloads)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from transformers import (AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3_5TextConfig, Qwen3Config,
                          Qwen3NextConfig)

VOCAB = 128


def tiny_config(family: str, **overrides):
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64}, **common)
    if family == "qwen2":
        return Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    if family == "qwen3":
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
        return Qwen3Config(**{"head_dim": 16, "rope_parameters": yarn, **common})
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    model.eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so the tests exercise them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


DENSE_FAMILIES = ["llama", "qwen2", "qwen3"]


@pytest.fixture(params=DENSE_FAMILIES)
def dense_model(request):
    return tiny_model(request.param)


HYBRID_FAMILIES = ["qwen3_5", "qwen3_next"]
L, A = "linear_attention", "full_attention"
HYBRID_LAYERS = [L, L, A, L, L, A]  # default: linear layer first (Cache.length reads layer 0), attention last


def tiny_hybrid_config(family: str, **overrides):
    """Qwen3.5 / Qwen3-Next with Gated DeltaNet and gated full-attention layers (partial RoPE 0.25, so 4 of
    16 head dims rotate); linear layers have 2 key heads serving 4 value heads. Qwen3-Next's layers use a
    4-expert top-2 MoE with a shared expert except layer 1 (dense MLP)."""
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, layer_types=HYBRID_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    common.update(overrides)
    common["num_hidden_layers"] = len(common["layer_types"])
    if family == "qwen3_5":
        return Qwen3_5TextConfig(**common)
    if family == "qwen3_next":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   mlp_only_layers=[1])
        return Qwen3NextConfig(**{**moe, **common})
    raise ValueError(family)


def tiny_hybrid_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hybrid_config(family, **overrides), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # incl. q/k norms, the gated norm and dt_bias
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):  # decisive routing: no near-ties flipped by rounding
                p.mul_(20.0)
            if ".linear_attn.in_proj" in name or ".linear_attn.conv1d" in name:  # O(1) q/k/v, gates and states
                p.mul_(6.0 if "in_proj" in name else 25.0)
            if name.endswith("A_log"):
                # Moderate decays (init draws A up to 16: a head then sees ~one token, its output q.k v is
                # often near zero, and the gated RMSNorm blows fp32 rounding up ~1e4x). Here a state spans
                # several tokens, as in trained checkpoints.
                p.copy_(torch.empty_like(p).uniform_(0.05, 0.5).log())
    return model


def random_ids(n: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, n), generator=g)


from tiny_checkpoint import long_docs, tiny_checkpoint, write_corpus  # noqa: E402,F401  (fixtures: model, long text)
# the vLLM tests' shared fixtures, registered here once: a session fixture imported into several test modules is a
# fixture of each module, and was built once per module (the tiny checkpoints and their maps five times)
from vllm_fixtures import (engines, smollm2_tuned, vllm_hybrid, vllm_lookback, vllm_tiny,  # noqa: E402,F401
                           vllm_tuned)


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
    out = {}
    for family in ("llama", "qwen2", "qwen3"):
        m = tiny_gguf.model(family)
        out[family] = (m, tiny_gguf.write(m, folder / f"tiny-{family}.gguf", family))
    return out


# --- running in parallel (pytest-xdist: `make test` runs two workers) ----------------------------------------------
# The tests that start vLLM engines, or use the session fixtures that fit maps for them (tests/vllm_fixtures.py), go
# to groups (`--dist loadgroup`), each run on one worker: the engine-pool tests (the pool's engines start once, in
# one process) and, for each other module, its vLLM tests (a module fixture, such as test_vllm_server.py's server,
# starts once). xdist sends the largest group first, the pool, and balances the rest over the workers. vLLM's
# automatic CPU binding is deterministic (here: 2 cores, one kept for its scheduler), so two engines side by side got
# the same core and ran slower than one group alone (measured); each xdist worker's engines and servers get cores of
# their own instead (vllm_cores), and torch in each worker runs on its share of the cores (pytest_configure). The
# session fixtures are built once per run (vllm_fixtures.built_once). Measured on 2 cores (a fresh clone, cold
# compile cache): one vLLM group 24 min 41 s of pytest; two groups, one core each, 21 min 49 s; the same after three
# tests were trimmed (CHANGELOG), 15 min 39 s; with the pool's forkserver 13 min 1 s; with one torch thread per
# worker 10 min 26 s (two threads per worker kept four spinning OpenMP threads on the two cores).
VLLM_FIXTURES = {"vllm_tiny", "vllm_lookback", "vllm_hybrid", "smollm2_tuned", "engines", "vllm_tuned"}


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
    threads, four spinning threads on two cores), and vLLM engines and servers started from it bind to that
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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the marks (it names the groups from them)
def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if VLLM_FIXTURES & fixtures:
            group = "vllm-pool" if "engines" in fixtures else f"vllm-{item.path.stem}"
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

