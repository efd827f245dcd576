"""Pins applied where every kernel is compiled: at ``triton.compile`` (``patches/triton_seams/triton_compile``),
before Triton
compiles, the options an operator pinned for the kernel on this GPU (:mod:`smemguard.facts.pins`) replace the ones
asked for.

Why there and not at the JIT's cache miss (``patches/triton_seams/jit_compile``, where stored decisions apply): a pin
must be
refused when its variant does not fit, and only the compile seam holds both the compiled kernel and Triton's own
compile to compile again as asked; at the JIT's miss, an overflowing pinned variant would pass the core and be
fitted to fewer stages still (and under Triton's ``AsyncCompileMode`` the miss gets a future, no kernel). The seam
also serves every compile the JIT's miss never sees (Triton 3.4, warm-ups, library tuners, torch.compile's): one
place applies pins, for all of them. Stored decisions keep their place: one the JIT applied lowered the options
already, and a pin lowers them further or leaves them (a pin is a ceiling); a variant stored as overflowing at any
stage count is refused before compiling, pin or not.

A pin applies only where it lowers what was asked (the variant recovery itself could compile: fewer stages or
warps, the same tiles and grid, the same answer), with the kernel's pipeline-depth parameters lowered with it, and
is refused with one line where the kernel computes with a parameter named like the option (the keyword sets both)
or where its variant needs more shared memory than the limit: the kernel is then compiled as asked and fitted as
without the pin, at the cost of the one compile the refused pin took. One compile when it applies, and one record
(``action: pinned``) per kernel, GPU and pin in a process: a decision taken before deployment, never a failure.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import types
from typing import Any

from ..facts import gpus, pins, process
from ..kernels import introspect
from ..store import decision_cache, incidents
from ..store.decision import PINNED, SHARED
from . import compile_fit, recall
from .steps import Steps

log = logging.getLogger(__name__)

def in_force(settings) -> tuple[pins.Pin, ...]:
    """The pins of this process: the ``SMEMGUARD_PINS`` file's, and the decision cache's it does not override."""
    store = decision_cache.store(settings.cache_dir)
    if store is None or not store.holds("pins"):  # every compile asks: a stat of the file, no more
        return settings.pins
    return pins.in_force(settings.pins, (pins.of(entry, pins.CACHE_ORIGIN) for entry in store.entries("pins").values()))


def gpu_names(settings, device: int) -> tuple[str, ...]:
    """The names a pin may call the GPU by: the emulated one's under ``SMEMGUARD_MAX_SHARED=<GPU>`` (the process
    behaves as that GPU), none when it emulates a byte count, else torch's name of the device."""
    named = settings.max_shared_label if settings.max_shared is not None else process.gpu_name(device)
    known = gpus.lookup(named) if named else None
    return (known.name,) if known is not None else ()


def arch_text(arch) -> str:
    """A target's arch as pins name it: ``sm_89`` for Triton's 89, ``gfx942`` (its features left out)."""
    return f"sm_{arch}" if isinstance(arch, int) else str(arch).split(":")[0]


