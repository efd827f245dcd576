"""Incident records: one JSON line per overflow smemguard handled, and one warning per case.

The schema (``"schema": 1``) is documented in ``docs/INCIDENTS.md``. Writing is best
effort: a record that cannot be written produces one warning naming the path and the fix,
and the launch goes on.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from pathlib import Path

log = logging.getLogger("smemguard")

SCHEMA = 1

_write_lock = threading.Lock()
_unwritable: set[Path] = set()
_warned: set[tuple] = set()
_sequence = 0


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
            with open(path, "a", encoding="utf-8") as out:
                out.write(line + "\n")
        except OSError as error:
            _unwritable.add(path)
            log.warning("smemguard: cannot write incident records to %s (%s); they go to the log only. "
                        "Fix: point SMEMGUARD_LOG at a writable file.", path, error.strerror or error)
            return None
    return f"{path}#{record['id']}"


def warn_once(case: tuple, message: str, *args) -> None:
    """Log ``message`` at WARNING the first time ``case`` (kernel, device, config) is seen, else at DEBUG."""
    with _write_lock:
        first = case not in _warned
        _warned.add(case)
    log.log(logging.WARNING if first else logging.DEBUG, message, *args)


def host() -> str:
    return socket.gethostname()
