"""tests/gpu: torchfill's runner on a CUDA GPU against float32 references (bf16 error bounds, not equality). Every
test in this folder is marked to skip unless torch sees a CUDA GPU, so CI (CPU only) collects and skips them, visibly
(`pytest -rs` names the reason). scripts/gpu_check.sh runs them on a GPU machine.

The folder is a package (tests/gpu/__init__.py) so that this conftest is `gpu.conftest`, beside tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
NO_GPU = "no CUDA GPU visible: tests/gpu run on a GPU machine (scripts/gpu_check.sh)"


def pytest_collection_modifyitems(config, items):
    """Mark this folder's tests skip-unless-CUDA (the hook sees the whole session's items: only ours are marked)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)


@pytest.fixture
def fp32_reference():
    """Float32 references computed in full float32 (no TF32 in matmuls or cuDNN), restored afterwards."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
