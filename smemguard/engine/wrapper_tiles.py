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

This module holds the declarations and what they learnt; :mod:`.wrapper_rerun` runs a declared wrapper again.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
from typing import Any, Callable

import wrapt

from ..facts import process
from ..kernels import introspect
from ..store import tile_entries
from . import wrapper_outcomes

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Call:
    """One running call of a declared wrapper: its name, and every tile a declaration answered in it."""

    wrapper: str
    engine: Any  # the install's (:func:`smemguard.facts.process.installed_engine`), whose memory holds what was learnt
    declarations: tuple  # the wrapper's
    chosen: list = dataclasses.field(default_factory=list)  # [(declaration, shape class, tiles)]
    least: int | None = None  # the least bytes the launch guard's candidates needed at the last failed launch


_UNKNOWN = object()
#: The table of the engine's memory (:attr:`smemguard.engine.core.Engine.memory`, forgotten at ``uninstall()``)
#: that holds what declarations learnt in this install: a :class:`_Learnt` under each declaration, and under
#: :data:`IN_USE` whether any declaration may answer a learnt tile (one was learnt, or the decision cache holds a
#: tiles table; absent: not read yet). While that is False, a healthy call records nothing: a declared wrapper
#: costs a ``try`` and a declared choice a thread-local read.
MEMORY = "declared wrappers"
IN_USE = "in use"


@dataclasses.dataclass
class _Learnt:
    """What one declaration learnt in one install, per (wrapper, device, limit, shape class)."""

    known: dict = dataclasses.field(default_factory=dict)  # key -> tiles; None: none
    limits: dict = dataclasses.field(default_factory=dict)  # device -> the limit enforced there
    exhausted: dict = dataclasses.field(default_factory=dict)  # key -> why not even the smallest tiles fit there


class _Running(threading.local):
    call: Call | None = None  # the innermost declared wrapper's call on this thread (a class default: a missing
    # attribute's AttributeError would cost a healthy choice more than everything else it does)


running = _Running()


def _checked(kernels: tuple, tiles, smallest) -> tuple[tuple, tuple[str, ...]]:
    """(the kernels' JIT functions, the tiles' names as a tuple); TypeError saying what is wrong."""
    names = (tiles,) if isinstance(tiles, str) else tuple(tiles) if isinstance(tiles, (tuple, list)) else ()
    if not names or not all(isinstance(name, str) and name.isidentifier() for name in names) \
            or len(set(names)) != len(names):
        raise TypeError(f"tile must name the kernel's constexpr (or a tuple of them), not {tiles!r}")
    if not callable(smallest) and (type(smallest) is not int or smallest < 1):
        raise TypeError(f"smallest must be a positive integer or a function of the shape class, not {smallest!r}")
    jits = []
    for kernel in kernels:
        jit = introspect.declared_kernel(kernel)
        if jit is None or not hasattr(jit, "arg_names"):
            raise TypeError(f"kernel must be a Triton kernel (@triton.jit, autotune or heuristics), not {kernel!r}")
        missing = [name for name in names if name not in jit.arg_names]
        if missing:
            raise TypeError(f"{introspect.kernel_name(jit)} has no parameter {missing[0]!r}")
        jits.append(jit)
    return tuple(jits), names


def tile_choice(*, kernel, tile: str | tuple[str, ...], smallest: int | Callable[[dict], int] = 16,
                at: int | tuple[int, ...] | None = None,
                launch_shape: Callable[[dict], dict] | None = None) -> Callable[[Callable[..., Any]], Callable]:
    """Declare the decorated function as where a wrapper chooses ``kernel``'s ``tile`` (a constexpr the launch
    passes by name; a tuple of them when the function chooses several; ``kernel`` a tuple of kernels when the
    library's wrappers launch different ones with the same choice). ``smallest``: the least tile the kernels may
    take (16 for ``tl.dot``), or a function of the shape class (the choice's arguments by name, dtypes by name)
    that gives it. ``at``: where the tiles are in the tuple the function returns (a library's function that
    returns its whole launch configuration); None: it returns the tile itself. ``launch_shape``: for a wrapper that
    asks the choice more than once in a call, for different launches, the choice's arguments (by name) that a
    launch's tiles came from, given the launch's arguments by the kernel's parameter names; without it a launch
    takes the first answer with its tiles."""
    jits, names = _checked(kernel if isinstance(kernel, (tuple, list)) else (kernel,), tile, smallest)
    if launch_shape is not None and not callable(launch_shape):
        raise TypeError(f"launch_shape must be a function of the launch's arguments, not {launch_shape!r}")
    positions = None if at is None else (at,) if type(at) is int else tuple(at) if isinstance(at, (tuple, list)) \
        else ()
    if positions is not None and (len(positions) != len(names) or not all(type(index) is int for index in positions)):
        raise TypeError(f"at must give one position in the returned tuple per tile ({len(names)}), not {at!r}")
    if positions is None and len(names) > 1:
        raise TypeError("a function that chooses several tiles returns a tuple: say where each one is with at=")
    return lambda function: TileChoice(function, jits, names, smallest, positions, launch_shape).over(function)


