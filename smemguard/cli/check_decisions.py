"""``smemguard check --decisions FILE``: where the decisions recovery would take for the check's overflows are written.
Never over a file the check read, and into this host's live decision file only by merging under its lock."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from ..facts import untrusted


def unwritable(path: Path) -> str | None:
    """Why ``--decisions`` cannot be written (said before anything is checked), or None."""
    shown = untrusted.printable(str(path))
    if path.is_dir():
        return f"{shown} is a directory; name a file in it"
    if os.path.lexists(path) and not path.is_file():
        return f"{shown} is not a regular file (a FIFO, a device or a dangling link)"
    folder = path.parent
    if not folder.is_dir():
        return f"{shown}: the directory {untrusted.printable(str(folder))} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"{shown} cannot be written (permission denied)"
    return None


def refuse_an_input(path: Path, read: set[str]) -> None:
    """TargetError when ``--decisions`` names a file the check has read: writing would replace a kernel's source."""
    from ..preflight import TargetError

    try:
        written = os.stat(path)
    except OSError:  # not there yet: no input
        return
    for source in read:
        with contextlib.suppress(OSError):
            if os.path.samestat(written, os.stat(source)):
                raise TargetError(f"--decisions {untrusted.printable(str(path))} is {untrusted.printable(source)}, a "
                                  "file this check read (a kernel's source, a module it imported): name another "
                                  "file; nothing checked")


def _live_store(path: Path):
    """The decision store of ``SMEMGUARD_CACHE_DIR`` when ``path`` is its file (the live decisions), else None."""
    from ..facts import settings
    from ..store import decision_cache

    current = settings.current()
    if current.cache_dir is None or current.ignored(settings.CACHE_DIR):
        return None
    store = decision_cache.Store(current.cache_dir)
    return store if os.path.realpath(path) == os.path.realpath(store.path) else None


def write(report, path: Path, cache, progress) -> bool:
    """Take and write the decisions for ``report``'s overflows (one line on stderr says what); False when
    the file could not be written. The host's own decision file is not replaced but merged into under its lock,
    as 'cache import' does: no decision already there is lost, and it stays its owner's only."""
    from ..facts import files
    from ..preflight.decide import decide

    found = decide(report, cache.directory / "triton" if cache.directory is not None else None,
                   progress=progress)
    shown, live = untrusted.printable(str(path)), _live_store(path)
    try:
        if live is not None:
            added, present = live.merge(found.data)
        else:
            files.replace(path, json.dumps(found.data, indent=1, sort_keys=True), mode=0o644)
    except (OSError, ValueError) as error:  # ValueError: the merged file would be too large
        print(f"smemguard check: cannot write --decisions {shown} ({getattr(error, 'strerror', None) or error}); "
              "nothing written", file=sys.stderr)
        return False
    for note in found.notes:
        print(f"smemguard check: no decision for {note}", file=sys.stderr)
    done = (f"added {untrusted.counted(added, 'decision')} to this host's decision cache {shown} ({present} already "
            "there, kept as they were)" if live is not None else
            f"wrote {untrusted.counted(found.entries, 'decision')} to {shown}")
    print(f"smemguard check: {done} for {untrusted.counted(found.decided, 'overflowing config')} "
          f"({len(found.notes)} without one)"
          + ("" if live is not None else f"; import them with 'smemguard cache import {shown}'"), file=sys.stderr)
    return True
