"""FlagGems: recovery through its own ``LibEntry`` and ``LibTuner``, and a cuBLAS fallback for its matmul.

Why: FlagGems launches its Triton kernels through two layers of its own. ``LibTuner`` (an
``Autotuner`` subclass with its own ``run``) files the tuned config in a SQLite database
under its own key (``align32`` of M, N, K and the strides for the Hopper matmul), and
``LibEntry`` caches the compiled kernel ``LibTuner`` hands back, per argument signature, and
launches it directly next time. Its Hopper matmul (``mm_kernel_general_host_tma``, 216
configs, a ``pre_hook`` that sets the TMA descriptors' block shapes) dies with
``OutOfResources`` when a config chosen elsewhere (another GPU, another limit, a database
shared between machines) is launched here.

What it does, when ``flag_gems.utils.libentry`` is imported:

* describes ``LibTuner`` and ``LibEntry`` to :mod:`smemguard.kernels.tuners`, so the engine retries
  their launches: fewer stages of the tuned config (the replacement sits in Triton's JIT
  cache, where ``LibTuner`` finds it), else another config of ``LibTuner``'s own list, whose
  ``pre_hook`` sets the block shapes, written into ``LibTuner``'s database under its own key.
  ``LibTuner`` stores a config's parameters without its ``pre_hook`` and finds the hook again
  by looking the parameters up in its list, so only configs of that list are adopted. The
  next call misses ``LibEntry``'s cache once, gets the kernel that fits from ``LibTuner`` and
  caches it;
* when a FlagGems matmul module is imported, registers :func:`smemguard.fallbacks.cublas_mm`
  as the fallback of ``mm_kernel_general_host_tma`` and ``mm_kernel_general``: it reaches
  cuBLAS through ``aten::mm.dtype_out``, an overload FlagGems does not override, so it never
  re-enters FlagGems' own ``aten::mm``.

FlagGems' own errors (its 16-byte alignment assertion for TMA descriptors, a compile error
of its TMA kernel) are not ``OutOfResources`` and pass through untouched.

Read in the FlagGems releases of ``PATCH.checked`` (the files: docs/MEASURED.md). Another release of
the supported range is patched only if its layers still have the attributes read here; otherwise one line says
so and FlagGems runs unguarded.
"""

from __future__ import annotations

import logging
import sys

from ...facts import process
from ...facts.versions import Supported
from ...kernels import registry, tuners
from .. import Kernels, Patch, Registration

log = logging.getLogger(__name__)

LIBENTRY_MODULE = "flag_gems.utils.libentry"
# FlagGems imports its per-arch package with its own folder on sys.path: on a Hopper GPU the
# matmul that serves aten::mm is module "hopper.ops.mm", not flag_gems.runtime.backend._nvidia.hopper.ops.mm.
MATMUL_MODULES = ("flag_gems.ops.mm", "hopper.ops.mm", "flag_gems.runtime.backend._nvidia.hopper.ops.mm")

CHECKED = "5.0.2"

_FALLBACKS = Registration(registry.register_fallback, registry.unregister_fallback, registry.fallback_for,
                          lambda: PATCH.memory())


def _libtuner_key(tuner, args: tuple, kwargs: dict) -> tuple:
    return tuple(tuner.get_key(tuners.named_args(tuner, args, kwargs)))


def _own_config(tuner, config):
    """``tuner``'s own config with ``config``'s parameters: the one that carries the ``pre_hook``."""
    wanted = config.all_kwargs()
    return next((own for own in tuner.configs if own.all_kwargs() == wanted), config)


def _libtuner_config_in_force(tuner, key):
    if len(tuner.configs) > 1:
        stored = tuner.cache.get(key)
        if stored is not None:
            return _own_config(tuner, stored)
    return getattr(tuner, "best_config", None) or tuner.configs[0]


