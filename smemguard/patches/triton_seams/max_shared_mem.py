"""Emulated shared-memory limit: wraps ``triton.compiler.compiler.max_shared_mem``.

Why: ``CompiledKernel._init_handles`` compares ``metadata.shared`` with
``max_shared_mem(device)`` before loading a kernel; it is Triton's only shared-memory check
(the autotuner's benchmarking goes through it too). Returning ``min(device limit, emulated
limit)`` there makes a big GPU raise Triton's own ``OutOfResources`` exactly where a small
one would, so the failures of an L4 reproduce on an H200.

Only the limit Triton enforces changes here; what torch and vLLM report of the device follows in
``patches/torch_seams/torch_device_properties`` and ``patches/contrib/vllm_shared_memory``. The emulated limit is
noted on the
engine (:attr:`smemguard.facts.install.Notes.emulated_limit`), where its records read it.

The same function, an ``lru_cache`` over the device index, in every release checked.
"""

from __future__ import annotations

from .. import TRITON, TRITON_CHECKED, Layer, Patch, wrapt_layer


def _min_with_emulated(wrapped, instance, args, kwargs):
    device_limit = wrapped(*args, **kwargs)
    engine = PATCH.engine
    limit = engine.notes.emulated_limit if engine is not None else None
    return device_limit if limit is None else min(device_limit, limit)


def _set_emulated_limit(engine) -> None:
    engine.notes.emulated_limit = engine.settings.max_shared


PATCH = Patch(__name__, target="triton.compiler.compiler.max_shared_mem", modules=("triton",), supported=TRITON,
              checked=TRITON_CHECKED,
              observe_safe=True,  # observe mode enforces the emulated limit too: that is what it observes
              wanted=lambda settings: settings.max_shared is not None,
              layers={Layer("triton.compiler.compiler", "max_shared_mem"): wrapt_layer(_min_with_emulated)},
              apply=_set_emulated_limit)
