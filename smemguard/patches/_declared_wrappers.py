"""A library module's wrappers declared re-runnable for smemguard, as their author would declare them.

Shared by the packs for libraries whose wrappers choose a kernel's tiles (``sglang_extend_attention``,
``sglang_prefill_attention``): each describes its module here, and the public mechanism
(:mod:`smemguard.wrapper_tiles`: ``tile_choice`` or ``tiles_at_launch``, and ``rerun_on_overflow``) does the rest,
exactly as for a library that declares its own wrappers. The knowledge that makes smaller tiles safe lives in each
pack's docstring.

Layers: the declared attribute (the module's tile choice function, or its kernel) and each wrapper, here and in
the modules that imported them by name. Both are built to do nothing once the guard is uninstalled (a declared
wrapper reads the installed settings at each call).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Callable

from . import Layer
from ..wrapper_tiles import rerun_on_overflow


class DeclaredWrappers:
    """``module``'s ``wrappers``, declared re-runnable with the declaration ``declare(module, original)`` builds
    over ``module.declared`` (what the wrappers choose their tiles with). ``check(module)`` raises when the module
    is not laid out as the versions the pack was checked against. Its ``applies``, ``patch``, ``unpatch`` and
    ``is_patched`` are the patch module's contract (:mod:`smemguard.patches`)."""

    def __init__(self, *, module: str, declared: str, declare: Callable[[ModuleType, Any], Any],
                 wrappers: tuple[str, ...], check: Callable[[ModuleType], None]):
        self.module, self._declare, self._check = module, declare, check
        self._declared = Layer(module, declared, rebind=True)
        self._wrappers = tuple(Layer(module, wrapper, rebind=True) for wrapper in wrappers)

    @staticmethod
    def applies(settings) -> bool:
        return True

    def patch(self, context) -> None:
        if self.is_patched():
            return
        module = sys.modules.get(self.module)
        if module is None:
            return
        self._check(module)
        declaration = self._declared.add(lambda original: self._declare(module, original))
        for wrapper in self._wrappers:
            wrapper.add(rerun_on_overflow(declaration))

    def unpatch(self) -> None:
        for wrapper in reversed(self._wrappers):
            wrapper.remove()
        self._declared.remove()

    def is_patched(self) -> bool:
        return self._declared.present() and all(wrapper.present() for wrapper in self._wrappers)
