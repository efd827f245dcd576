"""Installing and removing the guard: idempotent, under one lock, all or nothing.

If Triton is not imported yet, :func:`install` registers a post-import hook and patches
when it is. Installing builds the engine (:class:`smemguard.engine.core.Engine`) and hands it to every
patch; uninstalling closes it. The patch modules are listed once, in :data:`smemguard.patches.MODULES`,
and each declares its :class:`~smemguard.patches.Patch` (see :mod:`smemguard.patches`):

* the Triton patches are applied each on its own; one that fails is rolled back, logs one line and
  leaves its target as it was (``strict`` mode rolls back all and raises instead);
* each library patch is applied when one of its modules is imported (now, or later through a
  post-import hook); an unsupported version or a failure logs one line and leaves that
  library untouched. It never raises into the user's import.
"""

from __future__ import annotations

import logging
import sys
import threading

from ._version import __version__
from .engine.core import Engine
from .facts import process, versions
from .facts import settings as settings_module
from .facts.settings import Settings, SettingsError
from .store import metrics

log = logging.getLogger(__name__)



class _Installer:
    """What installing knows across installs in this process: the import hooks registered (they cannot be taken
    back), the settings waiting for ``import triton``, the settings problems said already. The install in force
    is its engine (:func:`smemguard.facts.process.installed_engine`)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pending: Settings | None = None  # waiting for "import triton"
        self.guarding_triton = False  # some Triton patch applied (the library patches apply whatever Triton's fate)
        self.triton_hook = False  # the post-import hook on triton is registered
        self.library_hooks = False  # the post-import hooks on the libraries' modules are registered
        self.reported_problems: set[str] = set()


_installer = _Installer()


def _wanted(patch, settings: Settings) -> bool:
    return (patch.name not in settings.disabled and patch.applies(settings)
            and (patch.observe_safe or not settings.observe_only))


def _admitted(patch, settings: Settings) -> bool:
    """Whether the installed release of the patch's package may be patched: refused below the oldest release
    read (one line); above the newest checked, applied unverified (one info line), except in strict mode."""
    refusal = patch.supported.refusal()
    if refusal is not None:
        process.warn_once(log, ("unsupported", patch.name), "smemguard: %s; %s is left untouched and runs unguarded. "
                          "Fix: upgrade %s or smemguard.", refusal, patch.target, patch.supported.name)
        return False
    unverified = patch.supported.unverified()
    if unverified is not None and settings.mode == "strict":
        process.warn_once(log, ("unverified", patch.name), "smemguard: %s; %s is not applied (SMEMGUARD=strict "
                          "refuses unverified patches) and %s runs unguarded", unverified, patch.name, patch.target)
        return False
    return True


def _note_applied(patch, engine: Engine, *, announce: bool = True) -> None:
    """Remember the patch as applied (for the install line, the records and ``smemguard versions``); one info
    line when it applied unverified (the Triton patches say it once, on the install line)."""
    unverified = patch.supported.unverified()
    engine.notes.note_patch(patch.name, patch.supported.name, versions.installed(patch.supported.package),
                       unverified is None)
    if unverified is not None and announce:
        process.warn_once(log, ("applied unverified", patch.name), "smemguard: %s applied unverified: %s; its "
                          "patch-time checks passed (records say verified: false)", patch.name, unverified,
                          level=logging.INFO)


def _patch_library(patch, reason: str) -> None:
    """Apply one library patch; never raises (it may run inside the user's import)."""
    engine = process.installed_engine()
    if not _wanted(patch, engine.settings) or not _admitted(patch, engine.settings):
        return
    try:
        patch.patch(engine)
    except Exception:
        log.warning("smemguard: could not patch %s (%s); that kernel runs unguarded", patch.name, reason,
                    exc_info=True)
        _roll_back(patch)
        return
    if patch.is_patched():
        _note_applied(patch, engine)


def _roll_back(patch) -> None:
    try:
        patch.unpatch()
    except Exception:
        log.debug("smemguard: rollback of %s failed", patch.name, exc_info=True)


def _watch_libraries() -> None:
    """Patch known libraries whose modules are imported, now and whenever one is imported later."""
    from .patches import library_patches

    if _installer.library_hooks:  # hooks cannot be removed; they did nothing while the guard was not installed
        for patch in library_patches():
            if any(target in sys.modules for target in patch.modules):
                _patch_library(patch, "already imported")
        return
    import wrapt  # a hook registered for a module already imported runs at once: that patches it now

    def hook_for(patch):
        def on_import(imported) -> None:
            with _installer.lock:
                if process.installed_engine() is not None:
                    _patch_library(patch, f"on import of {imported.__name__}")

        return on_import

    for patch in library_patches():
        for target in patch.modules:
            wrapt.register_post_import_hook(hook_for(patch), target)
    _installer.library_hooks = True


def _fail(message: str, settings: Settings) -> bool:
    if settings.mode == "strict":
        raise SettingsError(message)
    log.warning("%s", message)
    return False


def _patch(settings: Settings) -> bool:
    """Apply every Triton patch that is wanted and admitted, each on its own: one that is refused or fails
    leaves its target untouched (one line), and the others, and the library patches, still apply. True when
    some Triton patch applied; strict mode raises where a patch was refused or failed."""
    from .patches import TRITON, triton_patches

    version = process.triton_version()
    problems = [problem for problem in (TRITON.refusal(), TRITON.unverified() if settings.mode == "strict" else None)
                if problem is not None]
    engine = Engine(settings)
    if not problems:
        problems = _patch_triton(engine, version)
    if problems and settings.mode == "strict":
        for patch in reversed(triton_patches()):
            _roll_back(patch)
        engine.close()
        raise SettingsError(f"smemguard {__version__}: {'; '.join(problems)}; Triton is left untouched (strict mode)")
    for problem in problems:
        log.warning("smemguard %s: %s; %s", __version__, problem, "those targets are left untouched"
                    if engine.notes.applied_patches() else "Triton is left untouched and kernels run unguarded. "
                    "Fix: upgrade Triton or smemguard.")
    process.set_installed_engine(engine)
    _installer.guarding_triton = bool(engine.notes.applied_patches())
    metrics.configure(settings)
    _watch_libraries()  # the hooks fire at once for modules already imported
    log.info("smemguard %s guarding Triton %s: mode=%s, %s; %s", __version__, version, settings.mode,
             settings.describe_limit(), engine.notes.applied_text())
    return _installer.guarding_triton


def _patch_triton(engine: Engine, version: str) -> list[str]:
    """Apply the Triton patches one by one; the problems of those that failed (each rolled back)."""
    from .patches import triton_patches

    failed = []
    for patch in triton_patches():
        if not _wanted(patch, engine.settings):
            continue
        if not patch.supported.admits(version):
            log.debug("smemguard: %s needs Triton %s; not applied", patch.target, patch.supported)
            continue
        try:
            patch.patch(engine)
        except Exception as error:
            _roll_back(patch)
            failed.append(f"could not patch Triton {version}: {patch.name} ({type(error).__name__}: {error})")
            log.debug("smemguard: could not patch %s", patch.target, exc_info=True)
            continue
        _note_applied(patch, engine, announce=False)
    return failed


def _on_triton_imported(module) -> None:
    """Post-import hook: must never raise, or it breaks the user's ``import triton``."""
    with _installer.lock:
        settings, _installer.pending = _installer.pending, None
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
    from .patches import NAMES

    return [*settings.problems, *settings_module.unknown_patches(settings, NAMES)]


def _report(settings: Settings) -> None:
    from .patches import NAMES

    problems = settings_problems(settings)
    new = [p for p in problems if p not in _installer.reported_problems]
    _installer.reported_problems.update(new)
    if settings.mode == "strict" and problems:
        raise SettingsError("smemguard: " + " ".join(problems))
    for problem in new:
        log.warning("smemguard: %s", problem)
    off = [name for name in settings.disabled if name in NAMES]
    if off and settings.enabled:
        log.info("smemguard: %s left off by %s; their targets are untouched", ", ".join(off), settings_module.DISABLE)


def install(settings: Settings | None = None) -> bool:
    """Guard every Triton launch in this process. Idempotent and thread-safe.

    ``settings`` defaults to the environment (:mod:`smemguard.facts.settings`). Returns True when
    the guard is installed, or will be once Triton is imported; False when it is off or
    could not be installed (the reason is logged). In ``strict`` mode a misconfiguration
    raises :class:`~smemguard.facts.settings.SettingsError` instead.
    """
    settings = settings or settings_module.current()
    with _installer.lock:
        if process.installed_engine() is not None or _installer.pending is not None:
            return _installer.guarding_triton or _installer.pending is not None
        _report(settings)
        if not settings.enabled:
            log.info("smemguard %s is off (SMEMGUARD=off)", __version__)
            return False
        if "triton" not in sys.modules:
            _installer.pending = settings
            if not _installer.triton_hook:
                import wrapt

                wrapt.register_post_import_hook(_on_triton_imported, "triton")
                _installer.triton_hook = True
            log.debug("smemguard: will install when triton is imported")
            return True
        return _patch(settings)


def uninstall() -> None:
    """Remove what :func:`install` added; safe to call at any time, any number of times."""
    with _installer.lock:
        engine, _installer.pending = process.installed_engine(), None
        process.set_installed_engine(None)
        _installer.guarding_triton = False
        metrics.configure(None)
        if "triton" not in sys.modules:
            return  # nothing was patched yet, and removing nothing must not import Triton
        from .patches import all_patches

        for patch in reversed(all_patches()):  # before the engine forgets what the patches put on their targets
            try:
                patch.unpatch()
            except Exception:
                log.warning("smemguard: could not remove the patch of %s", patch.name, exc_info=True)
        if engine is not None:
            engine.close()


def installed_engine() -> Engine | None:
    """The engine of the install in force, None while none is (or until ``import triton``)."""
    return process.installed_engine()


def is_installed() -> bool:
    """True when every Triton launch in this process is guarded now. After ``install()`` before ``import
    triton`` nothing is guarded yet (``install()`` returned True: it will be, once Triton is imported), and
    after a failed ``import triton`` nothing is: False in both, by design."""
    with _installer.lock:
        if process.installed_engine() is None:
            return False
    from .patches.triton_seams import kernel_interface

    return kernel_interface.PATCH.is_patched()
