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


def record_launch(launch, launched, failing, error, decision, started: float, log_path: Path | None,
                  described: dict | None = None, phase: str = "launch"):
    """Write the incident record and the one-line warning; return the decision with its location.

    ``launch`` is None when the launch could not be resolved; ``described``: the arguments as
    :func:`~smemguard.kernels.recorded.described_args` saw them at the failure, if taken then. Never raises: a
    record that cannot be built or written leaves the decision as it is.
    """
    try:
        return _record_launch(launch, launched, failing, error, decision, started, log_path, described, phase)
    except Exception:
        log.warning("smemguard: could not write the incident record for %s", type(launched).__name__,
                    exc_info=True)
        return decision


def _record_launch(launch, launched, failing, error, decision, started, log_path, described, phase):
    device = process.current_device()
    kernel = introspect.kernel_name(launch.jit if launch is not None else launched)
    extras: dict[str, Any] = {
        # Wall-clock time: compiles that ran concurrently are counted once.
        "compile_ms": decision.compile_ms or round(sum(attempt.compile_ms or 0.0 for attempt in decision.attempts), 3),
        "skipped": list(decision.skipped),
        "timings_ms": decision.timings,
    }
    if launch is not None and failing is not None:
        extras.update(launch_fields(launch, failing, described))
    record = Incident(
        kernel=kernel, launched_as=type(launched).__name__, phase=phase, action=decision.action, final=decision.final,
        resource=error.name, required=error.required, limit_hit=error.limit, started=started, device=device,
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


