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
one warning and rebuilt; so is a file holding entries recovery could not apply (hand-edited, from
another version), rebuilt with the usable ones. Failing I/O never stops a launch: one warning,
then memory only.
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

from . import incidents, introspect, ladder, registry, runtime, untrusted
from .decision import CONFIG_CHANGED, Decision, FALLBACK, RERAISED, STAGES_REDUCED, WARPS_REDUCED
from .launch import jit_keys_of, try_compile, with_config
from .untrusted import NAME, OBJECT, TEXT, Expect, integer, one_of, shown

log = logging.getLogger(__name__)

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
        raise ValueError(f"not a JSON object but {shown(data, 40)}")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"schema {shown(data.get('schema'), 40)}, expected {SCHEMA}")
    for kind in KINDS:
        if not isinstance(data.get(kind), dict):
            raise ValueError(f"no {kind!r} table")
    return data


#: The actions recovery stores in each table (recovery.py's names): option-only changes of one
#: compiled variant; another config, the fallback, or "nothing fits" for a launch.
ACTIONS = {"compile": (STAGES_REDUCED, WARPS_REDUCED),
           "launch": (CONFIG_CHANGED, FALLBACK, RERAISED)}

_OPTIONS = Expect("an object of num_stages and num_warps values (positive integers)", lambda value: (
    isinstance(value, dict) and len(value) > 0
    and all(name in ("num_stages", "num_warps") and integer(1).test(v) for name, v in value.items())))
_CONFIG = {"kwargs": OBJECT, "num_warps": integer(1), "num_stages": integer(0), "num_ctas": integer(1),
           "maxnreg": integer(1).or_null()}
#: Per action, what recovery reads from the entry to apply it.
_NEEDS = {STAGES_REDUCED: {"options": _OPTIONS}, WARPS_REDUCED: {"options": _OPTIONS},
          CONFIG_CHANGED: {"config": OBJECT}, FALLBACK: {"fallback": NAME},
          RERAISED: {"reason": TEXT}}


def entry_problems(kind: str, entry: Any) -> list[str]:
    """Why recovery could not apply ``entry`` of table ``kind`` (empty when it can)."""
    if not isinstance(entry, dict):
        return [f"the entry is {shown(entry, 40)}, expected an object"]
    found = untrusted.problems(entry, {"action": one_of(*ACTIONS[kind])})
    if found:
        return found
    found = untrusted.problems(entry, _NEEDS[entry["action"]])
    if not found and "config" in _NEEDS[entry["action"]]:
        found = untrusted.problems(entry["config"], _CONFIG, prefix="config.")
    return found


def usable(data: dict) -> tuple[dict, list[str]]:
    """(a copy of decision file ``data`` with only the entries recovery can apply, one line per entry left out)."""
    kept = {**data, **{kind: {} for kind in KINDS}}
    dropped = []
    for kind in KINDS:
        for key, entry in data[kind].items():
            found = entry_problems(kind, entry)
            if found:
                dropped.append(f"{kind} entry {shown(key, 40)}: {'; '.join(found)}")
            else:
                kept[kind][key] = entry
    return kept, dropped


def parse(text: str) -> tuple[dict, list[str]]:
    """The usable part of a decision file's text, and one line per entry left out; ValueError when
    the text is not a decision file at all."""
    data, problem = untrusted.loads(text)
    if problem is not None:
        raise ValueError(problem)
    return usable(validate(data))


