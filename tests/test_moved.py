"""The module paths of 0.1 still import for one release: the same module object as the new path, with a
DeprecationWarning naming it; and the folders are the layers (no module imports a folder above its own)."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import smemguard
from smemguard import _moved

PACKAGE = Path(smemguard.__file__).parent
#: Each folder may import its own modules and those of the folders before it.
LAYERS = ["facts", "kernels", "store", "engine", "patches"]


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED.items()))
def test_an_old_path_is_the_new_module_with_a_warning(old, new):
    script = (f"import warnings; warnings.simplefilter('always')\n"
              f"import smemguard.{new} as new\n"
              f"with warnings.catch_warnings(record=True) as caught:\n"
              f"    from smemguard import {old} as old\n"
              f"print(old is new, old.__spec__.name,\n"
              f"      [str(w.message) for w in caught if w.category is DeprecationWarning])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    warning = f"smemguard.{old} is now smemguard.{new}; the old path goes in the next release"
    assert done.stdout.strip() == f"True smemguard.{new} [{warning!r}]"
    assert not (PACKAGE / f"{old}.py").exists()


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
             for path in sorted((PACKAGE / folder).glob("*.py"))}
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
    (``smemguard.tile_choice`` and friends, ``engine.wrapper_tiles``) is imported, by the packs that declare with it."""
    reached = {str(path.relative_to(PACKAGE)): sorted(module for module in _imported_modules(path)
                                                      if module.startswith("engine."))
               for path in sorted((PACKAGE / "patches").glob("*.py"))}
    assert {path: modules for path, modules in reached.items() if set(modules) - {"engine.wrapper_tiles"}} == {}
