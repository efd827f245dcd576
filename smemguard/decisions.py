"""Decisions persisted in ``SMEMGUARD_CACHE_DIR/decisions.json``, shared by every process on the host.

A decision says what replaces a failing launch on one GPU model at one limit. There are two
kinds, because they are applied at two different moments:

* ``compile``: option-only changes (``num_stages``, ``num_warps``) of one compiled variant,
  keyed by kernel, source hash, Triton version, GPU, limit and Triton's JIT cache key. A
  process that meets the variant compiles the replacement instead, so the failing variant
  is never compiled (Triton >= 3.5, through ``JITFunction._do_compile``);
* ``launch``: a different autotuner config, the fallback, or "nothing fits", additionally
  keyed by the autotuner key. Applied at the first failing launch, without trying candidates.

The file is JSON (never pickle), read again whenever it changed on disk, and written
atomically (temporary file + rename) under an exclusive ``flock`` on ``decisions.lock``, so
concurrent workers (tensor-parallel ranks, restarts) agree: the first decision stored for a
case wins and everyone applies that one. A corrupt or foreign-schema file is moved aside with
one warning and rebuilt. Failing I/O never stops a launch: one warning, then memory only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("smemguard")

SCHEMA = 1
FILE_NAME = "decisions.json"
KINDS = ("compile", "launch")


def case_id(fields: dict) -> str:
    """A stable id for a case, from the fields that identify it (order-independent)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]


def empty() -> dict:
    return {"schema": SCHEMA, "compile": {}, "launch": {}}


def validate(data: Any) -> dict:
    """``data`` if it is a decision file of this schema; else ValueError saying what is wrong."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA}")
    for kind in KINDS:
        if not isinstance(data.get(kind), dict):
            raise ValueError(f"no {kind!r} table")
    return data


class Store:
    """The decision file of one cache directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / FILE_NAME
        self._lock = threading.Lock()
        self._data = empty()
        self._stamp: tuple | None = None  # (mtime_ns, size) of the file we last read
        self._broken = False  # I/O failed once: memory only from then on

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "decisions.lock", "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    def _refresh(self) -> None:
        """Read the file again if it changed since we last did (caller holds ``_lock``)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._data, self._stamp = empty(), None
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        try:
            self._data = validate(json.loads(self.path.read_text(encoding="utf-8")))
        except (ValueError, UnicodeDecodeError) as problem:
            aside = self.path.with_name(f"{FILE_NAME}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            os.replace(self.path, aside)
            log.warning("smemguard: %s was unreadable (%s); moved it to %s and starting a new one.",
                        self.path, problem, aside)
            self._data = empty()
            stamp = None
        self._stamp = stamp

    def _write(self) -> None:
        fd, temporary = tempfile.mkstemp(prefix=".decisions-", dir=self.directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(self._data, out, indent=1, sort_keys=True)
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        stat = self.path.stat()
        self._stamp = (stat.st_mtime_ns, stat.st_size)

    def _io_failed(self, error: OSError) -> None:
        self._broken = True
        log.warning("smemguard: cannot use the decision cache in %s (%s); decisions stay in this process. "
                    "Fix: point SMEMGUARD_CACHE_DIR at a writable directory, or set it to off.",
                    self.directory, error.strerror or error)

    def _changed(self) -> bool:
        """Whether the file is not the one we last read: a stat, no lock (writers replace it atomically).

        Called on every JIT compile miss: a healthy process must not create the directory or
        queue on the host-wide lock for a file nobody wrote.
        """
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return self._stamp is not None
        return (stat.st_mtime_ns, stat.st_size) != self._stamp

    def get(self, kind: str, key: str) -> dict | None:
        with self._lock:
            if not self._broken:
                try:
                    if self._changed():
                        with self._exclusive():
                            self._refresh()
                except OSError as error:
                    self._io_failed(error)
            return self._data[kind].get(key)

    def put(self, kind: str, key: str, entry: dict) -> dict:
        """Store ``entry`` unless another process stored this case first; return the one that stands."""
        with self._lock:
            if not self._broken:
                try:
                    with self._exclusive():
                        self._refresh()
                        standing = self._data[kind].setdefault(key, entry)
                        if standing is entry:
                            self._write()
                        return standing
                except OSError as error:
                    self._io_failed(error)
            return self._data[kind].setdefault(key, entry)

    def snapshot(self) -> dict:
        with self._lock, self._exclusive():
            self._refresh()
            return json.loads(json.dumps(self._data))

    def merge(self, data: dict) -> tuple[int, int]:
        """Add the entries of another decision file (``import``); returns (added, already there)."""
        validate(data)
        added = present = 0
        with self._lock, self._exclusive():
            self._refresh()
            for kind in KINDS:
                for key, entry in data[kind].items():
                    if key in self._data[kind]:
                        present += 1
                    else:
                        self._data[kind][key] = entry
                        added += 1
            self._write()
        return added, present

    def clear(self) -> int:
        with self._lock, self._exclusive():
            self._refresh()
            count = sum(len(self._data[kind]) for kind in KINDS)
            self._data = empty()
            self._write()
        return count


_stores: dict[Path, Store] = {}
_stores_lock = threading.Lock()


def store(directory: Path | None) -> Store | None:
    """The process-wide store of ``directory``; None when persistence is off."""
    if directory is None:
        return None
    with _stores_lock:
        return _stores.setdefault(directory, Store(directory))
