"""The compile-time core: wraps Triton's public ``triton.compile`` (every binding of it).

Why: it is the one seam every caller of Triton passes (the JIT, autotuners and library tuners, vLLM's
warm-up, Inductor's ``CachingAutotuner._precompile_config`` in torch 2.8 to 2.15), public and with the
signature ``compile(src, target=None, options=None)`` in Triton 3.4 to 3.9, and the compiled kernel's
``metadata.shared`` is known there before anything loads. A kernel that does not fit the device it will
load on is compiled again with fewer stages there (:mod:`smemguard.compile_fit`), so the first launch never
raises ``OutOfResources`` for what fewer stages fix, whoever launches it.

The bindings: ``triton.compiler.compiler.compile`` (the definition), ``triton.compiler.compile`` and
``triton.compile`` (re-exports), and any module that imported it by name. The JIT imports it from
``triton.compiler`` when it builds a kernel's binder (its first launch) and keeps it on the kernel: a kernel
first launched before ``install()`` keeps Triton's own compile, and the launch guard covers it. The layer
reads the engine at every call, so a kernel that kept it after ``uninstall()`` compiles as Triton does.

A compile the caller gets back is never an error smemguard made: the core's own failures hand on the
kernel as compiled. Not applied in observe mode (it changes what runs).

Checked against Triton 3.4.0, 3.5.1, 3.6.0, 3.7.1, 3.8.0 and 3.9.0.
"""

from __future__ import annotations

from . import TRITON, Layer, wrapt_layer

TARGET = "triton.compiler.compiler.compile"
TARGET_MODULES = ("triton",)
SUPPORTED = TRITON
OBSERVE_SAFE = False  # hands the caller a fewer-stage kernel

_LAYER = Layer("triton.compiler.compiler", "compile", rebind=True)
_on_compiled = None  # (compile, args, kwargs, kernel) -> the kernel that fits, or the kernel itself


def applies(settings) -> bool:
    return True


def _compile_fitting(wrapped, instance, args, kwargs):
    kernel = wrapped(*args, **kwargs)
    on_compiled = _on_compiled
    return kernel if on_compiled is None else on_compiled(wrapped, args, kwargs, kernel)


def patch(context) -> None:
    global _on_compiled
    _on_compiled = context.on_compiled
    _LAYER.add(wrapt_layer(_compile_fitting))


def unpatch() -> None:
    global _on_compiled
    _LAYER.remove()
    _on_compiled = None


def is_patched() -> bool:
    return _LAYER.present()
