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

from . import metrics, runtime, settings as settings_module, versions
from ._version import __version__
from .settings import Settings, SettingsError

log = logging.getLogger(__name__)

_lock = threading.RLock()
_active: Settings | None = None  # the settings the guard was installed with
_pending: Settings | None = None  # waiting for "import triton"
_guarding_triton = False  # some Triton patch applied (the library patches apply whatever Triton's fate)
_hook_registered = False
_library_hooks_registered = False
_reported_problems: set[str] = set()


def _wanted(module, settings: Settings) -> bool:
    return (module.__name__.rsplit(".", 1)[-1] not in settings.disabled and module.applies(settings)
            and (module.OBSERVE_SAFE or not settings.observe_only))


def _context(settings: Settings):
    from .patches import PatchContext

    return PatchContext(settings, _on_out_of_resources, _remembered_compile, _on_warmup, _on_inductor_overflow,
                        _on_inductor_load, _on_compiled)


def _admitted(module, settings: Settings) -> bool:
    """Whether the installed release of the module's package may be patched: refused below the oldest release
    read (one line); above the newest checked, applied unverified (one info line), except in strict mode."""
    name = _short(module)
    refusal = module.SUPPORTED.refusal()
    if refusal is not None:
        runtime.warn_once(log, ("unsupported", name), "smemguard: %s; %s is left untouched and runs unguarded. "
                          "Fix: upgrade %s or smemguard.", refusal, module.TARGET, module.SUPPORTED.name)
        return False
    unverified = module.SUPPORTED.unverified()
    if unverified is not None and settings.mode == "strict":
        runtime.warn_once(log, ("unverified", name), "smemguard: %s; %s is not applied (SMEMGUARD=strict refuses "
                          "unverified patches) and %s runs unguarded", unverified, name, module.TARGET)
        return False
    return True


def _short(module) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def _note_applied(module, *, announce: bool = True) -> None:
    """Remember the module as applied (for the install line, the records and ``smemguard versions``); one info
    line when it applied unverified (the Triton patches say it once, on the install line)."""
    unverified = module.SUPPORTED.unverified()
    runtime.note_patch(_short(module), module.SUPPORTED.name, versions.installed(module.SUPPORTED.package),
                       unverified is None)
    if unverified is not None and announce:
        runtime.warn_once(log, ("applied unverified", _short(module)), "smemguard: %s applied unverified: %s; its "
                          "patch-time checks passed (records say verified: false)", _short(module), unverified,
                          level=logging.INFO)


def _patch_library(module, reason: str) -> None:
    """Apply one library patch; never raises (it may run inside the user's import)."""
    if not _wanted(module, _active) or not _admitted(module, _active):
        return
    try:
        module.patch(_context(_active))
    except Exception:
        log.warning("smemguard: could not patch %s (%s); that kernel runs unguarded", module.__name__, reason,
                    exc_info=True)
        _roll_back(module)
        return
    if module.is_patched():
        _note_applied(module)


def _roll_back(module) -> None:
    try:
        module.unpatch()
    except Exception:
        log.debug("smemguard: rollback of %s failed", module.__name__, exc_info=True)


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
    with runtime.engine_compiling.scope():
        return recovery.handle_warmup(kernel, grid, args, kwargs, compiled, settings)


def _on_compiled(compile_fn, args, kwargs, kernel):
    """The kernel Triton compiled, or a fewer-stage compile of it that fits (:mod:`smemguard.compile_fit`).
    Never raises."""
    from . import compile_fit

    settings = _active
    return kernel if settings is None else compile_fit.fit(compile_fn, args, kwargs, kernel, settings)


def _on_inductor_overflow(autotuner, error, configs) -> bool | None:
    """True when variants that fit were loaded; False when none fits (or ``error`` is not an overflow);
    None when smemguard has no answer (uninstalled, or its own error). Never raises."""
    from . import inductor

    settings = _active
    if settings is None:
        return None
    try:
        with runtime.engine_compiling.scope():
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
        with runtime.engine_compiling.scope():
            inductor.load_remembered(autotuner, settings)
    except Exception:
        runtime.warn_once(log, ("inductor", "internal"),
                          "smemguard: internal error while applying a stored decision to "
                          "a torch.compile kernel; Inductor loads it as compiled (smemguard's bug: please report it)",
                          exc_info=True)


def _on_out_of_resources(kernel, grid, args, kwargs, error, again):
    from . import recovery

    settings = _active
    if settings is None:  # uninstalled while another tool's layer kept our launcher alive
        raise error
    return recovery.handle(kernel, grid, args, kwargs, error, settings, again)


def _patch(settings: Settings) -> bool:
    """Apply every Triton patch that is wanted and admitted, each on its own: one that is refused or fails
    leaves its target untouched (one line), and the others, and the library patches, still apply. True when
    some Triton patch applied; strict mode raises where a patch was refused or failed."""
    global _active, _guarding_triton
    from .patches import TRITON, triton_modules

    version = runtime.triton_version()
    problems = [problem for problem in (TRITON.refusal(), TRITON.unverified() if settings.mode == "strict" else None)
                if problem is not None]
    if not problems:
        problems = _patch_triton(settings, version)
    if problems and settings.mode == "strict":
        for module in reversed(triton_modules()):
            _roll_back(module)
        runtime.forget_patches()
        raise SettingsError(f"smemguard {__version__}: {'; '.join(problems)}; Triton is left untouched (strict mode)")
    for problem in problems:
        log.warning("smemguard %s: %s; %s", __version__, problem, "those targets are left untouched"
                    if runtime.applied_patches() else "Triton is left untouched and kernels run unguarded. "
                    "Fix: upgrade Triton or smemguard.")
    _active = settings
    runtime.set_installed_settings(settings)
    _guarding_triton = bool(runtime.applied_patches())
    metrics.configure(settings)
    _watch_libraries()  # the hooks fire at once for modules already imported
    log.info("smemguard %s guarding Triton %s: mode=%s, %s; %s", __version__, version, settings.mode,
             settings.describe_limit(), runtime.applied_text())
    return _guarding_triton


def _patch_triton(settings: Settings, version: str) -> list[str]:
    """Apply the Triton patches one by one; the problems of those that failed (each rolled back)."""
    from .patches import triton_modules

    context = _context(settings)
    failed = []
    for module in triton_modules():
        if not _wanted(module, settings):
            continue
        if not module.SUPPORTED.admits(version):
            log.debug("smemguard: %s needs Triton %s; not applied", module.TARGET, module.SUPPORTED)
            continue
        try:
            module.patch(context)
        except Exception as error:
            _roll_back(module)
            failed.append(f"could not patch Triton {version}: {_short(module)} ({type(error).__name__}: {error})")
            log.debug("smemguard: could not patch %s", module.TARGET, exc_info=True)
            continue
        _note_applied(module, announce=False)
    return failed


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
            return _guarding_triton or _pending is not None
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
    global _active, _pending, _guarding_triton
    with _lock:
        _pending = None
        _active = None
        runtime.set_installed_settings(None)
        _guarding_triton = False
        metrics.configure(None)
        if "triton" not in sys.modules:
            return  # nothing was patched yet, and removing nothing must not import Triton
        from . import recovery
        from .patches import modules

        recovery.forget()
        if "smemguard.wrapper_tiles" in sys.modules:  # a library declared its tile choices: forget what they learnt
            sys.modules["smemguard.wrapper_tiles"].forget()
        runtime.forget_patches()
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
