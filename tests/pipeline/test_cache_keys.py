"""A recipe's cache keys (pipeline/run.task_key): every option as the command will run it, defaults included, and the
code that makes the artifact; the manifest records that code per step. No model is loaded."""

from __future__ import annotations

from pathlib import Path

from ridgefill.commands import command
from ridgefill.pipeline.plan import plan
from ridgefill.pipeline.recipe import load_recipe
from ridgefill.pipeline.run import task_key
from ridgefill.runtime.provenance import code_hash

BASE = 'name = "keys"\nmodel = "smollm2-135m"\ndata = "wiki-leads"\nsplits = 18\ntails = 64\n[calibrate]\n[fit]\n'


def keys(tmp_path: Path, text: str, code: str = "c0de") -> dict[str, str]:
    path = tmp_path / f"r{abs(hash(text))}.toml"
    path.write_text(text)
    out = {}
    for task in plan(load_recipe(path)):
        out[task.label] = task_key(task, command(task.step), "w31ght5", out.get(task.needs), code)
    return out


def test_stating_a_default_gives_the_key_of_leaving_it_out(tmp_path):
    plain = keys(tmp_path, BASE + "[loss]\n")
    stated = keys(tmp_path, BASE.replace("[calibrate]\n[fit]\n", "[calibrate]\nholdout = 0.1\nlookback = 0\n[fit]\n"
                                         "targets = \"raw\"\n")
                  + "[loss]\nsamples = 16\noutlier-factor = 20\nkeep-first = 1\n")
    assert stated == plain
    changed = keys(tmp_path, BASE + "[loss]\nsamples = 17\n")
    assert changed["calibrate"] == plain["calibrate"] and changed["loss-s18-t64-seed0"] != \
        plain["loss-s18-t64-seed0"]


def test_another_default_or_other_code_gives_another_key(tmp_path, monkeypatch):
    """A pull that changes a default (what the task would run with) or any source file changes every key."""
    plain = keys(tmp_path, BASE + "[loss]\n")
    from ridgefill.evals.loss import LossConfig

    field = LossConfig.__dataclass_fields__["samples"]
    monkeypatch.setattr(field, "default", 12)
    assert keys(tmp_path, BASE + "[loss]\n")["loss-s18-t64-seed0"] != plain["loss-s18-t64-seed0"]
    monkeypatch.undo()
    other = keys(tmp_path, BASE + "[loss]\n", code="other")
    assert all(other[k] != plain[k] for k in plain)


def test_the_code_hash_is_the_package_source(tmp_path, monkeypatch):
    import ridgefill.runtime.provenance as provenance

    first = code_hash()
    assert first == code_hash() and len(first) == 16
    fake = tmp_path / "pkg" / "runtime"
    fake.mkdir(parents=True)
    (fake / "provenance.py").write_text("x = 1\n")
    (fake.parent / "a.py").write_text("y = 2\n")
    monkeypatch.setattr(provenance, "__file__", str(fake / "provenance.py"))
    one = code_hash()
    (fake.parent / "a.py").write_text("y = 3\n")
    assert code_hash() != one != first
