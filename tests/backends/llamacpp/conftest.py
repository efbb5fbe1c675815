"""The llama.cpp tests run only where the patched llama-cpp-python is installed (`make install` builds it)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_ggufs(tmp_path_factory):
    """family -> (transformers model, its GGUF file), written once per session."""
    import tiny_gguf

    folder = tmp_path_factory.mktemp("gguf")
    out = {}
    for family in ("llama", "qwen2", "qwen3"):
        model = tiny_gguf.model(family)
        out[family] = (model, tiny_gguf.write(model, folder / f"tiny-{family}.gguf", family))
    return out
