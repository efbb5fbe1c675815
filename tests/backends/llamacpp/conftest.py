"""The tiny GGUF files every llama.cpp test module uses, written once per test session (per pytest worker)."""

from __future__ import annotations

import pytest

import tiny_gguf


@pytest.fixture(scope="session")
def tiny_ggufs(tmp_path_factory):
    """family -> (transformers model, its GGUF file)."""
    folder = tmp_path_factory.mktemp("gguf")
    out = {}
    for family in ("llama", "qwen2", "qwen3"):
        m = tiny_gguf.model(family)
        out[family] = (m, tiny_gguf.write(m, folder / f"tiny-{family}.gguf", family))
    return out
