"""Tiles that can fit for FlexAttention, chosen before Inductor renders its templates: wraps Inductor's
``CUDAConfigHeuristic.get_flex_attn_fwd_configs`` and ``get_flex_attn_bwd_configs``.

Why: FlexAttention's kernels are templates: Inductor renders the tiles of the config it picks into the
kernel's source, so once a kernel is compiled only its stages can change (the ``inductor_launchers`` patch
does that at load). Inductor picks one config per (capability, dtype, head dim) from fixed tables that
read no shared-memory limit: every 8.x GPU gets the A100's (tuned for 166912 B), and the backward for head
dim 256 needs 131072 B at one stage, more than an L4, RTX 4090 or A10G has at any stage count (pytorch
#133254, #180278; measured: docs/MEASURED.md, smemguard/patches/inductor_flex_configs.py).

What: the wrapper hands each list of configs Inductor's table returns, with the heuristic's head dim and dtype,
to the engine (``engine.on_flex_configs``, :mod:`smemguard.engine.flex`), which replaces a config that cannot fit
at any stage count by the largest halving of its tiles that can, before rendering; a config that may fit is never
touched, so a GPU where Inductor's table fits compiles exactly what it compiled before.

Why a wrapper on the heuristic rather than Inductor's choices hook (``V.set_choices_handler``,
``config.inductor_choices_class``): that hook is one global slot, which vLLM and others set to their own
class; a second setter replaces the first. The wrapper sits on the heuristic every choices class ends up
asking, so it composes with whichever handler is installed.

Inductor's matmul templates are not resized here. Their tiles are also rendered into the source, but
they are used only under max-autotune, where Inductor compiles and benchmarks every choice: a template
kernel loads through ``CachingAutotuner`` like any other (the launcher patch lowers its stages when it
overflows), and a choice that still raises ``OutOfResources`` is dropped ("Ignoring this choice",
``select_algorithm.py``, torch 2.13), with ATen's mm among the choices by default, so no graph fails for
it. Inductor's own shared-memory pruning of mm configs (``max_autotune_prune_choices_based_on_shared_mem``,
off by default) reads the device's real limit: under an emulated limit it prunes as the big GPU would, and
the emulated limit still holds at the load. (Read in the source; not measured on a GPU.)

Inductor's FX graph cache keys a compiled graph by the device's name, not by a limit: under
``SMEMGUARD_MAX_SHARED`` the ``inductor_cache_key`` patch gives the emulated GPU keys of its own.

The configs are ``FlexConfig`` and ``FlexBwDConfig`` dataclasses and the heuristics' arguments are read by name, as
the releases differ (the modules and signatures of each: docs/MEASURED.md).
"""

from __future__ import annotations

import inspect
import logging
import sys
import time

from ...facts.versions import Supported
from .. import Layer, Patch, wrapt_layer

log = logging.getLogger(__name__)

#: Where Inductor's CUDA config heuristic lives: torch 2.14 and later (the module Inductor imports; the old name
#: is a shim Inductor never imports, so a hook on it alone never fires), 2.9 to 2.13, then 2.8.
MODULES = ("torch._inductor.heuristics.template.triton", "torch._inductor.template_heuristics.triton",
           "torch._inductor.template_heuristics")

PASSES = {"forward": "get_flex_attn_fwd_configs", "backward": "get_flex_attn_bwd_configs"}

#: The target in each of them (one per release family).
TARGETS = tuple(f"{module}.CUDAConfigHeuristic.get_flex_attn_fwd_configs" for module in MODULES)

#: One layer per heuristic in each home; a process imports one release, whose home holds the class.
LAYERS = {(module, name): Layer(module, f"CUDAConfigHeuristic.{name}") for module in MODULES
          for name in PASSES.values()}


def _names_its_arguments(function) -> bool:
    """Whether ``function``'s signature (through ``__wrapped__``) names ``head_dim`` and ``dtype``."""
    try:
        return {"head_dim", "dtype"} <= set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return False


def _head_dim_and_dtype(wrapped, args, kwargs) -> tuple:
    """The heuristic's ``head_dim`` and ``dtype``, read by name: torch 2.14 put ``seq_len`` between them in the
    forward's (``(head_dim, seq_len, dtype)``; 2.13: ``(head_dim, dtype)``). Under another tool's layer that takes
    ``*args`` and hides the signature (no ``__wrapped__``), by the convention every release keeps: ``head_dim``
    first, ``dtype`` last."""
    if _names_its_arguments(wrapped):
        arguments = inspect.signature(wrapped).bind(*args, **kwargs).arguments
        return arguments["head_dim"], arguments["dtype"]
    head_dim = kwargs["head_dim"] if "head_dim" in kwargs else args[0]
    return head_dim, kwargs["dtype"] if "dtype" in kwargs else args[-1]


def _wrapper(kind: str):
    def offer(wrapped, instance, args, kwargs):
        configs = wrapped(*args, **kwargs)
        engine = PATCH.engine
        if engine is None:  # uninstalled while another tool's layer kept ours alive
            return configs
        started, steps = time.perf_counter(), engine.steps(f"FlexAttention {kind}")
        read = None
        with steps.skippable("read the heuristic's arguments"):
            read = _head_dim_and_dtype(wrapped, args, kwargs)
        if read is not None:
            return engine.on_flex_configs(kind, list(configs), *read, started, steps)
        return configs

    return offer


_WRAPPERS = {kind: _wrapper(kind) for kind in PASSES}


def _apply(engine) -> None:
    layered = {id(owner) for (module, _), layer in LAYERS.items() if layer.present()
               for owner in [getattr(sys.modules.get(module), "CUDAConfigHeuristic", None)]}
    for module in MODULES:  # the first module defining the class; a package re-exporting it names the same class
        owner = getattr(sys.modules.get(module), "CUDAConfigHeuristic", None)
        if owner is None or id(owner) in layered:
            continue
        layered.add(id(owner))
        for kind, name in PASSES.items():
            if hasattr(owner, name):
                _check_parameters(owner, name)
                LAYERS[(module, name)].add(wrapt_layer(_WRAPPERS[kind]))


def _check_parameters(owner, name: str) -> None:
    """The patch-time check: the heuristic takes ``head_dim`` and ``dtype`` by those names, or sits under another
    tool's ``*args`` layer (read by the convention then, see :func:`_head_dim_and_dtype`)."""
    function = getattr(owner, name)
    parameters = inspect.signature(function).parameters.values()
    hidden = any(parameter.kind is inspect.Parameter.VAR_POSITIONAL for parameter in parameters)
    if not (_names_its_arguments(function) or hidden):
        raise TypeError(f"{owner.__qualname__}.{name}{inspect.signature(function)} takes no head_dim and dtype "
                        "parameters")


def _remove() -> None:
    for layer in LAYERS.values():
        layer.remove()


#: The target named where torch 2.9 to 2.13 have it.
PATCH = Patch(__name__, target=TARGETS[1], modules=MODULES,
              supported=Supported("torch", (2, 8), (2, 15), label="PyTorch"),
              checked=("2.11.0", "2.13.0", "2.14.1", "2.15.0"),
              observe_safe=False,  # changes the tiles Inductor renders
              apply=_apply, remove=_remove, present=lambda: any(layer.present() for layer in LAYERS.values()))
