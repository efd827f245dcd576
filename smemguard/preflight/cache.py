"""Measured results on disk, under Triton's own compile-cache key (see :func:`.compiling.cache_key`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..facts import files

log = logging.getLogger(__name__)

#: A result is a few numbers; a file larger than this is not one the check wrote.
MAX_RESULT = 64 * 2**10


class ResultCache:
    """Measured results as small JSON files, one per compile key; written atomically (:mod:`smemguard.facts.files`).
    A result decides a verdict as a compile would: one that another user can write (or the folder holding it) is
    compiled again, never read (``files.check_trusted``, the decision file's rule). ``refused``: why there is no
    directory, where it was not trusted."""

    def __init__(self, directory: Path | None, refused: str | None = None) -> None:
        self.directory = directory
        self.refused = refused

    def _path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict | None:
        """The result stored under ``key``; None when there is none usable (a damaged one is compiled again)."""
        if self.directory is None:
            return None
        path = self._path(key)
        try:
            files.check_trusted(path.parent, path)
            result = json.loads(files.read_bytes(path, MAX_RESULT))
        except (OSError, ValueError, RecursionError):  # Untrusted too
            return None
        return result if valid(result) else None

    def put(self, key: str, result: dict) -> None:
        if self.directory is None:
            return
        path = self._path(key)
        try:
            files.make_directory(path.parent)
            files.replace(path, json.dumps(result))
        except OSError:
            log.debug("smemguard check: could not write %s", path, exc_info=True)


def valid(result) -> bool:
    """Whether ``result`` is one the check stores: {"shared": bytes or null, "error": text or null, ...}."""
    if not isinstance(result, dict):
        return False
    shared, error = result.get("shared"), result.get("error")
    if shared is None:
        return isinstance(error, str)
    return isinstance(shared, int) and not isinstance(shared, bool) and shared >= 0


def default_cache() -> ResultCache:
    """``SMEMGUARD_CACHE_DIR/preflight``; no cache when the setting is off or unusable (its problem line
    says so): the default directory is never written in place of the one the user named. Nor when another user
    can write it or the cache directory (``refused`` says why): a result rewritten there would turn an overflow
    into "fits", as a decision file rewritten there would decide what compiles."""
    from ..facts import settings

    current = settings.current()
    if current.cache_dir is None or current.ignored(settings.CACHE_DIR):
        return ResultCache(None)
    directory = current.cache_dir / "preflight"
    try:
        files.check_trusted(current.cache_dir, directory)
    except files.Untrusted as refusal:
        return ResultCache(None, refused=str(refusal))
    return ResultCache(directory)
