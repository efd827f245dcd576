"""What smemguard does when a guarded launch raises ``OutOfResources``: recover it, or re-raise it.

:func:`handle` (called by the engine, :mod:`smemguard.engine.core`, with the decisions of its install) resolves the
launch (:mod:`smemguard.kernels.launch`), takes a decision once per failing compiled kernel (remembered from another
process, :mod:`smemguard.store.decision_cache`, or found by trying candidates, :mod:`.ladder`; stored and recalled by
:mod:`smemguard.engine.recall`), writes the incident record
(:mod:`smemguard.store.incidents`) and applies the decision. Concurrent threads meeting the same
failure wait for one decision under a lock and all apply it.

Tile sizes of a plain ``@triton.jit`` kernel are never changed unless alternatives were
registered for it: its grid was computed by the caller from them. Only launches whose every
layer is understood are retried (Triton's JIT function, autotuner and heuristics, and the
library layers described in :mod:`smemguard.kernels.tuners`), because each of those launches exactly
one kernel and enqueues nothing before the check fails.

Internal failures are logged and end in re-raising the user's error itself, never another one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from ..facts import process
from ..kernels import introspect, registry, variants
from ..kernels.launch import Launch, check, overflow, replace_in_jit_cache, resolve, unknown_layer, with_config
from ..kernels.recorded import described_args
from ..store import decision_cache, incidents
from ..store.decision import CONFIG_CHANGED, FALLBACK, OBSERVED, RERAISED, STAGES_REDUCED, WARPS_REDUCED, Decision
from . import ladder, recall, records
from .records import Failure
from .steps import StepFailed, Steps

log = logging.getLogger(__name__)


@dataclass
class _Case:
    lock: threading.RLock = field(default_factory=threading.RLock)
    decision: Decision | None = None
    recorded: bool = True  # False: re-raised for a declared wrapper that chose again and recorded the outcome


class Decided:
    """The decisions one install took: launched object -> {(compile hash of the failing kernel, device, limit,
    tuning key, fallback, alternatives): case}. Keyed by what was compiled, not by the kernel object: concurrent
    first launches each compile their own copy; and by what is registered for it, so that what the user registers
    after a re-raise's note is tried. Entries go with the kernel object they belong to."""

    def __init__(self):
        self._cases: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def case_for(self, launch: Launch, failing) -> _Case:
        device = process.current_device()
        key = (failing.hash, device, process.effective_limit(device), launch.tuning_key,
               registry.fallback_for(launch.jit), tuple(map(introspect.config_text, launch.alternatives())))
        with self._lock:
            return self._cases.setdefault(launch.launched, {}).setdefault(key, _Case())

    def clear(self) -> None:
        with self._lock:
            self._cases.clear()


def _plan(engine, failure: Failure, decision: Decision, steps: Steps) -> Callable[[], Any]:
    """What runs now that ``decision`` is taken: the relaunch, the user's fallback, or the user's error."""
    launch, failing, error = failure.launch, failure.failing, failure.error
    if decision.action in (STAGES_REDUCED, WARPS_REDUCED):
        with steps.required("replace in the JIT cache"):
            replace_in_jit_cache(launch, failing, decision.replacement, engine.notes)
        return launch.relaunch
    if decision.action == CONFIG_CHANGED:
        with steps.required("launch with the new config"):
            return with_config(launch, decision.config).relaunch
    if decision.action == FALLBACK:
        with steps.required("bind the fallback's arguments"):
            named = _fallback_arguments(launch)
        return functools.partial(_run_fallback, decision, named, error)
    incidents.add_note(error, lambda: records.explain(launch, decision, error))
    return functools.partial(_reraise, error)


def _fallback_arguments(launch: Launch) -> dict:
    """The launch's arguments by parameter name, as a fallback takes them."""
    return launch.named_args()


def _run_fallback(decision: Decision, named: dict, error, record=None):
    """Run the registered fallback in place of the launch; when it raises, the user gets their own error with
    a note. ``record`` (the first time) writes the incident record of what happened."""
    try:
        decision.fallback(**named)
    except Exception as fallback_error:
        reason = (f"the registered fallback {introspect.callable_name(decision.fallback)} raised "
                  f"{type(fallback_error).__name__}: {fallback_error}")
        if record is not None:
            record(dataclasses.replace(decision, action=RERAISED, reason=reason))
        incidents.add_note(error, f"smemguard: {reason}")
        raise error from fallback_error
    if record is not None:
        record(decision)


