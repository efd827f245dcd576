"""Incident records: one JSON line per overflow smemguard handled, and one warning per case.

The one writer of records, for Triton launches (:func:`record_launch`) and for the DeepGEMM
patch alike (:func:`emit`); the schema (``"schema": 1``) is documented in
``docs/INCIDENTS.md``, and declared once in :mod:`.record_fields`: who writes each field, and how
``smemguard report``, ``smemguard replay`` and the Prometheus series read it. Writing is
best effort: a record that cannot be written produces one warning naming the path and the fix,
and the launch goes on. Also the texts a user reads: the warning line and the note on a
re-raised error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..facts import files, process
from ..kernels import introspect
from . import metrics
from .decision import CONFIG_CHANGED, FALLBACK, OBSERVED, RERAISED, STAGES_REDUCED, WARPS_REDUCED
from .record_fields import SCHEMA, TIME_FORMAT

log = logging.getLogger(__name__)

_write_lock = threading.Lock()
_unwritable: set[Path] = set()
_sequence = 0


def new_record(kernel: str) -> dict:
    """The fields every incident record starts with (docs/INCIDENTS.md): schema, time, pid, host, rank, kernel;
    ``verified: false`` and the ``unverified`` patches when some patch applied above its newest checked release."""
    record = {"schema": SCHEMA, "time": time.strftime(TIME_FORMAT), "pid": os.getpid(), "host": host(),
              "rank": rank(), "kernel": kernel}
    unverified = process.unverified_patches()
    if unverified:  # some patch of this process runs on a release newer than any it was checked against
        record.update(verified=False, unverified=unverified)
    return record


def overflow_fields(device: int, resource: str, required, limit_hit) -> dict:
    """The fields every record of an overflow carries after :func:`new_record`'s: Triton, the device, the
    limits (the device's own and the emulated one), and what did not fit."""
    return {"triton": process.triton_version(), "device": process.device_description(device),
            "limit": {"device": process.device_limit(device), "emulated": process.emulated_limit()},
            "resource": resource, "required": required, "limit_hit": limit_hit}


@dataclasses.dataclass
class Incident:
    """One incident record as every source writes it (docs/INCIDENTS.md): the launch guard, the compile-time
    core, Inductor's load recovery, the FlexAttention configs, the wrapper tile choices and DeepGEMM. The common
    fields (:data:`FIELDS`' EVERY and TRITON) are set here; what is a source's own goes in ``extras`` (after the
    common fields, so a source cannot spell one of them another way)."""

    kernel: str
    launched_as: str
    phase: str  # "launch" (Triton raised at the launch) or "compile" (found before anything loaded)
    action: str  # one of smemguard.store.decision.ACTIONS
    final: str | None
    resource: str
    required: Any
    limit_hit: Any
    started: float  # time.perf_counter() when the handling began: the record's recovery_ms
    internal_steps: Sequence[str] = ()  # smemguard's own steps that failed in the handling (Steps.failed)
    internal_errors: int | None = None  # those and any other errors of smemguard's; default: the failed steps
    device: int | None = None  # None: not a Triton device (DeepGEMM): no device, Triton or limit fields
    reason: str | None = None
    attempts: list = dataclasses.field(default_factory=list)
    compiles: int = 0
    remembered: bool = False
    extras: dict = dataclasses.field(default_factory=dict)

    def record(self) -> dict:
        record = {**new_record(self.kernel), "launched_as": self.launched_as, "phase": self.phase}
        if self.device is None:
            record.update(resource=self.resource, required=self.required, limit_hit=self.limit_hit)
        else:
            record.update(overflow_fields(self.device, self.resource, self.required, self.limit_hit))
        errors = len(self.internal_steps) if self.internal_errors is None else self.internal_errors
        record.update(action=self.action, final=self.final, reason=self.reason, attempts=self.attempts,
                      compiles=self.compiles, remembered=self.remembered, internal_errors=errors,
                      internal_steps=list(self.internal_steps),
                      recovery_ms=round((time.perf_counter() - self.started) * 1000, 3))
        return {**record, **{name: value for name, value in self.extras.items() if name not in record}}


def report(incident: Incident, path: Path | None, case: tuple, message: str, *args) -> str | None:
    """Write ``incident``'s record and log ``message % args`` once per ``case``; returns where the record went."""
    return emit(incident.record(), path, case, message, *args)


def _json_default(value):
    return str(value)


def write(record: dict, path: Path | None) -> str | None:
    """Append ``record`` to ``path``; return where it went ("path#id"), or None if nowhere."""
    global _sequence
    with _write_lock:
        _sequence += 1
        record["id"] = f"{os.getpid()}-{_sequence}"
        if path is None or path in _unwritable:
            return None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps(record, default=_json_default, sort_keys=True)
            with files.open_append(path) as out:  # a FIFO or a device is refused, never waited on
                out.write(line + "\n")
        except OSError as error:
            _unwritable.add(path)
            log.warning("smemguard: cannot write incident records to %s (%s); they go to the log only. "
                        "Fix: point SMEMGUARD_LOG at a writable file.", path, error.strerror or error)
            return None
    return f"{path}#{record['id']}"


def host() -> str:
    return socket.gethostname()


def describe_arg(value) -> Any:
    """A kernel argument as the record keeps it: tensors by shape, stride, dtype and alignment."""
    if hasattr(value, "data_ptr") and hasattr(value, "shape"):
        return {"shape": list(value.shape), "stride": list(value.stride()), "dtype": str(value.dtype),
                "ptr_mod_16": value.data_ptr() % 16}
    if hasattr(value, "base") and hasattr(value, "block_shape"):  # TMA tensor descriptor
        return {"descriptor": True, "base": describe_arg(value.base), "shape": [int(s) for s in value.shape],
                "strides": [int(s) for s in value.strides], "block_shape": list(value.block_shape)}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


def specialization(jit, named: dict) -> dict:
    """What Triton specializes on, per int or pointer argument: ``"==1"``, ``"div16"`` or ``""``."""
    spec = {}
    for param in jit.params:
        value = named.get(param.name)
        if param.is_constexpr or getattr(param, "do_not_specialize", False) or isinstance(value, bool):
            continue
        if isinstance(value, int):
            spec[param.name] = "==1" if value == 1 else ("div16" if value % 16 == 0 else "")
        elif hasattr(value, "data_ptr"):
            spec[param.name] = "div16" if value.data_ptr() % 16 == 0 else ""
    return spec


def evaluate_grid(grid, named: dict):
    """The launch grid as a list, evaluated the way Triton does for a grid function."""
    try:
        return list(grid(named) if callable(grid) else grid)
    except Exception:
        return str(grid)


def rank() -> int | None:
    """torch.distributed's rank when it is initialised (the vLLM worker's), else None."""
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def emit(record: dict, path: Path | None, case: tuple, message: str, *args) -> str | None:
    """Write ``record`` and log ``message % args`` once per ``case`` (then at DEBUG), followed by
    where the record went; returns that location."""
    where = write(record, path)
    metrics.count(record)
    process.warn_once(log, case, message + "%s", *args, f"; record {where}" if where else "")
    log.debug("smemguard incident: %s", record)
    return where


# -- Triton launches ---------------------------------------------------------------------------


def described_args(launch) -> dict:
    """The kernel's non-constexpr arguments as the record keeps them."""
    constexprs = launch.constexpr_names()
    return {k: describe_arg(v) for k, v in launch.named_args().items() if k not in constexprs}


def record_launch(launch, launched, failing, error, decision, started: float, log_path: Path | None,
                  described: dict | None = None, phase: str = "launch"):
    """Write the incident record and the one-line warning; return the decision with its location.

    ``launch`` is None when the launch could not be resolved; ``described``: the arguments as
    :func:`described_args` saw them at the failure, if taken then. Never raises: a record that
    cannot be built or written leaves the decision as it is.
    """
    try:
        return _record_launch(launch, launched, failing, error, decision, started, log_path, described, phase)
    except Exception:
        log.warning("smemguard: could not write the incident record for %s", type(launched).__name__,
                    exc_info=True)
        return decision


def _record_launch(launch, launched, failing, error, decision, started, log_path, described, phase):
    from ..kernels.launch import describe

    device = process.current_device()
    kernel = introspect.kernel_name(launch.jit if launch is not None else launched)
    extras: dict[str, Any] = {
        # Wall-clock time: compiles that ran concurrently are counted once.
        "compile_ms": decision.compile_ms or round(sum(attempt.compile_ms or 0.0 for attempt in decision.attempts), 3),
        "skipped": list(decision.skipped),
        "timings_ms": decision.timings,
    }
    if launch is not None and failing is not None:
        code = launch.jit.fn.__code__
        named = launch.named_args()
        constexprs = launch.constexpr_names()
        extras.update({
            "source": f"{code.co_filename}:{code.co_firstlineno}",
            "source_hash": introspect.source_hash(launch.jit),
            "constexprs": {k: describe_arg(v) for k, v in named.items() if k in constexprs},
            "num_warps": failing.metadata.num_warps,
            "num_stages": failing.metadata.num_stages,
            "config": describe(launch, failing),
            "grid": evaluate_grid(launch.grid, named),
            "args": described if described is not None else described_args(launch),
            "specialization": specialization(launch.jit, named),
            "autotune_key": list(launch.tuning_key) if launch.tuning_key is not None else None,
        })
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


def attempt_records(attempts) -> list[dict]:
    """The attempts as records keep them: the failing configuration in full, then for each
    candidate only what it changed (``changes``), so a kernel with 40 constexprs stays readable."""
    if not attempts:
        return []
    failing = attempts[0].config
    return [vars(attempts[0])] + [{**{k: v for k, v in vars(a).items() if k != "config"},
                                   "changes": introspect.changes(failing, a.config)} for a in attempts[1:]]


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


def add_note(error: BaseException, note: str | Callable[[], str]) -> None:
    """Attach ``note`` (or the text it builds) to the user's error; never raises: the error must reach them as it is."""
    try:
        text = note() if callable(note) else note
        if hasattr(error, "add_note"):
            error.add_note(text)
        else:  # Python 3.10: same attribute, shown by tools that know PEP 678
            error.__notes__ = [*getattr(error, "__notes__", []), text]
    except Exception:
        log.debug("smemguard: could not add a note to %s", type(error).__name__, exc_info=True)
