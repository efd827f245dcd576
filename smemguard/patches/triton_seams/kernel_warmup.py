"""Decisions at warm-up: replaces ``triton.runtime.jit.KernelInterface.warmup``.

Why: vLLM 0.33 compiles many Triton kernels at start-up without launching them
(``vllm/model_executor/warmup/jit_warmup_triton_helper.py`` calls ``kernel.warmup(grid=(1,),
**kwargs)``), and so can any program (``kernel.warmup(...)``). A kernel compiled there that
exceeds the limit is known before the first request, from its ``metadata.shared``: the engine
(``engine.on_warmup``, :func:`smemguard.engine.recovery.handle_warmup`) decides its replacement then
and puts it into Triton's JIT cache under the same key, so the first request pays no exception
and no compile. ``warmup`` returns the kernel that will run. Nothing is launched: a tuned
kernel (whose candidates would be timed by launching them) is left to its first launch, and so
is any decision that cannot live in the JIT cache (another config, a fallback).

Under Triton's async compile mode (``triton.AsyncCompileMode``: vLLM 0.33 compiles its CUDA
warm-up in such a pool, ``compile_triton_warmup``) ``warmup`` returns a ``FutureKernel`` while the
pool compiles. Deciding then would wait for the compile, and the pool would compile one kernel at a
time; the decision is taken when the compile is finalized instead (``FutureKernel.result``, which the
mode's exit calls for every compile), and the future then resolves to the kernel that will run. The
decision's own candidates compile at once, outside the mode.

The replacement is a plain function calling the original, like the launch guard: ``warmup``
is not on the launch path, but one frame more or less keeps the two patches alike.
``Autotuner.warmup`` (which compiles every config, overflowing ones included, as the
autotuner's benchmarking will see them) is not touched.

In every release checked, ``KernelInterface.warmup(self, *args, grid, **kwargs)``
returns ``self.run(grid=grid, warmup=True, *map(MockTensor.wrap_dtype, args), **kwargs)``; under an
active ``AsyncCompileMode`` a JIT cache miss returns a ``FutureKernel`` whose ``kernel`` is None until
``result(ignore_errors=False)`` finalizes it (3.6 has no ``__getattr__`` forwarding to the kernel).
Triton 3.4 defines ``warmup`` on ``JITFunction`` instead; there the decision is taken at the
first launch.
"""

from __future__ import annotations

import contextvars
import functools

from ...facts.process import launching
from ...facts.versions import Supported
from .. import Layer, Patch, bound


def _deciding_warmup(wrap_dtype, async_compile):

    def build(original):

        def warmup(self, *args, grid, **kwargs):
            outer = launching.current
            launching.current = (self, grid, args, kwargs, True)  # what a compile it causes records
            try:
                kernel = bound(original, self)(*args, grid=grid, **kwargs)
            finally:
                launching.current = outer
            engine = PATCH.engine
            if engine is None:  # uninstalled while another tool's layer kept ours alive
                return kernel
            decide = functools.partial(engine.on_warmup, self, grid, tuple(map(wrap_dtype, args)), kwargs)
            if isinstance(kernel, async_compile.FutureKernel):
                return _decide_when_finalized(kernel, functools.partial(_outside, async_compile, decide))
            return decide(kernel)

        return warmup

    return build


def _decide_when_finalized(future, decide):
    """``future``, deciding on its kernel when it is finalized rather than now (which would wait)."""
    if future.kernel is not None:  # finalized already: another warm-up asked for the same compile
        return decide(future.kernel)
    finalize = future.result

    def result(ignore_errors=False):
        if future.kernel is None:
            compiled = finalize(ignore_errors)  # Triton's: caches the kernel, sets future.kernel
            if compiled is not None:
                future.kernel = decide(compiled)
        return future.kernel

    future.result = result
    return future


def _outside(async_compile, decide, compiled):
    """``decide(compiled)`` with the async compile mode off: its candidates compile here, as
    ``CompiledKernel`` objects, wherever ``result()`` was called (inside the mode or at its exit)."""
    context = contextvars.copy_context()
    context.run(async_compile.active_mode.set, None)
    return context.run(decide, compiled)


def _layer(original):
    from triton.runtime import _async_compile
    from triton.runtime.jit import MockTensor

    return _deciding_warmup(MockTensor.wrap_dtype, _async_compile)(original)


PATCH = Patch(__name__, target="triton.runtime.jit.KernelInterface.warmup", modules=("triton",),
              supported=Supported("triton", (3, 6), (3, 9), label="Triton"),
              checked=("3.6.0", "3.8.0", "3.9.0"),
              observe_safe=False,  # it puts replacements into the JIT cache
              layers={Layer("triton.runtime.jit", "KernelInterface.warmup"): _layer})
