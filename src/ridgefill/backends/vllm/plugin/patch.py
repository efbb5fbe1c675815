"""One patch of a vLLM attribute, checked before it is applied (no vLLM import: the target is named by its module
path, class and attribute, and imported when the patch is checked).

A patch replaces `owner.attribute` of a class in `module` with a wrapper built around the original (`wrap`). At
apply time it checks that the target exists and that its parameter names are exactly `params` (what the wrapper
was written against): a vLLM release that renamed, moved or re-signed it fails start-up with one line naming the
target and what changed, never a silently stock engine or an error deep inside a step. The original is kept on the
owner class (`stock_name`), which marks the class as patched: applying a patch twice is refused, and `restore`
puts the original back.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from ridgefill.errors import RidgefillError
from ridgefill.backends.vllm.config import VLLM_PIN


class Patch:
    module: str = ""  # the target's module path, e.g. vllm.v1.request
    owner: str = ""  # the class in that module
    attribute: str = ""  # the patched attribute of that class
    params: tuple[str, ...] = ()  # the original's parameter names, as the wrapper calls it
    is_classmethod: bool = False  # the attribute is a classmethod (the wrapper is installed as one)
    why: str = ""  # what the patch is for (docs/serving.md lists it)

    def __init__(self, fill: Any = None) -> None:
        self.fill = fill  # the served fill (method/fill.FillSettings), for wrappers that need it

    @property
    def target(self) -> str:
        return f"{self.module}.{self.owner}.{self.attribute}"

    @property
    def stock_name(self) -> str:
        return f"_ridgefill_stock_{self.attribute}"

    def wrap(self, original: Callable) -> Callable:
        """The replacement of the original function (for a classmethod: its underlying function)."""
        raise NotImplementedError

    def owner_class(self) -> type:
        """The class that holds the target; a missing module or class is a one-line RidgefillError."""
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:
            raise self.error(f"its module cannot be imported ({exc})") from None
        owner = getattr(module, self.owner, None)
        if not isinstance(owner, type):
            raise self.error(f"{self.module} has no class {self.owner}")
        return owner

    def applied(self) -> bool:
        return self.stock_name in vars(self.owner_class())

    def original(self) -> Callable:
        """The function the patch wraps, checked: present, of the expected kind and parameter names."""
        owner = self.owner_class()
        raw = inspect.getattr_static(owner, self.attribute, None)
        if raw is None:
            raise self.error("is missing")
        if self.is_classmethod != isinstance(raw, classmethod):
            raise self.error(f"is {'not ' if self.is_classmethod else ''}a classmethod now")
        function = raw.__func__ if isinstance(raw, classmethod) else raw
        if not callable(function):
            raise self.error(f"is a {type(function).__name__}, not a function")
        try:
            names = tuple(inspect.signature(function).parameters)
        except (TypeError, ValueError) as exc:
            raise self.error(f"has no readable signature ({exc})") from None
        if names != self.params:
            raise self.error(f"takes ({', '.join(names)})")
        return function

    def apply(self) -> None:
        """Check the target and replace it with the wrapper; the original is kept on the owner class."""
        owner = self.owner_class()
        if self.stock_name in vars(owner):
            raise RidgefillError(f"{self.target} is already patched by ridgefill's vLLM plugin: a patch is applied "
                                 "once per process (restore it first)")
        function = self.original()
        wrapper = self.wrap(function)
        setattr(owner, self.stock_name, function)
        setattr(owner, self.attribute, classmethod(wrapper) if self.is_classmethod else wrapper)

    def restore(self) -> None:
        """Put the original back (a patch not applied is refused)."""
        owner = self.owner_class()
        if self.stock_name not in vars(owner):
            raise RidgefillError(f"{self.target} is not patched: nothing to restore")
        function = vars(owner)[self.stock_name]
        setattr(owner, self.attribute, classmethod(function) if self.is_classmethod else function)
        delattr(owner, self.stock_name)

    def error(self, problem: str) -> RidgefillError:
        expected = f"({', '.join(self.params)})"
        return RidgefillError(f"vLLM's {self.target} {problem}: ridgefill's vLLM plugin patches it as {expected} "
                              f"({self.why}); this vLLM is not the release it was written for: {VLLM_PIN}")


def apply_patches(patches: list[Patch]) -> None:
    """Apply every patch not applied yet in this process (vLLM may load the plugin more than once), checking every
    target before the first is applied, so a vLLM that changed one fails start-up with nothing patched."""
    pending = [p for p in patches if not p.applied()]
    for patch in pending:
        patch.original()
    for patch in pending:
        patch.apply()
