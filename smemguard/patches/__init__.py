"""One module per patched target, all with one contract, listed once in :data:`MODULES`.

Each module defines:

``TARGET``
    what it patches, dotted (``"triton.runtime.jit.KernelInterface.__getitem__"``);
``TARGET_MODULES``
    the modules whose import (re)applies it: ``("triton",)`` for Triton's, the library's
    modules for a known kernel;
``SUPPORTED``
    a :class:`smemguard.versions.Supported`: the releases its target was read and tested
    against. Outside that range the module is not applied: one log line, target untouched;
``OBSERVE_SAFE``
    whether it applies in ``SMEMGUARD=observe`` (it only enforces the emulated limit,
    records, or describes kernels to the engine; nothing that changes what runs);
``applies(settings)``
    whether these settings want it at all (no emulated limit: no ``max_shared_mem`` patch);
``patch(context)``, ``unpatch()``
    idempotent; ``context`` is a :class:`PatchContext`. ``unpatch`` removes only smemguard's
    own layer and tolerates partial state;
``is_patched()``
    whether the target carries smemguard's layer now, read from the target itself.

The Triton patches (``SUPPORTED.package == "triton"``) are applied together at install, all or
nothing; the others each when one of their ``TARGET_MODULES`` is imported.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import wrapt

from ..versions import Supported

#: The Triton releases smemguard was read and tested against as a whole; a Triton patch may
#: declare a narrower ``SUPPORTED`` (it is then skipped outside it, the rest still applies).
TRITON = Supported("triton", (3, 4), (3, 10), label="Triton")

#: Every patch module, in the order they are applied (and removed in reverse).
MODULES = (
    "max_shared_mem",
    "autotuner_bench",
    "jit_compile",
    "kernel_interface",
    "kernel_warmup",
    "vllm_batch_invariant",
    "deepgemm_metadata",
    "flaggems",
    "vllm_unified_attention",
    "vllm_prefill_attention",
    "vllm_prefix_prefill",
)


@dataclass(frozen=True)
class PatchContext:
    """What a patch may use: the settings it was installed with and the engine's entry points."""

    settings: Any  # smemguard.settings.Settings
    #: (kernel, grid, args, kwargs, error) -> what the launch returns, or raises
    on_out_of_resources: Callable[..., Any]
    #: (jit, jit_key, device) -> option overrides remembered for that compile ({"num_stages": 3}) or None
    remembered_options: Callable[..., Any]
    #: (kernel, grid, args, kwargs, compiled) -> the compiled kernel that will run (a replacement when it did not fit)
    on_warmup: Callable[..., Any]


def modules() -> tuple[ModuleType, ...]:
    return tuple(importlib.import_module(f"{__name__}.{name}") for name in MODULES)


def triton_modules() -> tuple[ModuleType, ...]:
    return tuple(module for module in modules() if module.SUPPORTED.package == "triton")


def library_modules() -> tuple[ModuleType, ...]:
    return tuple(module for module in modules() if module.SUPPORTED.package != "triton")


def wrap(module_name: str, name: str, wrapper) -> None:
    """Wrap ``module.name`` (a dotted name: "Autotuner._bench") with a wrapt function wrapper."""
    wrapt.wrap_function_wrapper(module_name, name, wrapper)


def rebind(name: str, old, new) -> None:
    """Point every loaded module whose global ``name`` is ``old`` at ``new``: callers that
    imported a wrapped function by name (``from module import function``) keep the object
    they imported, so wrapping its defining module alone does not reach them."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(name) is old:
            setattr(module, name, new)


def _owner_and_attr(module_name: str, name: str):
    owner = importlib.import_module(module_name)
    *parents, attr = name.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, attr


def _layers(module_name: str, name: str):
    """The objects at ``module.name``, outermost first, following ``__wrapped__``."""
    owner, attr = _owner_and_attr(module_name, name)
    layer = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    while layer is not None:
        yield layer
        layer = getattr(layer, "__wrapped__", None)


def _is_wrapt_layer(obj, wrapper=None) -> bool:
    ours = getattr(obj, "_self_wrapper", None)
    return ours is not None if wrapper is None else ours is wrapper


def find_wrapper(module_name: str, name: str, wrapper):
    """Our wrapt layer on ``module.name``, wherever it sits in a chain of wrappers, or None."""
    return next((layer for layer in _layers(module_name, name) if _is_wrapt_layer(layer, wrapper)), None)


def unwrap(module_name: str, name: str, wrapper) -> bool:
    """Remove only our layer from ``module.name``: the outermost one, or one under another tool's.

    Returns False when our layer is not there (never patched, or already removed), or when
    the layer above ours is not a wrapt wrapper and so cannot be re-pointed.
    """
    owner, attr = _owner_and_attr(module_name, name)
    above = None
    for layer in _layers(module_name, name):
        if _is_wrapt_layer(layer, wrapper):
            if above is None:
                setattr(owner, attr, layer.__wrapped__)
                return True
            if _is_wrapt_layer(above):  # another tool wrapped on top of us: splice our layer out
                above.__wrapped__ = layer.__wrapped__
                return True
            return False
        above = layer
    return False
