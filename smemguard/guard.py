"""Installing and removing the guard: idempotent, under one lock, all or nothing.

If Triton is not imported yet, :func:`install` registers a post-import hook and patches
when it is. The patch modules are listed once, in :data:`smemguard.patches.MODULES`, and all
follow one contract (see :mod:`smemguard.patches`):

* the Triton patches are applied together; any failure rolls back what was patched, logs one
  line and leaves Triton as it was (``strict`` mode raises instead);
* each library patch is applied when one of its modules is imported (now, or later through a
  post-import hook); an unsupported version or a failure logs one line and leaves that
  library untouched. It never raises into the user's import.
"""

from __future__ import annotations

import logging
import sys
import threading

from . import metrics, runtime, settings as settings_module
from ._version import __version__
from .settings import Settings, SettingsError

log = logging.getLogger(__name__)

_lock = threading.RLock()
_active: Settings | None = None  # the settings the guard was installed with
_pending: Settings | None = None  # waiting for "import triton"
_hook_registered = False
_library_hooks_registered = False
_reported_problems: set[str] = set()


def _wanted(module, settings: Settings) -> bool:
    return (module.__name__.rsplit(".", 1)[-1] not in settings.disabled and module.applies(settings)
            and (module.OBSERVE_SAFE or not settings.observe_only))


def _context(settings: Settings):
    from .patches import PatchContext

    return PatchContext(settings, _on_out_of_resources, _remembered_compile, _on_warmup, _on_inductor_overflow,
                        _on_inductor_load)


def _patch_library(module, reason: str) -> None:
    """Apply one library patch; never raises (it may run inside the user's import)."""
    if not _wanted(module, _active):
        return
    refusal = module.SUPPORTED.refusal()
    if refusal is not None:
        runtime.warn_once(log, ("unsupported", module.__name__), "smemguard: %s; %s is left untouched and runs "
                            "unguarded. Fix: upgrade smemguard.", refusal, module.TARGET)
        return
    try:
        module.patch(_context(_active))
    except Exception:
        log.warning("smemguard: could not patch %s (%s); that kernel runs unguarded", module.__name__, reason,
                    exc_info=True)


def _watch_libraries() -> None:
    """Patch known libraries whose modules are imported, now and whenever one is imported later."""
    global _library_hooks_registered
    from .patches import library_modules

    if _library_hooks_registered:  # hooks cannot be removed; they did nothing while the guard was not installed
        for module in library_modules():
            if any(target in sys.modules for target in module.TARGET_MODULES):
                _patch_library(module, "already imported")
        return
    import wrapt  # a hook registered for a module already imported runs at once: that patches it now

    def hook_for(patch_module):
        def on_import(imported) -> None:
            with _lock:
                if _active is not None:
                    _patch_library(patch_module, f"on import of {imported.__name__}")

        return on_import

    for module in library_modules():
        for target in module.TARGET_MODULES:
            wrapt.register_post_import_hook(hook_for(module), target)
    _library_hooks_registered = True


def _fail(message: str, settings: Settings) -> bool:
    if settings.mode == "strict":
        raise SettingsError(message)
    log.warning("%s", message)
    return False


def _remembered_compile(jit, source, device, options, *, launching):
    from . import recovery

    settings = _active
    return (recovery.remembered_compile(jit, source, device, options, settings, launching=launching)
            if settings is not None else None)


def _on_warmup(kernel, grid, args, kwargs, compiled):
    from . import recovery

    settings = _active
    if settings is None:
        return compiled
    return recovery.handle_warmup(kernel, grid, args, kwargs, compiled, settings)


def _on_inductor_overflow(autotuner, error, configs) -> bool | None:
    """True when variants that fit were loaded; False when none fits (or ``error`` is not an overflow);
    None when smemguard has no answer (uninstalled, or its own error). Never raises."""
    from . import inductor

    settings = _active
    if settings is None:
        return None
    try:
        return inductor.overflow_of(error) is not None and inductor.recover(autotuner, error, configs, settings)
    except Exception:
        runtime.warn_once(log, ("inductor", "internal"), "smemguard: internal error while recovering a torch.compile "
                            "kernel; Inductor's own error is raised (smemguard's bug: please report it)",
                            exc_info=True)
        return None


def _on_inductor_load(autotuner) -> None:
    """Replace the compile results of ``autotuner`` that the decision cache holds a fitting variant of. Never raises."""
    from . import inductor

    settings = _active
    if settings is None:
        return
    try:
        inductor.load_remembered(autotuner, settings)
    except Exception:
        runtime.warn_once(log, ("inductor", "internal"), "smemguard: internal error while applying a stored decision to "
                          "a torch.compile kernel; Inductor loads it as compiled (smemguard's bug: please report it)",
                          exc_info=True)