def _reraise(error):
    raise error


def _decide(engine, launch: Launch, failing, error, steps: Steps) -> Decision:
    """The decision for this failure: one stored by any process for the same case, else a new one (stored).
    The store only saves work: when reading or writing it fails, the ladder decides and nothing is stored."""
    store = cases = decision = None
    with steps.skippable("open the decision store"):
        store = decision_cache.store(engine.settings.cache_dir)
    if store is not None:
        with steps.skippable("key the stored decisions"):
            cases = variants.cases_for(launch, failing)
    if cases:
        with steps.skippable("recall a stored decision"):
            decision = recall.recall(launch, failing, cases, store)
    if decision is None:
        with steps.required("decide"):
            timings = engine.notes.timings(launch.tuner, launch.tuning_key) if launch.tuner is not None else {}
            decision = ladder.decide(launch, failing, error, timings)
        if cases:
            with steps.skippable("store the decision"):
                decision = recall.remember(launch, failing, error, decision, cases, store)
    return decision


def handle_warmup(engine, launched, grid, args, kwargs, compiled):
    """``launched.warmup(...)`` compiled ``compiled``: when it will not fit, decide its replacement now
    and return that (it is in the JIT cache for the first launch). Never raises: a warm-up whose
    kernel stays as it was is decided at its first launch instead."""
    try:
        if compiled is None or engine.settings.observe_only:
            return compiled
        error = overflow(compiled)
        if error is None:
            return compiled
        failure = Failure(launched, grid, args, kwargs, error, time.perf_counter(), "warmup", failing=compiled)
        launch = failure.launch = resolve(launched, grid, args, kwargs)
        if launch is None or launch.tuner is not None:  # timing a tuner's candidates would launch them
            return compiled
        case = engine.decided.case_for(launch, compiled)
        with case.lock:
            if case.decision is None:
                failure.described = described_args(launch)
                decision = _decide(engine, launch, compiled, error, Steps(introspect.kernel_name(launched)))
                case.decision = records.record_launch(failure, decision, engine.settings.log_path)
        if case.decision.action in (STAGES_REDUCED, WARPS_REDUCED):
            replace_in_jit_cache(launch, compiled, case.decision.replacement, engine.notes)
            return case.decision.replacement
    except StepFailed:  # logged where it failed
        pass
    except Exception:
        log.warning("smemguard: internal error while deciding at warm-up for %s; left to its first launch",
                    introspect.kernel_name(launched), exc_info=True)
    return compiled


def _layer_name(launched) -> str:
    try:
        layer = unknown_layer(launched)
        return type(layer if layer is not None else launched).__qualname__
    except Exception:  # naming it is only for the record
        return type(launched).__qualname__


def handle(engine, launched, grid, args, kwargs, error, again):
    """Recover the launch ``launched[grid](*args, **kwargs)`` that raised ``error``, or re-raise it.
    ``again()`` runs the launch once more as it was asked (through every layer of the guarded call).

    smemguard's own work runs inside the guard (:class:`~smemguard.engine.steps.Steps`, and a last one
    around all of it); what it decides to run (the relaunch, the user's fallback) runs outside it, so
    that an error of smemguard's never replaces the user's error nor one of the user's own code. When
    a step fails, the record says which, and the user gets ``error`` itself, or where the step only
    saved work, the recovered launch. ``engine``: the install's, whose decisions are one per failing kernel."""
    failure = Failure(launched, grid, args, kwargs, error, time.perf_counter())
    stored = recall.stored(error)
    if stored is not None:
        return _switch_as_stored(engine, failure, again, stored)
    steps = Steps(_layer_name(launched))
    try:
        with process.engine_compiling.scope():  # the variants it compiles are measured as they are
            with steps.required("resolve the launch"):
                failure.launch = resolve(launched, grid, args, kwargs)
            if failure.launch is not None:
                with steps.required("compile the failing launch"):
                    failure.failing = failure.launch.compile()
                engine.notes.note_failing_kernel(error, failure.failing)
            run = _recover(engine, failure, steps)
    except StepFailed:
        run = None
    except Exception:
        steps.note("handle the failure")
        run = None
    if run is None:
        records.record_launch(failure, Decision(
            RERAISED, (), internal_steps=tuple(steps.failed),
            reason=f"smemguard's own step {steps.failed[-1]!r} failed (its bug: please report it); the original "
                   "error is raised"), engine.settings.log_path)
        raise error
    return run()


