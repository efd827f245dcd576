"""What one install knows, kept on its engine (:class:`smemguard.engine.core.Engine`) and gone with it: the patches'
and declared wrappers' :class:`Memory`, and the :class:`Notes` the seams take for the engine.

The patches (:mod:`smemguard.patches`) write the notes (the emulated limit by ``max_shared_mem``, autotuner timings by
``autotuner_bench``, failed launches by ``kernel_interface``), the engine reads them on itself, and neither imports
the other: the dependency runs one way, through this module (the patches see both through ``patches.Port``).
"""

from __future__ import annotations

import threading
import weakref


class Memory:
    """What the patches of one install decided and what declared wrappers learnt, one table each (the launch
    guard's decisions are :attr:`Engine.decided`), all forgotten when the engine closes."""

    def __init__(self):
        self.lock = threading.Lock()
        self._tables: dict[str, dict] = {}

    def table(self, name: str) -> dict:
        """The table ``name``, made at its first use (``setdefault`` is atomic: no lock for a reader that only
        looks); change it, or read it whole, under :attr:`lock`."""
        table = self._tables.get(name)  # a healthy declared call reads this: no empty dict made to be thrown away
        return table if table is not None else self._tables.setdefault(name, {})

    def first(self, table: str, key) -> bool:
        """True the first time ``key`` is seen in ``table`` by this install (what is recorded once per case)."""
        with self.lock:
            seen = self.table(table)
            if key in seen:
                return False
            seen[key] = True
            return True

    def clear(self) -> None:
        with self.lock:
            for table in self._tables.values():
                table.clear()


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
