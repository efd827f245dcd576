"""Decisions at warm-up: replaces ``triton.runtime.jit.KernelInterface.warmup``.

Why: vLLM 0.33 compiles many Triton kernels at start-up without launching them
(``vllm/model_executor/warmup/jit_warmup_triton_helper.py`` calls ``kernel.warmup(grid=(1,),
**kwargs)``), and so can any program (``kernel.warmup(...)``). A kernel compiled there that
exceeds the limit is known before the first request, from its ``metadata.shared``: the engine
(``context.on_warmup``, :func:`smemguard.recovery.handle_warmup`) decides its replacement then
and puts it into Triton's JIT cache under the same key, so the first request pays no exception
and no compile. ``warmup`` returns the kernel that will run. Nothing is launched: a tuned
kernel (whose candidates would be timed by launching them) is left to its first launch, and so
is any decision that cannot live in the JIT cache (another config, a fallback).

The replacement is a plain function calling the original, like the launch guard: ``warmup``
is not on the launch path, but one frame more or less keeps the two patches alike.
``Autotuner.warmup`` (which compiles every config, overflowing ones included, as the
autotuner's benchmarking will see them) is not touched.

Checked against Triton 3.6.0 and 3.9.0: ``KernelInterface.warmup(self, *args, grid, **kwargs)``
returns ``self.run(grid=grid, warmup=True, *map(MockTensor.wrap_dtype, args), **kwargs)``.
Triton 3.4 defines ``warmup`` on ``JITFunction`` instead; there the decision is taken at the
first launch.
"""

from __future__ import annotations

from ..versions import Supported

TARGET = "triton.runtime.jit.KernelInterface.warmup"
TARGET_MODULES = ("triton",)
SUPPORTED = Supported("triton", (3, 6), (3, 10), label="Triton")
OBSERVE_SAFE = False  # it puts replacements into the JIT cache

_original = None


def applies(settings) -> bool:
    return True


def _kernel_interface():
    from triton.runtime.jit import KernelInterface

    return KernelInterface


def _make_deciding_warmup(original, wrap_dtype, on_warmup):

    def warmup(self, *args, grid, **kwargs):
        kernel = original(self, *args, grid=grid, **kwargs)
        return on_warmup(self, grid, tuple(map(wrap_dtype, args)), kwargs, kernel)

    warmup.__smemguard__ = True
    return warmup


def patch(context) -> None:
    global _original
    if is_patched():
        return
    from triton.runtime.jit import MockTensor

    cls = _kernel_interface()
    _original = cls.__dict__["warmup"]
    cls.warmup = _make_deciding_warmup(_original, MockTensor.wrap_dtype, context.on_warmup)


def unpatch() -> None:
    global _original
    if not is_patched():
        return
    _kernel_interface().warmup = _original
    _original = None


def is_patched() -> bool:
    return getattr(_kernel_interface().__dict__.get("warmup"), "__smemguard__", False)
