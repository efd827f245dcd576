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
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("smemguard")

SCHEMA = 1
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"  # the records' "time"; `smemguard report` parses it back

_write_lock = threading.Lock()
_unwritable: set[Path] = set()
_warned: set[tuple] = set()
_sequence = 0


def new_record(kernel: str) -> dict:
    """The fields every incident record starts with (docs/INCIDENTS.md): schema, time, pid, host, rank, kernel."""
    return {"schema": SCHEMA, "time": time.strftime(TIME_FORMAT), "pid": os.getpid(), "host": host(),
            "rank": rank(), "kernel": kernel}


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
