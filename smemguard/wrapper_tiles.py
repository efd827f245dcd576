"""A library's wrapper that chooses a kernel's tiles, run again with smaller tiles when they cannot fit.

The public way for a library author to let smemguard recover the one class of overflow it otherwise leaves to the
caller: a plain ``@triton.jit`` kernel launched with a grid computed from tiles that its Python wrapper chose, where
no stage count fits. The author says where the tile comes from and that the wrapper may be run again::

    @smemguard.tile_choice(kernel=_attn_fwd, tile="BLOCK_M", smallest=16)
    def block_m_for(head_dim: int, dtype) -> int:        # what the choice depends on, as its arguments
        return 128 if head_dim <= 128 else 64

    @smemguard.rerun_on_overflow(block_m_for)
    def attention(q, k, v):
        block_m = block_m_for(q.shape[-1], q.dtype)
        _attn_fwd[(triton.cdiv(q.shape[0], block_m),)](q, k, v, ..., BLOCK_M=block_m)

When a call of ``attention`` raises ``OutOfResources`` for shared memory from a launch of ``_attn_fwd`` (after the
launch guard found no stage count that fits), the tile ``block_m_for`` answered in that call is halved for its
shape class (its arguments) on this GPU's arch and limit, and the call is run again, down to ``smallest``; the
first tile that fits is remembered in this process and in the decision cache (table ``tiles``), so the next call,
and the next process, choose it at once. Only calls of the choice made inside a call of the wrapper are lowered:
another caller keeps the library's own answer.

The contract, which the author's declaration states and smemguard cannot prove (hence opt-in, never inferred):
the failing launch is the wrapper's first, and nothing the wrapper did before it can be observed, so running it
again from its start repeats no effect; the kernel masks its tails so that any tile from ``smallest`` up computes
the same result (bitwise where only the iteration order within a tile is unchanged; within the library's own
tolerances otherwise). What smemguard enforces: the error must come from a launch of the declared kernel, the tile
must be the one the choice answered, the wrapper is run again at most ``log2(tile / smallest)`` times, an error
of anything else (another kernel, a later launch's different error) reaches the caller as raised, and nothing is
run again in observe mode or without ``install()``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
import time
import weakref
from typing import Any, Callable

from . import decisions, guard, incidents, introspect, runtime
from .decision import TILES_REDUCED
from .internal import StepFailed, Steps
from .launch import Attempt

log = logging.getLogger(__name__)

SHARED = "shared memory"
TABLE = "tiles"


@dataclasses.dataclass
class _Call:
    """One running call of a declared wrapper: its name, and every tile a declared choice answered in it."""

    wrapper: str
    chosen: list = dataclasses.field(default_factory=list)  # [(choice, shape class, tile)]


_UNKNOWN = object()
#: Whether any declared choice may answer a learnt tile: one was learnt here, or the decision cache holds a tiles
#: table (None: not read since install). While False, a healthy call records nothing: a declared wrapper costs a
#: ``try`` and a declared choice a thread-local read.
_tiles_in_use: bool | None = None
class _Running(threading.local):
    call: _Call | None = None  # the innermost declared wrapper's call on this thread (a class default: a missing
    # attribute's AttributeError would cost a healthy choice more than everything else it does)


_running = _Running()
_choices: weakref.WeakSet = weakref.WeakSet()  # every TileChoice, whose learnt tiles uninstall() forgets


def tile_choice(*, kernel, tile: str, smallest: int = 16) -> Callable[[Callable[..., int]], TileChoice]:
    """Declare the decorated function as where a wrapper chooses ``kernel``'s ``tile`` (a constexpr the launch
    passes by name); ``smallest``: the least tile the kernel may take (16 for ``tl.dot``)."""
    if not isinstance(tile, str) or not tile.isidentifier():
        raise TypeError(f"tile must name the kernel's constexpr, not {tile!r}")
    if type(smallest) is not int or smallest < 1:
        raise TypeError(f"smallest must be a positive integer, not {smallest!r}")
    jit = introspect.jit_function(kernel)
    if jit is None or not hasattr(jit, "arg_names"):
        raise TypeError(f"kernel must be a Triton kernel (@triton.jit, autotune or heuristics), not {kernel!r}")
    if tile not in jit.arg_names:
        raise TypeError(f"{introspect.kernel_name(jit)} has no parameter {tile!r}")
    return lambda function: TileChoice(function, jit, tile, smallest)


class TileChoice:
    """A library's tile choice function, lowered inside its declared wrappers to the tile learnt for a shape class
    on this device's arch and limit."""

    def __init__(self, function: Callable[..., int], jit, tile: str, smallest: int):
        functools.update_wrapper(self, function)
        self.function, self.jit, self.tile, self.smallest = function, jit, tile, smallest
        self.name = introspect.callable_name(function)
        self._signature = inspect.signature(function)
        self._names = tuple(self._signature.parameters)
        self._positional = all(parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
                               for parameter in self._signature.parameters.values())
        self._lock = threading.Lock()
        self._known: dict[tuple, int | None] = {}  # (wrapper, device, limit, shape class) -> tile; None: none
        self._limits: dict[int, int] = {}  # device -> the limit enforced there
        _choices.add(self)

    def __call__(self, *args, **kwargs) -> int:
        tile = self.function(*args, **kwargs)
        call = _running.call
        if call is None:  # not inside a declared wrapper: the library's own answer
            return tile
        try:
            shape = self.shape_class(args, kwargs)
            learnt = self._learnt(call.wrapper, shape) if shape is not None else None
        except Exception:  # bookkeeping only: the library's own choice stands
            log.debug("smemguard: could not look up a learnt %s for %s", self.tile, self.name, exc_info=True)
            return tile
        if learnt is not None and learnt < tile:
            tile = learnt
        if shape is not None:
            call.chosen.append((self, shape, tile))
        return tile

    def shape_class(self, args: tuple, kwargs: dict) -> tuple | None:
        """The choice's arguments by name (dtypes by name); None when one is not a plain value (a tensor: the
        choice takes what it depends on, not the data)."""
        if self._positional and not kwargs and len(args) == len(self._names):  # the usual call: no binding to do
            arguments = zip(self._names, args)
        else:
            bound = self._signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments.items()
        shape = []
        for name, value in arguments:
            if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
                value = str(value)
            elif not (value is None or isinstance(value, (bool, int, float, str))):
                return None
            shape.append((name, value))
        return tuple(shape)

    def case(self, wrapper: str, shape: tuple) -> dict:
        """What identifies a learnt tile to other processes: the wrapper, the kernel's source, the choice, the shape
        class, and this device's Triton, arch and limit."""
        return {"wrapper": wrapper, "kernel": introspect.kernel_name(self.jit),
                "source_hash": introspect.source_hash(self.jit), "choice": self.name, "tile": self.tile,
                "shape": [list(pair) for pair in shape], **decisions.on_device(runtime.current_device())}

    def _key(self, wrapper: str, shape: tuple) -> tuple:
        device = runtime.current_device()
        limit = self._limits.get(device)
        if limit is None:  # fixed while installed (an emulated limit is a setting): read once per device
            limit = self._limits[device] = runtime.effective_limit(device)
        return (wrapper, device, limit, shape)

    def _learnt(self, wrapper: str, shape: tuple) -> int | None:
        key = self._key(wrapper, shape)
        known = self._known.get(key, _UNKNOWN)  # one dict read, atomic: the lock only orders the writers
        if known is not _UNKNOWN:
            return known
        stored = _stored(self, wrapper, shape)
        with self._lock:
            return self._known.setdefault(key, stored)

    def learn(self, wrapper: str, shape: tuple, tile: int | None) -> None:
        global _tiles_in_use
        with self._lock:
            self._known[self._key(wrapper, shape)] = tile
        if tile is not None:
            _tiles_in_use = True

    def forget_all(self) -> None:
        with self._lock:
            self._known.clear()
            self._limits.clear()


