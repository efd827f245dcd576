"""What the package keeps at module level: each name in the allowlist below, with why it lasts the process.

Per-install state is on the engine (``Engine.decided``, ``Engine.memory``, ``Engine.notes``) and goes with it; what
stays module-level is truly process-wide. A new module-level binding that is not a constant (an UPPER_CASE name), a
logger or a lock fails this test until it is allowlisted here with its reason, or moved onto the engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "smemguard"

#: Process-wide state: module -> {name: why it lasts the process}. At most 12.
PROCESS_STATE = {
    "facts/process.py": {
        "_installed_engine": "the install in force, one per process: the route to it for code no patch hands it to",
        "_warned": "warn-once: a case warned of is not warned of again by a later install",
    },
    "facts/files.py": {"_paused": "lock files whose waits are paused: the lock is the host's, whichever install"},
    "guard.py": {"_installer": "import hooks cannot be removed; settings waiting for `import triton`"},
    "kernels/source.py": {"_parsed_so_far": "each kernel's parsed source: a kernel's source does not change"},
    "kernels/parameters.py": {"_read_so_far": "what each kernel's source says of its knobs, read once"},
    "kernels/registry.py": {"_registered": "users' registrations, made at their library's import"},
    "kernels/tuners.py": {"_kinds": "libraries' tuner kinds, described for the process"},
    "preflight/compiling.py": {"_worker": "a compile worker process's imported kernels"},
    "store/decision_cache.py": {"_stores": "one store, and its lock, per decision file"},
    "store/incidents.py": {"_writer": "record ids unique in the process; paths found unwritable"},
    "store/metrics.py": {"_exporter": "prometheus_client's registry is the process's: a series registers once"},
}

#: The call in progress on a thread (restored when it returns), never memory across calls.
THREAD_SCOPED = {
    "facts/process.py": {"launching", "benchmarking", "device_as_is", "engine_compiling"},
    "engine/recall.py": {"compiling_as_asked"},
    "engine/wrapper_tiles.py": {"running"},
}

#: Declarations: the demo's Triton kernels, and a type alias.
DECLARATIONS = {"examples.py": {"flaggems_matmul", "attention_fwd"}, "preflight/source.py": {"Axis"}}


def _module_state(path: Path) -> set[str]:
    """Names bound at module level that are neither constants, loggers nor locks; and names rebound by ``global``."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        for target in targets:
            if not isinstance(target, ast.Name):
                continue
            name = target.id
            if name.startswith("__") or name.strip("_") == name.strip("_").upper():
                continue
            if name == "log" or name.endswith("_lock"):
                continue
            names.add(name)
    names.update(name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names)
    return names


def _found() -> dict[str, set[str]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names = _module_state(path)
        if names:
            found[path.relative_to(PACKAGE).as_posix()] = names
    return found


def test_module_level_state_is_only_what_the_allowlist_names():
    allowed = {module: set(PROCESS_STATE.get(module, ())) | THREAD_SCOPED.get(module, set())
               | DECLARATIONS.get(module, set()) for module in {*PROCESS_STATE, *THREAD_SCOPED, *DECLARATIONS}}
    found = _found()
    unlisted = {module: sorted(names - allowed.get(module, set())) for module, names in found.items()
                if names - allowed.get(module, set())}
    assert not unlisted, f"module-level state not in the allowlist (move it onto the engine, or list it): {unlisted}"
    gone = {module: sorted(names - found.get(module, set())) for module, names in allowed.items()
            if names - found.get(module, set())}
    assert not gone, f"allowlisted names no module binds any more (take them out of the list): {gone}"


def test_process_wide_state_has_at_most_twelve_names():
    assert sum(map(len, PROCESS_STATE.values())) <= 12


def test_the_rule_finds_a_module_level_table(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import logging\nlog = logging.getLogger(__name__)\nLIMITS = {}\n_seen = {}\n_lock = None\n"
                      "def f():\n    global _count\n    _count = 1\n")
    assert _module_state(module) == {"_seen", "_count"}
