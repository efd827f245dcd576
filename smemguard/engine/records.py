"""The incident record of a launch the engine decided (the launch guard's, a warm-up's), and the texts a user reads
of it: the one-line warning, what each action did, the note on a re-raised error.

The record's description of the launch is :mod:`smemguard.kernels.recorded`'s, as every other writer's; the store
(:mod:`smemguard.store.incidents`) writes it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from ..facts import process
from ..kernels import introspect
from ..kernels.recorded import attempt_records, describe_arg, launch_fields
from ..store.decision import CONFIG_CHANGED, FALLBACK, OBSERVED, RERAISED, STAGES_REDUCED, WARPS_REDUCED
from ..store.incidents import Incident, emit

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Failure:
    """One failed launch as the engine handles it: ``launched[grid](*args, **kwargs)`` raised ``error``; handling
    began at ``started`` (``time.perf_counter()``: the record's recovery_ms). What the engine resolved of it is filled
    in as it goes: the ``launch`` (None where it cannot be resolved), the ``failing`` compiled kernel, the arguments
    ``described`` at the failure (before candidates' pre-hooks rewrite TMA descriptors)."""

    launched: Any
    grid: Any
    args: tuple
    kwargs: dict
    error: BaseException
    started: float
    phase: str = "launch"  # or "warmup": a warm-up compiled what would not fit
    launch: Any = None
    failing: Any = None
    described: dict | None = None


def record_launch(failure: Failure, decision, log_path: Path | None):
    """Write the incident record of ``failure`` and the one-line warning; return the decision with its location.
    Never raises: a record that cannot be built or written leaves the decision as it is."""
    try:
        return _record_launch(failure, decision, log_path)
    except Exception:
        log.warning("smemguard: could not write the incident record for %s", type(failure.launched).__name__,
                    exc_info=True)
        return decision


def _record_launch(failure: Failure, decision, log_path: Path | None):
    launch, launched, failing, error = failure.launch, failure.launched, failure.failing, failure.error
    device = process.current_device()
    kernel = introspect.kernel_name(launch.jit if launch is not None else launched)
    extras: dict[str, Any] = {
        # Wall-clock time: compiles that ran concurrently are counted once.
        "compile_ms": decision.compile_ms or round(sum(attempt.compile_ms or 0.0 for attempt in decision.attempts), 3),
        "skipped": list(decision.skipped),
        "timings_ms": decision.timings,
    }
    if launch is not None and failing is not None:
        extras.update(launch_fields(launch, failing, failure.described))
    record = Incident(
        kernel=kernel, launched_as=type(launched).__name__, phase=failure.phase, action=decision.action,
        final=decision.final, resource=error.name, required=error.required, limit_hit=error.limit,
        started=failure.started, device=device,
        internal_steps=decision.internal_steps,
        internal_errors=sum(attempt.internal_error for attempt in decision.attempts) + len(decision.internal_steps),
        reason=decision.reason or None, attempts=attempt_records(decision.attempts),
        compiles=sum(attempt.compile_ms is not None for attempt in decision.attempts),
        remembered=decision.remembered, extras=extras).record()
    failing = record.get("config") or ""
    where = emit(record, log_path, (kernel, device, failing),
                 "smemguard: %s: %s %s with %s; %s after %d tries in %.0f ms",
                 kernel, error.name, bytes_text(error.required, error.limit), failing or "?",
                 action_text(decision, failing), max(len(decision.attempts) - 1, 0), record["recovery_ms"])
    return dataclasses.replace(decision, record=where)

def bytes_text(required, limit) -> str:
    """``"106496 > 101376 B"``; for an error that gives no byte counts (a library's own
    ``OutOfResources(0, 0, ...)``), says so."""
    return f"{required} > {limit} B" if required and limit else "(the error gives no byte counts)"


def action_text(decision, failing_config: str = "") -> str:
    final = introspect.changes(failing_config, decision.final or "") or decision.final
    return ("remembered: " if decision.remembered else "") + {
        STAGES_REDUCED: f"recovered with {final}",
        WARPS_REDUCED: f"recovered with {final}",
        CONFIG_CHANGED: f"switched to config {final}",
        FALLBACK: f"ran {decision.final}",
        OBSERVED: "observed only (SMEMGUARD=observe)",
        RERAISED: "re-raised: " + decision.reason,
    }[decision.action]


def explain(launch, decision, error) -> str:
    """The note added to a re-raised error: kernel, tensors, what was tried and why nothing fits."""
    named = launch.named_args()
    code = launch.jit.fn.__code__
    tensors = ", ".join(f"{k}: {v['dtype']}{v['shape']} stride {v['stride']}" for k, v in
                        ((k, describe_arg(v)) for k, v in named.items()) if isinstance(v, dict) and "dtype" in v)
    lines = [
        f"smemguard could not recover {introspect.kernel_name(launch.jit)} ({code.co_filename}:{code.co_firstlineno}):",
        f"  {error.name}: required {error.required}, limit {error.limit}",
        f"  tensors: {tensors or 'none'}",
        f"  failing: {decision.attempts[0].summary() if decision.attempts else 'unknown'}",
        "  tried: " + ("; ".join(a.summary(introspect.changes(decision.attempts[0].config, a.config))
                                 for a in decision.attempts[1:]) or "nothing"),
        f"  {decision.reason}",
    ]
    if decision.remembered:
        lines.append("  (decided earlier and kept in SMEMGUARD_CACHE_DIR; 'smemguard cache clear' forgets it)")
    if decision.record:
        lines.append(f"  incident record: {decision.record}")
    return "\n".join(lines)


