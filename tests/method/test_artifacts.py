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


def test_maps_read_into_private_memory_outlive_changes_to_the_file(tmp_path):
    """load_private: tensors that own their memory (no view of the file) and the sha256 of the bytes read; changing
    the file in place or truncating it afterwards changes nothing; bytes that hash otherwise than expected are
    refused with one line."""
    import hashlib

    from ridgefill.runtime.artifacts import load_private

    path = tmp_path / "m.safetensors"
    original = {"weight": torch.randn(3, 8, 8), "bias": torch.randn(3, 8)}
    save_artifact(path, original, {"artifact": "maps"})
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    tensors, meta, sha = load_private(path, "maps", digest)
    assert sha == digest and meta["artifact"] == "maps"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - 64)
        f.write(bytes(64))  # the last tensor's bytes, zeroed in place
    assert all(torch.equal(tensors[k], original[k]) for k in original)
    with open(path, "r+b") as f:
        f.truncate(16)
    assert all(torch.equal(tensors[k], original[k]) for k in original)  # no SIGBUS, no change
    save_artifact(path, {k: v + 1 for k, v in original.items()}, {"artifact": "maps"})
    with pytest.raises(RidgefillError, match=r"changed since it was checked \(sha256 [0-9a-f]{16}, expected "
                                             rf"{digest[:16]}\): leave it in place"):
        load_private(path, "maps", digest)
    path.write_bytes(b"\x08" + bytes(20))
    with pytest.raises(RidgefillError, match="corrupted or truncated"):
        load_private(path, "maps")
