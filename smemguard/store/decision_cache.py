"""Decisions persisted in ``SMEMGUARD_CACHE_DIR/decisions.json``, shared by every process on the host:
the file, its schema, and the encoding of a decision as an entry (:mod:`smemguard.engine.recall` applies them).

A decision says what replaces a failing launch on one arch at one limit. There are three
kinds, because they are applied at three different moments:

* ``compile``: option-only changes (``num_stages``, ``num_warps``) of one compiled variant,
  keyed by kernel, source hash, Triton version, arch, limit and the variant (:func:`variant_id`).
  A process that meets the variant compiles the replacement instead, so the failing variant
  is never compiled (Triton >= 3.5, through ``JITFunction._do_compile``);
* ``launch``: a different autotuner config, keyed as a compile decision (it holds for the
  variant whatever tuning key chose it: recall checks that this launch allows the config and
  compiles it), or the fallback, or "nothing fits", additionally keyed by the tuning key (another
  key may allow configs this one did not). A config change is applied at the launch of the variant,
  which is refused before compiling (Triton >= 3.5); the others at the first failing launch. No
  candidates are tried;
* ``inductor``: the variant (fewer stages, warps or blocks) that replaces one config of a
  torch.compile kernel, keyed by Inductor's kernel name, its source hash, Triton version, arch,
  limit and the config. Applied when Inductor loads the kernel: the variant is compiled and
  loaded directly (:func:`smemguard.engine.inductor.load_remembered`). Files written before this table
  existed have none: they read as an empty one.

A variant is keyed by what Triton compiles (:func:`variant_id`), not by the JIT cache key, which
holds the launch's keyword order and the Triton release's own text: ``smemguard check
--decisions`` computes the same key offline. The GPU is keyed by arch and limit, which decide
what compiles and what fits; torch's device name is kept in the entry for people.

The file is JSON (never pickle), read again whenever it changed on disk, and written atomically under an
exclusive ``flock`` on ``decisions.lock`` (:mod:`smemguard.facts.files`), so concurrent workers
(tensor-parallel ranks, restarts) agree: the first decision stored for a case wins and everyone applies it.
A corrupt or foreign-schema file is moved aside with one warning and rebuilt; so is a file holding entries
recovery could not apply (hand-edited, from another version), rebuilt with the usable ones. The directory and
the file are a trust boundary: either one writable by another user (or owned by one) is refused, as ssh refuses
a writable ``authorized_keys``. Failing I/O never stops a launch: one warning, then memory only.

A directory this process cannot write (a read-only image layer, ``readOnlyRootFilesystem``, a server user other
than the one that imported the decisions) is read without the lock, which only writers need (they replace the file
atomically): its decisions apply, a new one stays in the process (one warning), nothing there is moved or rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..facts import files, pins, process, untrusted
from ..facts.untrusted import MAX_STAGES as MAX_STAGES, MAX_WARPS as MAX_WARPS, power_of_two as power_of_two, shown
from . import incidents
from .entry_rules import entry_problems

log = logging.getLogger(__name__)

SCHEMA = 1
FILE_NAME = "decisions.json"
LOCK_NAME = "decisions.lock"
KINDS = ("compile", "launch", "inductor", "tiles", "pins")
#: The tables of decisions smemguard took; ``pins`` holds an operator's (:mod:`smemguard.facts.pins`), which stay
#: when the decisions are cleared.
DECIDED = KINDS[:-1]
#: Tables added after schema 1 was first written: absent from older files, read as empty.
_ADDED_KINDS = ("inductor", "tiles", "pins")
#: A decision file is a few KiB per kernel; one larger than this is not one smemguard wrote.
MAX_FILE = 8 * 2**20


class FileTooLarge(ValueError):
    """A decision file would be larger than :data:`MAX_FILE`, which every reader refuses."""


def serialized(data: dict) -> str:
    """``data`` as the decision file holds it; :class:`FileTooLarge` when a reader would refuse that file."""
    text = json.dumps(data, indent=1, sort_keys=True)
    size = len(text.encode())
    if size > MAX_FILE:
        raise FileTooLarge(f"it would be {size / 2**20:.1f} MiB, over the {MAX_FILE // 2**20} MiB a decision file "
                           "may hold")
    return text


def case_id(fields: dict) -> str:
    """A stable id for a case, from the fields that identify it (order-independent)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]


def empty() -> dict:
    return {"schema": SCHEMA, **{kind: {} for kind in KINDS}}


