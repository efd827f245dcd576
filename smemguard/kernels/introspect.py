"""Reading Triton kernel objects: the chain of layers down to the JIT function, names, configs, errors.

Used by every part that looks at a kernel (recovery, the registry, replay, the preflight), so
that all of them agree on what "the kernel" under a stack of autotuner/heuristics/library
layers is, and on how a config and an error are written down.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any, Iterator

#: Deeper than any real stack of layers; stops a walk over an object whose ``fn`` leads back to itself.
MAX_LAYERS = 32

#: Triton's errors whose last line says why (the ones before it are source or compiler output).
_REASON_LAST = ("CompilationError", "PTXASError")

#: The launch options of a ``triton.Config``, besides its constexprs.
CONFIG_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def chain(obj) -> Iterator[Any]:
    """``obj`` and every layer under it, outermost first, following ``.fn``: for a Triton kernel
    the autotuner/heuristics/library layers, the ``JITFunction`` and last its Python function."""
    for _ in range(MAX_LAYERS):
        yield obj
        if not hasattr(obj, "fn"):
            return
        obj = obj.fn


def jit_function(obj):
    """The ``JITFunction`` under ``obj``'s layers (``obj`` itself if it is one), or None."""
    from triton.runtime.jit import JITFunction

    return next((layer for layer in chain(obj) if isinstance(layer, JITFunction)), None)


def declared_kernel(obj):
    """The kernel function a declaration names (:func:`jit_function`), or under ``TRITON_INTERPRET=1`` the
    interpreter's function Triton made in its place: a library that declares its kernels stays importable there,
    and what it declares never applies (the interpreter raises no ``OutOfResources``). None when neither."""
    jit = jit_function(obj)
    if jit is not None:
        return jit
    interpreter = sys.modules.get("triton.runtime.interpreter")  # loaded wherever an interpreted function exists
    interpreted = getattr(interpreter, "InterpretedFunction", None)
    return next((layer for layer in chain(obj) if interpreted is not None and isinstance(layer, interpreted)), None)


def kernel_name(kernel) -> str:
    """``module:qualname`` of the Python function under any layers (its ``__name__`` in place of the qualname's
    last part where the function was renamed once made), or the string given.

    A library's launcher object with no function inside is named by its class.
    """
    if isinstance(kernel, str):
        return kernel
    layers = list(chain(kernel))
    fn = next((layer for layer in layers if hasattr(layer, "__code__")), layers[-1])
    qualname, name = getattr(fn, "__qualname__", type(fn).__qualname__), getattr(fn, "__name__", None)
    if isinstance(name, str) and qualname.rpartition(".")[2] != name:
        qualname = name  # renamed once made: a kernel built from a template (triton_kernels' define_kernel) keeps
        # the template's qualname, ``define_kernel.<locals>._empty_fn``, for every kernel it builds
    return f"{getattr(fn, '__module__', '?')}:{qualname}"


def launching_site() -> str | None:
    """``file:line (function)`` of the innermost frame on this thread's stack outside Triton, wrapt and smemguard:
    for a plain kernel, the wrapper that launched it (and chose its tiles); None when there is none (smemguard's own
    stand-in launches)."""
    ours = tuple(os.path.dirname(getattr(sys.modules.get(name), "__file__", None) or "/nonexistent") + os.sep
                 for name in ("triton", "wrapt", "smemguard"))
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(ours) and not filename.startswith("<"):
            return f"{filename}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return None


def source_hash(jit) -> str:
    """First 16 hex digits of the SHA-256 of a JIT function's source."""
    return hashlib.sha256(jit.src.encode()).hexdigest()[:16]


def callable_name(fn) -> str:
    """``module:qualname`` of a fallback, hook or pruner; a lambda's with its line, since ``<lambda>``
    alone does not say which one (GemLite's pruners are lambdas: ``...gemm_kernels:<lambda> line 277``)."""
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    code = getattr(fn, "__code__", None)
    return f"{name} line {code.co_firstlineno}" if code is not None and code.co_name == "<lambda>" else name


def config_fields(config) -> dict:
    """A ``triton.Config`` as plain data: its constexprs and every launch option."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def config_text(config) -> str:
    """``BLOCK_M=64 BLOCK_N=64 num_warps=4 num_stages=3``: a ``triton.Config`` as records write configs."""
    fields = config_fields(config)
    options = [f"{name}={fields[name]}" for name in CONFIG_OPTIONS if name in ("num_warps", "num_stages")
               or fields[name] not in (None, 1)]
    return " ".join([*(f"{name}={value}" for name, value in fields["kwargs"].items()), *options])


def changes(base: str, other: str) -> str:
    """The ``name=value`` settings of ``other`` that differ from ``base`` (both as :func:`config_text`
    writes them): what one candidate changed against the failing launch."""
    before = dict(token.split("=", 1) for token in base.split() if "=" in token)
    return " ".join(token for token in other.split()
                    if "=" not in token or before.get(token.split("=", 1)[0]) != token.split("=", 1)[1])


def error_summary(error: BaseException, width: int = 300) -> str:
    """``"CompilationError: <reason>"``: the type and the one line that says why.

    Triton's compile errors put the source excerpt (or ptxas' banner) first and the reason
    last; other errors say it first.
    """
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    reason_last = any(cls.__name__ in _REASON_LAST for cls in type(error).__mro__)
    reason = "" if not lines else lines[-1] if reason_last else lines[0]
    return f"{type(error).__name__}: {reason[:width]}"
