"""Remembered decisions at compile time: wraps ``triton.runtime.jit.JITFunction._do_compile``.

Why: when another process (or an earlier run, or ``smemguard check --decisions``) learned that a
compiled variant overflows this GPU, compiling it first is wasted seconds and a wasted exception.
``_do_compile`` runs only on a JIT cache miss, with the key the variant will be cached under, what
it compiles (signature, constants, attributes) and Triton's parsed options; the wrapper keys the
variant as recovery does (:func:`smemguard.kernels.variants.variant_id`) and asks the decision cache
(``engine.remembered_compile``, :func:`smemguard.engine.recall.remembered_compile`):

* fewer stages (or warps) fit: the remembered options are swapped in, and the kernel's
  pipeline-depth parameters lowered with them (:mod:`smemguard.kernels.parameters`), so the replacement is
  compiled and cached under the original key and every launch of that variant runs it. Inside the
  autotuner's benchmarking (``Autotuner._bench``) too: the config is timed as the kernel that will run, as the
  compile-time core timed it in the process that decided;
* another config of the tuner fits (or the autotuner is benchmarking the variant): the
  ``OutOfResources`` the variant's launch would raise is raised before compiling it. The
  autotuner's benchmark counts it as a failed config, as it would; the launch guard switches the
  tuner to the stored config (:func:`smemguard.engine.recovery.handle`).

Launches never pass through here once cached. Not applied in observe mode (it changes what is
compiled), nor without a decision cache (``SMEMGUARD_CACHE_DIR=off``).

In every release checked: ``_do_compile(self, key, signature, device, constexprs, options, attrs, warmup)``, with
``options`` a frozen dataclass. Triton 3.4 compiles inline in ``run``; there remembered
decisions apply at the first failing launch instead.
"""

from __future__ import annotations

import dataclasses
import logging

from ...facts.versions import Supported
from ...kernels.parameters import lowered_constexprs
from .. import Layer, Patch, wrapt_layer

log = logging.getLogger(__name__)


def _arguments(key, signature, device, constexprs, options, attrs, warmup):
    return key, signature, device, constexprs, options, attrs, warmup


def _compile_remembered(wrapped, instance, args, kwargs):
    override = None
    engine = PATCH.engine
    if engine is not None and not engine.compiling:  # the engine's own compiles are measured as they are
        from triton.runtime.errors import OutOfResources

        try:
            from triton.compiler.compiler import ASTSource

            key, signature, device, constexprs, options, attrs, warmup = _arguments(*args, **kwargs)
            override = engine.remembered_compile(instance, ASTSource(instance, signature, constexprs, attrs), device,
                                               options, launching=not warmup)
            if override:
                replaced = dataclasses.replace(options, **override)
                # A pipeline-depth parameter is lowered with the option, as recovery compiled it.
                lowered = lowered_constexprs(instance, constexprs, override)
                if "options" in kwargs:
                    kwargs = {**kwargs, "options": replaced}
                else:
                    args = (*args[:4], replaced, *args[5:])
                if "constexprs" in kwargs:
                    kwargs = {**kwargs, "constexprs": lowered}
                else:
                    args = (*args[:3], lowered, *args[4:])
        except OutOfResources:  # the variant is stored as overflowing: refused before compiling, as it would fail
            raise
        except Exception:  # a lookup problem must never stop a compile
            log.debug("smemguard: remembered options not applied", exc_info=True)
            override = None
    kernel = wrapped(*args, **kwargs)
    if override and kernel is not None:
        engine.notes.note_replacement(instance, device, key, kernel)  # uninstall() takes it out again
    return kernel


PATCH = Patch(__name__, target="triton.runtime.jit.JITFunction._do_compile", modules=("triton",),
              supported=Supported("triton", (3, 5), (3, 9), label="Triton"),
              checked=("3.5.1", "3.6.0", "3.7.1", "3.8.0", "3.9.0"),
              observe_safe=False,  # compiles remembered replacements instead of what was asked for
              wanted=lambda settings: settings.cache_dir is not None,
              layers={Layer("triton.runtime.jit", "JITFunction._do_compile"): wrapt_layer(_compile_remembered)})