def read(path: Path) -> tuple[dict, list[str]]:
    """:func:`parse` of the file at ``path`` (an empty file when there is none), taking no lock and
    changing nothing: writers replace the file whole. OSError when it cannot be read."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return empty(), []
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8 text (byte {error.start})") from None
    return parse(text)


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
            self._data, dropped = read(self.path)
        except ValueError as problem:
            self._data, self._stamp = empty(), None
            log.warning("smemguard: %s was unreadable (%s); moved it to %s and starting a new one.",
                        self.path, problem, self._move_aside())
            return
        self._stamp = stamp
        if dropped:
            aside = self._move_aside()
            self._write()
            log.warning("smemguard: %s held %d entries smemguard cannot apply (%s%s); moved the file to %s and "
                        "kept the %d usable ones.", self.path, len(dropped), dropped[0],
                        "; ..." if len(dropped) > 1 else "", aside, sum(len(self._data[kind]) for kind in KINDS))

    def _move_aside(self) -> Path:
        """Keep the file as it is under a new name (nothing is lost); return that name."""
        aside = self.path.with_name(f"{FILE_NAME}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.replace(self.path, aside)
        return aside

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
        """Add the entries of another decision file (``import``); returns (added, already there).

        ValueError, adding nothing, unless ``data`` is a decision file whose every entry recovery
        can apply (:func:`usable` keeps those of a file that has others)."""
        _, dropped = usable(validate(data))
        if dropped:
            raise ValueError(dropped[0] + (f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""))
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


# -- Encoding: a recovery decision as a stored entry, and back --------------------------------
# A case is identified by what was compiled and where: kernel, source, Triton, GPU model,
# enforced limit, JIT key (``compile``), and the tuning key too (``launch``).


def _compile_case(jit, jit_key: str, device: int) -> dict:
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return {"kernel": introspect.kernel_name(jit), "source_hash": introspect.source_hash(jit),
            "triton": runtime.triton_version(), "gpu": runtime.gpu_name(device) or f"{target.backend}:{target.arch}",
            "arch": target.arch, "limit": runtime.effective_limit(device), "jit_key": jit_key}


def cases_for(launch, failing) -> dict | None:
    """{"compile": case, "launch": case} identifying this failure to other processes; None when
    the failing kernel is not in the JIT cache (nothing to key it by)."""
    jit_key = next(jit_keys_of(launch, failing), None)
    if jit_key is None:
        return None
    compile_case = _compile_case(launch.jit, jit_key, runtime.current_device())
    return {"compile": compile_case, "launch": {**compile_case, "tuning_key": repr(launch.tuning_key)}}


def remembered_options(jit, jit_key: str, device: int, directory: Path | None) -> dict | None:
    """Option overrides remembered for the variant Triton is about to compile (compile-time patch)."""
    decisions = store(directory)
    if decisions is None:
        return None
    entry = decisions.get("compile", case_id(_compile_case(jit, jit_key, device)))
    return dict(entry["options"]) if entry else None


def _config_from_entry(launch, entry: dict):
    """The tuner config described by ``entry`` (one of its own, or a fewer-stage variant), or None."""
    for config in ladder.allowed_configs(launch):
        fields = introspect.config_fields(config)
        same_but_stages = all(entry.get(name) == value for name, value in fields.items() if name != "num_stages")
        if same_but_stages and config.num_stages >= entry["num_stages"]:
            if config.num_stages == entry["num_stages"]:
                return config
            return ladder.variant(config, num_stages=entry["num_stages"]) if ladder.takes_variants(launch) else None
    return None


def _from_entry(launch, kind: str, entry: dict):
    """Apply a stored decision to this launch: one compile to confirm it fits, no other candidate."""
    if kind == "compile":
        kernel, attempt = try_compile(launch, "remembered", **entry["options"])
        if attempt.fits:
            return Decision(entry["action"], (attempt,), final=attempt.config, replacement=kernel,
                                   options=dict(entry["options"]), remembered=True)
        return None
    action = entry["action"]
    if action == CONFIG_CHANGED:
        config = _config_from_entry(launch, entry["config"])
        if config is None:
            return None
        _, attempt = try_compile(with_config(launch, config), introspect.config_text(config))
        if attempt.fits:
            ladder.adopt(launch, config)
            return Decision(CONFIG_CHANGED, (attempt,), config=config, final=attempt.config,
                                   remembered=True)
        return None
    fallback = registry.fallback_for(launch.jit)
    if action == FALLBACK and fallback is not None and introspect.callable_name(fallback) == entry["fallback"]:
        return Decision(FALLBACK, (), fallback=fallback, final=f"fallback {entry['fallback']}",
                               remembered=True)
    if action == RERAISED and fallback is None:
        return Decision(RERAISED, (), reason=entry["reason"], remembered=True)
    return None


def recall(launch, cases: dict, decisions: Store):
    """The decision stored for one of ``cases``, applied to ``launch``; None when there is none that applies."""
    for kind, case in cases.items():
        entry = decisions.get(kind, case_id(case))
        if entry is not None:
            decision = _from_entry(launch, kind, entry)
            if decision is not None:
                return decision
    return None


def remember(launch, decision, cases: dict, decisions: Store):
    """Store ``decision``; if another process stored this case first, apply theirs instead."""
    entry: dict[str, Any] = {"action": decision.action, "final": decision.final, "time": time.time(),
                             "host": incidents.host(), "pid": os.getpid(), "from_config": decision.attempts[0].config}
    kind = "compile" if decision.options is not None else "launch"
    case = cases[kind]
    if decision.options is not None:
        entry["options"] = decision.options
    else:
        if decision.config is not None:
            entry["config"] = introspect.config_fields(decision.config)
        if decision.fallback is not None:
            entry["fallback"] = introspect.callable_name(decision.fallback)
        entry["reason"] = decision.reason
    entry.update(case)
    standing = decisions.put(kind, case_id(case), entry)
    if standing is entry:
        return decision
    theirs = _from_entry(launch, kind, standing)
    return theirs if theirs is not None else decision
