"""Facts about the running process: the install in force, the launch in progress on each thread, the device, the
warnings said once. What one install knows is :mod:`.install`'s.

"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
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


def notes():
    """What the seams of the install in force noted (:class:`smemguard.facts.install.Notes`); while none is, an empty
    one kept nowhere."""
    from .install import Notes

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
