"""The compile-time core: a kernel that will not fit is compiled again with fewer stages before anything
loads it (``patches/triton_seams/triton_compile``, on Triton's public ``triton.compile``).

Every Triton kernel is compiled by ``triton.compile(src, target, options)``: plain launches, autotuners
and library tuners, warm-ups, Inductor's templates, pointwise and user kernels. The compiled kernel's
``metadata.shared`` is known there, before Triton's load check (``CompiledKernel._init_handles``) would
raise ``OutOfResources``. When it exceeds the limit of the device the kernel will load on (the emulated
limit under ``SMEMGUARD_MAX_SHARED``), :func:`fit` compiles the same source with fewer stages, the
kernel's pipeline-depth parameters lowered with them (:mod:`smemguard.kernels.parameters`, as the ladder does), and
hands the caller the variant that fits: the same tiles, the same grid, the same answer bitwise (only
pipelining changed). Nothing of the caller's is involved, so no release of torch, vLLM or a library can
step around it.

Rules, and why:

* **The device.** The limit is read only for a compile whose target is the current device's (``target``
  None, or equal to it) in a process that uses its GPU: Triton's driver is active, or torch has initialised
  CUDA (Inductor's parent, which loads what it compiles). A cross-compile (another arch) or a compile-only
  process (Inductor's compile workers, which start neither) is left as compiled: nothing there says which
  GPU will load it. The process that loads it compiles the same
  source again from Triton's cache (Inductor's parent does, in ``_precompile_config``) and is fitted
  there; the launch guard and the Inductor load patch remain behind it.
* **Threads** are known only when the kernel loads (the device's thread limit is not a compile input):
  a kernel with too many warps is left to the launch guard, which lowers its warps.
* **The autotuner's benchmark** (``Autotuner._bench``, a library tuner's, Inductor's) times each config as
  the kernel that will run: the JIT caches the fitting variant under the config's own key, so a config
  chosen for its fewer-stage variant's time launches exactly what was timed. (Counted as failed, an
  overflowing config could only lose a faster kernel that fits; timing its variant raises nothing.) The next
  process's benchmark times the stored
  fitting variant (``patches/triton_seams/jit_compile`` compiles it directly), so it chooses as the first did; a
  config the
  decision cache stores as switched away from is still refused before compiling there.
* **smemguard's own searches** (the launch guard's ladder, Inductor recovery, warm-up decisions)
  compile variants that must be measured as they are: the core stands aside while one runs, and so does
  :func:`smemguard.engine.recall.remembered_compile` (the compile seams test the engine's ``compiling``,
  :data:`smemguard.facts.process.engine_compiling`, process-wide, since the ladder compiles on a pool).
* **What stages cannot fix** (a kernel with no loop to pipeline, a loop with its own fixed depth, one
  stage already, or a source that is not a Triton function) is returned as compiled, for the launch
  guard to decide (other configs, alternatives, fallbacks).

Before Triton compiles a variant at a JIT cache miss (``patches/triton_seams/jit_compile``), what the decision cache
holds of it (the fewer-stage or fewer-warp options to compile instead, or the ``OutOfResources`` it would raise,
raised before compiling it) is :func:`smemguard.engine.recall.remembered_compile`'s: the one place a stored decision
is read and checked, whatever the path.

An operator's pins apply at the same seam, before Triton compiles (:mod:`smemguard.engine.pins`, which uses
:func:`compile_arguments`, :func:`loading_device` and :func:`compile_description` of this module).

One incident record per case (``phase: "compile"``, ``launched_as: "triton.compile"``), counted in the
metrics, and a ``compile`` decision keyed as the launch guard keys it: the next process's JIT compiles
the fitting variant first (``patches/triton_seams/jit_compile``), and this one compiles it from the store when Triton
has no ``_do_compile`` (3.4) or the caller is not the JIT (Inductor). At most ``stages - 1`` compiles, one
or two when the bytes per stage are linear (the usual case), none from a stored decision but the variant's.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from typing import Any

from ..facts import process
from ..kernels import introspect, recorded, variants
from ..store import decision_cache, incidents
from ..store.decision import AUTOTUNE_SKIPPED, SHARED, STAGES_REDUCED
from . import recall
from .candidates import FewerStages
from .steps import StepFailed, Steps

log = logging.getLogger(__name__)

LAUNCHED_AS = "triton.compile"


@dataclasses.dataclass(frozen=True)
class _Overflowing:
    """A kernel Triton compiled that will not fit the device it loads on, and the guard around smemguard's own steps
    in handling it."""

    source: Any  # what it was compiled from (an ASTSource for a @triton.jit kernel)
    kernel: Any  # as compiled
    device: int
    required: int  # its shared memory
    limit: int
    steps: Steps


def fit(engine, compile_fn, args: tuple, kwargs: dict, kernel):
    """``kernel`` (what ``compile_fn(*args, **kwargs)`` returned), or a fewer-stage compile of the same
    source that fits the device it will load on. Never raises."""
    try:
        overflow = _overflow(args, kwargs, kernel)
    except Exception:
        log.debug("smemguard: could not read the compiled kernel's fit", exc_info=True)
        return kernel
    if overflow is None:
        return kernel
    steps = Steps(_name(args))
    overflowing = _Overflowing(compile_arguments(args, kwargs)[0], kernel, *overflow, steps)
    fitted = None
    try:
        fitted = _refit(engine, compile_fn, args, kwargs, overflowing)
    except StepFailed:  # logged where it failed: the kernel is handed on as compiled, the launch guard behind it
        pass
    except Exception:
        steps.note("fit the compiled kernel", "it is handed on as compiled")
    if fitted is None and _timing_a_triton_config():
        with steps.skippable("record the skipped config"):
            _record_skipped(engine, overflowing)
    return kernel if fitted is None else fitted


def _timing_a_triton_config() -> bool:
    """Whether an autotuner built on Triton's is timing a config on this thread (``Autotuner._bench``): it counts a
    config that does not fit as failed and chooses another, so nothing the caller asked for fails. (Inductor's
    choices are recorded by its load recovery, which compiles candidates of its own first.)"""
    return bool(process.benchmarking) and not isinstance(process.benchmarking.value, process.TimedChoice)


def _name(args) -> str:
    source = args[0] if args else None
    return introspect.kernel_name(getattr(source, "fn", None) or "a compiled kernel")


def compile_arguments(args: tuple, kwargs: dict):
    """(source, target, options, the other keywords) of a ``compile(src, target=None, options=None, ...)`` call."""
    names = ("src", "target", "options")
    bound = dict(zip(names, args))
    rest = {name: value for name, value in kwargs.items() if name not in names}
    bound.update({name: kwargs[name] for name in names if name in kwargs})
    return bound.get("src"), bound.get("target"), bound.get("options"), rest


def _overflow(args, kwargs, kernel) -> tuple[int, int, int] | None:
    """(device, the bytes it needs, the limit) when ``kernel`` will not fit the current device; else None."""
    metadata = getattr(kernel, "metadata", None)
    shared = getattr(metadata, "shared", None)
    if not isinstance(shared, int):
        return None
    device = loading_device(compile_arguments(args, kwargs)[1])
    if device is None:
        return None
    limit = process.effective_limit(device)
    return (device, shared, limit) if shared > limit else None


def loading_device(target) -> int | None:
    """The device a kernel compiled for ``target`` will load on: the current one, in a process that uses its GPU;
    None for a compile-only process (a compile worker: no device to read a limit from) or a cross-compile."""
    from triton.runtime import driver

    if getattr(driver, "_active", True) is None and not _gpu_in_use():
        return None
    if target is not None and target != driver.active.get_current_target():
        return None
    return process.current_device()


def _gpu_in_use() -> bool:
    """Whether this process already uses its GPU through torch (Inductor's parent process, which loads what it
    compiles), so that starting Triton's driver here initialises nothing new."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def _refit(engine, compile_fn, args, kwargs, overflowing: _Overflowing):
    """A fewer-stage compile of the overflowing kernel's source that fits, recorded and stored; None when none
    does."""
    from triton.compiler.compiler import ASTSource

    from ..kernels.parameters import OptionIsAParameter, knobs_of, lowered_constexprs

    settings, kernel, steps = engine.settings, overflowing.kernel, overflowing.steps
    device, required, limit = overflowing.device, overflowing.required, overflowing.limit
    source, target, options, rest = compile_arguments(args, kwargs)
    stages = kernel.metadata.num_stages
    jit = getattr(source, "fn", None)
    if not isinstance(source, ASTSource) or stages <= 1 or jit is None:
        return None
    futile = stored = None
    with steps.skippable("read the kernel's loops"):
        futile = knobs_of(jit).stages_futile()
    if futile:
        return None
    started = time.perf_counter()
    with steps.required("key the variant"):
        case = _case(jit, kernel, device)
    with steps.skippable("read the decision cache"):
        stored = recall.stored_stages(settings.cache_dir, case[0], stages, kernel)
    attempts = []

    def compile_at(count: int):
        try:
            constants = lowered_constexprs(jit, source.constants, {"num_stages": count})
        except OptionIsAParameter:
            return None
        variant = ASTSource(jit, source.signature, constants, source.attrs)
        compiled = compile_fn(variant, target, {**(options or {}), "num_stages": count}, **rest)
        attempts.append({"num_stages": count, **changed_parameters(jit, source.constants, constants),
                         "shared": compiled.metadata.shared})
        return compiled

    with process.engine_compiling.scope():
        fitted = compile_at(stored) if stored else None
        if fitted is None or fitted.metadata.shared > limit:
            fitted = _fewer_stages(compile_at, stages, required, limit)
    if fitted is None or fitted.metadata.shared > limit:
        return None
    count = fitted.metadata.num_stages
    final = ", ".join(f"{name}={value}" for name, value in next(attempt for attempt in reversed(attempts)
                                                                  if attempt["num_stages"] == count).items()
                      if name != "shared")
    _record(engine, overflowing, fitted, final, attempts, remembered=bool(stored and count == stored),
            started=started)
    if not stored:
        with steps.skippable("store the decision"):
            _store(case, overflowing, count, settings)
    engine.notes.note_replacement(jit, device, None, fitted)  # uninstall() takes it out of the JIT cache again
    return fitted