def forget() -> None:
    """Forget every tile learnt in this process (``uninstall()``); the decision cache keeps its entries."""
    global _tiles_in_use
    for choice in list(_choices):
        choice.forget_all()
    _tiles_in_use = None


def _in_use(settings) -> bool:
    global _tiles_in_use
    if _tiles_in_use is None:
        try:
            store = decisions.store(settings.cache_dir)
            _tiles_in_use = store is not None and store.holds(TABLE)
        except Exception:  # no store to read: only what this process learns
            log.debug("smemguard: could not read the decision cache for tiles", exc_info=True)
            _tiles_in_use = False
    return _tiles_in_use


def _overflow(error: BaseException) -> bool:
    from triton.runtime.errors import OutOfResources

    return isinstance(error, OutOfResources) and error.name == SHARED


def rerun_on_overflow(*choices: TileChoice) -> Callable[[Callable], Callable]:
    """Declare the decorated wrapper safe to run again from its start when the first launch of a kernel whose tile
    one of ``choices`` chose cannot fit (the contract: this module's docstring)."""
    if not choices or not all(isinstance(choice, TileChoice) for choice in choices):
        raise TypeError("rerun_on_overflow takes the smemguard.tile_choice functions the wrapper chooses tiles with")

    def decorate(wrapper: Callable) -> Callable:
        name = introspect.callable_name(wrapper)

        @functools.wraps(wrapper)
        def rerunnable(*args, **kwargs):
            settings = guard.active_settings()
            if settings is None or settings.observe_only:
                return wrapper(*args, **kwargs)
            if _tiles_in_use is not False and _in_use(settings):
                return _run(wrapper, name, choices, settings, args, kwargs)
            try:
                return wrapper(*args, **kwargs)
            except Exception as error:
                if not _overflow(error):
                    raise
                failure = error
            # Outside the except block: the caller's error, if it stands, is raised unchained.
            return _run(wrapper, name, choices, settings, args, kwargs, failure)

        return rerunnable

    return decorate