def declaration_of(declared) -> Declaration | None:
    """The declaration behind what :func:`tile_choice` or :func:`tiles_at_launch` returned (or the declaration
    itself); None for anything else."""
    declaration = declared if isinstance(declared, Declaration) else getattr(declared, "_self_tiles", None)
    return declaration if isinstance(declaration, Declaration) else None


def tiles_at_launch(kernel, *, tile: str | tuple[str, ...], grid: Callable[[tuple, dict, dict], tuple],
                    shape: Callable[[tuple, dict], dict], smallest: int | Callable[[dict], int] = 16) -> Any:
    """``kernel`` for a wrapper that chooses its tiles inline (no function to declare): use what this returns
    in place of the kernel. Inside a call of a wrapper declared with it, a launch answers the tiles learnt for
    its shape class: ``shape(args, kwargs)`` of the launch (a dict of plain values: what the tiles depend on),
    and ``grid(grid, launched, lowered)`` the grid for the lowered tiles (``launched`` and ``lowered``: the
    tiles by name), which the caller computed from the tiles it launched: the declaration says how."""
    jits, names = _checked((kernel,), tile, smallest)
    if not callable(grid) or not callable(shape):
        raise TypeError("grid and shape must be functions of the launch (see smemguard.tiles_at_launch)")
    return LaunchTiles(jits, names, smallest, grid, shape, introspect.kernel_name(jits[0])).over(kernel)


