"""The vLLM backend's own logic that needs no vLLM engine: the model read without its weights, and the prompts
whose prompt log-probs give every scored target (loss's exact rows), the cores its workers bind to."""

from __future__ import annotations

import os

import pytest

from ridgefill.backends.vllm.backend import VllmBackend, covering_prompts, worker_threads
from ridgefill.commands import command


def test_covering_prompts_give_each_target_once_after_its_own_rows():
    """Targets that are the sequence's next tokens share one prompt; a target that is not (a window's last target,
    past its rows) gets a prompt of its own rows and itself. Every target is read at the position after its row,
    after exactly the sequence's rows up to it."""
    batch = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]]
    rows = [2, 3, 4]
    targets = [[13, 14, 15], [23, 99, 25]]  # the second sequence's middle target is not its next token
    found = covering_prompts(batch, rows, targets)
    assert [p for p, _ in found] == [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25], [20, 21, 22, 23, 99]]
    cells = sorted(cell for _, cs in found for cell in cs)
    assert cells == [(0, 0, 3), (0, 1, 4), (0, 2, 5), (1, 0, 3), (1, 1, 4), (1, 2, 5)]
    for prompt, cs in found:
        for b, j, at in cs:
            assert prompt[at] == targets[b][j] and prompt[:at] == batch[b][: rows[j] + 1]


def test_the_vllm_backend_reads_the_model_without_its_weights(tiny_checkpoint, monkeypatch, tmp_path):
    """--engine vllm reads the model's identity, shape and tokenizer here, and loads no weights (vLLM loads its
    own): the plans of every variant it serves are built on that."""
    import ridgefill.runtime.models as models
    from ridgefill.method.fill import FillSettings
    from ridgefill.runtime.session import open_session

    pytest.importorskip("vllm")
    loaded = open_session(str(tiny_checkpoint))

    def no_weights(*args, **kwargs):
        raise AssertionError("the model's weights were loaded")

    monkeypatch.setattr(models, "load_model", no_weights)
    config = command("loss").make(model=str(tiny_checkpoint), engine="vllm", data="wiki-leads", out=tmp_path / "x")
    backend = VllmBackend(config)
    facts = backend.model
    assert facts.shape == loaded.shape and facts.context_length == loaded.context_length
    assert facts.fingerprint == loaded.fingerprint and facts.model_info["weights_hash"] == loaded.fingerprint
    assert facts.tokenizer("the king")["input_ids"] == loaded.tokenizer("the king")["input_ids"]
    plan, _ = FillSettings("identity", 2, tail=8).plan(facts)
    assert plan.split == 2 and int((~plan.full_rows(40)).sum()) == 40 - 8 - 1


def test_the_engines_bind_to_threads_else_the_operators_binding_else_every_core(monkeypatch):
    """--threads N binds cores 0..N-1; without it an operator's VLLM_CPU_OMP_THREADS_BIND is kept (it was overridden
    with every core, so two workers side by side spun on the same cores); else every core."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert worker_threads(2, {"VLLM_CPU_OMP_THREADS_BIND": "3"}) == "0-1"
    assert worker_threads(0, {"VLLM_CPU_OMP_THREADS_BIND": "2,3"}) == "2,3"
    assert worker_threads(0, {}) == worker_threads(0, {"VLLM_CPU_OMP_THREADS_BIND": ""}) == "0-3"
