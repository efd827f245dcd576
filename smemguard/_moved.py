"""The module paths of smemguard 0.1, before its modules moved into folders, and of the patch modules before they
moved into theirs (``smemguard.patches.kernel_interface``), kept for one release:
``import smemguard.runtime`` (or ``from smemguard import runtime``) gives ``smemguard.facts.process`` itself, the
same module object, with a DeprecationWarning naming the new path. Looked up only for a name under smemguard that
no folder has: a finder of smemguard's own path entry, so that no other import in the process passes through here.
``smemguard.cli`` is the command's folder now; its ``main`` is still there."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
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
MOVED.update({f"patches.{module.rpartition('.')[2]}": f"patches.{module}" for module in (
    "triton_seams.max_shared_mem", "triton_seams.autotuner_bench", "triton_seams.jit_compile",
    "triton_seams.triton_compile", "triton_seams.kernel_interface", "triton_seams.kernel_warmup",
    "torch_seams.torch_device_properties", "torch_seams.inductor_static_launcher", "torch_seams.inductor_launchers",
    "torch_seams.inductor_autotune", "torch_seams.inductor_flex_configs", "torch_seams.inductor_cache_key",
    "contrib.vllm_batch_invariant", "contrib.deepgemm_metadata", "contrib.flaggems", "contrib.vllm_unified_attention",
    "contrib.vllm_prefill_attention", "contrib.vllm_prefix_prefill", "contrib.vllm_shared_memory",
    "contrib.sglang_extend_attention", "contrib.sglang_prefill_attention", "contrib.lmdeploy_flash_attention")})


class _OldPaths(importlib.abc.PathEntryFinder, importlib.abc.Loader):
    """The finder of the path entry :data:`ENTRY`, which only ``smemguard``'s own ``__path__`` holds: the import
    system asks it for a submodule of smemguard that no folder has, and never for anyone else's import."""

    def find_spec(self, name, target=None):
        old = name.partition("smemguard.")[2] if name.startswith("smemguard.") else None
        return importlib.util.spec_from_loader(name, self) if old in MOVED else None

    def invalidate_caches(self) -> None:
        """Nothing cached."""

    def create_module(self, spec):
        new = f"smemguard.{MOVED[spec.name.partition('.')[2]]}"
        warnings.warn(f"{spec.name} is now {new}; the old path goes in the next release", DeprecationWarning,
                      stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import system sets the old path's spec on it next
        return module

    def exec_module(self, module) -> None:
        """The module ran at its new path already; it keeps that path's spec (``importlib.reload`` reads it)."""
        module.__spec__ = module.__spec__.loader_state


#: An absolute path that is no directory (``importlib.invalidate_caches()`` keeps an absolute entry's finder).
ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "<moved in 0.2>")


def _finder_of(entry: str) -> _OldPaths:
    if entry != ENTRY:
        raise ImportError("not smemguard's moved paths", path=entry)
    return _OldPaths()


def add_finder(package_path: list[str]) -> None:
    """Look the moved paths up after smemguard's own folder, once. The path hook goes last: the import system
    reaches it only for an entry that no other hook takes (no directory, no zip), and caches what it answers."""
    if ENTRY not in package_path:
        package_path.append(ENTRY)
    if _finder_of not in sys.path_hooks:
        sys.path_hooks.append(_finder_of)
