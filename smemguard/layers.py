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
their patch module (:mod:`smemguard.patches.flaggems`), registered when the library is imported.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable


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

    return runs_as(layer, Autotuner)


def _triton_config_in_force(autotuner, key):
    if len(autotuner.configs) > 1 and key in autotuner.cache:
        return autotuner.cache[key]
    return getattr(autotuner, "best_config", None) or autotuner.configs[0]


def adopt_in_cache(tuner, key, config) -> None:
    """Adopt ``config`` for ``key`` in a tuner's ``cache`` mapping (Triton's dict, FlagGems' database)."""
    tuner.cache[key] = config


TRITON_AUTOTUNER = Tuner("triton.Autotuner", _is_triton_autotuner, tuning_key, _triton_config_in_force,
                         adopt_in_cache)

_lock = threading.Lock()
_tuners: list[Tuner] = [TRITON_AUTOTUNER]
_entries: list[Entry] = []


def register(kind: Tuner | Entry) -> None:
    with _lock:
        kinds = _tuners if isinstance(kind, Tuner) else _entries
        if kind not in kinds:
            kinds.append(kind)


def unregister(kind: Tuner | Entry) -> None:
    with _lock:
        kinds = _tuners if isinstance(kind, Tuner) else _entries
        if kind in kinds and kind is not TRITON_AUTOTUNER:
            kinds.remove(kind)


def registered() -> tuple:
    """Every tuner and entry kind the engine understands now."""
    with _lock:
        return (*_tuners, *_entries)


def tuner_for(layer) -> Tuner | None:
    return next((tuner for tuner in tuple(_tuners) if tuner.matches(layer)), None)


def is_entry(layer) -> bool:
    return any(entry.matches(layer) for entry in tuple(_entries))


def key_for(layer, args: tuple, kwargs: dict) -> tuple:
    """The tuning key of ``layer`` (any registered tuner; Triton's way for an unknown one)."""
    tuner = tuner_for(layer)
    return (tuner.key if tuner is not None else tuning_key)(layer, args, kwargs)
