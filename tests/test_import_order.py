"""The import-order dimension of the patch contract (ddtrace's contrib tests have it): every patch applies whether
its library is imported before ``install()`` or after it (through the post-import hook), exactly once when the
library or the install comes twice, and one ``unpatch`` takes it off again (a second layer would be left behind).
Each order in a fresh interpreter; a library not installed here is skipped (CI's later stages have them)."""

import importlib.util
import json
from pathlib import Path

import pytest

from smemguard import patches

from conftest import run_python

ORDERS = ("imported before install", "imported after install", "imported and installed twice")
#: What a library needs in its environment to import on a machine without a GPU (FlagGems finds its vendor with
#: nvidia-smi, and names its tuning database after the CUDA device, unless told; tests/test_flaggems.py does the same).
LIBRARY_ENV = {"flaggems": lambda tmp_path: {"GEMS_VENDOR": "nvidia",
                                             "FLAGGEMS_DB_URL": f"sqlite:///{tmp_path}/tuned.db"}}


def _importable(module: str) -> bool:
    """Whether ``module`` is installed, found without importing its package here (FlagGems' looks for a GPU at
    import, and tests/test_flaggems.py imports it once, with settings of its own)."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None or not rest:
        return spec is not None
    return any(Path(location, *rest).with_suffix(".py").is_file() or Path(location, *rest, "__init__.py").is_file()
               for location in spec.submodule_search_locations or ())


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", patches.MODULES)
def test_a_patch_applies_once_whatever_the_import_order(name, order, tmp_path):
    module_path, name = name, name.rpartition(".")[2]
    import importlib

    patch = importlib.import_module(f"smemguard.patches.{module_path}").PATCH
    module = next((module for module in patch.modules if _importable(module)), None)
    if module is None:
        pytest.skip(f"{name} patches {', '.join(patch.modules)}, not installed here")
    result = run_python(f"""
        import importlib, json, logging
        import smemguard
        from smemguard.facts.settings import Settings
        import smemguard.patches.{module_path} as patched

        settings = Settings(max_shared=65536)  # every patch wanted: an emulated limit, a decision cache
        # wanted, and its library's release one the patch reads (kernel_warmup reads Triton 3.6 and later)
        wanted = patched.PATCH.applies(settings) and patched.PATCH.supported.refusal() is None
        order = {order!r}
        if {module!r} != "triton":
            import triton  # the library patches apply once Triton is guarded, whenever that is
        if order == "imported before install":
            importlib.import_module({module!r})
            smemguard.install(settings)
        else:
            smemguard.install(settings)
            importlib.import_module({module!r})
            if order == "imported and installed twice":
                importlib.import_module({module!r})
                smemguard.install(settings)
                smemguard.uninstall()
                smemguard.install(settings)
                smemguard.install(settings)
        applied = patched.PATCH.is_patched()
        patched.PATCH.unpatch()
        print(json.dumps({{"wanted": wanted, "applied": applied, "left": patched.PATCH.is_patched()}}))
    """, env=LIBRARY_ENV.get(name, lambda _: {})(tmp_path))
    seen = json.loads(result.stdout.splitlines()[-1])
    if not seen["wanted"]:
        pytest.skip(f"{name} is not wanted with an emulated limit and a decision cache, or not for this release")
    assert seen["applied"], f"{name} did not apply when its library was {order}"
    assert not seen["left"], f"{name} applied twice when its library was {order}: one unpatch left a layer"