def _switch_as_stored(engine, failure: Failure, again, stored: tuple[str, dict]):
    """``error`` was raised before the variant was compiled: the decision cache switches its tuner to
    another config (:func:`smemguard.engine.recall.remembered_compile`). Applied here with one compile, the
    stored config's, and no incident (it was decided before). Where it does not apply to this launch,
    or a step of it fails, the launch runs again as asked, compiling the variant, and a failure of
    that is recovered like any other."""
    from triton.runtime.errors import OutOfResources

    launched = failure.launched
    steps = Steps(_layer_name(launched))
    decision = launch = None
    try:
        with process.engine_compiling.scope():  # the stored config is compiled and checked as it is
            with steps.required("resolve the launch"):
                launch = resolve(launched, failure.grid, failure.args, failure.kwargs)
            if launch is not None:
                with steps.required("apply the stored config"):
                    decision = recall.switch(launch, *stored)
    except StepFailed:  # logged where it failed
        pass
    if decision is not None:
        return with_config(launch, decision.config).relaunch()
    try:
        with recall.compiling_as_asked.scope():
            return again()
    except OutOfResources as real:
        real_error = real
    return handle(engine, launched, failure.grid, failure.args, failure.kwargs, real_error, again)


def _recover(engine, failure: Failure, steps: Steps):
    """What runs for the failed launch (see :func:`_plan`), with its decision taken and recorded."""
    settings, launched, launch, failing, error = (engine.settings, failure.launched, failure.launch, failure.failing,
                                                  failure.error)
    if launch is None:
        action = OBSERVED if settings.observe_only else RERAISED
        decision = records.record_launch(failure, Decision(action, (), reason=(
            f"{_layer_name(launched)} is not a Triton JIT function, heuristics, or an autotuner whose run "
            "launches exactly what Autotuner.run does: it may launch more than one kernel, so it is not "
            "retried")), settings.log_path)
        incidents.add_note(error, lambda: f"smemguard did not retry {introspect.kernel_name(launched)}: "
                           f"{decision.reason}" + (f"; incident record: {decision.record}" if decision.record else ""))
        return functools.partial(_reraise, error)
    if settings.observe_only:
        records.record_launch(failure, Decision(OBSERVED, ()), settings.log_path)
        return functools.partial(_reraise, error)
    # Another thread already put a kernel that fits in its place.
    fitting, case = False, _Case()
    with steps.skippable("check the kernel in the JIT cache"):
        fitting = check(failing)[0]
    if fitting:
        return launch.relaunch
    with steps.skippable("find the case"):
        case = engine.decided.case_for(launch, failing)
    with case.lock:
        if case.decision is None:
            # Described before candidates are tried: their pre_hooks rewrite TMA descriptors' block shapes.
            with steps.skippable("describe the arguments"):
                failure.described = described_args(launch)
            decision = _decide(engine, launch, failing, error, steps)
            if steps.failed:
                decision = dataclasses.replace(decision, internal_steps=tuple(steps.failed))
            if decision.action == FALLBACK:  # recorded once it ran: the record says whether it raised
                case.decision = decision
                with steps.required("bind the fallback's arguments"):
                    named = _fallback_arguments(launch)
                record = functools.partial(records.record_launch, failure, log_path=settings.log_path)
                return functools.partial(_run_fallback, decision, named, error, record)
            if decision.action == RERAISED and _chosen_again(launch, decision, steps):
                case.decision, case.recorded = decision, False
                return functools.partial(_reraise, error)
            case.decision = records.record_launch(failure, decision, settings.log_path)
        elif not case.recorded:
            if _chosen_again(launch, case.decision, steps):
                return functools.partial(_reraise, error)
            case.decision, case.recorded = records.record_launch(failure, case.decision, settings.log_path), True
    return _plan(engine, failure, case.decision, steps)


def _chosen_again(launch: Launch, decision: Decision, steps: Steps) -> bool:
    """Whether a wrapper declared with :mod:`.wrapper_tiles` chose these tiles in the call running on this
    thread: it then runs again with smaller ones and records the outcome (one record per call, not two)."""
    from . import wrapper_rerun  # imported by the declaring library, never on a healthy launch's path

    needed = [attempt.required for attempt in decision.attempts if attempt.required]
    with steps.skippable("ask the declared wrapper"):
        return wrapper_rerun.chooses_again(launch.jit, launch.named_args(), min(needed, default=None))
    return False
