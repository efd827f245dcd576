"""A library module's wrappers declared re-runnable for smemguard, as their author would declare them.

Shared by the packs for libraries whose wrappers choose a kernel's tiles (``sglang_extend_attention``,
``sglang_prefill_attention``, ``vllm_unified_attention``, ``vllm_prefill_attention``): each describes its kernels
here, wherever the library's releases keep them, and the public mechanism (``engine.wrapper_tiles``: ``tile_choice``
or ``tiles_at_launch``, and ``rerun_on_overflow``) does the rest, exactly as for a library that declares its own
wrappers. The knowledge that makes smaller tiles safe lives
in each pack's docstring.

Layers: each wrapper, and the declared attribute (the module's tile choice function, or its kernel), here and in
the modules that imported them by name. The declared attribute's layer is held back until it is needed (a launch of
the declared kernel overflows, or the decision cache holds learnt tiles at install): until then a healthy call pays
for the wrapper's layer only. Both are built to do nothing once the guard is uninstalled (a declared wrapper reads
the installed settings at each call).
"""

from __future__ import annotations

import inspect
import threading
from types import ModuleType
from typing import Any, Callable

from ...engine import wrapper_rerun
from ...engine.wrapper_rerun import rerun_on_overflow
from ...engine.wrapper_tiles import declaration_of
from .. import Kernels, Layer, Patch


class DeclaredWrappers(Patch):
    """The ``wrappers`` of the home of ``kernels`` (:class:`smemguard.patches.Kernels`: wherever a release keeps
    them, where they have what the pack's argument reads), declared re-runnable with the declaration
    ``declare(module, original)`` builds over the home's ``declared`` attribute (what the wrappers choose their tiles
    with). ``fallbacks``: per wrapper, the name in :mod:`smemguard.fallbacks` of the torch computation of its result
    for calls where not even the smallest tiles fit, taking the wrapper's parameters by name. Its target is the first
    wrapper (always layered; the declared attribute only once needed). ``name``, ``supported`` and ``checked`` are
    the patch's contract (:class:`smemguard.patches.Patch`); never applied in observe mode (it changes the tiles that
    run)."""

    def __init__(self, name: str, *, supported, checked: tuple[str, ...], kernels: Kernels, declared: str,
                 declare: Callable[[ModuleType, Any], Any], wrappers: tuple[str, ...],
                 fallbacks: dict[str, str] | None = None):
        super().__init__(name, target=wrappers[0], kernels=kernels, supported=supported, checked=checked,
                         observe_safe=False, apply=self._layer, remove=self._remove, present=self._present)
        self._declare, self._declared, self._wrappers = declare, declared, wrappers
        self._fallbacks = fallbacks or {}
        self._homes: dict[str, tuple[Layer, tuple[Layer, ...]]] = {}  # home -> (its declared layer, its wrappers')
        self._held: dict[str, Any] = {}  # home -> its declaration while held back
        self._placing = threading.Lock()  # one thread puts a held-back declaration in place

    def _home_layers(self, home: str) -> tuple[Layer, tuple[Layer, ...]]:
        if home not in self._homes:
            self._homes[home] = (Layer(home, self._declared, rebind=True),
                                 tuple(Layer(home, wrapper, rebind=True) for wrapper in self._wrappers))
        return self._homes[home]

    def _layer(self, engine) -> None:
        stored = wrapper_rerun.in_use(engine)  # learnt tiles to answer from the first call: in place at once
        for home, module in self.homes():
            declared, wrappers = self._home_layers(home)
            if all(wrapper.present() for wrapper in wrappers):
                continue
            declaration = declaration_of(self._declare(module, getattr(module, declared.name)))
            for wrapper in wrappers:
                compute = self._fallbacks.get(wrapper.name)
                wrapper.add(lambda original, compute=compute, declaration=declaration: rerun_on_overflow(
                    declaration, fallback=None if compute is None else _taking(original, compute))(original))
            self._held[home] = declaration
            declaration.put_in_place = lambda home=home: self._place(home)
            if stored:
                self._place(home)

    def _place(self, home: str) -> None:
        """Put the declaration held back for ``home`` in place of its declared attribute, over whatever is there
        now."""
        with self._placing:
            declaration = self._held.pop(home, None)
            if declaration is None:  # in place already, or the patch was removed
                return
            self._homes[home][0].add(declaration.over)
            declaration.put_in_place = None

    def _remove(self) -> None:
        with self._placing:
            for declaration in self._held.values():
                declaration.put_in_place = None  # a wrapper layer another tool keeps alive puts nothing in place
            self._held.clear()
        for declared, wrappers in self._homes.values():
            for wrapper in reversed(wrappers):
                wrapper.remove()
            declared.remove()

    def declared_in_place(self) -> bool:
        """Whether the declared attribute is in place in a home (from the first overflow of its kernel on, or from
        install when the decision cache holds learnt tiles)."""
        return any(declared.present() for declared, _ in self._homes.values())

    def _present(self) -> bool:
        return any(all(wrapper.present() for wrapper in wrappers) for _, wrappers in self._homes.values())


def _taking(original, compute: str) -> Callable[..., Any]:
    """``smemguard.fallbacks.<compute>`` called with the arguments given to the wrapper ``original``, by its parameter
    names (only those given: an argument of a newer release reaches it by name, and it declines). Imported at the
    first such call: torch is not imported at install."""
    signature = inspect.signature(inspect.unwrap(original))

    def fallback(*args, **kwargs):
        from ... import fallbacks

        return getattr(fallbacks, compute)(**signature.bind(*args, **kwargs).arguments)

    fallback.__module__, fallback.__qualname__ = "smemguard.fallbacks", compute
    return fallback
