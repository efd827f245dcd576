"""What users (and ``smemguard.patches``) tell smemguard about their kernels."""

from __future__ import annotations

import threading
from typing import Any, Callable

from .introspect import declared_kernel, kernel_name



class _Registered:
    """What was registered, by kernel name: users' registrations last the process, whichever install is in force
    (a library registers at its import, before or after ``install()``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fallbacks: dict[str, Callable[..., Any]] = {}
        self.alternatives: dict[str, tuple] = {}


_registered = _Registered()


def _registered_name(kernel) -> str:
    """``kernel``'s name for the registry; TypeError or ValueError saying what is accepted."""
    if isinstance(kernel, str):
        module, _, qualname = kernel.partition(":")
        if not all(part.isidentifier() for part in (*module.split("."), *qualname.split("."))):
            raise ValueError(f"kernel {kernel!r} is not a 'module:qualname' such as 'my_ops:matmul_kernel'")
        return kernel
    if declared_kernel(kernel) is None:
        raise TypeError(f"kernel must be a Triton kernel (@triton.jit, autotuned or heuristics-wrapped) or its "
                        f"'module:qualname', not {type(kernel).__name__}")
    return kernel_name(kernel)


def register_fallback(kernel, fallback: Callable[..., Any]) -> None:
    """Run ``fallback`` instead of ``kernel`` when no config of it fits the GPU.

    ``kernel`` is a ``@triton.jit`` function, an autotuned or heuristics-wrapped one, or its
    ``"module:qualname"``. ``fallback`` receives the launch's arguments by parameter name
    (tensors, scalars and constexprs, as the kernel would) and must write the kernel's outputs
    in place, e.g. ``lambda a_ptr, b_ptr, c_ptr, **_: torch.mm(a_ptr, b_ptr, out=c_ptr)``.
    Its return value is ignored. Registering again replaces the previous fallback.
    """
    if not callable(fallback):
        raise TypeError(f"fallback must be callable, not {type(fallback).__name__}")
    name = _registered_name(kernel)
    with _registered.lock:
        _registered.fallbacks[name] = fallback


def unregister_fallback(kernel) -> None:
    with _registered.lock:
        _registered.fallbacks.pop(kernel_name(kernel), None)


def fallback_for(kernel) -> Callable[..., Any] | None:
    with _registered.lock:
        return _registered.fallbacks.get(kernel_name(kernel))


def register_alternatives(kernel, configs) -> None:
    """Configs a plain ``@triton.jit`` kernel may run with when the launched one does not fit.

    ``configs`` are ``triton.Config`` objects (constexprs and options), tried largest tile
    first. Register only a kernel that masks its tails and whose callers pass the grid as a
    function of the meta-parameters (``grid=lambda meta: (cdiv(M, meta["BLOCK_M"]),)``): a
    launch with a tuple grid keeps its tiles whatever is registered, since the caller computed
    that grid from them, and so does one whose grid function reads none of an alternative's
    parameters from its argument (``lambda meta: (cdiv(M, BLOCK_M),)`` closes over the caller's
    tile). Registering again replaces the previous list.
    """
    name = _registered_name(kernel)
    try:
        configs = tuple(configs)
    except TypeError:
        raise TypeError(f"alternatives must be a list of triton.Config objects, not {type(configs).__name__}") from None
    if not all(hasattr(config, "all_kwargs") and hasattr(config, "kwargs") for config in configs):
        raise TypeError("alternatives must be triton.Config objects")
    with _registered.lock:
        _registered.alternatives[name] = configs


def alternatives_for(kernel) -> tuple:
    with _registered.lock:
        return _registered.alternatives.get(kernel_name(kernel), ())


def unregister_alternatives(kernel) -> None:
    with _registered.lock:
        _registered.alternatives.pop(kernel_name(kernel), None)