def validate(data: Any) -> dict:
    """``data`` if it is a decision file of this schema; else ValueError saying what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object but {shown(data, 40)}")
    if type(data.get("schema")) is not int or data["schema"] != SCHEMA:  # true and 1.0 equal 1 in Python
        raise ValueError(f"schema {shown(data.get('schema'), 40)}, expected {SCHEMA}")
    for kind in _ADDED_KINDS:
        data.setdefault(kind, {})
    for kind in KINDS:
        if not isinstance(data.get(kind), dict):
            raise ValueError(f"no {kind!r} table")
    return data


def usable(data: dict) -> tuple[dict, list[str]]:
    """(a copy of decision file ``data`` with only the entries recovery can apply, one line per entry left out)."""
    kept = {**data, **{kind: {} for kind in KINDS}}
    dropped = []
    for kind in KINDS:
        for key, entry in data[kind].items():
            found = entry_problems(kind, entry) or (pins.key_problems(key, entry) if kind == "pins" else [])
            if found:
                dropped.append(f"{kind} entry {shown(key, 40)}: {'; '.join(found)}")
            else:
                kept[kind][key] = entry
    return kept, dropped


def parse(raw: bytes) -> tuple[dict, list[str]]:
    """The usable part of a decision file's bytes, and one line per entry left out; ValueError when
    they are not a decision file at all."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8 text (byte {error.start})") from None
    data, problem = untrusted.loads(text)
    if problem is not None:
        raise ValueError(problem)
    return usable(validate(data))


def read(path: Path) -> tuple[dict, list[str]]:
    """:func:`parse` of the decision file at ``path`` (an empty file when there is none), taking no lock
    and changing nothing: writers replace the file whole. OSError when it cannot be read or trusted
    (:class:`files.Untrusted` when another user can write it), ValueError when it is not a decision file."""
    files.check_trusted(path.parent, path)
    try:
        raw = files.read_bytes(path, MAX_FILE)
    except FileNotFoundError:
        return empty(), []
    return parse(raw)