def _on_out_of_resources(kernel, grid, args, kwargs, error, again):
    from . import recovery

    settings = _active
    if settings is None:  # uninstalled while another tool's layer kept our launcher alive
        raise error
    return recovery.handle(kernel, grid, args, kwargs, error, settings, again)


def _patch(settings: Settings) -> bool:
    global _active
    from . import runtime
    from .patches import TRITON, triton_modules

    version = runtime.triton_version()
    refusal = TRITON.refusal()
    if refusal is not None:
        return _fail(f"smemguard {__version__}: {refusal}; Triton is left untouched and kernels run unguarded. "
                     "Fix: upgrade smemguard.", settings)
    context = _context(settings)
    applied = []
    try:
        for module in triton_modules():
            if not _wanted(module, settings):
                continue
            if not module.SUPPORTED.admits(version):
                log.debug("smemguard: %s needs Triton %s; not applied", module.TARGET, module.SUPPORTED)
                continue
            module.patch(context)
            applied.append(module)
    except Exception as error:
        for module in reversed(applied):
            try:
                module.unpatch()
            except Exception:
                log.debug("smemguard: rollback of %s failed", module.__name__, exc_info=True)
        return _fail(f"smemguard {__version__}: could not patch Triton {version} ({type(error).__name__}: {error}); "
                     "Triton is left untouched and kernels run unguarded.", settings)
    _active = settings
    metrics.configure(settings)
    _watch_libraries()  # the hooks fire at once for modules already imported
    log.info("smemguard %s guarding Triton %s: mode=%s, %s", __version__, version, settings.mode,
             settings.describe_limit())
    return True


def _on_triton_imported(module) -> None:
    """Post-import hook: must never raise, or it breaks the user's ``import triton``."""
    global _pending
    with _lock:
        settings, _pending = _pending, None
        if settings is None:
            return
        try:
            _patch(settings)
        except SettingsError as error:  # strict: the user asked for a loud failure, but not a broken import
            log.error("%s", error)
        except Exception:
            log.warning("smemguard: install after 'import triton' failed; kernels run unguarded", exc_info=True)


def settings_problems(settings: Settings) -> list[str]:
    """Every problem line of ``settings``, with the names in SMEMGUARD_DISABLE that are no patch module."""
    from .patches import MODULES

    return [*settings.problems, *settings_module.unknown_patches(settings, MODULES)]


def _report(settings: Settings) -> None:
    from .patches import MODULES

    problems = settings_problems(settings)
    new = [p for p in problems if p not in _reported_problems]
    _reported_problems.update(new)
    if settings.mode == "strict" and problems:
        raise SettingsError("smemguard: " + " ".join(problems))
    for problem in new:
        log.warning("smemguard: %s", problem)
    off = [name for name in settings.disabled if name in MODULES]
    if off and settings.enabled:
        log.info("smemguard: %s left off by %s; their targets are untouched", ", ".join(off), settings_module.DISABLE)


def install(settings: Settings | None = None) -> bool:
    """Guard every Triton launch in this process. Idempotent and thread-safe.

    ``settings`` defaults to the environment (:mod:`smemguard.settings`). Returns True when
    the guard is installed, or will be once Triton is imported; False when it is off or
    could not be installed (the reason is logged). In ``strict`` mode a misconfiguration
    raises :class:`~smemguard.settings.SettingsError` instead.
    """
    global _pending, _hook_registered
    settings = settings or settings_module.current()
    with _lock:
        if _active is not None or _pending is not None:
            return True
        _report(settings)
        if not settings.enabled:
            log.info("smemguard %s is off (SMEMGUARD=off)", __version__)
            return False
        if "triton" not in sys.modules:
            _pending = settings
            if not _hook_registered:
                import wrapt

                wrapt.register_post_import_hook(_on_triton_imported, "triton")
                _hook_registered = True
            log.debug("smemguard: will install when triton is imported")
            return True
        return _patch(settings)


def uninstall() -> None:
    """Remove what :func:`install` added; safe to call at any time, any number of times."""
    global _active, _pending
    with _lock:
        _pending = None
        _active = None
        metrics.configure(None)
        if "triton" not in sys.modules:
            return  # nothing was patched yet, and removing nothing must not import Triton
        from . import recovery
        from .patches import modules

        recovery.forget()
        for module in reversed(modules()):
            try:
                module.unpatch()
            except Exception:
                log.warning("smemguard: could not remove the patch of %s", module.__name__, exc_info=True)


def is_installed() -> bool:
    """True when every Triton launch in this process is guarded now. After ``install()`` before ``import
    triton`` nothing is guarded yet (``install()`` returned True: it will be, once Triton is imported), and
    after a failed ``import triton`` nothing is: False in both, by design."""
    with _lock:
        if _active is None:
            return False
    from .patches import kernel_interface

    return kernel_interface.is_patched()


def active_settings() -> Settings | None:
    return _active