class Declaration:
    """Where a wrapper's tiles for one kernel come from. What the install and the decision cache learnt for them,
    per (wrapper, device, limit, shape class), is in the engine's memory (:data:`MEMORY`): libraries declare at
    import, before any install.

    :meth:`over` builds what stands in place of the library's function (or kernel). A library's own declaration is
    in place from its import. A pack's (:class:`smemguard.patches.contrib._declared_wrappers.DeclaredWrappers`) is
    held back until a launch of its kernel overflows, or the decision cache holds learnt tiles, so that a healthy
    call of the library pays for its wrapper's layer only: then ``put_in_place`` puts it there."""

    #: None: in place; else puts it in place (a pack's, held back)
    put_in_place: Callable[[], None] | None = None

    def __init__(self, jits: tuple, tiles: tuple[str, ...], smallest, name: str,
                 launch_shape: Callable[[dict], dict] | None = None):
        self.jits, self.tiles, self.smallest, self.name = jits, tiles, smallest, name
        self._launch_shape = launch_shape

    def lowered(self, call: Call, shape: tuple, answered: tuple) -> tuple:
        """``answered`` with each tile no larger than the one learnt for the shape class."""
        known = self._known_tiles(call.engine, call.wrapper, shape, answered)
        return answered if known is None else tuple(min(pair) for pair in zip(answered, known))

    def over(self, original) -> Any:
        """What stands in place of ``original``, the library's function or kernel, for this declaration."""
        raise NotImplementedError

    def declares(self, jit) -> bool:
        """Whether ``jit`` is one of the declaration's kernels."""
        return any(jit is declared for declared in self.jits)

    def smallest_for(self, shape: tuple) -> int:
        """The least tile the kernels may take for the shape class."""
        return self.smallest(dict(shape)) if callable(self.smallest) else self.smallest

    def smaller(self, tiles: tuple, shape: tuple) -> tuple | None:
        """The next tiles to try (:func:`smemguard.store.tile_entries.halved`), or None below the smallest."""
        return tile_entries.halved(tiles, self.smallest_for(shape))

    def took(self, shape: tuple, launched: dict) -> bool:
        """Whether a launch with the ``launched`` arguments (by the kernel's parameter names) took the tiles this
        declaration answered for ``shape`` (always, unless the declaration says which answer a launch takes)."""
        if self._launch_shape is None:
            return True
        try:
            return dict(plain_shape(self._launch_shape(launched).items()) or ()) == dict(shape)
        except Exception:  # the declaration cannot tell: not this answer's launch
            log.debug("smemguard: could not read the shape class of a launch for %s", self.name, exc_info=True)
            return False

    def label(self, tiles: tuple) -> str:
        return tile_entries.label(self.tiles, tiles)

    def _of(self, engine) -> tuple[_Learnt, Any]:
        """(what this declaration learnt in ``engine``'s install, the lock its writers take)."""
        table = engine.memory.table(MEMORY)
        learnt = table.get(self)  # one dict read, atomic: the lock only orders the writers
        if learnt is None:
            learnt = table.setdefault(self, _Learnt())
        return learnt, engine.memory.lock

    def _key(self, learnt: _Learnt, wrapper: str, shape: tuple) -> tuple:
        device = process.current_device()
        limit = learnt.limits.get(device)
        if limit is None:  # fixed while installed (an emulated limit is a setting): read once per device
            limit = learnt.limits[device] = process.effective_limit(device)
        return (wrapper, device, limit, shape)

    def _known_tiles(self, engine, wrapper: str, shape: tuple, answered: tuple) -> tuple | None:
        learnt, lock = self._of(engine)
        key = self._key(learnt, wrapper, shape)
        known = learnt.known.get(key, _UNKNOWN)
        if known is not _UNKNOWN:
            return known
        try:
            stored = wrapper_outcomes.stored_tiles(self, wrapper, shape, answered, engine.settings)
        except Exception:  # an unreadable decision cache: this process learns its own, as with no cache
            log.debug("smemguard: could not read the tiles stored for %s", wrapper, exc_info=True)
            stored = None
        with lock:
            return learnt.known.setdefault(key, stored)

    def learn(self, engine, wrapper: str, shape: tuple, tiles: tuple | None) -> None:
        learnt, lock = self._of(engine)
        with lock:
            learnt.known[self._key(learnt, wrapper, shape)] = tiles
            if tiles is not None:
                engine.memory.table(MEMORY)[IN_USE] = True

    def exhaust(self, engine, wrapper: str, shape: tuple, reason: str) -> None:
        """Not even the smallest tiles fit for the shape class: later calls go to the outcome at once."""
        learnt, lock = self._of(engine)
        with lock:
            key = self._key(learnt, wrapper, shape)
            learnt.known[key] = None
            learnt.exhausted[key] = reason

    def exhausted(self, engine, wrapper: str, shape: tuple) -> str | None:
        learnt, _ = self._of(engine)
        return learnt.exhausted.get(self._key(learnt, wrapper, shape))


def plain_shape(arguments) -> tuple | None:
    """A shape class as records and the decision cache hold it: (name, value) pairs with dtypes by name; None when a
    value is not a plain one (a tensor: the shape class holds what the tiles depend on, not the data)."""
    shape = []
    for name, value in arguments:
        if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
            value = str(value)
        elif not (value is None or isinstance(value, (bool, int, float, str))):
            return None
        shape.append((name, value))
    return tuple(shape)