def pinned_compile(engine, compile_fn, args: tuple, kwargs: dict):
    """The kernel ``compile_fn(*args, **kwargs)`` compiles, compiled with the pin that applies to it here, or None:
    no pin applies (nothing to lower), or it was refused (one line): the caller compiles as asked."""
    from triton.compiler.compiler import ASTSource, make_backend

    from ..kernels.parameters import OptionIsAParameter, lowered_constexprs

    source, target, options, rest = compile_fit.compile_arguments(args, kwargs)
    jit = getattr(source, "fn", None)
    if not isinstance(source, ASTSource) or jit is None:
        return None
    declared = in_force(engine.settings)
    device = compile_fit.loading_device(target) if declared else None
    if device is None:
        return None
    from triton.runtime import driver

    current = driver.active.get_current_target()
    name, limit = introspect.kernel_name(jit), process.effective_limit(device)
    pin = pins.applying(declared, name, gpu_names(engine.settings, device), arch_text(current.arch), limit)
    if pin is None:
        return None
    asked = make_backend(target or current).parse_options(dict(options or {}))
    changes = {option: value for option, value in pin.options().items() if value < getattr(asked, option)}
    if not changes:  # it asks for as few: compiled as asked
        return None
    why = recall.options_problem(changes, asked.num_stages, asked.num_warps, getattr(asked, "warp_size", 32))
    try:
        constants = lowered_constexprs(jit, source.constants, changes) if why is None else None
    except OptionIsAParameter as error:
        why = str(error)
    if why is not None:
        return _refused(pin, name, device, why)
    try:
        kernel = compile_fn(ASTSource(jit, source.signature, constants, source.attrs), target,
                            {**(options or {}), **changes}, **rest)
    except Exception as error:  # Triton's own refusal of the options (the kernel as asked may compile)
        return _refused(pin, name, device, f"its variant does not compile ({introspect.error_summary(error)})")
    started = time.perf_counter()
    shared = kernel.metadata.shared
    if shared > limit:
        return _refused(pin, name, device, f"its variant needs {shared} B, over the {limit} B limit here")
    lowered = compile_fit.changed_parameters(jit, source.constants, constants)
    if engine.memory.first("pinned", (name, device, limit, pin)):
        steps = Steps(name)
        with steps.skippable("record the pin"):
            _record(engine, pin, _Compiled(source, asked, kernel, device, limit, started), {**changes, **lowered},
                    steps)
    engine.notes.note_replacement(jit, device, None, kernel)  # uninstall() takes it out of the JIT cache again
    return kernel


def _refused(pin: pins.Pin, name: str, device: int, why: str) -> None:
    process.warn_once(log, ("pin refused", pin, name, device), "smemguard: the pin %s (%s) is refused for %s: %s; "
                      "compiled as without it", pin.text(), pin.origin, name, why)
    return None


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """A kernel compiled with a pin's options in place of those asked, on a device and its limit."""

    source: Any  # the ASTSource it was compiled from
    asked: Any  # the options as asked, parsed by the backend
    kernel: Any  # as compiled with the pin's options
    device: int
    limit: int
    started: float


def _record(engine, pin: pins.Pin, compiled: _Compiled, chosen: dict, steps: Steps) -> None:
    """The one record of ``pin`` applying to a compile: the compile as asked (and the launch that caused it), the
    options the pin ``chosen`` (with the parameters lowered with them) and the bytes that needs."""
    source, asked, kernel, device, limit = (compiled.source, compiled.asked, compiled.kernel, compiled.device,
                                            compiled.limit)
    name = introspect.kernel_name(source.fn)
    # The kernel as asked was never compiled: what its description reads of it is its options.
    as_asked = types.SimpleNamespace(metadata=types.SimpleNamespace(num_warps=asked.num_warps,
                                                                      num_stages=asked.num_stages))
    described = compile_fit.compile_description(source, as_asked)
    described.pop("phase", None)  # a pin applies at the compile, whoever caused it
    shared = kernel.metadata.shared
    final = ", ".join(f"{option}={value}" for option, value in chosen.items())
    incident = incidents.Incident(
        kernel=name, launched_as=compile_fit.LAUNCHED_AS, phase="compile", action=PINNED, final=final,
        resource=SHARED, required=shared, limit_hit=limit, started=compiled.started, device=device,
        internal_steps=steps.failed, reason=f"pinned by {pin.origin}: {pin.text()}",
        attempts=[{**chosen, "shared": shared}], compiles=1, extras=described)
    incidents.report(incident, engine.settings.log_path, ("pinned", name, device, limit, pin),
                     "smemguard: %s: compiled with %s (%d B of %d) as pinned by %s", name, final, shared, limit,
                     pin.origin, level=logging.INFO)
