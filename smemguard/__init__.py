"""smemguard: keep Triton launches alive when a kernel asks for more shared memory than the GPU has.

    import smemguard
    smemguard.install()     # or run vLLM with VLLM_PLUGINS=smemguard

Importing this package imports neither Triton nor torch.
"""

from . import _moved
from ._version import __version__

_moved.add_finder(__path__)  # before anything else of ours is imported

from .guard import install, is_installed, uninstall  # noqa: E402
from .kernels.registry import (  # noqa: E402
    register_alternatives,
    register_fallback,
    unregister_alternatives,
    unregister_fallback,
)

__all__ = ["install", "uninstall", "is_installed", "register_fallback", "unregister_fallback",
           "register_alternatives", "unregister_alternatives", "tile_choice", "tiles_at_launch", "rerun_on_overflow",
           "fits", "fits_for", "__version__"]


def __getattr__(name):
    # The pruner is not needed to guard launches: every vLLM process imports smemguard at plugin
    # registration, so it loads on first use only.
    if name in ("fits", "fits_for"):
        from .kernels import pruning

        return getattr(pruning, name)
    if name in ("tile_choice", "tiles_at_launch"):  # for wrappers; imports Triton when used
        from .engine import wrapper_tiles

        return getattr(wrapper_tiles, name)
    if name == "rerun_on_overflow":
        from .engine import wrapper_rerun

        return wrapper_rerun.rerun_on_overflow
    raise AttributeError(f"module 'smemguard' has no attribute {name!r}")
