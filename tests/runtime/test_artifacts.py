"""The streaming safetensors writer: what safetensors itself reads back, one part or only the metadata."""

import re

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


TRUNCATED_UNDER_A_READER = """
import sys, torch
from ridgefill.runtime.artifacts import load_artifact, read_meta, save_artifact
path = sys.argv[1]
original = {"s3.train.xtx": torch.randn(512, 512, dtype=torch.float64), "s3.train.counts": torch.tensor([4, 1, 0]),
            "s4.train.xtx": torch.randn(8, 8, dtype=torch.float64)}
save_artifact(path, original, {"artifact": "stats", "splits": [3, 4]})
whole, meta = load_artifact(path, "stats")
part, _ = load_artifact(path, "stats", prefix="s3.")
assert read_meta(path, "stats")["splits"] == [3, 4] and sorted(part) == ["s3.train.counts", "s3.train.xtx"]
with open(path, "r+b") as f:
    f.truncate(16)  # what a concurrent writer (or a full disk) does to the file under a running fit or key-scale
for read in (whole, part):
    assert all(torch.equal(read[k], original[k]) for k in read)
total = lambda tensors: sum(float(t.double().sum()) for t in tensors.values())
print("read", total(whole) == total(original))
"""


def test_statistics_read_into_private_memory_outlive_truncating_the_file(tmp_path):
    """load_artifact (statistics, one part of them, key-scale's maps) copies every tensor out of the file: truncating
    the file afterwards changes nothing for the reader (a tensor that viewed a mapping of the file would end the
    process with SIGBUS), in a process of its own so that a crash is seen as one."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TRUNCATED_UNDER_A_READER, str(tmp_path / "s.safetensors")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.strip() == "read True"


@pytest.mark.parametrize("dtype, value", [(torch.float32, float("inf")), (torch.float64, float("nan")),
                                          (torch.bfloat16, float("-inf")), (torch.float16, float("nan"))])
def test_a_tensor_with_a_nan_or_an_infinity_is_refused_before_anything_is_written(tmp_path, dtype, value):
    """save_artifact, which every writer of statistics and maps goes through, refuses a tensor that holds a NaN or
    an infinity as it would be stored, naming the file, the tensor, its dtype and the fix; nothing is written, not
    even the output's folder or a temporary."""
    bad = torch.ones(3, 4, dtype=dtype)
    bad[2, 1] = value
    out = tmp_path / "new" / "m.safetensors"
    ok = {"bias": torch.ones(3), "counts": torch.tensor([1, 2])}
    name = {torch.float32: "fp32", torch.float64: "float64", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    with pytest.raises(RidgefillError, match=rf"^{re.escape(str(out))} not written: weight holds a NaN or an "
                                             rf"infinity as {name}: refit with a larger --lam"):
        save_artifact(out, {**ok, "weight": bad}, {"artifact": "maps"})
    with pytest.raises(RidgefillError, match=r"weight holds .*: calibrate again from the start"):
        save_artifact(out, {**ok, "weight": bad}, {"artifact": "stats"})
    with pytest.raises(RidgefillError, match=r"weight holds .*: rerun it$"):
        save_artifact(out, {**ok, "weight": bad}, {"artifact": "maps"}, fix="rerun it")
    assert list(tmp_path.iterdir()) == []
    save_artifact(out, {**ok, "weight": bad.nan_to_num(0.0, 0.0, 0.0)}, {"artifact": "maps"})
    assert load_artifact(out, "maps")[0]["weight"].dtype == dtype


def test_a_value_that_overflows_the_writers_cast_is_refused(tmp_path):
    """Finite in float64, infinite once cast to fp32 (the dtype maps are stored in): what is checked is the tensor as
    it is stored."""
    big = torch.tensor([1.0, 1e285], dtype=torch.float64)
    assert bool(big.isfinite().all())
    with pytest.raises(RidgefillError, match="weight holds a NaN or an infinity as fp32"):
        save_artifact(tmp_path / "m.safetensors", {"weight": big.float()}, {"artifact": "maps"})
    assert list(tmp_path.iterdir()) == []