def _kinds_for(module) -> list:
    libtuner, libentry = module.LibTuner, module.LibEntry
    missing = [f"{cls.__name__}.{name}" for cls, names in ((libtuner, ("run", "get_key", "_bench")),
                                                           (libentry, ("run",)))
               for name in names if not hasattr(cls, name)]
    if missing:
        raise AttributeError(f"missing {', '.join(missing)}")
    return [
        tuners.Tuner("flag_gems.LibTuner", lambda layer: tuners.runs_as(layer, libtuner), _libtuner_key,
                     _libtuner_config_in_force, tuners.adopt_in_cache, takes_variants=False),
        tuners.Entry("flag_gems.LibEntry", lambda layer: tuners.runs_as(layer, libentry)),
    ]


def _host_tma_mm_fallback(a_desc, b_desc, c_desc, **_) -> None:
    from ...fallbacks import cublas_mm

    # A descriptor's base is the operand itself, in either layout (FlagGems passes A_ROW_MAJOR apart).
    cublas_mm(a_desc.base, b_desc.base, c_desc.base)


def _mm_fallback(A, B, C, **_) -> None:
    from ...fallbacks import cublas_mm

    cublas_mm(A, B, C)


def _in_flaggems(module) -> bool:
    return "flag_gems" in str(getattr(module, "__file__", ""))


#: kernel name -> (where FlagGems keeps it and the tensor parameters its fallback takes, its fallback)
MATMUL_KERNELS = {
    name: (Kernels(MATMUL_MODULES, {name: params}, reads=(("FlagGems' own file", _in_flaggems),)), fallback)
    for name, params, fallback in (
        ("mm_kernel_general_host_tma", ("a_desc", "b_desc", "c_desc"), _host_tma_mm_fallback),
        ("mm_kernel_general", ("A", "B", "C"), _mm_fallback))}


def _imported_matmuls():
    """(kernel, its fallback) for each FlagGems matmul kernel imported now."""
    for name, (kernels, fallback) in MATMUL_KERNELS.items():
        for _, module in kernels.found(PATCH.name):
            yield getattr(module, name), fallback


def _register_fallbacks() -> None:
    for kernel, fallback in _imported_matmuls():
        _FALLBACKS.add(kernel, fallback)


def _apply(engine) -> None:
    """Describe FlagGems' layers and register the matmul fallbacks (called again on each import)."""
    libentry = sys.modules.get(LIBENTRY_MODULE)
    described = engine.memory.table(PATCH.name).setdefault("kinds", [])  # registered with smemguard.kernels.tuners
    if libentry is not None and not described:
        try:
            kinds = _kinds_for(libentry)
        except AttributeError as error:
            version = getattr(sys.modules.get("flag_gems"), "__version__", "?")
            # Every import of a FlagGems module comes back here: one line, then DEBUG.
            process.warn_once(log, ("flaggems", "layers"),
                                "smemguard: FlagGems %s's LibEntry/LibTuner differ from %s (%s); FlagGems kernels run "
                                "unguarded. Fix: upgrade smemguard.", version, CHECKED, error)
            return
        for kind in kinds:
            tuners.register(kind)
        described.extend(kinds)
    _register_fallbacks()


def _remove() -> None:
    described = PATCH.memory().get("kinds", [])
    while described:
        tuners.unregister(described.pop())
    _FALLBACKS.clear()


def _present() -> bool:
    """Whether FlagGems' LibTuner is understood by the engine, or one of its matmuls has our fallback now."""
    libentry = sys.modules.get(LIBENTRY_MODULE)
    tuner_class = getattr(libentry, "LibTuner", None)
    described = isinstance(tuner_class, type) and any(
        isinstance(kind, tuners.Tuner) and kind.name == "flag_gems.LibTuner" for kind in tuners.registered())
    return described or any(_FALLBACKS.holds(kernel, fallback) for kernel, fallback in _imported_matmuls())


PATCH = Patch(__name__, target=f"{LIBENTRY_MODULE}.LibTuner", modules=(LIBENTRY_MODULE, *MATMUL_MODULES),
              supported=Supported("flag_gems", (5, 0), (5, 0), label="FlagGems"), checked=(CHECKED,),
              observe_safe=True,  # describes layers and registers fallbacks: the engine records and re-raises
              apply=_apply, remove=_remove, present=_present)
