"""An entry of the plugin's private-surface table (backends/vllm/plugin/private.py READS) and its check against the installed
vLLM (vLLM imported only when checked): a `Read`'s names are a dataclass's or msgspec struct's fields, a class's
attributes (defined on it, or assigned by its methods: `self.x = ...`) or a module's names; a `Call`'s function or
method exists with the parameter names the plugin calls it with. `problem()` is the one-line refusal, or None.
"""

from __future__ import annotations

import dataclasses
import dis
import importlib
import inspect
import types
from typing import NamedTuple

from ridgefill.backends.vllm.config import VLLM_PIN


class Read(NamedTuple):
    """Names the plugin reads: fields or attributes of a class, or a module's own names."""

    module: str
    owner: str | None  # the class read; None: `names` are the module's own
    names: tuple[str, ...]
    why: str
    by: tuple[str, ...] = ()  # the functions of this module that read them

    def problem(self, seen: dict | None = None) -> str | None:
        """seen: classes already read by earlier entries of one check -> the names their methods assign."""
        found = available(self, {} if seen is None else seen)
        missing = [n for n in self.names if n not in found]
        if not missing:
            return None
        return (f"vLLM's {where(self)} has no {', '.join(missing)}, which ridgefill's vLLM plugin reads "
                f"({self.why}); this vLLM is not the release it was written for: {VLLM_PIN}")


class Call(NamedTuple):
    """A vLLM function (owner None) or method the plugin calls, with the parameter names it calls it with."""

    module: str
    owner: str | None
    name: str
    params: tuple[str, ...]
    why: str
    by: tuple[str, ...] = ()

    def problem(self, seen: dict | None = None) -> str | None:
        """seen: unused (a call's check reads no class's attributes); taken so that a check treats every entry
        alike."""
        found = parameter_names(self)
        if found == self.params:
            return None
        change = found if isinstance(found, str) else f"takes ({', '.join(found)})"
        return (f"vLLM's {where(self)}.{self.name} {change}, which ridgefill's vLLM plugin calls as "
                f"({', '.join(self.params)}) ({self.why}); this vLLM is not the release it was written for: "
                f"{VLLM_PIN}")


def where(read: Read | Call) -> str:
    return f"{read.module}.{read.owner}" if read.owner else read.module


def available(read: Read, seen: dict) -> set[str]:
    """The names `read` may use: the module's attributes, or its class's fields and attributes (seen: as in
    `assigned`)."""
    module = imported(read.module)
    if module is None:
        return set()
    if read.owner is None:
        return set(vars(module))
    owner = getattr(module, read.owner, None)
    if not isinstance(owner, type):
        return set()
    fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set()
    return fields | set(getattr(owner, "__struct_fields__", ())) | set(dir(owner)) | assigned(owner, seen)


def imported(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def parameter_names(call: Call) -> tuple[str, ...] | str:
    """The parameter names of `call`'s function in the installed vLLM, or what it is instead ("is missing", "is not
    a function")."""
    holder = imported(call.module)
    if holder is not None and call.owner is not None:
        holder = getattr(holder, call.owner, None)
        holder = holder if isinstance(holder, type) else None
    raw = None if holder is None else inspect.getattr_static(holder, call.name, None)
    function = getattr(raw, "__func__", raw)  # a classmethod's or staticmethod's function
    if function is None:
        return "is missing"
    if not callable(function):
        return "is not a function"
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return "is not a function"


def assigned(cls: type, seen: dict) -> set[str]:
    """The attribute names the methods of `cls` (and its bases) assign (`self.x = ...`), also through a decorator's
    wrapper. seen: class -> the names its own methods assign, filled here (the entries of one check share bases:
    torch's Module, vLLM's model runner: each is disassembled once per check)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass not in seen:
            seen[klass] = assigned_by(klass)
        names |= seen[klass]
    return names


def assigned_by(klass: type) -> set[str]:
    """The attribute names the methods defined on `klass` itself assign."""
    names: set[str] = set()
    for value in vars(klass).values():
        function = inspect.unwrap(getattr(value, "__func__", getattr(value, "fget", value)) or value)
        if isinstance(function, types.FunctionType):
            names |= _stored(function.__code__)
            names |= set().union(*(_stored(f.__code__) for f in _wrapped(function)))
    return names


def _wrapped(function: types.FunctionType) -> list[types.FunctionType]:
    """The functions a decorator's wrapper closes over (vLLM's support_torch_compile wraps a model's __init__)."""
    cells = function.__closure__ or ()
    return [c.cell_contents for c in cells if isinstance(c.cell_contents, types.FunctionType)]


def _stored(code: types.CodeType) -> set[str]:
    names = {i.argval for i in dis.get_instructions(code) if i.opname == "STORE_ATTR"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _stored(const)
    return names
