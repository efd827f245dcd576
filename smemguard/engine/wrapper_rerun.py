"""A declared wrapper's call (:mod:`.wrapper_tiles`, whose docstring states the contract) that raised a shared-memory
overflow at the first launch of a declared kernel: run again with smaller tiles, down to the smallest, and what it
comes to recorded once (:mod:`.wrapper_outcomes`). The launch guard asks :func:`chooses_again` before it records a
launch that no stage count fits, so that the call has one record, not two.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from typing import Any, Callable

from ..facts import process
from ..kernels import introspect
from ..kernels.launch import Attempt
from ..store.decision import SHARED
from . import wrapper_outcomes
from .steps import StepFailed, Steps
from .wrapper_tiles import IN_USE, MEMORY, Call, declaration_of, running

log = logging.getLogger(__name__)
_UNKNOWN = object()


def in_use(engine) -> bool:
    """Whether a call of a declared wrapper needs bookkeeping (:data:`IN_USE`)."""
    table = engine.memory.table(MEMORY)
    in_use = table.get(IN_USE)
    if in_use is None:
        try:
            in_use = wrapper_outcomes.tiles_stored(engine.settings)
        except Exception:  # no store to read: only what this install learns
            log.debug("smemguard: could not read the decision cache for tiles", exc_info=True)
            in_use = False
        in_use = table.setdefault(IN_USE, in_use)  # tiles learnt meanwhile stay in use
    return in_use


def _overflow(error: BaseException) -> bool:
    from triton.runtime.errors import OutOfResources

    return isinstance(error, OutOfResources) and error.name == SHARED


def rerun_on_overflow(*choices, fallback: Callable[..., Any] | None = None) -> Callable[[Callable], Callable]:
    """Declare the decorated wrapper safe to run again from its start when the first launch of a kernel whose tiles
    one of ``choices`` (``smemguard.tile_choice`` functions, ``smemguard.tiles_at_launch`` kernels) chose cannot
    fit (the contract: :mod:`.wrapper_tiles`). ``fallback``: called with the wrapper's own arguments when not
    even the smallest tiles fit, it computes the wrapper's result another way (torch), or returns
    ``NotImplemented`` for arguments it does not cover (the caller then gets its own error)."""
    declarations = tuple(declaration_of(choice) for choice in choices)
    if not declarations or None in declarations:
        raise TypeError("rerun_on_overflow takes the smemguard.tile_choice functions or smemguard.tiles_at_launch "
                        "kernels the wrapper chooses tiles with")
    if fallback is not None and not callable(fallback):
        raise TypeError(f"fallback must be callable, not {type(fallback).__name__}")

    def decorate(wrapper: Callable) -> Callable:
        name = introspect.callable_name(wrapper)

        @functools.wraps(wrapper)
        def rerunnable(*args, **kwargs):
            engine = process.installed_engine()
            if engine is None or engine.settings.observe_only:
                return wrapper(*args, **kwargs)
            if in_use(engine):
                return _run(wrapper, name, declarations, fallback, engine, args, kwargs)
            try:
                return wrapper(*args, **kwargs)
            except Exception as error:
                if not _overflow(error):
                    raise
                failure = error
            # Outside the except block: the caller's error, if it stands, is raised unchained.
            return _run(wrapper, name, declarations, fallback, engine, args, kwargs, failure)

        return rerunnable

    return decorate


def _recorded_call(wrapper: Callable, name: str, declarations: tuple, engine, args: tuple, kwargs: dict
                   ) -> tuple[Any, BaseException | None, Call]:
    """(result, the shared-memory overflow the call raised or None, the tiles chosen in it)."""
    outer, call = running.call, Call(name, engine, declarations)
    running.call = call
    try:
        return wrapper(*args, **kwargs), None, call
    except Exception as error:
        if not _overflow(error):
            raise
        return None, error, call
    finally:
        running.call = outer


def _run(wrapper: Callable, name: str, declarations: tuple, fallback, engine, args: tuple, kwargs: dict,
         unrecorded: BaseException | None = None):
    """The call, run again with smaller tiles while a declaration's kernel is the launch that does not fit.
    ``unrecorded``: the overflow of a first call made without bookkeeping, run again to see the tiles it chose
    (the contract makes that safe: it failed at its first launch)."""
    if unrecorded is not None:
        _put_in_place(declarations, unrecorded, engine)
    result, error, call = _recorded_call(wrapper, name, declarations, engine, args, kwargs)
    if error is None:
        return result
    if unrecorded is None and _put_in_place(declarations, error, engine):  # its tiles were not in the call's books
        unrecorded = error
        result, error, call = _recorded_call(wrapper, name, declarations, engine, args, kwargs)
        if error is None:
            return result
    original, started, steps, failed, step = unrecorded or error, time.perf_counter(), Steps(name), [], None
    with steps.skippable("read the failed launch"):
        step = _failed_choice(declarations, call, error, engine)
    if step is None:
        raise original  # not a launch of a declared kernel at the tiles declared for it: the caller's error
    declaration, shape, tiles, kernel = step
    known = declaration.exhausted(engine, name, shape)
    if known is not None:  # decided and recorded before in this process
        return wrapper_outcomes.nothing_fits(known, fallback, original, args, kwargs)
    outcome = wrapper_outcomes.Outcome(wrapper, name, declaration, kernel, shape, original, failed, None, started,
                                       engine, steps)
    while True:
        failed.append(Attempt(declaration.label(tiles), error.required, error.limit, False))
        smaller = declaration.smaller(tiles, shape)
        if smaller is None:  # nothing smaller may run: the wrapper's fallback, or its own tiles again and its error
            outcome.least = call.least
            reason = None
            with steps.skippable("explain the failure"):
                reason = outcome.reason(fallback, error)
            if reason is not None:
                with steps.skippable("remember the failure"):
                    declaration.exhaust(engine, name, shape, reason)
            return outcome.decided(reason, fallback, args, kwargs)
        try:
            with steps.required("learn the tiles"):
                declaration.learn(engine, name, shape, smaller)
        except StepFailed:
            raise original from None
        result, error, call = _recorded_call(wrapper, name, declarations, engine, args, kwargs)
        if error is None:
            break
        step = None
        with steps.skippable("read the failed launch"):
            step = _failed_choice(declarations, call, error, engine)
        if step is None or step[:2] != (declaration, shape):
            raise error  # a later launch failed after the kernel ran: the call is not run again
        tiles = step[2]
    outcome.reduced(smaller)
    return result


def _put_in_place(declarations: tuple, error, engine) -> bool:
    """Put in place the declarations of the kernel whose launch raised ``error`` that a pack held back
    (:attr:`.wrapper_tiles.Declaration.put_in_place`): True when one was. The contract makes running the call again
    to see its tiles safe: it failed at its first launch."""
    kernel, _ = _failed_launch(error, engine)
    held = _held_back(declarations, kernel)
    for declaration in held:
        try:
            declaration.put_in_place()
        except Exception:  # the call's own error stands, as for a kernel nothing declared
            log.warning("smemguard: could not put the declaration of %s in place", declaration.name, exc_info=True)
            return False
    return bool(held)


def _held_back(declarations: tuple, jit) -> list:
    """The declarations of ``jit`` among ``declarations`` that a pack holds back."""
    return [declaration for declaration in declarations if declaration.put_in_place is not None
            and jit is not None and declaration.declares(jit)]


def _failed_choice(declarations: tuple, call: Call, error, engine) -> tuple | None:
    """(declaration, shape class, tiles, kernel) when ``error`` came from a launch of a declared kernel with the
    tiles a declaration answered in ``call`` (each passed by name); else None."""
    kernel, launched = _failed_launch(error, engine)
    chosen = _chosen(call, kernel, launched, declarations)
    return None if chosen is None else (*chosen, kernel)


def _chosen(call: Call, jit, launched: dict, declarations: tuple | None = None) -> tuple | None:
    """(declaration, shape class, tiles) answered in ``call`` for this launch of ``jit`` with the ``launched``
    constexprs, by one of ``declarations`` (None: any); else None."""
    return next(((declaration, shape, tiles) for declaration, shape, tiles in call.chosen
                 if (declarations is None or declaration in declarations)
                 and declaration.declares(jit)
                 and all(launched.get(name, _UNKNOWN) == tile for name, tile in zip(declaration.tiles, tiles))
                 and declaration.took(shape, launched)),
                None)


def chooses_again(jit, launched: dict, least: int | None) -> bool:
    """Whether a declared wrapper running on this thread chose the tiles of this launch of ``jit`` that no stage
    count fits (the launch guard asks): it then chooses again and records the outcome, and the guard re-raises
    with no record of its own. ``least``: the least bytes the guard's candidates needed, for that record."""
    call = running.call
    if call is None:
        return _first_call_on_stack(jit)
    if _chosen(call, jit, launched) is None:
        return bool(_held_back(call.declarations, jit))  # put in place, the call runs again and records
    call.least = least
    return True


def _first_call_on_stack(jit) -> bool:
    """A declared wrapper's call made without bookkeeping (nothing learnt yet: a healthy call costs a ``try``) is
    on this thread's stack, declared for ``jit``: it runs again with bookkeeping, which checks the tiles."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "rerunnable" and frame.f_code.co_filename == __file__:
            declarations = frame.f_locals.get("declarations", ())
            return any(declaration.declares(jit) for declaration in declarations)
        frame = frame.f_back
    return False


def _failed_launch(error, engine) -> tuple[Any, dict]:
    """(the Triton kernel whose launch raised ``error``, its arguments by the kernel's parameter names), as the
    launch guard saw that launch (``engine.notes.failed_launch``); (None, {}) for an error no guarded launch
    raised."""
    kernel, _, args, kwargs = engine.notes.failed_launch(error) or (None, None, (), {})
    jit = introspect.jit_function(kernel) if kernel is not None else None
    if jit is None or not hasattr(jit, "arg_names"):
        return None, {}
    return jit, {**dict(zip(jit.arg_names, args)), **(kwargs or {})}

