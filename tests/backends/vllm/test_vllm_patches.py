"""The vLLM plugin's patches (backends/vllm/plugin/patch.py, patches.py) and private reads (backends/vllm/plugin/private.py): each
patch against a stand-in target (applied once, the original kept and restored, a changed or missing target refused
in one line naming it), the real list and reads against the installed vLLM, and the one line a vLLM that changed a
target gives `ridgefill serve` (no engine started)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from helpers import PLUGIN_PROBE_HEAD, plugin_startup_line
from ridgefill.errors import RidgefillError
from ridgefill.backends.vllm.plugin.patch import Patch, apply_patches
from ridgefill.backends.vllm.plugin.private import READS, Read, check_reads

STAND_IN = "ridgefill_test_stand_in"


def stand_in_module(monkeypatch) -> types.ModuleType:
    """A module holding a class `Target` with a method, a classmethod and an attribute its __init__ assigns."""
    module = types.ModuleType(STAND_IN)

    class Target:
        def __init__(self):
            self.assigned_here = 1

        def step(self, request, size=1):
            return ("stock", request, size)

        @classmethod
        def build(cls, request):
            return ("built", cls.__name__, request)

    module.Target = Target
    monkeypatch.setitem(sys.modules, STAND_IN, module)
    return module


class StepPatch(Patch):
    module, owner, attribute, params, why = STAND_IN, "Target", "step", ("self", "request", "size"), "a test"

    def wrap(self, original):
        def step(target, request, size=1):
            return ("patched", *original(target, request, size))

        return step


class BuildPatch(Patch):
    module, owner, attribute, params, why = STAND_IN, "Target", "build", ("cls", "request"), "a test"
    is_classmethod = True

    def wrap(self, original):
        def build(cls, request):
            return ("patched", *original(cls, request))

        return build


def test_a_patch_wraps_its_target_keeps_the_original_and_restores_it(monkeypatch):
    module = stand_in_module(monkeypatch)
    stock = module.Target.step
    patch = StepPatch()
    assert not patch.applied()
    patch.apply()
    assert patch.applied() and module.Target._ridgefill_stock_step is stock
    assert module.Target().step("r", 2) == ("patched", "stock", "r", 2)
    patch.restore()
    assert module.Target.step is stock and not patch.applied()
    assert module.Target().step("r") == ("stock", "r", 1)


def test_a_classmethod_patch_stays_a_classmethod(monkeypatch):
    module = stand_in_module(monkeypatch)
    BuildPatch().apply()
    assert module.Target.build("r") == ("patched", "built", "Target", "r")
    BuildPatch().restore()
    assert module.Target.build("r") == ("built", "Target", "r")


def test_a_patch_is_applied_once_and_restored_only_when_applied(monkeypatch):
    stand_in_module(monkeypatch)
    with pytest.raises(RidgefillError, match="is not patched: nothing to restore"):
        StepPatch().restore()
    StepPatch().apply()
    with pytest.raises(RidgefillError) as err:
        StepPatch().apply()
    assert str(err.value).startswith(f"{STAND_IN}.Target.step is already patched") and "\n" not in str(err.value)


@pytest.mark.parametrize("change, problem", [
    (lambda m: setattr(m.Target, "step", lambda self, req, size=1: None), "takes (self, req, size)"),
    (lambda m: delattr(m.Target, "step"), "is missing"),
    (lambda m: setattr(m.Target, "step", classmethod(lambda cls, request, size: None)), "is a classmethod now"),
    (lambda m: setattr(m.Target, "step", 3), "is a int, not a function"),
    (lambda m: delattr(m, "Target"), f"{STAND_IN} has no class Target"),
])
def test_a_changed_or_missing_target_is_refused_in_one_line_naming_it(monkeypatch, change, problem):
    module = stand_in_module(monkeypatch)
    change(module)
    with pytest.raises(RidgefillError) as err:
        StepPatch().apply()
    message = str(err.value)
    assert message.startswith(f"vLLM's {STAND_IN}.Target.step {problem}: ridgefill's vLLM plugin patches it as "
                              "(self, request, size) (a test)") and "pip install" in message and "\n" not in message


def test_a_missing_module_is_refused_in_one_line(monkeypatch):
    class Gone(StepPatch):
        module = "ridgefill_test_no_such_module"

    with pytest.raises(RidgefillError, match=r"^vLLM's ridgefill_test_no_such_module.Target.step its module cannot"):
        Gone().apply()


def test_the_plugin_list_is_checked_whole_before_the_first_patch_and_applied_once(monkeypatch):
    module = stand_in_module(monkeypatch)
    stock = module.Target.step
    module.Target.build = classmethod(lambda cls, req: None)  # the second target changed
    with pytest.raises(RidgefillError, match="build takes \\(cls, req\\)"):
        apply_patches([StepPatch(), BuildPatch()])
    assert module.Target.step is stock  # nothing patched
    del module.Target.build
    apply_patches([StepPatch()])
    apply_patches([StepPatch()])  # vLLM loads the plugin more than once per process: left as it is
    assert module.Target().step("r") == ("patched", "stock", "r", 1)


def test_a_read_finds_fields_class_attributes_assigned_attributes_and_module_names(monkeypatch):
    module = stand_in_module(monkeypatch)

    @dataclasses.dataclass
    class Meta:
        block_table: int = 0

    module.Meta = Meta
    module.helper = len
    check_reads([Read(STAND_IN, "Meta", ("block_table",), "x"), Read(STAND_IN, "Target", ("assigned_here", "step"),
                 "x"), Read(STAND_IN, None, ("helper",), "x")])
    with pytest.raises(RidgefillError) as err:
        check_reads([Read(STAND_IN, "Target", ("step", "gone", "also_gone"), "the runner's step")])
    assert str(err.value).startswith(f"vLLM's {STAND_IN}.Target has no gone, also_gone, which ridgefill's vLLM "
                                     "plugin reads (the runner's step)") and "\n" not in str(err.value)
    with pytest.raises(RidgefillError, match=f"^vLLM's {STAND_IN}.Missing has no x"):
        check_reads([Read(STAND_IN, "Missing", ("x",), "x")])


vllm = pytest.importorskip("vllm")


def test_every_patch_target_of_the_plugin_is_in_the_installed_vllm_as_expected():
    from ridgefill.backends.vllm.plugin.patches import PATCHES, plugin_patches
    from ridgefill.backends.vllm.config import VLLM_VERSION

    assert vllm.__version__ == VLLM_VERSION
    patches = plugin_patches(None)
    assert len({p.target for p in patches}) == len(PATCHES) == 5
    for patch in patches:
        assert callable(patch.original()) and patch.why and not patch.applied()


def test_every_private_read_of_the_plugin_is_in_the_installed_vllm():
    check_reads()
    assert len(READS) >= 10


PROBE = PLUGIN_PROBE_HEAD + r"""
from vllm.v1.core.kv_cache_manager import KVCacheManager
del KVCacheManager.get_computed_blocks  # as a vLLM release that renamed it
from ridgefill.backends.vllm.plugin.entry import register
register()
"""


def test_a_vllm_without_a_patch_target_fails_start_up_with_one_line_naming_it(tmp_path):
    """The plugin's refusal reaches `ridgefill serve` as its other start-up refusals do: a RidgefillError in vLLM's
    log, which serve turns into one line (process.startup_error)."""
    line = plugin_startup_line(PROBE, tmp_path)
    assert line.startswith("vLLM's vllm.v1.core.kv_cache_manager.KVCacheManager.get_computed_blocks is missing: "
                           "ridgefill's vLLM plugin patches it as (self, request)"), line
