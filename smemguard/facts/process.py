"""Facts about the running process: the install in force, the launch in progress on each thread, the device, the
warnings said once; and :class:`Notes`, what the seams of one install note for its engine.

The patches (:mod:`smemguard.patches`) write the notes (the emulated limit by ``max_shared_mem``, autotuner
timings by ``autotuner_bench``, failed launches by ``kernel_interface``), the engine reads them on itself
(``Engine.notes``), and neither imports the other: the dependency runs one way, through this module.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
import weakref
from typing import Iterator, NamedTuple

from . import versions

log = logging.getLogger(__name__)

#: The engine of the install in force (the installer writes it), None while none is: the one route to it for code
#: no patch hands it to (a library's declared wrappers, a record's facts of the install).
_installed_engine = None


def installed_engine():
    """The engine of the install in force in this process (:class:`smemguard.engine.core.Engine`), None while none
    is (before ``import triton`` too): the installer's, and what code no patch hands it to reads (a library's
    declared wrappers, :mod:`smemguard.engine.wrapper_tiles`)."""
    return _installed_engine


def set_installed_engine(engine) -> None:
    global _installed_engine
    _installed_engine = engine


def notes() -> "Notes":
    """What the seams of the install in force noted (:class:`Notes`); while none is, an empty one kept nowhere."""
    engine = _installed_engine
    return engine.notes if engine is not None else Notes()


#: What Triton and torch warn of once per process when smemguard itself compiles or imports them, which its user
#: cannot act on: Triton 3.9's fp-fusion default about to change, torch without NumPy (smemguard uses none).
NOT_OURS_TO_SHOW = ("TRITON_DEFAULT_FP_FUSION", "Failed to initialize NumPy")


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """Those two warnings (:data:`NOT_OURS_TO_SHOW`) left unsaid while smemguard compiles or imports on its own
    account (its commands, its compile workers, its install under ``smemguard run``); the program's own stay."""
    with warnings.catch_warnings():
        for message in NOT_OURS_TO_SHOW:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


# -- warnings once per process ----------------------------------------------------------------

_warned: set = set()
_warned_lock = threading.Lock()


def warn_once(logger: logging.Logger, case, message: str, *args, exc_info: bool = False,
              level: int = logging.WARNING) -> None:
    """Log ``message`` on ``logger`` at ``level`` (WARNING) the first time ``case`` (a kernel and config, a
    path, a patch) is seen in this process, afterwards at DEBUG: the one warn-once of the package."""
    with _warned_lock:
        first = case not in _warned
        _warned.add(case)
    logger.log(level if first else logging.DEBUG, message, *args, exc_info=exc_info)


def warned(case) -> bool:
    """Whether :func:`warn_once` has warned about ``case`` in this process."""
    with _warned_lock:
        return case in _warned


def forget_warnings() -> None:
    with _warned_lock:
        _warned.clear()


def triton_version() -> str:
    import triton

    return getattr(triton, "__version__", "unknown")


def triton_release() -> tuple[int, int] | None:
    """(major, minor) of the imported Triton."""
    return versions.parse(triton_version())


def current_device() -> int:
    from triton.runtime import driver

    return driver.active.get_current_device()


@functools.lru_cache(maxsize=None)
def gpu_name(device: int) -> str | None:
    """torch's name of the CUDA device (``"NVIDIA H200"``, the device's own under an emulated GPU), or None
    without CUDA."""
    try:
        import torch

        return own_device_properties(device).name if torch.cuda.is_available() else None
    except Exception:
        log.debug("no device name", exc_info=True)
        return None


def own_device_properties(device: int):
    """``torch.cuda.get_device_properties(device)`` as the device reports them, whatever GPU is emulated (what
    smemguard itself records and compares, never what it shows the libraries)."""
    import torch

    with device_as_is.scope():
        return torch.cuda.get_device_properties(device)


def device_description(device: int) -> dict:
    """The device as records keep it: ``{name, backend, arch, index}``."""
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return {"name": gpu_name(device), "backend": target.backend, "arch": target.arch, "index": device}


# -- shared-memory limits -------------------------------------------------------------------