def changed_parameters(jit, asked: dict, lowered: dict) -> dict:
    """The parameters, by name, whose value in packed constexprs ``lowered`` is not the one ``asked`` holds."""
    return {jit.arg_names[path[0]]: value for path, value in lowered.items()
            if asked.get(path) != value and len(path) == 1 and path[0] < len(jit.arg_names)}


def _fewer_stages(compile_at, stages: int, required: int, limit: int):
    """The kernel at the most stages below ``stages`` that fit ``limit`` (:class:`~.candidates.FewerStages`), or
    None (a count that cannot be compiled ends it: its pipeline depth is a parameter the kernel computes with)."""
    search = FewerStages(stages, required, limit)
    for count in search:
        compiled = compile_at(count)
        if compiled is None:
            return None
        search.measured(count, compiled.metadata.shared)
        if search.done and not search.inert:
            return compiled
    return None


def _case(jit, kernel, device: int) -> tuple[str, dict]:
    case = variants.device_case(jit, variants.compiled_variant_id(kernel), device)
    return decision_cache.case_id(case), case


def _store(case, overflowing: _Overflowing, count: int, settings) -> None:
    store = decision_cache.store(settings.cache_dir)
    if store is None:
        return
    key, fields = case
    store.put("compile", key, decision_cache.new_entry(
        fields, action=STAGES_REDUCED, final=f"num_stages={count}",
        from_config=f"num_stages={overflowing.kernel.metadata.num_stages}",
        gpu=variants.gpu_label(overflowing.device), resource=SHARED, required=overflowing.required,
        options={"num_stages": count}))


