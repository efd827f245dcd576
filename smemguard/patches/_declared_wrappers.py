"""A library module's wrappers declared re-runnable for smemguard, as their author would declare them.

Shared by the packs for libraries whose wrappers choose a kernel's tiles (``sglang_extend_attention``,
``sglang_prefill_attention``): each describes its module here, and the public mechanism
(``engine.wrapper_tiles``: ``tile_choice`` or ``tiles_at_launch``, and ``rerun_on_overflow``) does the rest,
exactly as for a library that declares its own wrappers. The knowledge that makes smaller tiles safe lives in each
pack's docstring.

Layers: the declared attribute (the module's tile choice function, or its kernel) and each wrapper, here and in
the modules that imported them by name. Both are built to do nothing once the guard is uninstalled (a declared
wrapper reads the installed settings at each call).
"""

from __future__ import annotations

import inspect
import sys
from types import ModuleType
from typing import Any, Callable

from ..engine.wrapper_tiles import rerun_on_overflow
from . import Layer, Patch


class DeclaredWrappers(Patch):
    """``module``'s ``wrappers``, declared re-runnable with the declaration ``declare(module, original)`` builds
    over ``module.declared`` (what the wrappers choose their tiles with). ``check(module)`` raises when the module
    is not laid out as the versions the pack was checked against. ``fallbacks``: per wrapper, the name in
    :mod:`smemguard.fallbacks` of the torch computation of its result for calls where not even the smallest tiles
    fit, taking the wrapper's parameters by name. ``target`` names what it patches (default: the declared
    attribute). ``name``, ``supported`` and ``checked`` are the patch's contract
    (:class:`smemguard.patches.Patch`); it patches the declared attribute, and never in observe mode (it changes
    the tiles that run)."""

    def __init__(self, name: str, *, supported, checked: tuple[str, ...], module: str, declared: str,
                 declare: Callable[[ModuleType, Any], Any], wrappers: tuple[str, ...],
                 check: Callable[[ModuleType], None], fallbacks: dict[str, str] | None = None,
                 target: str | None = None):
        super().__init__(name, target=target or f"{module}.{declared}", modules=(module,), supported=supported,
                         checked=checked, observe_safe=False, apply=self._layer, remove=self._remove,
                         present=self._present)
        self.module, self._declare, self._check = module, declare, check
        self._fallbacks = fallbacks or {}
        self._declared = Layer(module, declared, rebind=True)
        self._wrappers = tuple(Layer(module, wrapper, rebind=True) for wrapper in wrappers)

    def _layer(self, engine) -> None:
        if self.is_patched():
            return
        module = sys.modules.get(self.module)
        if module is None:
            return
        self._check(module)
        declaration = self._declared.add(lambda original: self._declare(module, original))
        for wrapper in self._wrappers:
            compute = self._fallbacks.get(wrapper.name)
            wrapper.add(lambda original, compute=compute: rerun_on_overflow(
                declaration, fallback=None if compute is None else _taking(original, compute))(original))

    def _remove(self) -> None:
        for wrapper in reversed(self._wrappers):
            wrapper.remove()
        self._declared.remove()

    def _present(self) -> bool:
        return self._declared.present() and all(wrapper.present() for wrapper in self._wrappers)


def _taking(original, compute: str) -> Callable[..., Any]:
    """``smemguard.fallbacks.<compute>`` called with the arguments given to the wrapper ``original``, by its parameter
    names (only those given: an argument of a newer release reaches it by name, and it declines). Imported at the
    first such call: torch is not imported at install."""
    signature = inspect.signature(inspect.unwrap(original))

    def fallback(*args, **kwargs):
        from .. import fallbacks

        return getattr(fallbacks, compute)(**signature.bind(*args, **kwargs).arguments)

    fallback.__module__, fallback.__qualname__ = "smemguard.fallbacks", compute
    return fallback
