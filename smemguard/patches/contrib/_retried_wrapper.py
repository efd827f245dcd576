"""A vLLM wrapper's own tile choice, lowered for the calls whose first kernel launch does not fit, and the wrapper
called again.

Shared by the patches of vLLM wrapper functions that choose a kernel's tile with a module-level
function, launch that kernel first, and either launch it with a grid that does not depend on the
tile or compute the grid from the same choice (``vllm_unified_attention``,
``vllm_prefill_attention``), wherever a release keeps them. Each patch describes its target as a
:class:`RetriedWrapper`; the per-kernel knowledge that makes a smaller tile safe lives in that patch's docstring.

How: the wrapper gets a plain function layer, a ``try`` around the call (a healthy call pays one
Python frame and nothing else; a wrapt ``FunctionWrapper`` costs several times that;
measured: docs/MEASURED.md). When the call raises ``OutOfResources`` for shared
memory, the frame directly below the wrapper's in the traceback is the launcher ``kernel[grid]``
returned: its ``self`` is the kernel, its ``args``/``kwargs`` the launch's arguments. Only when that
kernel is the patch's kernel (the first launch of the call, so nothing of the call has run) and its
tile is the one the wrapper chooses for the launch's shape class is the choice halved for that class
and the wrapper called again, down to the smallest tile. From the first such decision on, the
choice function gets a layer too that answers the smaller tile when the wrapper asks for that shape
class, so every kernel of the call that reads the choice sees the same value and later calls choose
it at once. A failure of any later launch of the call is never retried. One incident record
(``"action": "tiles_reduced"``) per shape class, after the engine's own record of the failed launch.
"""

from __future__ import annotations

import inspect
import logging
import sys
import time
from typing import Any, Callable

from ...facts import process
from ...kernels.launch import Attempt
from ...kernels import recorded
from ...kernels.recorded import attempt_records
from ...engine.wrapper_tiles import plain_shape
from ...store import incidents, tile_entries
from ...store.decision import TILES_REDUCED
from .. import Kernels, Layer, Patch

log = logging.getLogger(__name__)


