"""What a declared wrapper's call that smemguard ran again comes to (:mod:`.wrapper_tiles`), with its one
incident record and warning line: smaller tiles that fit; or, where not even the smallest declared tiles fit, the
wrapper's fallback (a torch computation of the same result, which a pack that knows the op supplies) or the caller's
own error, with a note naming the wrapper and its line, the tiles, the bytes the smallest still needs, and the exact
call that would let it run here. The tiles that fit are kept in the decision cache (table ``tiles``), where the next
process recalls them."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from ..facts import process
from ..kernels import introspect, recorded, variants
from ..kernels.launch import Attempt
from ..kernels.recorded import attempt_records
from ..store import decision_cache, incidents, tile_entries
from ..store.decision import FALLBACK, RERAISED, SHARED, TILES_REDUCED
from . import recall
from .steps import Steps

#: The decision cache's table of the tiles declared wrappers learnt.
TABLE = "tiles"


@dataclasses.dataclass
class Outcome:
    """One declared call that did not fit at the tiles its library chose."""

    wrapper: Callable
    name: str  # the wrapper's module:qualname
    declaration: Any  # smemguard.engine.wrapper_tiles.Declaration
    jit: Any  # the kernel that did not fit
    shape: tuple
    error: BaseException  # the caller's own: the first launch's OutOfResources
    failed: list  # Attempt per tiles tried, the library's first
    least: int | None  # the least bytes the launch guard's candidates needed at the smallest tiles
    started: float
    engine: Any  # the install's (smemguard.engine.core.Engine)
    steps: Steps

    def reduced(self, final: tuple) -> None:
        """Smaller tiles fit: the record, and the line saying the wrapper chooses them from now on."""
        chosen = self.declaration.label(final)
        self._report(TILES_REDUCED, chosen, None, [*self.failed, Attempt(chosen, None, self.error.limit, True)],
                     "smemguard: %s: %s %s > %s B with %s (%s); %s chooses %s for this shape class from now on",
                     self.kernel, SHARED, self.error.required, self.error.limit, self.failed[0].config,
                     tile_entries.label(dict(self.shape), dict(self.shape).values()), self.name, chosen)
        self._remember(final)

    def _remember(self, final: tuple) -> None:
        """Keep the tiles that fit in the decision cache, for the next process on this arch and limit."""
        remember_tiles(self.engine.settings, tile_case(self.name, self.declaration.jits, self.declaration.name,
                                                self.declaration.tiles, self.shape),
                       from_config=self.failed[0].config,
                       required=self.error.required, tiles=final, steps=self.steps)

    @property
    def kernel(self) -> str:
        return introspect.kernel_name(self.jit)

    def reason(self, fallback, last_error) -> str:
        """What chose the tiles and what the smallest still needs: the record's reason and the error's note."""
        needs = self.least or getattr(last_error, "required", None)
        choice = self.declaration.name.rpartition(":")[2]
        return (f"{self.name} at {_site(self.wrapper, self.error)} chose {self.failed[0].config} for {self.kernel} "
                f"({choice}); even {self.failed[-1].config}, the smallest declared, needs {needs} B over "
                f"{self.error.limit} B at any stage count" + ("" if fallback is not None else
                f"; to run here, give the wrapper a torch fallback: smemguard.rerun_on_overflow({choice}, fallback=fn) "
                f"with fn taking {self.name}'s arguments, or smemguard.register_fallback({self.kernel}, fn) with fn "
                "taking the kernel's"))

    def decided(self, reason: str | None, fallback, args: tuple, kwargs: dict):
        """The fallback's result (recorded), or the caller's error with the record and a note."""
        reason = reason or f"not even the smallest declared tiles fit for {self.name}"
        result, why_not, fallback_error = _fallen_back(fallback, args, kwargs)
        if why_not is None:
            self._report(FALLBACK, introspect.callable_name(fallback), reason, self._attempts(),
                         "smemguard: %s: %s; %s ran in its place", self.kernel, reason,
                         introspect.callable_name(fallback))
            return result
        raise self._reraised(reason + why_not) from fallback_error

    def _reraised(self, reason: str) -> BaseException:
        where = self._report(RERAISED, None, reason, self._attempts(), "smemguard: %s: re-raised: %s", self.kernel,
                             reason)
        incidents.add_note(self.error, f"smemguard: {reason}" + (f"; incident record: {where}" if where else ""))
        return self.error

    def _attempts(self) -> list:
        return [*self.failed[:-1], dataclasses.replace(self.failed[-1], required=self.least or
                                                       self.failed[-1].required)]

    def _report(self, action: str, final: str | None, reason: str | None, attempts: list, message: str,
                *args) -> str | None:
        device = process.current_device()
        described = {}
        with self.steps.skippable("describe the failed launch"):
            described = recorded.failed_launch_fields(self.error, self.engine.notes)
        incident = incidents.Incident(
            kernel=self.kernel, launched_as=self.name, phase="launch", action=action, final=final, resource=SHARED,
            required=self.error.required, limit_hit=self.error.limit, started=self.started, device=device,
            reason=reason, internal_steps=self.steps.failed, compiles=len(self.failed),
            attempts=attempt_records(attempts),
            extras={**described, "shape_class": dict(self.shape), "config": self.failed[0].config,
                    "choice": self.declaration.name})
        return incidents.report(incident, self.engine.settings.log_path, (self.name, self.declaration.name, self.shape,
                                                                   device, action), message, *args)


def nothing_fits(reason: str, fallback, error: BaseException, args: tuple, kwargs: dict):
    """A later call of a shape class whose outcome was recorded in this process: the fallback, or the error."""
    result, why_not, fallback_error = _fallen_back(fallback, args, kwargs)
    if why_not is None:
        return result
    incidents.add_note(error, f"smemguard: {reason}{why_not}")
    raise error from fallback_error


def _fallen_back(fallback, args: tuple, kwargs: dict) -> tuple[Any, str | None, BaseException | None]:
    """(the fallback's result, None) when it ran; else (None, why not, as the reason's end, the error it raised)."""
    if fallback is None:
        return None, "", None
    name = introspect.callable_name(fallback)
    try:
        result = fallback(*args, **kwargs)
    except Exception as error:  # the user's (or a pack's) code: its error is the cause of the caller's
        return None, f"; its fallback {name} raised {introspect.error_summary(error)}", error
    if result is NotImplemented:
        return None, f"; its fallback {name} does not cover these arguments", None
    return result, None, None


def _site(wrapper: Callable, error: BaseException) -> str:
    """``file:line`` of the wrapper's line that launched the kernel (the innermost frame of its code in the
    traceback), else of its definition."""
    code = getattr(inspect.unwrap(wrapper), "__code__", None)
    found = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            found = f"{code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found or (f"{code.co_filename}:{code.co_firstlineno}" if code is not None else "?")


def tiles_stored(settings) -> bool:
    """Whether the decision cache holds any learnt tiles; raises when it cannot be read."""
    store = decision_cache.store(settings.cache_dir)
    return store is not None and store.holds(TABLE)


def stored_tiles(declaration, wrapper: str, shape: tuple, answered: tuple, settings) -> tuple | None:
    """The tiles the decision cache holds for ``wrapper``'s ``shape`` on this device (:func:`recall_tiles`)."""
    return recall_tiles(settings, tile_case(wrapper, declaration.jits, declaration.name, declaration.tiles, shape),
                        answered, declaration.smallest_for(shape))


