"""Launch guard: replaces ``triton.runtime.jit.KernelInterface.__getitem__``.

Why: ``kernel[grid](*args)`` is how JIT functions, autotuners and heuristics are launched;
``__getitem__`` returns a small closure that calls ``kernel.run(grid=grid, warmup=False, ...)``.
Our closure is the same call inside a ``try``, whose ``except OutOfResources`` hands the
failed launch (kernel object, grid, arguments, and a way to run it again as asked) to the engine
(``context.on_out_of_resources``, :func:`smemguard.recovery.handle`). The error is raised on the host before anything is
enqueued (``CompiledKernel._init_handles``), so the launch can be retried with the same buffers.

Why not a wrapt wrapper here, unlike the other patches: this sits on every kernel launch,
and a ``try`` costs nothing until it catches (CPython 3.11+), while a wrapt descriptor
adds a bound-wrapper object and two calls to each launch (see
``benchmarks/launch_overhead.py``). The replacement is a plain function that builds the
same closure the original builds, so a healthy launch runs the same number of Python frames.

Launches that bypass ``__getitem__`` (``kernel.run(..., grid=g, warmup=False)`` directly,
the autotuner's benchmarking, ``CompiledKernel[grid]``) are not guarded; the autotuner must
keep seeing overflowing configs as infinitely slow.

Checked against Triton 3.4.0, 3.5.1, 3.6.0, 3.7.1, 3.8.0 and 3.9.0: ``__getitem__`` is
defined once, on ``KernelInterface``, and no subclass in Triton overrides it.
"""

from __future__ import annotations

import functools

from . import TRITON, Layer, bound

TARGET = "triton.runtime.jit.KernelInterface.__getitem__"
TARGET_MODULES = ("triton",)
SUPPORTED = TRITON
OBSERVE_SAFE = True  # the engine records and re-raises in observe mode

_LAYER = Layer("triton.runtime.jit", "KernelInterface.__getitem__")


def applies(settings) -> bool:
    return True


def _guarded_getitem(out_of_resources, on_out_of_resources, triton_getitem):
    """A ``__getitem__`` whose launcher is the one below it inside a ``try``. Over Triton's own, it
    builds Triton's launcher itself (one frame per launch, as unpatched); over another tool's layer it
    calls that layer, so the other tool still sees every launch."""

    def build(below):
        if below is triton_getitem:

            def __getitem__(self, grid):

                def launch(*args, **kwargs):
                    try:
                        return self.run(*args, grid=grid, warmup=False, **kwargs)
                    except out_of_resources as error:
                        again = functools.partial(self.run, *args, grid=grid, warmup=False, **kwargs)
                        return on_out_of_resources(self, grid, args, kwargs, error, again)

                return launch

            return __getitem__

        def __getitem__(self, grid):
            launcher = bound(below, self)(grid)

            def launch(*args, **kwargs):
                try:
                    return launcher(*args, **kwargs)
                except out_of_resources as error:
                    return on_out_of_resources(self, grid, args, kwargs, error, functools.partial(launcher, *args,
                                                                                                  **kwargs))

            return launch

        return __getitem__

    return build


def patch(context) -> None:
    """Route every ``OutOfResources`` of a ``kernel[grid](...)`` launch to ``context.on_out_of_resources``."""
    from triton.runtime.errors import OutOfResources

    _LAYER.add(_guarded_getitem(OutOfResources, context.on_out_of_resources, _triton_getitem()))


def _triton_getitem():
    """Triton's own ``KernelInterface.__getitem__``, under any layers."""
    import inspect

    from triton.runtime.jit import KernelInterface

    return inspect.unwrap(KernelInterface.__dict__["__getitem__"])


def unpatch() -> None:
    _LAYER.remove()


def is_patched() -> bool:
    return _LAYER.present()
