"""The module paths of smemguard 0.1, before its modules moved into folders, kept for one release:
``import smemguard.runtime`` (or ``from smemguard import runtime``) gives ``smemguard.facts.process`` itself, the
same module object, with a DeprecationWarning naming the new path. Looked up only for a name no folder has.
``smemguard.cli`` is the command's folder now; its ``main`` is still there."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module under ``smemguard`` -> its path under ``smemguard`` now
MOVED = {
    "runtime": "facts.process",
    "versions": "facts.versions",
    "settings": "facts.settings",
    "gpus": "facts.gpus",
    "files": "facts.files",
    "untrusted": "facts.untrusted",
    "introspect": "kernels.introspect",
    "layers": "kernels.tuners",
    "registry": "kernels.registry",
    "knobs": "kernels.parameters",
    "launch": "kernels.launch",
    "pruning": "kernels.pruning",
    "estimate": "kernels.estimate",
    "decision": "store.decision",
    "decisions": "store.decision_cache",
    "incidents": "store.incidents",
    "metrics": "store.metrics",
    "internal": "engine.steps",
    "candidates": "engine.candidates",
    "compile_fit": "engine.compile_fit",
    "ladder": "engine.ladder",
    "recall": "engine.recall",
    "recovery": "engine.recovery",
    "inductor": "engine.inductor",
    "wrapper_tiles": "engine.wrapper_tiles",
    "wrapper_outcomes": "engine.wrapper_outcomes",
    "cli_check": "cli.check",
    "cli_demo": "cli.demo",
    "cli_run": "cli.run",
    "report": "cli.report",
    "replay": "cli.replay",
}


class _OldPath(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        old = name.partition("smemguard.")[2] if name.startswith("smemguard.") else None
        return importlib.util.spec_from_loader(name, self) if old in MOVED else None

    def create_module(self, spec):
        new = f"smemguard.{MOVED[spec.name.partition('.')[2]]}"
        warnings.warn(f"{spec.name} is now {new}; the old path goes in the next release", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """The module ran at its new path already."""


def add_finder() -> None:
    """After every other finder (a moved path is looked up only once the others found nothing), once."""
    if not any(isinstance(finder, _OldPath) for finder in sys.meta_path):
        sys.meta_path.append(_OldPath())