class RetriedWrapper(Patch):
    """One vLLM wrapper, the function it chooses a tile with, and the kernel it launches first, in the home of
    ``kernels`` (:class:`smemguard.patches.Kernels`: wherever a release keeps them, where the kernel has what the
    pack's argument reads; a process imports one release, so the first home found is the one patched).

    ``choice_shape(args, kwargs, frame)``: the shape class of a call of the choice function (its
    arguments, and the wrapper's frame that called it); ``launch_shape(args, kwargs)``: the shape
    class of a launch of the kernel (None: not a launch this patch knows); ``wrapper_tile(module, choose,
    shape, learnt)``: the tile the wrapper of the home ``module`` launches with for a shape class, given vLLM's own
    choice function and the tile learnt for the class (None when none); ``smallest(shape)``: the smallest
    tile the kernel may take; ``shape_fields``: names of a shape class's values, for records. ``name``,
    ``supported`` and ``checked`` are the patch's contract (:class:`smemguard.patches.Patch`); it patches the
    wrapper, and never in observe mode (it changes the tile that runs).
    """

    def __init__(self, name: str, *, supported, checked: tuple[str, ...], kernels: Kernels, wrapper: str,
                 choice: str, tile: str, shape_fields: tuple[str, ...], choice_shape: Callable[..., tuple],
                 launch_shape: Callable[[tuple, dict], tuple | None],
                 wrapper_tile: Callable[[Any, Callable, tuple, int | None], int], smallest: Callable[[tuple], int]):
        super().__init__(name, target=wrapper, kernels=kernels, supported=supported, checked=checked,
                         observe_safe=False, apply=self._layer_wrapper, remove=self._forget,
                         present=lambda: self._wrapper_layer.present())
        self.wrapper, self.choice, self.tile = wrapper, choice, tile
        [self.kernel] = kernels.kernels
        self.shape_fields = shape_fields
        self._choice_shape, self._launch_shape = choice_shape, launch_shape
        self._wrapper_tile, self._smallest = wrapper_tile, smallest
        self._out_of_resources: type = Exception  # Triton's OutOfResources, bound at patch time
        self._wrapper_code = None  # the code of vLLM's wrapper, bound at patch time
        self._home(kernels.homes[0])

    def _home(self, module: str) -> None:
        """Patch the wrapper and the choice of ``module`` (both also where vLLM's callers imported them by name:
        the Triton backend imports the wrapper)."""
        self.module = module
        self._wrapper_layer = Layer(module, self.wrapper, rebind=True)
        self._choice_layer = Layer(module, self.choice, rebind=True)

    # -- the patch contract ----------------------------------------------------------------------

    def _layer_wrapper(self, engine) -> None:
        """Layer the wrapper of the kernels' home, here and in the modules that imported it by name."""
        from triton.runtime.errors import OutOfResources

        self._out_of_resources = OutOfResources
        if self.is_patched():
            return
        homes = self.homes()
        if not homes:
            return
        home, module = homes[0]
        if home != self.module:
            self._home(home)
        self._wrapper_code = inspect.unwrap(getattr(module, self.wrapper)).__code__
        self._wrapper_layer.add(self._guarded)
        if engine.holds_tiles():  # another process learnt tiles: the choice answers them from the first call
            self._choice_layer.add(self._capped)

    def _forget(self) -> None:
        """Remove both layers, here and in the callers, and forget the tiles learnt."""
        engine = self.engine
        if engine is not None:
            with engine.memory.lock:  # the lock every writer of the engine's memory takes
                self.memory().clear()
        self._choice_layer.remove()
        self._wrapper_layer.remove()

    def caps_choice(self) -> bool:
        """Whether vLLM's choice function carries the layer that answers learnt tiles (from the first
        decision on)."""
        return self._choice_layer.present()

    # -- plain function layers -------------------------------------------------------------------

    def _guarded(self, original: Callable) -> Callable:
        out_of_resources, retry = self._out_of_resources, self._retry

        def guarded(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except out_of_resources as error:
                return retry(original, args, kwargs, error)

        return guarded

    def _capped(self, original: Callable) -> Callable:
        """vLLM's choice function, lowered to the tile learnt for the shape class when the wrapper asks
        (another caller of the same function keeps vLLM's answer)."""

        def capped(*args, **kwargs):
            tile = original(*args, **kwargs)
            try:
                frame = self._wrapper_frame(sys._getframe(1))
                if frame is not None:
                    learnt = self._learnt(self._choice_shape(args, kwargs, frame), tile)
                    if learnt is not None and learnt < tile:
                        return learnt
            except Exception:  # bookkeeping only: vLLM's own choice stands
                log.debug("smemguard: could not look up a learnt %s", self.tile, exc_info=True)
            return tile

        return capped

    def _wrapper_frame(self, frame):
        """``frame``, past other tools' wrapt frames, when it runs vLLM's wrapper; else None."""
        while frame is not None and frame.f_globals.get("__name__", "").startswith("wrapt"):
            frame = frame.f_back
        return frame if frame is not None and frame.f_code is self._wrapper_code else None

    # -- the shape class and its tile ------------------------------------------------------------

    @staticmethod
    def _key(shape: tuple) -> tuple:
        """A shape class on this device and limit."""
        device = process.current_device()
        return (device, process.effective_limit(device), *shape)

    def _learnt(self, shape: tuple, answered: int) -> int | None:
        """The tile learnt for the shape class on this device and limit: in this install, else in the decision cache
        (looked up once per class; a stored tile vLLM's ``answered`` one does not halve to is ignored)."""
        key, memory = self._key(shape), self.memory()
        if key in memory:
            return memory[key]
        engine = self.engine
        if engine is None or self._plain(key) is None:
            return None
        found = engine.learnt_tiles(*self._described(key), (answered,), self._smallest(shape))
        stored = found[0] if found else None
        with engine.memory.lock:
            return memory.setdefault(key, stored)

    def _described(self, key: tuple) -> tuple:
        """A shape class as the decision cache's tiles table knows it: the wrapper, its kernel, the choice, the tile's
        name and the shape class's (name, value) pairs, the form declared wrappers' learnt tiles take."""
        return (f"{self.module}:{self.wrapper}", (self._jit(),), f"{self.module}:{self.choice}", (self.tile,),
                self._plain(key))

    def _plain(self, key: tuple) -> tuple | None:
        """A shape class's (name, value) pairs as records and the decision cache hold them (a dtype by its name);
        None when a value is not a plain one."""
        _, _, *shape = key
        return plain_shape(zip(self.shape_fields, shape))

    def _jit(self):
        return getattr(sys.modules[self.module], self.kernel)

    def _learn(self, key: tuple, tile: int | None) -> bool:
        """Make the choice answer ``tile`` for ``key`` (None: vLLM's own choice again); False when no install
        holds what is learnt (uninstalled while another tool's layer kept ours alive)."""
        engine = self.engine
        if engine is None:
            return False
        learnt = self.memory()
        with engine.memory.lock:
            if tile is None:
                learnt.pop(key, None)
                return True
            learnt[key] = tile
            self._choice_layer.add(self._capped)
        return True

    def _failed_launch(self, error: BaseException) -> tuple | None:
        """(args, kwargs) of the launch of the patch's kernel that raised ``error`` for shared memory, as the
        launch guard saw it (``Port.notes.failed_launch``); None when ``error`` came from another launch."""
        engine = self.engine
        if getattr(error, "name", None) != "shared memory" or engine is None:
            return None
        kernel, _, args, kwargs = engine.notes.failed_launch(error) or (None, None, (), None)
        if kernel is not self._jit() or not isinstance(kwargs, dict):
            return None
        return tuple(args), kwargs

    def _smaller_tile(self, args: tuple, kwargs: dict) -> tuple | None:
        """(key, tile that failed, half of it) when the launch's tile is the one the wrapper chooses for
        its shape class and a smaller one exists; else None."""
        shape = self._launch_shape(args, kwargs)
        if shape is None:
            return None
        key, tile = self._key(shape), kwargs[self.tile]
        if self._plain(key) is None:  # no shape class the decision cache and records can hold: not one of ours
            return None
        module = sys.modules[self.module]
        choose = inspect.unwrap(getattr(module, self.choice))
        if self._wrapper_tile(module, choose, shape, self.memory().get(key)) != tile:  # chosen elsewhere: not ours
            return None
        smaller = tile // 2
        return (key, tile, smaller) if smaller >= self._smallest(shape) else None

    # -- the retry -------------------------------------------------------------------------------

    def _retry(self, wrapped, args, kwargs, original):
        """Call again with halved tiles while the patch's kernel is the launch that does not fit."""
        engine = self.engine
        if engine is None:  # uninstalled while another tool's layer kept ours alive
            raise original
        started = time.perf_counter()
        steps = engine.steps(f"{self.module}:{self.kernel}")
        error, key, before, failed = original, None, None, []
        while True:
            launch = step = None
            with steps.skippable("read the failed launch"):
                launch = self._failed_launch(error)
            if launch is not None:
                with steps.skippable("choose a smaller tile"):
                    step = self._smaller_tile(*launch)
            if step is None:
                if error is original:
                    raise original
                if launch is not None:  # not even the smallest tile fits: vLLM's own choice again
                    with steps.skippable("forget the tile"):
                        self._learn(key, before)
                    raise original
                raise error  # a later launch failed after the kernel ran: the call is not repeated
            if key is None:
                key, before = step[0], self.memory().get(step[0])
            failed.append(Attempt(tile_entries.label((self.tile,), (step[1],)), error.required, error.limit, False))
            learned = False
            with steps.skippable("learn the tile"):
                learned = self._learn(key, step[2])
            if not learned:
                raise original  # without the smaller tile in place, calling again would fail the same way
            try:
                result = wrapped(*args, **kwargs)
            except self._out_of_resources as again:
                error = again
                continue
            self._report(original, key, failed, step[2], started, steps)
            engine.keep_tiles(*self._described(key), (step[2],), from_config=failed[0].config,
                              required=original.required, steps=steps)
            return result

    def _report(self, error, key: tuple, failed: list, final: int, started: float, steps) -> None:
        described = {}
        with steps.skippable("describe the failed launch"):
            described = recorded.failed_launch_fields(error, self.engine.notes)
        try:
            device = key[0]
            shape_class = dict(self._plain(key))
            chosen = tile_entries.label((self.tile,), (final,))
            incident = incidents.Incident(
                kernel=f"{self.module}:{self.kernel}", launched_as=f"{self.module}:{self.wrapper}", phase="launch",
                action=TILES_REDUCED, final=chosen, resource=error.name, required=error.required,
                limit_hit=error.limit, started=started, device=device, internal_steps=steps.failed,
                attempts=attempt_records([*failed, Attempt(chosen, None, error.limit, True)]),
                extras={**described, "shape_class": shape_class, "config": failed[0].config})
            incidents.report(incident, self.records_path(), (self.kernel, key),
                             "smemguard: %s: %s %s > %s B with %s (%s); %s chooses %s for this shape class from now "
                             "on", self.kernel, error.name, error.required, error.limit, failed[0].config,
                             tile_entries.label(shape_class, shape_class.values()), self.wrapper, chosen)
        except Exception:
            log.warning("smemguard: could not write the incident record for %s", self.kernel, exc_info=True)
