"""The streaming safetensors writer: what safetensors itself reads back, one part or only the metadata."""

import pytest
import torch
from safetensors.torch import load_file

from ridgefill.errors import RidgefillError
from ridgefill.runtime.artifacts import load_artifact, read_meta, save_artifact


def tensors():
    return {"s3.train.xty": torch.randn(2, 5, 5, dtype=torch.float64), "s3.train.counts": torch.tensor([4, 1, 0]),
            "s3.train.xx": torch.tensor(2.5, dtype=torch.float64), "s4.val.x": torch.randn(6, 4)[:, ::2],
            "half": torch.randn(7).bfloat16(), "empty": torch.zeros(0, 3), "flags": torch.tensor([True, False])}


def test_written_file_is_read_back_by_safetensors_exactly(tmp_path):
    path, original = tmp_path / "a.safetensors", tensors()
    save_artifact(path, original, {"artifact": "stats", "splits": [3]})
    for read in (load_file(path), load_artifact(path, "stats")[0]):
        assert read.keys() == original.keys()
        assert all(torch.equal(read[k], original[k]) for k in original)
    assert read_meta(path, "stats")["splits"] == [3] and "ridgefill_version" in read_meta(path, "stats")


def test_a_prefix_reads_one_part(tmp_path):
    path = tmp_path / "a.safetensors"
    save_artifact(path, tensors(), {"artifact": "stats"})
    assert sorted(load_artifact(path, "stats", prefix="s3.")[0]) == ["s3.train.counts", "s3.train.xty", "s3.train.xx"]


def test_truncated_and_foreign_files_are_one_line(tmp_path):
    path = tmp_path / "a.safetensors"
    save_artifact(path, tensors(), {"artifact": "maps"})
    with pytest.raises(RidgefillError, match="not a ridgefill stats file"):
        read_meta(path, "stats")
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(RidgefillError, match="corrupted or truncated"):
        load_artifact(path, "maps")
