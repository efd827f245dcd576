"""The compile-time core: wraps Triton's public ``triton.compile`` (every binding of it).

Why: it is the one seam every caller of Triton passes (the JIT, autotuners and library tuners, vLLM's
warm-up, Inductor's ``CachingAutotuner._precompile_config``), public and with the signature
``compile(src, target=None, options=None)`` in every release supported (releases: docs/MEASURED.md,
smemguard/patches/triton_compile.py), and the compiled kernel's ``metadata.shared`` is known there before
anything loads. A kernel that does not fit the device it will load on is compiled again with fewer stages
there (:mod:`smemguard.engine.compile_fit`), so the first launch never raises ``OutOfResources`` for what
fewer stages fix, whoever launches it.

The bindings: ``triton.compiler.compiler.compile`` (the definition), ``triton.compiler.compile`` and
``triton.compile`` (re-exports), and any module that imported it by name. The JIT imports it from
``triton.compiler`` when it builds a kernel's binder (its first launch) and keeps it on the kernel: a kernel
first launched before ``install()`` keeps Triton's own compile, and the launch guard covers it. The layer
reads the engine at every call, so a kernel that kept it after ``uninstall()`` compiles as Triton does.

Pins (``SMEMGUARD_PINS``, ``smemguard pin``) apply here too, before Triton compiles (:mod:`smemguard.engine.pins`).

A compile the caller gets back is never an error smemguard made: the core's own failures hand on the kernel as
compiled. Not applied in observe mode (it changes what runs).
"""

from __future__ import annotations

from .. import TRITON, TRITON_CHECKED, Layer, Patch, wrapt_layer


def _compile_fitting(wrapped, instance, args, kwargs):
    engine = PATCH.engine
    if engine is None or engine.compiling:
        return wrapped(*args, **kwargs)
    pinned = engine.pinned_compile(wrapped, args, kwargs)  # an operator's pin, applied before Triton compiles
    if pinned is not None:
        return pinned
    return engine.on_compiled(wrapped, args, kwargs, wrapped(*args, **kwargs))


PATCH = Patch(__name__, target="triton.compiler.compiler.compile", modules=("triton",), supported=TRITON,
              checked=TRITON_CHECKED, observe_safe=False,  # hands the caller a fewer-stage kernel
              layers={Layer("triton.compiler.compiler", "compile", rebind=True): wrapt_layer(_compile_fitting)})
