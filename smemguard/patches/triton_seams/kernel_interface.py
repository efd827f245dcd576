"""Launch guard: replaces ``triton.runtime.jit.KernelInterface.__getitem__``.

Why: ``kernel[grid](*args)`` is how JIT functions, autotuners and heuristics are launched;
``__getitem__`` returns a small closure that calls ``kernel.run(grid=grid, warmup=False, ...)``.
Our closure is the same call inside a ``try``, whose ``except OutOfResources`` hands the
failed launch (kernel object, grid, arguments, and a way to run it again as asked) to the engine
(``engine.on_out_of_resources``, ``engine.recovery.handle``). While the call runs, the launch is the thread's
launch in progress (``facts.process.launching``): a compile it causes (a JIT cache miss, an autotuner timing a
config) is recorded with the launch's shapes, grid and config, which the compile alone does not know. The error
is raised on the host before anything is enqueued (``CompiledKernel._init_handles``), so the launch can be
retried with the same buffers.

Why not a wrapt wrapper here, unlike the other patches: this sits on every kernel launch,
and a ``try`` costs nothing until it catches (CPython 3.11+; noting the launch in progress is two assignments
to a thread-local), while a wrapt descriptor
adds a bound-wrapper object and two calls to each launch (see
``benchmarks/launch_overhead.py``). The replacement is a plain function that builds the
same closure the original builds, so a healthy launch runs the same number of Python frames.

Launches that bypass ``__getitem__`` (``kernel.run(..., grid=g, warmup=False)`` directly,
the autotuner's benchmarking, ``CompiledKernel[grid]``) are not guarded; the autotuner must
keep seeing overflowing configs as infinitely slow.

In every release checked, ``__getitem__`` is defined once, on ``KernelInterface``, and no subclass in
Triton overrides it.
"""

from __future__ import annotations

import functools

from ...facts.process import launching
from .. import TRITON, TRITON_CHECKED, Layer, Patch, bound


def _guarded_getitem(out_of_resources, triton_getitem):
    """A ``__getitem__`` whose launcher is the one below it inside a ``try``. Over Triton's own, it
    builds Triton's launcher itself (one frame per launch, as unpatched); over another tool's layer it
    calls that layer, so the other tool still sees every launch."""

    def build(below):
        if below is triton_getitem:

            def __getitem__(self, grid):

                def launch(*args, **kwargs):
                    outer = launching.current
                    launching.current = (self, grid, args, kwargs, False)
                    try:
                        return self.run(*args, grid=grid, warmup=False, **kwargs)
                    except out_of_resources as error:
                        again = functools.partial(self.run, *args, grid=grid, warmup=False, **kwargs)
                        return _recovered(self, grid, args, kwargs, error, again)
                    finally:
                        launching.current = outer

                return launch

            return __getitem__

        def __getitem__(self, grid):
            launcher = bound(below, self)(grid)

            def launch(*args, **kwargs):
                outer = launching.current
                launching.current = (self, grid, args, kwargs, False)
                try:
                    return launcher(*args, **kwargs)
                except out_of_resources as error:
                    return _recovered(self, grid, args, kwargs, error, functools.partial(launcher, *args, **kwargs))
                finally:
                    launching.current = outer

            return launch

        return __getitem__

    return build


def _recovered(kernel, grid, args, kwargs, error, again):
    engine = PATCH.engine
    if engine is None:  # uninstalled while another tool's layer kept ours alive
        raise error
    engine.notes.note_failed_launch(error, kernel, grid, args, kwargs)  # for a wrapper run again, and its record
    return engine.on_out_of_resources(kernel, grid, args, kwargs, error, again)


def _layer(below):
    """Route every ``OutOfResources`` of a ``kernel[grid](...)`` launch to the engine."""
    from triton.runtime.errors import OutOfResources

    return _guarded_getitem(OutOfResources, _triton_getitem())(below)


def _triton_getitem():
    """Triton's own ``KernelInterface.__getitem__``, under any layers."""
    import inspect

    from triton.runtime.jit import KernelInterface

    return inspect.unwrap(KernelInterface.__dict__["__getitem__"])


PATCH = Patch(__name__, target="triton.runtime.jit.KernelInterface.__getitem__", modules=("triton",),
              supported=TRITON, checked=TRITON_CHECKED,
              observe_safe=True,  # the engine records and re-raises in observe mode
              layers={Layer("triton.runtime.jit", "KernelInterface.__getitem__"): _layer})
