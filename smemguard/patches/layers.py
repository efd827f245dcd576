"""The one layer mechanism of every patch: :class:`Layer`, smemguard's layer on one attribute among whatever layers
other tools put above or below it, and the builders :func:`wrapt_layer` (a wrapt function wrapper) and a plain
function (where every launch passes)."""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from typing import Any, Callable

import wrapt

log = logging.getLogger(__name__)


def rebind(name: str, old, new) -> None:
    """Point every loaded module whose global ``name`` is ``old`` at ``new``: callers that
    imported a wrapped function by name (``from module import function``) keep the object
    they imported, so wrapping its defining module alone does not reach them."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(name) is old:
            setattr(module, name, new)


def bound(layer, instance):
    """``layer`` (a class attribute: a function, or another tool's wrapper of one) bound to
    ``instance`` as attribute access would bind it."""
    return layer.__get__(instance, type(instance))


class Layer:
    """smemguard's one layer on one attribute, ``module.name`` (``name`` dotted within the module:
    ``"KernelInterface.__getitem__"``), among whatever layers other tools put above or below it.

    :meth:`add` installs what ``build(original)`` returns: a plain function (where every launch
    passes, a ``try`` costs nothing and a wrapt descriptor costs two calls) or a wrapt
    ``FunctionWrapper`` (where the target's attributes must still be reachable, as
    ``max_shared_mem.cache_clear``). A plain function gets the original's name, docstring and
    ``__wrapped__``, so that the layers stay a chain other tools and :func:`inspect.unwrap` can walk.
    The layer is recognised by identity, read from the target each time: :meth:`present` says
    whether the target carries it now, whoever added or removed layers since.

    :meth:`remove` takes out only this layer: when it is outermost, the attribute goes back to what
    it wrapped; under another tool's wrapt layer, that layer is pointed past it. Under a layer that
    cannot be re-pointed (a plain function that closed over ours) it stays, and the patches' layers
    are built to do nothing once the guard is uninstalled. ``rebind`` also replaces the attribute in
    every module that imported it by name.
    """

    def __init__(self, module: str, name: str, *, rebind: bool = False):
        self.module, self.name, self._rebind = module, name, rebind
        self._layer = None
        self._inherited = False

    @property
    def target(self) -> str:
        return f"{self.module}.{self.name}"

    def _owner(self):
        """(the object holding the attribute, its name); (None, name) while the module is not imported:
        reading or removing a layer never imports the target."""
        owner = sys.modules.get(self.module)
        *parents, attr = self.name.split(".")
        if owner is None:
            return None, attr
        for parent in parents:
            owner = getattr(owner, parent)
        return owner, attr

    def _chain(self):
        """(the object above, the layer) for each layer at the target, outermost first."""
        owner, attr = self._owner()
        above, layer = None, _raw_attribute(owner, attr)
        seen = 0
        while layer is not None and seen < 64:  # a chain that loops back on itself is not ours to follow
            yield above, layer
            above, layer, seen = layer, getattr(layer, "__wrapped__", None), seen + 1

    def current(self):
        """What the target holds now (outermost layer)."""
        return next(self._chain(), (None, None))[1]

    def present(self) -> bool:
        return self._layer is not None and any(layer is self._layer for _, layer in self._chain())

    def add(self, build: Callable[[Any], Any]):
        """Layer the target with ``build(original)`` (importing its module); nothing when this layer
        is there already. Returns the layer."""
        if self.present():
            return self._layer
        importlib.import_module(self.module)
        owner, attr = self._owner()
        original = self.current()
        layer = build(original)
        if not _is_wrapt_proxy(layer):
            functools.update_wrapper(layer, original)
        # A method a class inherits gets our layer on the class itself; removing it deletes that attribute.
        self._inherited = isinstance(owner, type) and attr not in vars(owner)
        setattr(owner, attr, layer)
        if self._rebind:
            rebind(attr, original, layer)
        self._layer = layer
        return layer

    def remove(self) -> bool:
        """Take this layer out of the chain; False when it is not there or cannot be taken out."""
        if self._layer is None:
            return False
        for above, layer in self._chain():
            if layer is not self._layer:
                continue
            if above is None:
                owner, attr = self._owner()
                if self._inherited and layer.__wrapped__ is _raw_attribute(owner.__mro__[1], attr):
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, layer.__wrapped__)
                if self._rebind:
                    rebind(attr, layer, layer.__wrapped__)
            elif _is_wrapt_proxy(above):  # another tool wrapped on top of us: point it past us
                above.__wrapped__ = layer.__wrapped__
            else:
                log.warning("smemguard: %s is wrapped over smemguard's layer by %r, which cannot be re-pointed; "
                            "smemguard's layer stays there and does nothing", self.target, above)
                return False
            self._layer = None
            return True
        self._layer = None  # another tool took it out already
        return False


#: The base of every wrapt proxy (``ObjectProxy``, ``FunctionWrapper``): in wrapt 2 the ``wrapt.ObjectProxy``
#: it exports is a subclass of it, which ``FunctionWrapper`` is not.
_WRAPT_PROXY = wrapt.FunctionWrapper.__mro__[-2]


def _is_wrapt_proxy(obj) -> bool:
    """A wrapt proxy, whose ``__wrapped__`` can be re-pointed."""
    return isinstance(obj, _WRAPT_PROXY)


def _raw_attribute(owner, attr):
    """``owner.attr`` unbound: a class's own entry, or the nearest base class's (as wrapt resolves it)."""
    if isinstance(owner, type):
        return next((vars(cls)[attr] for cls in owner.__mro__ if attr in vars(cls)), None)
    return getattr(owner, attr, None)


def wrapt_layer(wrapper: Callable) -> Callable[[Any], Any]:
    """A :meth:`Layer.add` builder: ``original`` wrapped by the wrapt function wrapper ``wrapper``."""
    return lambda original: wrapt.FunctionWrapper(original, wrapper)
