"""Fixtures of the vLLM tests: tiny checkpoints of each dense family that vLLM's CPU backend can serve (head size
32), with maps fitted for them here, and maps for the embedded SmolLM2. Skipped where vLLM is not installed."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tiny_models import save_tiny_checkpoint, write_corpus

DENSE = ("llama", "qwen2", "qwen3")
SPLIT = 2  # of 6 layers
# YaRN over the whole 4096-token context (the unit tests' 128 x 4 = 512 ends inside vLLM's 2048-token tests)
QWEN3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "original_max_position_embeddings": 128}


def prompts(n: int, lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of random token ids (3..vocab-1), their lengths cycling through `lengths`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def vocab_of(folder) -> int:
    import json

    return json.loads((folder / "config.json").read_text())["vocab_size"]


def reference(folder, maps, tail: int, batch: list[list[int]], new: int, keep_first: int = 1, chunk: int = 2048,
              dtype: str = "fp32"):
    """torchfill (what `ridgefill generate` runs): greedy tokens and first-token log-probs [V]
    (maps None: exact)."""
    import torch

    from ridgefill.method.fill import FillSettings
    from ridgefill.runtime.session import open_session

    session = open_session(str(folder), chunk=chunk, dtype=dtype)
    plan = None if maps is None else FillSettings("ridge", None, Path(maps), tail, keep_first).plan(session)[0]
    tokens, first = [], []
    for p in batch:
        ids = torch.tensor([p])
        result = session.runner.generate(ids, new, plan, None)
        tokens.append(result.tokens[0])
        first.append(torch.log_softmax(result.prefill.logits[0, -1].double(), -1))
    return tokens, first


def fit_maps(model: str, data: Path, out: Path, split: int, tokens: int, seq_len: int, lookback: int = 0) -> Path:
    from ridgefill.method.calibrate import COMMAND as calibrate
    from ridgefill.method.fit import COMMAND as fit

    calibrate(model=model, data=str(data), split=str(split), tokens=tokens, seq_len=seq_len,
              out=out / "stats.safetensors", holdout=0.25, lookback=lookback)
    fit(stats=out / "stats.safetensors", out=out / "maps.safetensors", split=split)
    return out / "maps.safetensors"


def sharpen(folder: Path, scale: float = 12.0, offset: float = 0.0) -> Path:
    """Scale the final norm of a random-init checkpoint: its next-token distribution is otherwise so flat that
    greedy decoding hangs on near-ties that any change of summation order flips. offset: the norm's own (Qwen3-Next
    scales by 1 + weight: offset 1)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = (tensors["model.norm.weight"] + offset) * scale - offset
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def built_once(tmp_path_factory, name: str, build):
    """build(folder) -> its result (paths), run once per test run: pytest-xdist's workers share one folder under the
    run's base temporary folder, the first builds in it while the others wait on a lock and read its result (each
    worker had built its own copy: the same calibrations and fits twice). Without xdist, a fresh folder."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp(name))
    import fcntl
    import pickle

    root = tmp_path_factory.getbasetemp().parent / name  # the run's folder, above each worker's own
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        result = root / "result.pickle"
        if not result.exists():
            if root.exists():
                pytest.fail(f"building {name} failed in another pytest-xdist worker: see its error")
            root.mkdir()
            result.write_bytes(pickle.dumps(build(root)))
        return pickle.loads(result.read_bytes())


@pytest.fixture(scope="session")
def vllm_tiny(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (checkpoint folder, maps at split 2)."""
    pytest.importorskip("vllm")
    return built_once(tmp_path_factory, "vllm-tiny", tiny_checkpoints)


def tiny_checkpoints(root: Path) -> dict[str, tuple[Path, Path]]:
    data = write_corpus(root / "corpus.txt", seed=3, lines_per_document=30)
    out = {}
    for family in DENSE:
        extra = {"rope_parameters": QWEN3_ROPE} if family == "qwen3" else {}
        folder = sharpen(save_tiny_checkpoint(root / family, family, hidden_size=128, intermediate_size=256,
                                              head_dim=32, **extra))
        work = root / f"{family}-maps"
        work.mkdir()
        out[family] = (folder, fit_maps(str(folder), data, work, SPLIT, tokens=4096, seq_len=256))
    return out


HYBRID_SPLIT = 4  # of 8 layers (linear, linear, linear, attention, twice): the late layers hold both kinds


