"""Emulated shared-memory limit for Inductor's static CUDA launcher: wraps ``load_kernel``.

Why: Inductor loads most of its kernels (in OSS builds, by default) with its own static launcher,
not with Triton's: ``StaticallyLaunchedCudaKernel.load_kernel(device)`` calls C++ that reads the
device's opt-in limit itself (``CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN``) and fails with
``torch.OutOfMemoryError("out of resource: <kernel> Required: N Hardware limit:M ...")`` when a kernel
above 48 KiB needs ``>=`` that limit. Lowering Triton's ``max_shared_mem`` (the ``max_shared_mem``
patch) never reaches it, so without this a big GPU would load torch.compile kernels a small one refuses.
Under ``SMEMGUARD_MAX_SHARED`` the wrapper makes the same check against the emulated limit first and
raises the same error with it, so torch.compile code fails on an H200 exactly as on an L4 or a T4.

Only applied with ``SMEMGUARD_MAX_SHARED``; it changes nothing else (a kernel already loaded, or one
that fits, goes straight to Inductor's loader).

The kernel's ``name``, ``shared`` and ``function`` (None until loaded) and its ``load_kernel``, as each release
defines them (the modules and signatures: docs/MEASURED.md).
"""

from __future__ import annotations

import sys

from ...facts.versions import Supported
from .. import Layer, Patch, wrapt_layer

#: Where the static CUDA launcher lives: torch 2.11 and later, then 2.8 to 2.10.
MODULES = ("torch._inductor.runtime.static_triton_launcher", "torch._inductor.runtime.static_cuda_launcher")

#: The C++ loader checks only kernels above the 48 KiB every CUDA GPU gives without opting in.
_STATIC_SHARED = 49152

#: One layer per home of the launcher; a process imports one of them.
LAYERS = tuple(Layer(module, "StaticallyLaunchedCudaKernel.load_kernel") for module in MODULES)


def _refuse_over_emulated_limit(wrapped, instance, args, kwargs):
    engine = PATCH.engine
    limit = engine.notes.emulated_limit if engine is not None else None
    shared = getattr(instance, "shared", 0)
    if limit is not None and not _loaded(instance, args, kwargs) and shared > _STATIC_SHARED and shared >= limit:
        import torch

        raise torch.OutOfMemoryError(f"out of resource: {instance.name} Required: {shared} Hardware limit:{limit} "
                                     "Reducing block sizes or `num_stages` may help.")
    return wrapped(*args, **kwargs)


def _loaded(instance, args, kwargs) -> bool:
    """Whether the kernel is loaded on the device asked for: its ``function`` (torch 2.8 to 2.13, and 2.14's
    device-bound kernels), or its per-device ``functions`` (2.14's ``device_agnostic`` kernels)."""
    if getattr(instance, "function", None) is not None:
        return True
    device = args[0] if args else kwargs.get("device")
    return device in (getattr(instance, "functions", None) or {})


def _apply(engine) -> None:
    engine.notes.emulated_limit = engine.settings.max_shared
    for layer in LAYERS:
        if hasattr(sys.modules.get(layer.module), "StaticallyLaunchedCudaKernel"):
            layer.add(wrapt_layer(_refuse_over_emulated_limit))


def _remove() -> None:
    for layer in LAYERS:
        layer.remove()


PATCH = Patch(__name__, target=f"{MODULES[0]}.StaticallyLaunchedCudaKernel.load_kernel", modules=MODULES,
              supported=Supported("torch", (2, 8), (2, 15), label="PyTorch"),
              checked=("2.11.0", "2.13.0", "2.14.0", "2.15.0"),
              observe_safe=True,  # observe mode enforces the emulated limit too: that is what it observes
              wanted=lambda settings: settings.max_shared is not None,
              apply=_apply, remove=_remove, present=lambda: any(layer.present() for layer in LAYERS))
