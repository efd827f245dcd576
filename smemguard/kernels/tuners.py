"""The layers a launch passes through on its way to the JIT function, and how recovery reads them.

Recovery retries a launch only when it understands every layer between ``kernel[grid]`` and
the JIT function, because a layer it does not know may launch several kernels, or enqueue
work before the failing one. Two kinds are understood:

* a **tuner** picks a config by a key and passes its meta-parameters down (Triton's
  ``Autotuner``; FlagGems' ``LibTuner``). Recovery reads the config in force for the key and,
  when it switches config, files the new one where the tuner will find it next time;
* an **entry** passes the call to its ``fn`` and launches the one kernel that returns,
  caching it for the next call (FlagGems' ``LibEntry``). Recovery passes through it and
  relaunches below it: an entry keys its cache on argument state that the tuner's pre_hook
  rewrites (TMA block shapes), so a relaunch through it would file the kernel under a key no
  call uses. The next call misses the entry's cache once, finds the kernel that fits through
  the tuner (the replacement in Triton's JIT cache, or the config the tuner adopted), and
  caches it.

Triton's ``Heuristics`` is handled by recovery itself. Libraries' layers are described by
their patch module (:mod:`smemguard.patches.contrib.flaggems`), registered when the library is imported.

A subclass of Triton's ``Autotuner`` that overrides ``run`` (fla's ``CachedAutotuner``, which
loads a config tuned elsewhere into ``cache`` and then calls ``Autotuner.run``) is read like
Triton's own autotuner when its code shows that it keeps the contract
(:func:`keeps_autotuner_contract`): whatever it does first, it launches nothing itself and
ends by returning ``Autotuner.run``'s result, so one call is still one launch of the kernel.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
import threading
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tuner:
    """How to read and update one kind of autotuner."""

    name: str
    matches: Callable[[Any], bool]
    #: (layer, args, kwargs) -> the key the layer files its choice under
    key: Callable[[Any, tuple, dict], tuple]
    #: (layer, key) -> the config the layer launches for that key
    config_in_force: Callable[[Any, tuple], Any]
    #: (layer, key, config): make the layer launch ``config`` for that key from now on
    adopt: Callable[[Any, tuple, Any], None]
    #: whether a config outside the layer's own list (one of its configs with fewer stages)
    #: can be adopted; a tuner that finds a config's pre_hook again by looking it up in its
    #: own list cannot take one
    takes_variants: bool = True


@dataclass(frozen=True)
class Entry:
    """One kind of entry layer: runs exactly one kernel per call, through its ``fn``."""

    name: str
    matches: Callable[[Any], bool]


def runs_as(layer, cls) -> bool:
    """True when ``layer`` is a ``cls`` whose ``run`` is ``cls``'s own (possibly patched) one."""
    return isinstance(layer, cls) and type(layer).run is cls.run


def named_args(layer, args: tuple, kwargs: dict) -> dict:
    """The arguments a layer's ``run`` received, by parameter name (options such as num_warps left out)."""
    named = {**dict(zip(layer.arg_names, args)), **kwargs}
    return {name: value for name, value in named.items() if name in layer.arg_names}


def tuning_key(autotuner, args: tuple, kwargs: dict) -> tuple:
    """The key Triton's ``Autotuner.run`` files a tuned config under: the ``key=`` argument
    values, then the dtype of every argument that has one."""
    named = named_args(autotuner, args, kwargs)
    key = [named[name] for name in autotuner.keys if name in named]
    key.extend(str(value.dtype) for value in named.values() if hasattr(value, "dtype"))
    return tuple(key)


def _is_triton_autotuner(layer) -> bool:
    from triton.runtime.autotuner import Autotuner

    return isinstance(layer, Autotuner) and keeps_autotuner_contract(type(layer))


#: Attribute calls that launch, compile or benchmark a kernel.
_LAUNCHING_CALLS = frozenset({"run", "warmup", "_bench", "bench", "do_bench", "launch"})