@pytest.fixture(scope="session")
def vllm_hybrid(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny Qwen3-Next checkpoint in bf16 with shapes vLLM's CPU kernels take: head_dim 64, Gated DeltaNet head
    dims 64; untied embeddings, as vLLM's Qwen3-Next loads them; maps at split 4 of 8, fitted, then perturbed: on
    this random model the fitted maps' fill is within bf16 rounding of exact prefill, so it would hide a wrong fill;
    the perturbed maps move the first token's log-probs by 1-2.3 nats at tail 4, measured)."""
    pytest.importorskip("vllm")
    return built_once(tmp_path_factory, "vllm-hybrid", hybrid_checkpoint)


def hybrid_checkpoint(root: Path) -> tuple[Path, Path]:
    import torch

    from tiny_models import A, L

    folder = sharpen(save_tiny_checkpoint(root / "qwen3_next", "qwen3_next", dtype=torch.bfloat16, hidden_size=128,
                                          intermediate_size=256, layer_types=[L, L, L, A] * 2, head_dim=64,
                                          linear_key_head_dim=64, linear_value_head_dim=64, moe_intermediate_size=64,
                                          shared_expert_intermediate_size=96, tie_word_embeddings=False), offset=1.0)
    data = write_corpus(root / "corpus.txt", seed=3, lines_per_document=30)
    work = root / "maps"
    work.mkdir()
    fitted = fit_maps(str(folder), data, work, HYBRID_SPLIT, tokens=4096, seq_len=256)
    return folder, perturbed(fitted, work / "perturbed.safetensors")


def perturbed(maps: Path, out: Path) -> Path:
    """The maps with a random term (std 2/sqrt(H)) added to every weight: predictions that still depend on the row,
    far from the fitted ones."""
    import torch

    from ridgefill.runtime.artifacts import load_artifact, save_artifact

    tensors, meta = load_artifact(maps, "maps")
    weight = tensors["weight"]
    g = torch.Generator().manual_seed(0)
    tensors["weight"] = weight + 2 * torch.randn(weight.shape, generator=g) / weight.shape[-1] ** 0.5
    save_artifact(out, tensors, meta)
    return out


@pytest.fixture(scope="session")
def vllm_lookback(vllm_tiny, tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny llama checkpoint, maps at split 2 with lookback 1, fitted on the same text)."""
    folder, _ = vllm_tiny["llama"]

    def build(work: Path) -> tuple[Path, Path]:
        data = write_corpus(work / "corpus.txt", seed=3, lines_per_document=30)
        return folder, fit_maps(str(folder), data, work, SPLIT, tokens=4096, seq_len=256, lookback=1)

    return built_once(tmp_path_factory, "vllm-lookback", build)


@pytest.fixture(scope="session")
def smollm2_tuned(tmp_path_factory) -> tuple[Path, Path]:
    """(the embedded SmolLM2 folder, the serving config `ridgefill tune` wrote for it: ridge at split 15, tail 64,
    its maps fitted on 2,048 tokens of wiki-leads; the serve tests compare the server with torchfill on the
    same maps, so the maps need not be good, only real)."""
    pytest.importorskip("vllm")
    from ridgefill.commands import command
    from ridgefill.runtime.models import model_folder

    def build(root: Path) -> tuple[Path, Path]:
        config = root / "serving.json"
        command("tune")(model="smollm2-135m", data="wiki-leads", splits="15", variants="ridge", tail=64, tokens=2048,
                        seq_len=512, holdout=0.25, lengths="320", tasks="niah_single_1", samples=1, max_new_tokens=4,
                        nll_check=False, out_dir=root / "run", config_out=config)
        return Path(model_folder("smollm2-135m")), config

    return built_once(tmp_path_factory, "smollm2-tuned", build)


class WorkerPool:
    """vLLM workers shared by the tests of a session, keyed by their settings (model, fill, options): a test asks
    for the worker it needs and gets a running one when an earlier test started it. At most `alive` workers run at
    once (the least recently used is closed first), so the tests that share a worker sit next to each other.
    Tests that share a worker read its tally as a difference (`tally_delta`): the worker has served others."""

    def __init__(self, alive: int = 3) -> None:
        self.alive = alive
        self.workers: dict[str, object] = {}  # key -> VllmWorker, least recently used first
        self.started = 0

    def get(self, settings):
        import dataclasses
        import json

        from ridgefill.backends.vllm.worker import VllmWorker

        key = json.dumps(dataclasses.asdict(settings), sort_keys=True, default=str)
        if key in self.workers:
            self.workers[key] = self.workers.pop(key)  # most recently used
            return self.workers[key]
        while len(self.workers) >= self.alive:
            self.workers.pop(next(iter(self.workers))).close()
        self.workers[key] = VllmWorker(settings)  # forked from the process's vLLM forkserver (worker_context)
        self.started += 1
        return self.workers[key]

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()


@pytest.fixture(scope="session")
def workers(request):
    """The session's WorkerPool; at the end, the number of workers it started is written to the terminal."""
    pytest.importorskip("vllm")
    pool = WorkerPool()
    yield pool
    pool.close()
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"vLLM workers started by the worker pool: {pool.started}")


