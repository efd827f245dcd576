"""What smemguard does when a guarded launch raises ``OutOfResources``: recover it, or re-raise it.

:func:`handle` resolves the launch (:mod:`smemguard.launch`), takes a decision once per
failing compiled kernel (remembered from another process, :mod:`smemguard.decisions`, or
found by trying candidates, :mod:`smemguard.ladder`; stored and recalled by :mod:`smemguard.recall`), writes the incident record
(:mod:`smemguard.incidents`) and applies the decision. Concurrent threads meeting the same
failure wait for one decision under a lock and all apply it.

Tile sizes of a plain ``@triton.jit`` kernel are never changed unless alternatives were
registered for it: its grid was computed by the caller from them. Only launches whose every
layer is understood are retried (Triton's JIT function, autotuner and heuristics, and the
library layers described in :mod:`smemguard.layers`), because each of those launches exactly
one kernel and enqueues nothing before the check fails.

Internal failures are logged and end in re-raising the user's error itself, never another one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

from . import decisions, incidents, introspect, ladder, recall, registry, runtime
from .decision import CONFIG_CHANGED, FALLBACK, OBSERVED, RERAISED, STAGES_REDUCED, WARPS_REDUCED, Decision
from .launch import Launch, check, overflow, replace_in_jit_cache, resolve, unknown_layer, with_config

log = logging.getLogger(__name__)


# launched object -> {(compile hash of the failing kernel, device, limit, tuning key, fallback): case}.
# Keyed by what was compiled, not by the kernel object: concurrent first launches each
# compile their own copy. Entries go with the kernel object they belong to.
_cases: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_cases_guard = threading.Lock()


@dataclass
class _Case:
    lock: threading.RLock = field(default_factory=threading.RLock)
    decision: Decision | None = None


def _case_for(launch: Launch, failing) -> _Case:
    device = runtime.current_device()
    key = (failing.hash, device, runtime.effective_limit(device), launch.tuning_key,
           registry.fallback_for(launch.jit))
    with _cases_guard:
        return _cases.setdefault(launch.launched, {}).setdefault(key, _Case())


def forget() -> None:
    """Drop every decision taken in this process and every kernel smemguard put into Triton's JIT
    caches (``uninstall`` does): the next launch compiles what its caller asked for."""
    with _cases_guard:
        _cases.clear()
    runtime.drop_replacements()


def remembered_options(jit, jit_key: str, device: int, options, settings) -> dict | None:
    """Option overrides remembered for the variant Triton is about to compile (compile-time patch)."""
    return recall.remembered_options(jit, jit_key, device, options, settings.cache_dir)


def _apply(decision: Decision, launch: Launch, failing, error):
    if decision.action in (STAGES_REDUCED, WARPS_REDUCED):
        replace_in_jit_cache(launch, failing, decision.replacement)
        return launch.relaunch()
    if decision.action == CONFIG_CHANGED:
        return with_config(launch, decision.config).relaunch()
    if decision.action == FALLBACK:
        fallback_error = _run_fallback(decision, launch)
        if fallback_error is not None:
            incidents.add_note(error, f"smemguard: {_fallback_failure(decision, fallback_error)}")
            raise error from fallback_error
        return None
    incidents.add_note(error, lambda: incidents.explain(launch, decision, error))
    raise error


def _run_fallback(decision: Decision, launch: Launch) -> Exception | None:
    """Run the registered fallback in place of the launch; the exception it raised, if any."""
    try:
        decision.fallback(**launch.named_args())
    except Exception as fallback_error:
        return fallback_error
    return None


def _fallback_failure(decision: Decision, fallback_error: Exception) -> str:
    return (f"the registered fallback {introspect.callable_name(decision.fallback)} raised "
            f"{type(fallback_error).__name__}: {fallback_error}")


def _decide(launch: Launch, failing, error, settings) -> Decision:
    """The decision for this failure: one stored by any process for the same case, else a new one (stored)."""
    store = decisions.store(settings.cache_dir)
    cases = decisions.cases_for(launch, failing) if store is not None else None
    decision = recall.recall(launch, failing, cases, store) if cases else None
    if decision is None:
        decision = ladder.decide(launch, failing, error)
        if cases:
            decision = recall.remember(launch, failing, decision, cases, store)
    return decision


def handle_warmup(launched, grid, args, kwargs, compiled, settings):
    """``launched.warmup(...)`` compiled ``compiled``: when it will not fit, decide its replacement now
    and return that (it is in the JIT cache for the first launch). Never raises: a warm-up whose
    kernel stays as it was is decided at its first launch instead."""
    try:
        if compiled is None or settings.observe_only:
            return compiled
        error = overflow(compiled)
        if error is None:
            return compiled
        started = time.perf_counter()
        launch = resolve(launched, grid, args, kwargs)
        if launch is None or launch.tuner is not None:  # timing a tuner's candidates would launch them
            return compiled
        case = _case_for(launch, compiled)
        with case.lock:
            if case.decision is None:
                described = incidents.described_args(launch)
                decision = _decide(launch, compiled, error, settings)
                case.decision = incidents.record_launch(launch, launched, compiled, error, decision, started,
                                                        settings.log_path, described, phase="warmup")
        if case.decision.action in (STAGES_REDUCED, WARPS_REDUCED):
            replace_in_jit_cache(launch, compiled, case.decision.replacement)
            return case.decision.replacement
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


def handle(launched, grid, args, kwargs, error, settings):
    """Recover the launch ``launched[grid](*args, **kwargs)`` that raised ``error``, or re-raise it."""
    started = time.perf_counter()
    try:
        launch = resolve(launched, grid, args, kwargs)
        failing = launch.compile() if launch is not None else None
    except Exception:  # smemguard's bug: the user gets their own error, and one warning says whose bug it is
        incidents.warn_once(("resolve", _layer_name(launched)), "smemguard: internal error while reading the failed "
                            "launch of %s; re-raising the original error", _layer_name(launched), exc_info=True)
        raise error
    if launch is None:
        action = OBSERVED if settings.observe_only else RERAISED
        decision = incidents.record_launch(None, launched, None, error, Decision(action, (), reason=(
            f"{_layer_name(launched)} is not a Triton JIT function, heuristics, or an autotuner whose run launches "
            "exactly what Autotuner.run does: it may launch more than one kernel, so it is not retried")), started,
            settings.log_path)
        incidents.add_note(error, lambda: f"smemguard did not retry {introspect.kernel_name(launched)}: "
                           f"{decision.reason}" + (f"; incident record: {decision.record}" if decision.record else ""))
        raise error

    if settings.observe_only:
        incidents.record_launch(launch, launched, failing, error, Decision(OBSERVED, ()), started,
                                settings.log_path)
        raise error

    if check(failing)[0]:  # another thread already put a kernel that fits in its place
        return launch.relaunch()

    case = _case_for(launch, failing)
    with case.lock:
        if case.decision is None:
            try:
                # Described before candidates are tried: their pre_hooks rewrite TMA descriptors' block shapes.
                described = incidents.described_args(launch)
                decision = _decide(launch, failing, error, settings)
            except Exception:
                log.warning("smemguard: internal error while recovering %s; re-raising the original error",
                            introspect.kernel_name(launch.jit), exc_info=True)
                raise error
            if decision.action == FALLBACK:  # recorded as what happened: the fallback ran, or it raised
                fallback_error = _run_fallback(decision, launch)
                recorded = decision if fallback_error is None else dataclasses.replace(
                    decision, action=RERAISED, reason=_fallback_failure(decision, fallback_error))
                case.decision = dataclasses.replace(decision, record=incidents.record_launch(
                    launch, launched, failing, error, recorded, started, settings.log_path, described).record)
                if fallback_error is None:
                    return None
                incidents.add_note(error, f"smemguard: {recorded.reason}")
                raise error from fallback_error
            case.decision = incidents.record_launch(launch, launched, failing, error, decision, started,
                                                    settings.log_path, described)
    return _apply(case.decision, launch, failing, error)
