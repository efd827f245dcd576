"""The module paths of 0.1 still import for one release: the same module object as the new path, with a
DeprecationWarning naming it; and the folders are the layers (no module imports a folder above its own)."""

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import smemguard
from smemguard import _moved

PACKAGE = Path(smemguard.__file__).parent
#: Each folder may import its own modules and those of the folders before it.
LAYERS = ["facts", "kernels", "store", "engine", "patches"]


def test_an_old_path_is_the_new_module_with_a_warning():
    # One fresh process for every old path: each import is the first of its module there.
    script = ("import importlib, json, sys, warnings\n"
              "warnings.simplefilter('always')\n"
              f"moved = {dict(_moved.MOVED)!r}\n"
              "seen = {}\n"
              "for old, new in moved.items():\n"
              "    new_module = importlib.import_module(f'smemguard.{new}')\n"
              "    with warnings.catch_warnings(record=True) as caught:\n"
              "        old_module = importlib.import_module(f'smemguard.{old}')\n"
              "    parent, _, leaf = f'smemguard.{old}'.rpartition('.')\n"
              "    seen[old] = [old_module is new_module, getattr(sys.modules[parent], leaf) is new_module,\n"
              "                 old_module.__spec__.name,\n"
              "                 [str(w.message) for w in caught if w.category is DeprecationWarning]]\n"
              "print(json.dumps(seen))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    for old, new in _moved.MOVED.items():
        warning = f"smemguard.{old} is now smemguard.{new}; the old path goes in the next release"
        assert seen[old] == [True, True, f"smemguard.{new}", [warning]], old
        assert not (PACKAGE / f"{old.replace('.', '/')}.py").exists()


def test_only_smemguards_own_imports_reach_the_moved_paths():
    # A meta-path finder would be asked for every import of the process (prometheus_client's optional imports, on
    # the first incident); the finder of smemguard's own path entry is asked only for a name under smemguard.
    script = ("import importlib, sys, smemguard, smemguard._moved as moved\n"
              "asked = []\n"
              "find = moved._OldPaths.find_spec\n"
              "moved._OldPaths.find_spec = lambda self, name, target=None: asked.append(name) or find(self, name)\n"
              "for name in ('no_such_module_anywhere', 'json.no_such_module', 'smemguard.no_such_module'):\n"
              "    try:\n"
              "        importlib.import_module(name)\n"
              "    except ImportError:\n"
              "        pass\n"
              "importlib.invalidate_caches()\n"
              "sys.path_importer_cache.clear()  # the path hook makes the finder again\n"
              "import smemguard.runtime\n"
              "print(asked)")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['smemguard.no_such_module', 'smemguard.runtime']"


def test_a_name_no_module_had_still_fails_to_import():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("smemguard.no_such_module")


def _imported_modules(path: Path) -> set[str]:
    """The smemguard modules (``engine.steps``) and folders (``engine``) that the module at ``path`` imports."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = path.parent.relative_to(PACKAGE).parts
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                parts = [*base, *(node.module.split(".") if node.module else [])]
            elif (node.module or "").startswith("smemguard."):
                parts = node.module.split(".")[1:]
            else:
                continue
            if len(parts) > 1:
                modules.add(".".join(parts[:2]))
            elif parts:
                modules |= {f"{parts[0]}.{alias.name}" for alias in node.names}
            else:
                modules |= {alias.name for alias in node.names}
    return modules


def _imported_folders(path: Path) -> set[str]:
    """The top folders of smemguard that the module at ``path`` imports (relative or absolute)."""
    return {module.partition(".")[0] for module in _imported_modules(path)} & set(LAYERS)


@pytest.mark.parametrize("folder", LAYERS)
def test_a_folder_imports_only_its_own_and_the_folders_below(folder):
    allowed = set(LAYERS[:LAYERS.index(folder) + 1])
    above = {str(path.relative_to(PACKAGE)): sorted(_imported_folders(path) - allowed)
             for path in sorted((PACKAGE / folder).rglob("*.py"))}
    assert {path: folders for path, folders in above.items() if folders} == {}


def test_the_store_keeps_plain_data_and_imports_neither_triton_nor_the_kernels():
    """The store validates, locks, merges and writes: what identifies a compiled variant is the kernels' (issue 46)."""
    for path in sorted((PACKAGE / "store").glob("*.py")):
        assert _imported_folders(path) <= {"facts", "store"}, path
        imported = {alias.name for node in ast.walk(ast.parse(path.read_text()))
                    for alias in getattr(node, "names", ()) if isinstance(node, ast.Import)} | {
            node.module or "" for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)}
        assert not any(name == "triton" or name.startswith("triton.") for name in imported), path


def test_every_folder_of_the_package_ships_in_the_wheel():
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(init.parent.relative_to(PACKAGE.parent).parts) for init in PACKAGE.rglob("__init__.py")}
    assert folders - listed == set(), "a package folder a non-editable install would leave out"


def test_patches_reach_the_engine_only_through_the_port():
    """A patch is handed the engine (``patches.Port``: its entry points, settings, memory and the guard around its
    own steps) and never imports the engine's modules; only the public wrapper API that libraries call themselves
    (``smemguard.tile_choice`` and friends: ``engine.wrapper_tiles``, ``engine.wrapper_rerun``) is imported, by the
    packs that declare with it."""
    reached = {str(path.relative_to(PACKAGE)): sorted(module for module in _imported_modules(path)
                                                      if module.startswith("engine."))
               for path in sorted((PACKAGE / "patches").rglob("*.py"))}
    public = {"engine.wrapper_tiles", "engine.wrapper_rerun"}
    assert {path: modules for path, modules in reached.items() if set(modules) - public} == {}