def tally_delta(worker, run):
    """(run(), what the worker's tally counted while it ran)."""
    before = worker.tally()
    out = run()
    after = worker.tally()
    return out, {k: after[k] - before[k] for k in after}


# --- comparing completions where arithmetic is not invariant ---------------------------------------------------
def diverge(a, b) -> int:
    """The index of the first token where two completions differ (-1: none)."""
    return next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), -1)


def reference_parting(got, want) -> tuple[int, float] | None:
    """Where `got` (anything with tokens) first leaves the completion `want` (None: never, over the shorter of the
    two) and how near a tie `want` was there: its best log-prob minus its log-prob of the token `got` took (inf where
    that token is not among its top tokens; `want` needs logprobs >= 2)."""
    step = diverge(got, want)
    if step < 0:
        return None
    top = want.top[step]
    taken = top.get(got.tokens[step])
    return step, math.inf if taken is None else max(top.values()) - taken


def top2_gap(completion, step: int = 0) -> float:
    """The gap between the two best log-probs of a completion's step (inf with one)."""
    best = sorted(completion.top[step].values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else math.inf


def assert_parts_only_at_near_ties(what: str, got, want, near_tie: float) -> list:
    """Each completion equals its reference, or parts from it only where the reference's log-probs make the token it
    took a near tie with the reference's own (a gap under `near_tie`): what arithmetic that is not invariant (bf16
    batching, chunking, another implementation) may swap on another CPU, while a wrong fill moves the tokens far from
    any tie. The partings (step, gap) by request (None where none) are printed and returned."""
    partings = [reference_parting(g, w) for g, w in zip(got, want)]
    print(f"{what}: {partings.count(None)} of {len(partings)} equal; partings (request, (step, gap)): "
          f"{[(i, p) for i, p in enumerate(partings) if p is not None]}")
    far = [(i, p) for i, p in enumerate(partings) if p is not None and p[1] >= near_tie]
    assert not far, f"{what}: requests part from the reference away from a near tie (request, (step, gap)): {far}"
    return partings


def gap_before_parting(got, want) -> float:
    """Largest |log p| difference of the chosen tokens over the steps before each pair parts."""
    gaps = []
    for g, w in zip(got, want):
        step, pairs = diverge(g, w), list(zip(g.logprobs, w.logprobs))
        gaps += [abs(a - b) for a, b in (pairs if step < 0 else pairs[:step])]
    return max(gaps, default=0.0)


@pytest.fixture(scope="session")
def vllm_tuned(vllm_tiny, tmp_path_factory) -> dict[str, Path]:
    """variant -> the serving config `ridgefill tune` wrote for the tiny llama that vLLM serves: identity and ridge,
    each tuned alone (tail 32, RULER only: a random model's scores are flat, so the lowest candidate is served)."""
    from ridgefill.commands import command

    folder, _ = vllm_tiny["llama"]

    def build(root: Path) -> dict[str, Path]:
        data = write_corpus(root / "text.txt", seed=5, lines_per_document=40)
        out = {}
        for variant in ("identity", "ridge"):
            out[variant] = root / f"{variant}.json"
            command("tune")(model=str(folder), data=str(data), splits="2-3", variants=variant, tail=32, tokens=2048,
                            seq_len=128, holdout=0.25, lengths="320", tasks="niah_single_1", samples=1,
                            max_new_tokens=4, nll_check=False, out_dir=root / "run", config_out=out[variant])
        return out

    return built_once(tmp_path_factory, "vllm-tune", build)
