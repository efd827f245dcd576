"""The runtime pruner: :func:`fits`, an autotuner's ``early_config_prune`` that keeps the configs whose
compiled kernel fits the GPU the autotuner runs on (``smemguard.fits``, ``smemguard.fits_for``).

Serving processes import it without the offline checker (:mod:`smemguard.preflight`: process pools,
AST tools); importing it imports neither Triton nor torch.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

from . import introspect

log = logging.getLogger(__name__)


def fits(configs, named_args, **kwargs):
    """``early_config_prune`` that keeps every config whose compiled kernel fits this GPU.

        @triton.autotune(configs, key=["M", "N", "K"], prune_configs_by={"early_config_prune": smemguard.fits})
        @triton.jit
        def kernel(...): ...

    Each config is compiled (not launched) with the launch's own arguments, so in the launch's
    specialization (alignment, sizes equal to 1), and its ``metadata.shared`` is compared with the
    limit Triton enforces on the current device, emulated limits included
    (``SMEMGUARD_MAX_SHARED``). Little is wasted: the compiled kernels are the ones the autotuner
    then benchmarks, from Triton's JIT cache (only configs a ``perf_model`` drops afterwards are
    compiled for nothing). A config that fails to compile in a way the autotuner itself tolerates
    (``PTXASError``, ``CompileTimeAssertionFailure``) is dropped. Never returns an empty list: when
    nothing fits, the config needing the least shared memory is
    kept and a warning is logged (the launch then raises ``OutOfResources``, or smemguard recovers it).

    The kernel is the one of the autotuner calling the pruner, found on the call stack: the
    pruner's signature carries no kernel, and ``triton.autotune(...)`` is applied before the
    ``@triton.jit`` function exists, so it cannot be bound at decoration time. Triton's
    ``Autotuner.prune_configs`` (also in subclasses such as FlagGems' LibTuner) and smemguard's
    recovery both hold the autotuner in a local. For any other caller, use :func:`fits_for`.
    """
    tuner = _calling_autotuner()
    if tuner is None:
        raise TypeError("smemguard.fits is an early_config_prune for triton.autotune; elsewhere use "
                        "smemguard.fits_for(kernel)")
    return _keep_fitting(tuner.fn, configs, named_args, kwargs)


def fits_for(kernel) -> Callable:
    """An ``early_config_prune`` like :func:`fits`, bound to ``kernel`` (the ``@triton.jit`` function,
    or the heuristics over it, that the tuner launches)."""

    def prune(configs, named_args, **kwargs):
        return _keep_fitting(kernel, configs, named_args, kwargs)

    return prune


def _calling_autotuner():
    """The nearest ``Autotuner`` among the locals of the callers of :func:`fits` (``self`` first)."""
    from triton.runtime.autotuner import Autotuner

    frame = sys._getframe(2)
    while frame is not None:
        local_values = frame.f_locals
        candidates = [local_values.get("self"), *local_values.values()]
        for value in candidates:
            if isinstance(value, Autotuner):
                return value
        frame = frame.f_back
    return None


def _keep_fitting(inner, configs, named_args: dict, kwargs: dict) -> list:
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime import driver
    from triton.runtime.errors import PTXASError

    from ..facts.process import effective_limit
    from .launch import resolve

    # What Autotuner._bench turns into an infinite time: the autotuner would never pick these.
    tolerated = (PTXASError, CompileTimeAssertionFailure)
    launch_kwargs = {name: value for name, value in kwargs.items() if name not in ("grid", "warmup")}
    args = tuple(named_args.values())
    limit = effective_limit(driver.active.get_current_device())
    kept, measured = [], []
    for config in configs:
        if config.pre_hook is not None:  # may set TMA block shapes, which the compile depends on
            config.pre_hook({**named_args, **launch_kwargs, **config.all_kwargs()})
        launch = resolve(inner, None, args, {**launch_kwargs, **config.all_kwargs()})
        if launch is None:
            raise TypeError(f"smemguard.fits: {type(inner).__name__} is not a Triton JIT function or heuristics")
        try:
            shared = launch.compile().metadata.shared
        except tolerated as error:
            log.debug("smemguard.fits: %s does not compile: %s", config, introspect.error_summary(error))
            continue
        measured.append((shared, config))
        if shared <= limit:
            kept.append(config)
        else:
            log.debug("smemguard.fits: dropping %s: %d B > %d B", config, shared, limit)
    if kept:
        return kept
    smallest = min(measured, key=lambda pair: pair[0])[1] if measured else configs[0]
    log.warning("smemguard.fits: no config of %s fits the %d B shared-memory limit (%s); keeping the smallest, %s",
                getattr(inner, "__name__", inner), limit,
                ", ".join(f"{shared} B" for shared, _ in measured) or "none compiled", smallest)
    return [smallest]
