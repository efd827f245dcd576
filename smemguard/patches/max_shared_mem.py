"""Emulated shared-memory limit: wraps ``triton.compiler.compiler.max_shared_mem``.

Why: ``CompiledKernel._init_handles`` compares ``metadata.shared`` with
``max_shared_mem(device)`` before loading a kernel; it is Triton's only shared-memory check
(the autotuner's benchmarking goes through it too). Returning ``min(device limit, emulated
limit)`` there makes a big GPU raise Triton's own ``OutOfResources`` exactly where a small
one would, so the failures of an L4 reproduce on an H200.

Only the limit Triton enforces changes. Code that picks its configs from
``get_device_properties()`` still sees the real GPU.

Checked against Triton 3.4.0, 3.5.1, 3.6.0, 3.7.1, 3.8.0 and 3.9.0 (same function, an
``lru_cache`` over the device index, in every one of them).
"""

from __future__ import annotations

from . import unwrap, wrap, find_wrapper

MODULE = "triton.compiler.compiler"
TARGET = "max_shared_mem"

_limit: int | None = None


def _min_with_emulated(wrapped, instance, args, kwargs):
    device_limit = wrapped(*args, **kwargs)
    return device_limit if _limit is None else min(device_limit, _limit)


def patch(limit: int) -> None:
    global _limit
    _limit = limit
    if not is_patched():
        wrap(MODULE, TARGET, _min_with_emulated)


def unpatch() -> None:
    global _limit
    unwrap(MODULE, TARGET, _min_with_emulated)
    _limit = None


def is_patched() -> bool:
    return find_wrapper(MODULE, TARGET, _min_with_emulated) is not None


def emulated_limit() -> int | None:
    return _limit


def device_limit(device: int) -> int:
    """The device's own limit, whatever is emulated."""
    from triton.compiler import compiler

    layer = find_wrapper(MODULE, TARGET, _min_with_emulated)
    return (layer.__wrapped__ if layer is not None else compiler.max_shared_mem)(device)


def effective_limit(device: int) -> int:
    """The limit Triton enforces now: the device's, lowered by any emulation."""
    from triton.compiler import compiler

    return compiler.max_shared_mem(device)
