"""Emulated shared-memory limit: wraps ``triton.compiler.compiler.max_shared_mem``.

Why: ``CompiledKernel._init_handles`` compares ``metadata.shared`` with
``max_shared_mem(device)`` before loading a kernel; it is Triton's only shared-memory check
(the autotuner's benchmarking goes through it too). Returning ``min(device limit, emulated
limit)`` there makes a big GPU raise Triton's own ``OutOfResources`` exactly where a small
one would, so the failures of an L4 reproduce on an H200.

Only the limit Triton enforces changes. Code that picks its configs from
``get_device_properties()`` still sees the real GPU. The emulated limit is kept in
:mod:`smemguard.runtime`, where the engine reads it.

Checked against Triton 3.4.0, 3.5.1, 3.6.0, 3.7.1, 3.8.0 and 3.9.0 (same function, an
``lru_cache`` over the device index, in every one of them).
"""

from __future__ import annotations

from .. import runtime
from . import TRITON, Layer, wrapt_layer

TARGET = "triton.compiler.compiler.max_shared_mem"
TARGET_MODULES = ("triton",)
SUPPORTED = TRITON
OBSERVE_SAFE = True  # observe mode enforces the emulated limit too: that is what it observes

_LAYER = Layer(*TARGET.rsplit(".", 1))


def applies(settings) -> bool:
    return settings.max_shared is not None


def _min_with_emulated(wrapped, instance, args, kwargs):
    device_limit = wrapped(*args, **kwargs)
    limit = runtime.emulated_limit()
    return device_limit if limit is None else min(device_limit, limit)


def patch(context) -> None:
    runtime.set_emulated_limit(context.settings.max_shared)
    _LAYER.add(wrapt_layer(_min_with_emulated))


def unpatch() -> None:
    _LAYER.remove()
    runtime.set_emulated_limit(None)


def is_patched() -> bool:
    return _LAYER.present()
