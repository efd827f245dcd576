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
from . import metrics
from .record_fields import SCHEMA, TIME_FORMAT

log = logging.getLogger(__name__)



class _Writer:
    """What writing records knows in this process: the last record's number (ids are ``pid-number``, unique in the
    process whichever install wrote them) and the paths found unwritable (warned of once, then left alone)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sequence = 0
        self.unwritable: set[Path] = set()


_writer = _Writer()


def new_record(kernel: str) -> dict:
    """The fields every incident record starts with (docs/INCIDENTS.md): schema, time, pid, host, rank, kernel;
    ``verified: false`` and the ``unverified`` patches when some patch applied above its newest checked release."""
    record = {"schema": SCHEMA, "time": time.strftime(TIME_FORMAT), "pid": os.getpid(), "host": host(),
              "rank": rank(), "kernel": kernel}
    unverified = process.notes().unverified_patches()
    if unverified:  # some patch of this process runs on a release newer than any it was checked against
        record.update(verified=False, unverified=unverified)
    return record


def overflow_fields(device: int, resource: str, required, limit_hit) -> dict:
    """The fields every record of an overflow carries after :func:`new_record`'s: Triton, the device, the
    limits (the device's own and the emulated one), and what did not fit."""
    return {"triton": process.triton_version(), "device": process.device_description(device),
            "limit": {"device": process.device_limit(device), "emulated": process.notes().emulated_limit},
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


def report(incident: Incident, path: Path | None, case: tuple, message: str, *args,
           level: int = logging.WARNING) -> str | None:
    """Write ``incident``'s record and log ``message % args`` once per ``case`` (at ``level``); returns where the
    record went."""
    return emit(incident.record(), path, case, message, *args, level=level)


def _json_default(value):
    return str(value)


def write(record: dict, path: Path | None) -> str | None:
    """Append ``record`` to ``path``; return where it went ("path#id"), or None if nowhere."""
    with _writer.lock:
        _writer.sequence += 1
        record["id"] = f"{os.getpid()}-{_writer.sequence}"
        if path is None or path in _writer.unwritable:
            return None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps(record, default=_json_default, sort_keys=True)
            files.append_line(path, line)  # a FIFO or a device is refused, never waited on
        except OSError as error:
            _writer.unwritable.add(path)
            log.warning("smemguard: cannot write incident records to %s (%s); they go to the log only. "
                        "Fix: point SMEMGUARD_LOG at a writable file.", path, error.strerror or error)
            return None
    return f"{path}#{record['id']}"


def host() -> str:
    return socket.gethostname()


def rank() -> int | None:
    """torch.distributed's rank when it is initialised (the vLLM worker's), else None."""
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def emit(record: dict, path: Path | None, case: tuple, message: str, *args, level: int = logging.WARNING
         ) -> str | None:
    """Write ``record`` and log ``message % args`` once per ``case`` at ``level`` (then at DEBUG), followed by
    where the record went; returns that location."""
    where = write(record, path)
    metrics.count(record)
    process.warn_once(log, case, message + "%s", *args, f"; record {where}" if where else "", level=level)
    log.debug("smemguard incident: %s", record)
    return where


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
