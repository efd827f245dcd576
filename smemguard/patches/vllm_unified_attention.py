"""vLLM's unified attention: a smaller ``TILE_SIZE`` for the calls whose attention kernel does not fit.

Why: ``unified_attention`` (the Triton attention backend, vLLM's default on Turing) picks the
KV tile with ``_get_tile_size(head_size, sliding_window, element_size, is_prefill)`` and
launches ``kernel_unified_attention`` with a tuple grid, then, on the 3D (split-KV decode)
path, ``reduce_segments`` with the same tile. Head size 512 in fp16 (Gemma 4's global
layers) needs 98304 B on sm_75 at every stage count, and head size 256 in fp32 (Gemma 3 on a
T4, where vLLM runs it in fp32) 81920 B: more than a T4's 65536. With a 16-wide tile they
need 65536 and 49152. The engine cannot help: the stage ladder changes nothing on sm_75, and
it never changes a constexpr of a plain kernel launched with a tuple grid.

Why a smaller tile is safe: ``TILE_SIZE`` is the width of the KV slice each step of the
kernel's online softmax reads; the grid does not depend on it (the 2D grid is query blocks x
KV heads, the 3D one adds the segment count), every KV load is masked against the sequence
length, and ``reduce_segments`` reads it only to find the same segment boundaries the
attention kernel used, which is why both must see the same value. The results equal the
larger tile's up to the order of floating-point additions in the softmax (not bitwise).
The smallest tile is 16 (``tl.dot`` needs K >= 16), 32 for fp8 queries, as vLLM says.

What it does: wraps ``unified_attention`` (and rebinds it in the modules that imported it by
name, such as the Triton backend). When a call raises ``OutOfResources`` for shared memory,
it finds which launch of that call raised it, from the traceback: the frame directly below
``unified_attention``'s is the launcher ``kernel[grid]`` returned, holding the kernel and
its keyword arguments. Only when that kernel is ``kernel_unified_attention`` -- the first
launch of the call, so nothing of it has run -- and its ``TILE_SIZE`` is the one
``_get_tile_size`` gives for the call's shape class, it halves the tile for that shape class
and calls ``unified_attention`` again, down to the smallest tile. ``_get_tile_size`` is
wrapped (from the first such decision on) to return the smaller tile for that shape class,
so the wrapper's own choice changes: the attention kernel and ``reduce_segments`` get the
same value, and later calls of that class pick it at once, with no failed launch. A failure
of any other launch (``reduce_segments``, after the attention kernel ran) is never retried.
One incident record (``"action": "tile_reduced"``) per shape class, after the engine's own
record of the failed launch.

Not applied in ``SMEMGUARD=observe``: it changes what runs.

Checked against vLLM 0.32.0 and 0.33.0 (``vllm/v1/attention/ops/triton_unified_attention.py``):
both choose ``TILE_SIZE_PREFILL``/``TILE_SIZE_DECODE`` with ``_get_tile_size`` before any
launch, launch ``kernel_unified_attention[grid](...)`` first with keyword arguments only, and
pass ``TILE_SIZE_DECODE`` to ``reduce_segments``. (Their INT4 path hands the call to another
kernel before that; its tile is not changed.) On Blackwell (sm_100) with head size 256 the
wrapper overrides the prefill tile after ``_get_tile_size``: such a launch does not match the
check above and is left to the engine.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import time

from . import find_wrapper, rebind, unwrap, wrap
from .. import incidents, runtime
from ..versions import Supported

log = logging.getLogger(__name__)

TARGET_MODULE = "vllm.v1.attention.ops.triton_unified_attention"
WRAPPER = "unified_attention"
TILE_CHOICE = "_get_tile_size"
KERNEL = "kernel_unified_attention"
TARGET = f"{TARGET_MODULE}.{WRAPPER}"
TARGET_MODULES = (TARGET_MODULE,)
SUPPORTED = Supported("vllm", (0, 32), (0, 34), label="vLLM")
OBSERVE_SAFE = False  # changes the tile that runs

_TILE_CHOICE_PARAMETERS = ("head_size", "sliding_window", "element_size", "is_prefill")
_KERNEL_PARAMETERS = {"query_ptr", "TILE_SIZE", "HEAD_SIZE", "SLIDING_WINDOW", "IS_3D"}
#: ``tl.dot`` needs K >= 16; vLLM keeps fp8 (one-byte) queries at 32 or more.
_SMALLEST_TILE = {1: 32}
_DEFAULT_SMALLEST_TILE = 16

_lock = threading.Lock()
#: (device, limit, head_size, sliding_window, element_size, is_prefill) -> the tile that fits
_tiles: dict[tuple, int] = {}
_log_path = None
_out_of_resources: type = Exception  # Triton's OutOfResources, bound at patch time
_wrapper_code = None  # the code of vLLM's unified_attention, bound at patch time


def applies(settings) -> bool:
    return True


def patch(context) -> None:
    """Wrap ``unified_attention`` in its module and in the modules that imported it by name."""
    global _log_path, _out_of_resources, _wrapper_code
    from triton.runtime.errors import OutOfResources

    _log_path, _out_of_resources = context.settings.log_path, OutOfResources
    if is_patched():
        return
    module = sys.modules.get(TARGET_MODULE)
    if module is None:
        return
    kernel = getattr(module, KERNEL, None)
    if not hasattr(kernel, "arg_names"):  # a vLLM build without a usable Triton: nothing can overflow
        log.debug("smemguard: %s.%s is not a Triton kernel; %s left as it is", TARGET_MODULE, KERNEL, WRAPPER)
        return
    _check(module, kernel)
    _wrapper_code = inspect.unwrap(getattr(module, WRAPPER)).__code__
    wrap(TARGET_MODULE, WRAPPER, _with_a_tile_that_fits)
    wrapper = getattr(module, WRAPPER)
    rebind(WRAPPER, wrapper.__wrapped__, wrapper)


def unpatch() -> None:
    """Remove both layers, here and in the callers, and forget the tiles learnt."""
    with _lock:
        _tiles.clear()
    if TARGET_MODULE not in sys.modules:
        return
    unwrap(TARGET_MODULE, TILE_CHOICE, _capped_tile_size)
    wrapper = find_wrapper(TARGET_MODULE, WRAPPER, _with_a_tile_that_fits)
    if wrapper is not None and unwrap(TARGET_MODULE, WRAPPER, _with_a_tile_that_fits):
        rebind(WRAPPER, wrapper, wrapper.__wrapped__)


def is_patched() -> bool:
    return TARGET_MODULE in sys.modules and find_wrapper(TARGET_MODULE, WRAPPER, _with_a_tile_that_fits) is not None


def _check(module, kernel) -> None:
    """Raise when the module is not laid out as the versions this was checked against."""
    choice = getattr(module, TILE_CHOICE, None)
    wrapper = getattr(module, WRAPPER, None)
    if choice is None or wrapper is None:
        raise RuntimeError(f"{TARGET_MODULE} has no {TILE_CHOICE} or {WRAPPER}")
    if tuple(inspect.signature(choice).parameters) != _TILE_CHOICE_PARAMETERS:
        raise RuntimeError(f"{TARGET_MODULE}.{TILE_CHOICE}{inspect.signature(choice)} is not "
                           f"({', '.join(_TILE_CHOICE_PARAMETERS)})")
    missing = _KERNEL_PARAMETERS - set(kernel.arg_names)
    if missing:
        raise RuntimeError(f"{TARGET_MODULE}.{KERNEL} has no parameter {', '.join(sorted(missing))}")


# -- the shape class and its tile ------------------------------------------------------------


def _shape_class(head_size, sliding_window, element_size, is_prefill) -> tuple:
    """What ``_get_tile_size`` decides on, on this device and limit."""
    device = runtime.current_device()
    return device, runtime.effective_limit(device), head_size, sliding_window, element_size, bool(is_prefill)


def _called_by(code) -> bool:
    """Whether the Python caller of the function being wrapped (past wrapt's frames) runs ``code``."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("wrapt"):
        frame = frame.f_back
    return frame is not None and frame.f_code is code


def _capped_tile_size(wrapped, instance, args, kwargs):
    """``_get_tile_size``, lowered to the tile learnt for the shape class (installed once one is learnt).

    Only for ``unified_attention`` itself: its INT4 path (another kernel) asks the same function.
    """
    try:
        if _called_by(_wrapper_code):
            return _wrapper_tile(wrapped, *args, **kwargs)
    except Exception:  # bookkeeping only: vLLM's own choice stands
        log.debug("smemguard: could not look up a learnt tile", exc_info=True)
    return wrapped(*args, **kwargs)


def _wrapper_tile(choose, head_size, sliding_window, element_size, is_prefill) -> int:
    """The tile ``unified_attention`` gets for these arguments: vLLM's choice, or the smaller one learnt."""
    tile = choose(head_size, sliding_window, element_size, is_prefill)
    learnt = _tiles.get(_shape_class(head_size, sliding_window, element_size, is_prefill))
    return tile if learnt is None or learnt >= tile else learnt


def _learn(shape: tuple, tile: int | None) -> None:
    """Make ``_get_tile_size`` answer ``tile`` for ``shape`` (None: vLLM's own choice again)."""
    with _lock:
        if tile is None:
            _tiles.pop(shape, None)
            return
        _tiles[shape] = tile
        if find_wrapper(TARGET_MODULE, TILE_CHOICE, _capped_tile_size) is None:
            wrap(TARGET_MODULE, TILE_CHOICE, _capped_tile_size)


# -- which launch failed ----------------------------------------------------------------------


def _failed_launch(error: BaseException, code) -> tuple | None:
    """(kernel, keyword arguments) of the ``kernel[grid](...)`` statement, in the frame running
    ``code``, that raised ``error``; None when the frame below it is not such a launcher.

    Triton's ``KernelInterface.__getitem__`` (and smemguard's guarded one) returns a closure
    whose ``self`` is the kernel and whose ``kwargs`` are the launch's keyword arguments.
    """
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code is not code:
        tb = tb.tb_next
    if tb is None or tb.tb_next is None:
        return None
    launcher = tb.tb_next.tb_frame.f_locals
    kernel, kwargs = launcher.get("self"), launcher.get("kwargs")
    return (kernel, kwargs) if isinstance(kwargs, dict) else None


def _attention_launch(error: BaseException, wrapped) -> dict | None:
    """The keyword arguments of the attention kernel's launch when that launch raised ``error``
    for shared memory; else None."""
    if getattr(error, "name", None) != "shared memory":
        return None
    launch = _failed_launch(error, _wrapper_code)
    if launch is None or launch[0] is not getattr(sys.modules[TARGET_MODULE], KERNEL):
        return None
    return launch[1]


def _smaller_tile(launch: dict) -> tuple | None:
    """(shape class, tile that failed, half of it) when the launch's tile is the one
    ``_get_tile_size`` chose for its shape class and a smaller one exists; else None."""
    element_size = launch["query_ptr"].element_size()
    arguments = (launch["HEAD_SIZE"], max(launch["SLIDING_WINDOW"], 0), element_size, not launch["IS_3D"])
    tile = launch["TILE_SIZE"]
    choose = inspect.unwrap(getattr(sys.modules[TARGET_MODULE], TILE_CHOICE))
    if _wrapper_tile(choose, *arguments) != tile:  # chosen elsewhere: not ours to change
        return None
    smaller = tile // 2
    if smaller < _SMALLEST_TILE.get(element_size, _DEFAULT_SMALLEST_TILE):
        return None
    return _shape_class(*arguments), tile, smaller


def _with_a_tile_that_fits(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    except _out_of_resources as error:
        return _retry(wrapped, args, kwargs, error)


def _retry(wrapped, args, kwargs, original):
    """Call again with halved tiles while the attention kernel is the launch that does not fit."""
    started = time.perf_counter()
    error, shape, before, failed = original, None, None, []
    while True:
        try:
            launch = _attention_launch(error, wrapped)
            step = _smaller_tile(launch) if launch is not None else None
        except Exception:  # our failure must not replace vLLM's error
            log.debug("smemguard: could not read the failed unified_attention launch", exc_info=True)
            launch = step = None
        if step is None:
            if error is original:
                raise original
            if launch is not None:  # not even the smallest tile fits: vLLM's own choice again
                _learn(shape, before)
                raise original
            raise error  # a later launch failed after the attention kernel ran: the call is not repeated
        if shape is None:
            shape, before = step[0], _tiles.get(step[0])
        failed.append({"config": f"TILE_SIZE={step[1]}", "required": error.required, "limit": error.limit,
                       "fits": False, "error": None})
        _learn(shape, step[2])
        try:
            result = wrapped(*args, **kwargs)
        except _out_of_resources as again:
            error = again
            continue
        _report(original, shape, failed, step[2], started)
        return result


def _report(error, shape: tuple, failed: list, final: int, started: float) -> None:
    try:
        device, _, head_size, sliding_window, element_size, is_prefill = shape
        record = {
            **incidents.new_record(f"{TARGET_MODULE}:{KERNEL}"),
            "launched_as": f"{TARGET_MODULE}:{WRAPPER}",
            "device": runtime.device_description(device),
            "limit": {"device": runtime.device_limit(device), "emulated": runtime.emulated_limit()},
            "resource": error.name,
            "required": error.required,
            "limit_hit": error.limit,
            "shape_class": {"head_size": head_size, "sliding_window": sliding_window, "element_size": element_size,
                            "is_prefill": is_prefill},
            "config": failed[0]["config"],
            "attempts": [*failed, {"config": f"TILE_SIZE={final}", "required": None, "limit": error.limit,
                                   "fits": True, "error": None}],
            "action": "tile_reduced",
            "final": f"TILE_SIZE={final}",
            "recovery_ms": round((time.perf_counter() - started) * 1000, 3),
        }
        incidents.emit(record, _log_path, (KERNEL, shape),
                       "smemguard: %s: %s %s > %s B with %s (head size %s, %s); %s chooses TILE_SIZE=%s "
                       "for this shape from now on", KERNEL, error.name, error.required, error.limit,
                       failed[0]["config"], head_size, "prefill" if is_prefill else "decode", WRAPPER, final)
    except Exception:
        log.warning("smemguard: could not write the incident record for %s", KERNEL, exc_info=True)