class TileChoice(Declaration):
    """A library's tile choice function, lowered inside its declared wrappers to the tiles learnt for a shape class
    (its arguments) on this device's arch and limit."""

    def __init__(self, function: Callable[..., Any], jits: tuple, tiles: tuple[str, ...], smallest,
                 positions: tuple[int, ...] | None, launch_shape: Callable[[dict], dict] | None = None):
        super().__init__(jits, tiles, smallest, introspect.callable_name(function), launch_shape)
        self.positions = positions
        self._signature = inspect.signature(function)
        self._names = tuple(self._signature.parameters)
        self._positional = all(parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
                               for parameter in self._signature.parameters.values())

    def over(self, original) -> Callable[..., Any]:
        """The declared choice: ``original``, whose answers inside a declared wrapper's call are lowered to the tiles
        learnt (:meth:`answered_in`). A plain function, not an instance's ``__call__``: a healthy call (no declared
        call running on the thread) costs a function layer and a thread-local read."""
        answered_in = self.answered_in

        @functools.wraps(original)
        def choice(*args, **kwargs):
            answer = original(*args, **kwargs)
            call = running.call
            return answer if call is None else answered_in(call, args, kwargs, answer)

        choice._self_tiles = self  # what rerun_on_overflow declares the wrapper with (declaration_of)
        return choice

    def answered_in(self, call: Call, args: tuple, kwargs: dict, answer):
        """``answer``, the library's own for ``args`` and ``kwargs``, inside the declared wrapper's ``call``: lowered
        to the tiles learnt for its shape class, and kept in the call's books."""
        try:
            shape = self.shape_class(args, kwargs)
            if shape is None:
                return answer
            answered = (answer,) if self.positions is None else tuple(answer[index] for index in self.positions)
            tiles = self.lowered(call, shape, answered)
            if tiles != answered:
                answer = tiles[0] if self.positions is None else _replaced(answer, self.positions, tiles)
        except Exception:  # bookkeeping only: the library's own choice stands
            log.debug("smemguard: could not look up a learnt %s for %s", self.label(self.tiles), self.name,
                      exc_info=True)
            return answer
        call.chosen.append((self, shape, tiles))
        return answer

    def shape_class(self, args: tuple, kwargs: dict) -> tuple | None:
        """The choice's arguments by name (dtypes by name); None when one is not a plain value."""
        if self._positional and not kwargs and len(args) == len(self._names):  # the usual call: no binding to do
            return plain_shape(zip(self._names, args))
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return plain_shape(bound.arguments.items())


def _replaced(answer: tuple, positions: tuple[int, ...], tiles: tuple) -> tuple:
    replaced = list(answer)
    for index, tile in zip(positions, tiles):
        replaced[index] = tile
    return answer._make(replaced) if hasattr(answer, "_make") else type(answer)(replaced)


class LaunchTiles(Declaration):
    """Tiles a wrapper chose inline, lowered at its kernel's launch, with the grid the declaration computes."""

    def __init__(self, jits: tuple, tiles: tuple[str, ...], smallest, grid: Callable, shape: Callable,
                 name: str):
        super().__init__(jits, tiles, smallest, name)
        self._grid, self._shape = grid, shape

    def over(self, original) -> Any:
        """``original``, the kernel, whose launches inside declared calls answer learnt tiles."""
        return _LaunchLayer(original, self)

    def launch(self, kernel, call: Call, grid, args: tuple, kwargs: dict):
        """``kernel[grid](*args, **kwargs)`` inside a declared call, with the tiles learnt for its shape class."""
        try:
            answered = tuple(kwargs[name] for name in self.tiles)
            shape = plain_shape(self._shape(args, kwargs).items()) if all(
                type(tile) is int for tile in answered) else None
            tiles = self.lowered(call, shape, answered) if shape is not None else answered
            if tiles != answered:
                launched, lowered = dict(zip(self.tiles, answered)), dict(zip(self.tiles, tiles))
                kwargs = {**kwargs, **lowered}
                grid = grid if callable(grid) else tuple(self._grid(tuple(grid), launched, lowered))
        except Exception:  # bookkeeping only: the launch as the library made it
            log.debug("smemguard: could not look up learnt tiles for %s", self.name, exc_info=True)
            return kernel[grid](*args, **kwargs)
        if shape is not None:
            call.chosen.append((self, shape, tiles))
        return kernel[grid](*args, **kwargs)


class _LaunchLayer(wrapt.ObjectProxy):
    """A kernel whose launches inside declared calls answer learnt tiles (:func:`tiles_at_launch`); elsewhere the
    kernel itself."""

    def __init__(self, kernel, tiles: LaunchTiles):
        super().__init__(kernel)
        self._self_tiles = tiles

    def __getitem__(self, grid):
        call = running.call
        if call is None:
            return self.__wrapped__[grid]
        return functools.partial(_launch_with, self._self_tiles, self.__wrapped__, call, grid)


def _launch_with(tiles: LaunchTiles, kernel, call: Call, grid, *args, **kwargs):
    return tiles.launch(kernel, call, grid, args, kwargs)