class Store:
    """The decision file of one cache directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / FILE_NAME
        self._lock = threading.Lock()
        self._data = empty()
        self._stamp: tuple | None = None  # (mtime_ns, size) of the file we last read
        self._broken = False  # I/O failed (but for a busy lock): memory only from then on

    def _exclusive(self):
        files.make_directory(self.directory)
        return files.exclusive(self.directory / LOCK_NAME)

    @property
    def read_only(self) -> bool:
        """An existing directory this process cannot write: its decisions apply, new ones stay in the process."""
        return self.directory.is_dir() and not os.access(self.directory, os.W_OK | os.X_OK)

    def _refresh(self, repair: bool = True) -> None:
        """Read the file again if it changed since we last did (caller holds ``_lock``, and the file lock when
        ``repair``: a file that cannot be used whole is then moved aside; without, it is left as it is)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._data, self._stamp = empty(), None
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        try:
            self._data, dropped = read(self.path)
        except files.Untrusted:  # never moved, never rewritten: it is not ours
            raise
        except (ValueError, files.Refused) as problem:  # corrupt, too large, or no longer a regular file
            self._data, self._stamp = empty(), None if repair else stamp
            if repair:
                log.warning("smemguard: %s was unusable (%s); moved it to %s and starting a new one.",
                            self.path, problem, files.move_aside(self.path))
            else:
                log.warning("smemguard: %s was unusable (%s); its directory is read-only: left as it is, none of "
                            "its decisions apply.", self.path, problem)
            return
        self._stamp = stamp
        if dropped and not repair:
            log.warning("smemguard: %s held %d entries smemguard cannot apply (%s%s); its directory is read-only: "
                        "left as it is, the %d usable ones apply.", self.path, len(dropped), dropped[0],
                        "; ..." if len(dropped) > 1 else "", sum(len(self._data[kind]) for kind in KINDS))
        elif dropped:
            aside = files.move_aside(self.path)
            self._write()
            log.warning("smemguard: %s held %d entries smemguard cannot apply (%s%s); moved the file to %s and "
                        "kept the %d usable ones.", self.path, len(dropped), dropped[0],
                        "; ..." if len(dropped) > 1 else "", aside, sum(len(self._data[kind]) for kind in KINDS))

    def _write(self, text: str | None = None) -> None:
        stat = files.replace(self.path, text if text is not None else serialized(self._data))
        self._stamp = (stat.st_mtime_ns, stat.st_size)

    def _io_failed(self, error: OSError) -> None:
        self._broken = not isinstance(error, files.Busy)  # a busy lock: tried again at the next miss (files.exclusive)
        if isinstance(error, files.Refused):  # a busy lock refuses each miss while it is held: said once
            return process.warn_once(log, str(error), "smemguard: refusing the decision cache: %s; decisions stay in "
                                     "this process.", error)
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

    def _checked(self) -> None:
        """Untrusted when another user can write the directory or the file."""
        files.check_trusted(self.directory, self.path)

    def _fresh(self) -> dict:
        """The decisions, read again if the file changed (caller holds ``_lock``)."""
        if not self._broken:
            try:
                if self._changed():
                    self._checked()
                    if self.read_only:
                        self._refresh(repair=False)
                    else:
                        with self._exclusive():
                            self._refresh()
            except OSError as error:
                self._io_failed(error)
        return self._data

    def get(self, kind: str, key: str) -> dict | None:
        with self._lock:
            return self._fresh()[kind].get(key)

    def holds(self, kind: str) -> bool:
        """Whether table ``kind`` has any entry: a compile miss skips keying its variant when it has none."""
        with self._lock:
            return bool(self._fresh()[kind])

    def put(self, kind: str, key: str, entry: dict) -> dict:
        """Store ``entry`` unless another process stored this case first; return the one that stands."""
        with self._lock:
            if not self._broken and self.read_only:
                standing = self._fresh()[kind].setdefault(key, entry)
                process.warn_once(log, ("decisions read-only", str(self.directory)), "smemguard: the decision "
                                  "cache in %s is read-only: its decisions apply, new ones stay in this process.",
                                  self.directory)
                return standing
            if not self._broken:
                try:
                    self._checked()
                    with self._exclusive():
                        self._refresh()
                        standing = self._data[kind].setdefault(key, entry)
                        if standing is entry:
                            self._write_within_bounds()
                        return standing
                except OSError as error:
                    self._io_failed(error)
            return self._data[kind].setdefault(key, entry)

    def _write_within_bounds(self) -> None:
        """Write the file unless it would be larger than every reader accepts: then the new decision stays in this
        process (one warning), and the file stays as it was, usable."""
        try:
            self._write(serialized(self._data))
        except FileTooLarge as error:
            process.warn_once(log, ("decisions too large", str(self.path)), "smemguard: not storing a new decision "
                              "in %s: %s; it holds in this process only. Fix: 'smemguard cache clear' or a "
                              "SMEMGUARD_CACHE_DIR of its own for this fleet", self.path, error)

    def merge(self, data: dict) -> tuple[int, int]:
        """Add the entries of another decision file (``import``); returns (added, already there).

        ValueError, adding nothing, unless ``data`` is a decision file whose every entry recovery
        can apply (:func:`usable` keeps those of a file that has others). Nothing to add: nothing
        is created or written."""
        _, dropped = usable(validate(data))
        if dropped:
            raise ValueError(dropped[0] + (f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""))
        if not any(data[kind] for kind in KINDS):
            return 0, 0
        added = present = 0
        with self._lock:
            self._checked()
            with self._exclusive():
                self._refresh()
                merged = {**self._data, **{kind: dict(self._data[kind]) for kind in KINDS}}
                for kind in KINDS:
                    for key, entry in data[kind].items():
                        if key in merged[kind]:
                            present += 1
                        else:
                            merged[kind][key] = entry
                            added += 1
                if added:
                    self._write(serialized(merged))  # FileTooLarge (a ValueError): nothing written, nothing added
                    self._data = merged
        return added, present

    def clear(self) -> int:
        """Forget every decision (the pins stay: ``smemguard pin remove`` takes them); returns how many."""
        with self._lock:
            self._checked()
            with self._exclusive():
                self._refresh()
                count = sum(len(self._data[kind]) for kind in DECIDED)
                self._data = {**empty(), "pins": self._data["pins"]}
                self._write()
        return count

    def entries(self, kind: str) -> dict:
        """Table ``kind`` as it stands (read again when the file changed)."""
        with self._lock:
            return dict(self._fresh()[kind])

    def edit(self, kind: str, key: str, entry: dict | None) -> dict | None:
        """Store ``entry`` under ``key`` of table ``kind`` in place of what stands there, or remove that with None
        (``smemguard pin``); returns the entry replaced or removed. OSError or :class:`FileTooLarge` when the file
        cannot be written: nothing changed."""
        with self._lock:
            self._checked()
            with self._exclusive():
                self._refresh()
                table = dict(self._data[kind])
                before = table.pop(key, None)
                if entry is not None:
                    table[key] = entry
                if before is not None or entry is not None:
                    edited = {**self._data, kind: table}
                    self._write(serialized(edited))
                    self._data = edited
        return before


_stores: dict[Path, Store] = {}
_stores_lock = threading.Lock()


def store(directory: Path | None) -> Store | None:
    """The process-wide store of ``directory``; None when persistence is off."""
    if directory is None:
        return None
    with _stores_lock:
        return _stores.setdefault(directory, Store(directory))


# -- Encoding: a recovery decision as a stored entry -------------------------------------------


def provenance() -> dict:
    """Where and when an entry was stored (for people reading the file; never part of a key)."""
    return {"time": time.time(), "host": incidents.host(), "pid": os.getpid()}


def new_entry(case: dict, *, action: str, final: str | None, from_config: str, gpu: str, resource: str,
              required, **own) -> dict:
    """An entry of any table (the launch guard's, the compile-time core's, torch.compile's): the ``case`` that keys
    it, what every entry says (what was decided, from what, on which GPU, about what did not fit: a process that
    meets it again refuses it before compiling), where and when (:func:`provenance`), and the table's ``own``
    fields, which come last (torch.compile's ``config`` is the variant's, its case's the failing one's)."""
    return {**case, "action": action, "final": final, "from_config": from_config, "gpu": gpu, "resource": resource,
            "required": required, **provenance(), **own}