def tile_case(wrapper: str, jits: tuple, choice: str, tiles: tuple[str, ...], shape: tuple) -> dict:
    """What identifies learnt tiles to other processes: the wrapper, the kernels' source, the choice that answers
    the tiles, the shape class ((name, value) pairs), and this device's Triton, arch and limit. One form for every
    wrapper whose tiles smemguard lowers (declared ones, the vLLM packs'), so one table and one check serve all."""
    return {"wrapper": wrapper, "kernel": ",".join(map(introspect.kernel_name, jits)),
            "source_hash": ",".join(map(introspect.source_hash, jits)), "choice": choice, "tile": ",".join(tiles),
            "shape": [list(pair) for pair in shape], **variants.on_device(process.current_device())}


def remember_tiles(settings, case: dict, *, from_config: str, required: int, tiles: tuple,
                   steps: Steps) -> None:
    """Keep ``tiles``, which fit for ``case`` (:func:`tile_case`), in the decision cache's table of learnt tiles (its
    ``final`` labelled here, from the case's tile names)."""
    store = None
    with steps.skippable("open the decision cache"):
        store = decision_cache.store(settings.cache_dir)
    if store is None:
        return
    with steps.skippable("store the tiles"):
        store.put(TABLE, decision_cache.case_id(case), decision_cache.new_entry(
            case, action=TILES_REDUCED, final=tile_entries.label(case["tile"].split(","), tiles),
            from_config=from_config,
            gpu=variants.gpu_label(process.current_device()), resource=SHARED, required=required,
            value=_as_stored(tiles)))


def recall_tiles(settings, case: dict, answered: tuple, smallest: int) -> tuple | None:
    """The tiles the decision cache holds for ``case`` (:func:`tile_case`), or None; stored tiles that recovery
    could not have produced from the tiles the wrapper ``answered`` are ignored, with one warning. Raises when the
    cache cannot be read."""
    key = decision_cache.case_id(case)
    found = recall.stored_entry(settings.cache_dir, (TABLE,), key)
    if found is None:
        return None
    tiles = tile_entries.stored(found[1])
    why = tile_entries.not_a_halving(answered, tiles, smallest)
    if why is not None:
        recall.ignored(key, why)
        return None
    return tiles


def _as_stored(tiles: tuple) -> int | list[int]:
    """How the decision cache holds the tiles (one tile as a number, as entries written before several)."""
    return tiles[0] if len(tiles) == 1 else list(tiles)
