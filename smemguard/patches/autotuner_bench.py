"""Autotuner timings per tuning key: wraps ``triton.runtime.autotuner.Autotuner._bench``.

Why: when a tuned config overflows at launch, recovery prefers the next config the
autotuner itself timed fastest *for that key*. Triton keeps only the timings of the last
key it tuned (``configs_timings``), so we note each measurement as ``_bench`` returns it.
The wrapper observes and returns ``_bench``'s result untouched: overflowing configs stay
infinitely slow to the autotuner (it also tells the compile-time patch that it is inside
benchmarking, where remembered decisions must not apply). It runs only while tuning, never
on a launch.

Timings are filed under the key the tuner itself uses (:func:`smemguard.layers.key_for`:
Triton's, or a registered library tuner's such as FlagGems' ``LibTuner``, which inherits
``_bench``).

Checked against Triton 3.4.0, 3.5.1, 3.6.0, 3.7.1, 3.8.0 and 3.9.0:
``_bench(self, *args, config, **meta)`` returns a list of quantiles (median first) or
``[inf, inf, inf]``, and the tuning key is computed the same way in every one of them.
"""

from __future__ import annotations

import logging
import threading
import weakref

from .. import layers
from . import find_wrapper, unwrap, wrap

log = logging.getLogger(__name__)

MODULE = "triton.runtime.autotuner"
TARGET = "Autotuner._bench"

# autotuner -> {tuning key -> {config -> median ms}}
_timings: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_inside = threading.local()


def benchmarking() -> bool:
    """True while this thread is inside ``Autotuner._bench``: nothing may be changed there."""
    return getattr(_inside, "depth", 0) > 0


def _record(wrapped, instance, args, kwargs):
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _inside.depth -= 1
    try:
        median = result[0] if isinstance(result, (list, tuple)) else result
        meta = {name: value for name, value in kwargs.items() if name != "config"}
        key = layers.key_for(instance, args, meta)
        with _lock:
            _timings.setdefault(instance, {}).setdefault(key, {})[kwargs["config"]] = float(median)
    except Exception:  # bookkeeping only: never disturb tuning
        log.debug("could not record an autotuner timing", exc_info=True)
    return result


def timings(autotuner, key: tuple) -> dict:
    """{config: median ms} measured for ``key`` (inf for configs that failed), possibly empty."""
    with _lock:
        return dict(_timings.get(autotuner, {}).get(key, {}))


def patch() -> None:
    if not is_patched():
        wrap(MODULE, TARGET, _record)


def unpatch() -> None:
    unwrap(MODULE, TARGET, _record)


def is_patched() -> bool:
    return find_wrapper(MODULE, TARGET, _record) is not None