def _delegates_to_base_run(call: ast.AST) -> bool:
    """``super().run(...)``, ``super(Cls, self).run(...)`` or ``Base.run(self, ...)``."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "run"):
        return False
    owner = call.func.value
    is_super = isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
    is_base = isinstance(owner, ast.Name) and bool(call.args) and isinstance(call.args[0], ast.Name) \
        and call.args[0].id == "self"
    return is_super or is_base


def _launches(tree: ast.AST, allowed: ast.AST | None = None) -> bool:
    """Whether ``tree`` may launch a kernel besides the call ``allowed``: ``kernel[grid](...)`` or
    a call to one of :data:`_LAUNCHING_CALLS`."""
    for node in ast.walk(tree):
        if node is allowed or not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Subscript):
            return True
        if isinstance(node.func, ast.Attribute) and node.func.attr in _LAUNCHING_CALLS:
            return True
    return False


def _function_tree(function) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]


def _run_keeps_contract(cls) -> bool:
    run = _function_tree(cls.__dict__["run"])
    last = run.body[-1] if run.body else None
    if not (isinstance(last, ast.Return) and _delegates_to_base_run(last.value)):
        return False
    if _launches(run, allowed=last.value):
        return False
    # The class's own methods that run calls (self.load_config(...)) must not launch either.
    called = {node.func.attr for node in ast.walk(run) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
              and node.func.value.id == "self"}
    own_methods = (member for name in called for klass in cls.__mro__ if name in klass.__dict__
                   for member in (klass.__dict__[name],) if inspect.isfunction(member)
                   and klass.__module__ != "triton.runtime.autotuner")
    return not any(_launches(_function_tree(method)) for method in own_methods)


@functools.lru_cache(maxsize=None)
def keeps_autotuner_contract(cls) -> bool:
    """Whether an ``Autotuner`` subclass still launches exactly what ``Autotuner.run`` launches.

    True for ``Autotuner`` itself and for subclasses that leave ``run`` and ``_bench`` (which
    recovery calls to time candidates) alone, or whose overriding ``run`` (checked in every class of the MRO
    that defines one) ends with ``return super().run(...)`` and neither it nor the class's
    own methods it calls launch, compile or benchmark anything. Read from the source once per
    class; a class whose source cannot be read does not keep it (never retried).
    """
    from triton.runtime.autotuner import Autotuner

    try:
        for klass in cls.__mro__:
            if klass is Autotuner:
                return True
            if "_bench" in klass.__dict__:
                return False
            if "run" in klass.__dict__ and not _run_keeps_contract(klass):
                return False
    except (OSError, TypeError, SyntaxError, IndexError):
        log.debug("smemguard: cannot read the source of %s", cls.__qualname__, exc_info=True)
    return False


def _triton_config_in_force(autotuner, key):
    if len(autotuner.configs) > 1 and key in autotuner.cache:
        return autotuner.cache[key]
    return getattr(autotuner, "best_config", None) or autotuner.configs[0]


def adopt_in_cache(tuner, key, config) -> None:
    """Adopt ``config`` for ``key`` in a tuner's ``cache`` mapping (Triton's dict, FlagGems' database)."""
    tuner.cache[key] = config


TRITON_AUTOTUNER = Tuner("triton.Autotuner", _is_triton_autotuner, tuning_key, _triton_config_in_force,
                         adopt_in_cache)



class _Kinds:
    """The tuner and entry kinds described, newest first: libraries describe theirs for the process (a pack at its
    library's import), Triton's own always there."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tuners: list[Tuner] = [TRITON_AUTOTUNER]
        self.entries: list[Entry] = []


_kinds = _Kinds()


def register(kind: Tuner | Entry) -> None:
    """Describe a library's layer; library tuners are asked before Triton's (a library tuner is an
    ``Autotuner`` subclass that its own description reads better)."""
    with _kinds.lock:
        kinds = _kinds.tuners if isinstance(kind, Tuner) else _kinds.entries
        if kind not in kinds:
            kinds.insert(0, kind)


def unregister(kind: Tuner | Entry) -> None:
    with _kinds.lock:
        kinds = _kinds.tuners if isinstance(kind, Tuner) else _kinds.entries
        if kind in kinds and kind is not TRITON_AUTOTUNER:
            kinds.remove(kind)


def registered() -> tuple:
    """Every tuner and entry kind the engine understands now."""
    with _kinds.lock:
        return (*_kinds.tuners, *_kinds.entries)


def tuner_for(layer) -> Tuner | None:
    return next((tuner for tuner in tuple(_kinds.tuners) if tuner.matches(layer)), None)


def is_entry(layer) -> bool:
    return any(entry.matches(layer) for entry in tuple(_kinds.entries))


def key_for(layer, args: tuple, kwargs: dict) -> tuple:
    """The tuning key of ``layer`` (any registered tuner; Triton's way for an unknown one)."""
    tuner = tuner_for(layer)
    return (tuner.key if tuner is not None else tuning_key)(layer, args, kwargs)