def _recorded_call(wrapper: Callable, name: str, args: tuple, kwargs: dict) -> tuple[Any, BaseException | None,
                                                                                    _Call]:
    """(result, the shared-memory overflow the call raised or None, the tiles chosen in it)."""
    outer, call = _running.call, _Call(name)
    _running.call = call
    try:
        return wrapper(*args, **kwargs), None, call
    except Exception as error:
        if not _overflow(error):
            raise
        return None, error, call
    finally:
        _running.call = outer


def _run(wrapper: Callable, name: str, choices: tuple, settings, args: tuple, kwargs: dict,
         unrecorded: BaseException | None = None):
    """The call, run again with halved tiles while a declared choice's kernel is the launch that does not fit.
    ``unrecorded``: the overflow of a first call made without bookkeeping, run again to see the tile it chose
    (the contract makes that safe: it failed at its first launch)."""
    result, error, call = _recorded_call(wrapper, name, args, kwargs)
    if error is None:
        return result
    original, started, steps, failed = unrecorded or error, time.perf_counter(), Steps(name), []
    step = steps.run("read the failed launch", _failed_choice, choices, call, error, otherwise=lambda: None)
    if step is None:
        raise original  # not a launch of a declared choice's kernel at the tile it chose: the caller's error
    choice, shape, tile = step
    while True:
        failed.append(Attempt(f"{choice.tile}={tile}", error.required, error.limit, False))
        smaller = tile // 2
        if smaller < choice.smallest:  # nothing smaller may run: the library's own tile again, its error
            steps.run("forget the tile", choice.learn, name, shape, None, otherwise=lambda: None)
            raise original
        try:
            steps.run("learn the tile", choice.learn, name, shape, smaller)
        except StepFailed:
            raise original from None
        result, error, call = _recorded_call(wrapper, name, args, kwargs)
        if error is None:
            break
        step = steps.run("read the failed launch", _failed_choice, choices, call, error, otherwise=lambda: None)
        if step is None or step[:2] != (choice, shape):
            raise error  # a later launch failed after the kernel ran: the call is not run again
        tile = step[2]
    _report(name, choice, shape, original, failed, smaller, started, settings, steps)
    return result


def _failed_choice(choices: tuple, call: _Call, error) -> tuple | None:
    """(choice, shape class, tile) when ``error`` came from a launch of a declared choice's kernel and that choice
    answered in ``call``; else None."""
    kernel = _failed_kernel(error)
    return next(((choice, shape, tile) for choice, shape, tile in call.chosen
                 if choice in choices and kernel is choice.jit), None)


def _failed_kernel(error):
    """The Triton kernel whose launch raised ``error``: the JIT function under the ``self`` of the innermost frame
    in the traceback that holds one (Triton's own ``run``, an autotuner's)."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        holder = tb.tb_frame.f_locals.get("self")
        jit = introspect.jit_function(holder) if holder is not None else None
        if jit is not None and hasattr(jit, "arg_names"):
            found = jit
        tb = tb.tb_next
    return found


def _stored(choice: TileChoice, wrapper: str, shape: tuple) -> int | None:
    """The tile the decision cache holds for ``wrapper``'s ``shape`` on this device, or None."""
    settings = guard.active_settings()
    store = decisions.store(settings.cache_dir) if settings is not None else None
    if store is None or not store.holds(TABLE):
        return None
    entry = store.get(TABLE, decisions.case_id(choice.case(wrapper, shape)))
    return entry["value"] if entry is not None and entry["value"] >= choice.smallest else None


def _report(wrapper: str, choice: TileChoice, shape: tuple, error, failed: list, final: int, started: float,
            settings, steps: Steps) -> None:
    device = runtime.current_device()
    chosen = f"{choice.tile}={final}"
    kernel = introspect.kernel_name(choice.jit)
    incident = incidents.Incident(
        kernel=kernel, launched_as=wrapper, phase="launch", action=TILES_REDUCED, final=chosen, resource=SHARED,
        required=error.required, limit_hit=error.limit, started=started, device=device,
        internal_steps=steps.failed, compiles=len(failed),
        attempts=incidents.attempt_records([*failed, Attempt(chosen, None, error.limit, True)]),
        extras={"shape_class": dict(shape), "config": failed[0].config, "choice": choice.name})
    incidents.report(incident, settings.log_path, (wrapper, choice.name, shape, device),
                     "smemguard: %s: %s %s > %s B with %s (%s); %s chooses %s for this shape class from now on",
                     kernel, SHARED, error.required, error.limit, failed[0].config,
                     " ".join(f"{name}={value}" for name, value in shape), wrapper, chosen)
    store = steps.run("open the decision cache", decisions.store, settings.cache_dir, otherwise=lambda: None)
    if store is not None:
        case = choice.case(wrapper, shape)
        steps.run("store the tile", store.put, TABLE, decisions.case_id(case), decisions.new_entry(
            case, action=TILES_REDUCED, final=chosen, from_config=failed[0].config, gpu=decisions.gpu_label(device),
            resource=SHARED, required=error.required, value=final), otherwise=lambda: None)