def _record(engine, overflowing: _Overflowing, fitted, final: str, attempts: list, *, remembered: bool,
            started: float) -> None:
    """The record of a fewer-stage compile (``fitted``, with the options ``final``) that fits in the overflowing
    kernel's place, after the compiles ``attempts``; ``remembered``: the decision cache's stage count."""
    source, steps = overflowing.source, overflowing.steps
    device, required, limit = overflowing.device, overflowing.required, overflowing.limit
    name = introspect.kernel_name(source.fn)
    stages = overflowing.kernel.metadata.num_stages
    described = {}
    with steps.skippable("describe the launch"):
        described = compile_description(source, overflowing.kernel)
    phase = described.pop("phase", "compile")
    # An autotuner times each config: one record per kernel and shape class, not one per config timed.
    if phase == "autotune" and not engine.memory.first("autotune", (name, device, limit, _shape_class(described),
                                                                    STAGES_REDUCED)):
        return
    incident = incidents.Incident(
        kernel=name, launched_as=LAUNCHED_AS, phase=phase, action=STAGES_REDUCED, final=final, resource=SHARED,
        required=required, limit_hit=limit, started=started, device=device, internal_steps=steps.failed,
        attempts=[{"num_stages": stages, "shared": required}, *attempts], compiles=len(attempts),
        remembered=remembered, extras=described)
    incidents.report(incident, engine.settings.log_path, ("compile", name, device, limit, stages, required),
                     "smemguard: %s: shared memory %d > %d B at num_stages=%d; compiled with %s (%d B) "
                     "before it loaded, %d compile%s", name, required, limit, stages, final, fitted.metadata.shared,
                     len(attempts), "" if len(attempts) == 1 else "s")