def device_limit(device: int) -> int:
    """The device's own per-block opt-in limit, whatever is emulated."""
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(device)["max_shared_mem"]


def effective_limit(device: int) -> int:
    """The limit Triton enforces now: the device's, lowered by any emulation (Triton's own check asks the
    same function)."""
    from triton.compiler import compiler

    return compiler.max_shared_mem(device)


# -- the launch in progress, and which launch raised an overflow -------------------------------------------


class _Launching(threading.local):
    #: ``(launched, grid, args, kwargs, warmup)`` of the ``kernel[grid](...)`` launch or ``kernel.warmup(...)``
    #: (``warmup`` true) the seam is running on this thread (``patches/triton_seams/kernel_interface``,
    #: ``patches/triton_seams/kernel_warmup``
    #: set it), None outside one.
    #: A plain tuple in a thread-local: set and restored on every launch, so it must cost no more than that.
    current: tuple | None = None


#: The launch in progress on this thread: what a compile it causes was launched with (the record's shapes).
launching = _Launching()


def launch_in_progress() -> tuple | None:
    """``(launched, grid, args, kwargs, warmup)`` of the launch (or warm-up) running on this thread, or None."""
    return launching.current


# -- autotuner timings ----------------------------------------------------------------------


class ThreadFlag:
    """Set for the calling thread while a ``with flag.scope():`` block runs (blocks may nest)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def __bool__(self) -> bool:
        return getattr(self._local, "depth", 0) > 0


class ThreadValue:
    """A value for the calling thread while a ``with value.scope(v):`` block runs (the innermost block's), None
    outside; true while one runs."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def scope(self, value) -> Iterator[None]:
        outer = getattr(self._local, "value", None)
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = outer

    @property
    def value(self):
        return getattr(self._local, "value", None)

    def __bool__(self) -> bool:
        return self.value is not None


class TimedChoice(NamedTuple):
    """A choice Inductor's max-autotune compiles or times (``patches/torch_seams/inductor_autotune``)."""

    shape_class: tuple  # its inputs' and output's dtypes, sizes and strides


#: What an autotuner is timing on this thread: the ``triton.Config`` of ``Autotuner._bench``
#: (``patches/triton_seams/autotuner_bench``) or Inductor's :class:`TimedChoice`; None outside a benchmark.
benchmarking = ThreadValue()

#: Set while smemguard reads what the device itself reports (:func:`own_device_properties`): the emulated view
#: of the device (``patches/torch_seams/torch_device_properties``) stands aside.
device_as_is = ThreadFlag()


class ProcessFlag(ThreadFlag):
    """Set for every thread of the process while a ``with flag.scope():`` block runs in any of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        with self._lock:
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1

    def __bool__(self) -> bool:
        return self._depth > 0


#: Set while smemguard's own engine compiles variants to measure them (the ladder on its pool of threads,
#: Inductor recovery, warm-up decisions, a stored config switch): the compile seams
#: (``patches/triton_seams/triton_compile``,
#: ``patches/triton_seams/jit_compile``) hand Triton's result on without asking the engine.
engine_compiling = ProcessFlag()


class Notes:
    """What the seams of one install noted for its engine (:attr:`smemguard.engine.core.Engine.notes`): the
    patches applied, the limit emulated, the kernels put into Triton's JIT caches, autotuner timings and the
    launches that failed. The patches write it, the engine reads it; it goes with the engine, and the next install
    starts with none of it."""

    def __init__(self) -> None:
        #: the per-block limit smemguard makes Triton enforce (``SMEMGUARD_MAX_SHARED``), or None
        self.emulated_limit: int | None = None
        self._lock = threading.Lock()
        self._applied: dict[str, tuple[str, str | None, bool]] = {}  # patch -> (package label, version, verified)
        # (JIT function, device, key, kernel)
        self._replacements: list[tuple[weakref.ref, int, str | None, object]] = []
        # tuning layer -> {tuning key -> {config -> median ms}}
        self._timings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # error -> (kernel, grid, args, kwargs, the compiled kernel once the engine has it)
        self._failed_launches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # -- the patches applied

    def note_patch(self, name: str, package: str, version: str | None, verified: bool) -> None:
        self._applied[name] = (package, version, verified)

    def applied_patches(self) -> dict[str, tuple[str, str | None, bool]]:
        return dict(self._applied)

    def unverified_patches(self) -> list[str]:
        """``"name (package version)"`` of every patch applied above the newest release it was checked against."""
        return [f"{name} ({package} {version})" for name, (package, version, verified) in self._applied.items()
                if not verified]

    def applied_text(self) -> str:
        """The applied patches in one phrase, grouped by package and version: ``"patches: Triton 3.9.0 (verified):
        max_shared_mem, ..."``."""
        groups: dict[tuple, list[str]] = {}
        for name, (package, version, verified) in self._applied.items():
            groups.setdefault((package, version, verified), []).append(name)
        if not groups:
            return "no patch applied"
        return "patches: " + "; ".join(f"{package} {version} ({'verified' if verified else 'unverified'}): "
                                       f"{', '.join(names)}" for (package, version, verified), names in groups.items())

    # -- kernels smemguard put into Triton's JIT caches

    def note_replacement(self, jit, device: int, key: str | None, kernel) -> None:
        """``kernel`` sits in ``jit``'s JIT cache under ``key`` (None: under whichever key the JIT files it)
        because of smemguard (fewer stages, a remembered decision), not because the caller asked for it."""
        with self._lock:
            self._replacements.append((weakref.ref(jit), device, key, kernel))

    def drop_replacements(self) -> int:
        """Take every kernel noted by :meth:`note_replacement` out of the JIT caches where it still sits; the next
        launch of that variant compiles what the caller asked for. Returns how many."""
        with self._lock:
            noted, self._replacements = self._replacements, []
        dropped = 0
        for jit_ref, device, key, kernel in noted:
            jit = jit_ref()
            kernel_cache = jit.device_caches.get(device, ({},))[0] if jit is not None else {}
            for cached in [key] if key is not None else [k for k, v in list(kernel_cache.items()) if v is kernel]:
                if kernel_cache.get(cached) is kernel:
                    del kernel_cache[cached]
                    dropped += 1
        return dropped

    # -- autotuner timings

    def note_timing(self, tuner, key: tuple, config, median_ms: float) -> None:
        with self._lock:
            self._timings.setdefault(tuner, {}).setdefault(key, {})[config] = median_ms

    def timings(self, tuner, key: tuple) -> dict:
        """{config: median ms} the tuner measured for ``key`` (inf for configs that failed), possibly empty."""
        with self._lock:
            return dict(self._timings.get(tuner, {}).get(key, {}))

    # -- launches that failed

    def note_failed_launch(self, error: BaseException, kernel, grid, args: tuple, kwargs: dict) -> None:
        """The launch guard saw ``kernel[grid](*args, **kwargs)`` raise ``error``: kept for as long as the error
        lives (as its traceback keeps the launch's frame), for a patch that runs its caller's wrapper again and for
        the record of what that wrapper decided."""
        try:
            self._failed_launches[error] = (kernel, grid, args, kwargs, None)
        except TypeError:  # an error type without weak references: nothing is kept
            pass

    def note_failing_kernel(self, error: BaseException, compiled) -> None:
        """The compiled kernel of the noted launch that raised ``error``, once the engine compiled it: the record of
        a wrapper run again describes it from this, with no compile of its own (a compile runs the kernel's pre-run
        hooks, which the user's code sees)."""
        noted = self._noted_launch(error)
        if noted is not None:
            self._failed_launches[error] = (*noted[:4], compiled)

    def failed_launch(self, error: BaseException) -> tuple | None:
        """(kernel, grid, args, kwargs) of the launch that raised ``error``, as the launch guard saw it; else
        None."""
        noted = self._noted_launch(error)
        return noted[:4] if noted is not None else None

    def failing_kernel(self, error: BaseException):
        """The compiled kernel of the launch that raised ``error`` (:meth:`note_failing_kernel`), or None."""
        noted = self._noted_launch(error)
        return noted[4] if noted is not None else None

    def _noted_launch(self, error: BaseException) -> tuple | None:
        try:
            return self._failed_launches.get(error)
        except TypeError:
            return None
