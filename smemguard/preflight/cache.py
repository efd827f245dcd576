"""Measured results on disk, under Triton's own compile-cache key (see :func:`.compiling.cache_key`)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


class ResultCache:
    """Measured results as small JSON files, one per compile key; written atomically."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    def _path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict | None:
        if self.directory is None:
            return None
        try:
            return json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, result: dict) -> None:
        if self.directory is None:
            return
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
                json.dump(result, handle)
            os.replace(handle.name, path)
        except OSError:
            log.debug("smemguard check: could not write %s", path, exc_info=True)


def default_cache() -> ResultCache:
    from .. import settings

    directory = settings.current().cache_dir
    return ResultCache(directory / "preflight" if directory is not None else None)