def _record_skipped(engine, overflowing: _Overflowing) -> None:
    """A config an autotuner is timing that fits at no stage count: it counts it as failed and chooses another.
    Recorded once per kernel and shape class as ``autotune_skipped``, never as a failed launch."""
    source, kernel, steps = overflowing.source, overflowing.kernel, overflowing.steps
    device, required, limit = overflowing.device, overflowing.required, overflowing.limit
    name = introspect.kernel_name(source.fn)
    described = compile_description(source, kernel)
    described.pop("phase", None)
    if not engine.memory.first("autotune", (name, device, limit, _shape_class(described), AUTOTUNE_SKIPPED)):
        return
    incident = incidents.Incident(
        kernel=name, launched_as=LAUNCHED_AS, phase="autotune", action=AUTOTUNE_SKIPPED, final=None, resource=SHARED,
        required=required, limit_hit=limit, started=time.perf_counter(), device=device, internal_steps=steps.failed,
        reason="no stage count of this config fits; the autotuner times it as failed and chooses among the others",
        attempts=[{"num_stages": kernel.metadata.num_stages, "shared": required}], extras=described)
    incidents.report(incident, engine.settings.log_path, ("autotune", name, device, limit),
                     "smemguard: %s: shared memory %d > %d B with %s while an autotuner timed it; skipped (the "
                     "autotuner chooses among the configs that fit)", name, required, limit,
                     described.get("config", "?"))


def _shape_class(described: dict):
    """The shape class of a record: the autotuner's key where a launch names one, else the tensors' shapes."""
    key = described.get("autotune_key")
    if key is not None:
        return tuple(map(str, key))
    return tuple(sorted((name, str(arg.get("shape"))) for name, arg in (described.get("args") or {}).items()
                        if isinstance(arg, dict)))


def compile_description(source, kernel) -> dict:
    """What the record says of the compile: what it was given (Triton's signature, specialization and constexprs:
    what was compiled, whatever the launch passed), and the launch that caused it (its shapes, grid and config,
    and the phase: a launch's compile, a warm-up's, or an autotuner timing a config)."""
    fields = recorded.compile_fields(source, kernel.metadata.num_warps, kernel.metadata.num_stages)
    launch, warmup = recorded.in_progress(source.fn)
    if launch is None:
        return {**fields, "phase": "autotune"} if process.benchmarking else fields
    phase = "autotune" if process.benchmarking else "warmup" if warmup else "compile"
    return {**recorded.launch_fields(launch, kernel), **fields, "phase": phase}
