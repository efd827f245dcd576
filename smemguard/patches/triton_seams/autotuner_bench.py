"""Autotuner timings per tuning key: wraps ``triton.runtime.autotuner.Autotuner._bench``.

Why: when a tuned config overflows at launch, recovery prefers the next config the
autotuner itself timed fastest *for that key*. Triton keeps only the timings of the last
key it tuned (``configs_timings``), so each measurement is noted in :mod:`smemguard.facts.process`
as ``_bench`` returns it. The wrapper observes and returns ``_bench``'s result untouched:
overflowing configs stay infinitely slow to the autotuner (it also marks the thread as
benchmarking, where the compile-time patch must not apply remembered decisions). It runs
only while tuning, never on a launch.

Timings are filed under the key the tuner itself uses (:func:`smemguard.kernels.tuners.key_for`:
Triton's, or a registered library tuner's such as FlagGems' ``LibTuner``, which inherits
``_bench``).

In every release checked, ``_bench(self, *args, config, **meta)`` returns a list of quantiles (median first) or
``[inf, inf, inf]``, and the tuning key is computed the same way in every one of them.
"""

from __future__ import annotations

import logging

from ...facts import process
from ...kernels import tuners
from .. import TRITON, TRITON_CHECKED, Layer, Patch, wrapt_layer

log = logging.getLogger(__name__)


def _record(wrapped, instance, args, kwargs):
    with process.benchmarking.scope(kwargs.get("config", True)):  # a compile it causes records the config timed
        result = wrapped(*args, **kwargs)
    try:
        median = result[0] if isinstance(result, (list, tuple)) else result
        meta = {name: value for name, value in kwargs.items() if name != "config"}
        engine = PATCH.engine
        if engine is not None:
            engine.notes.note_timing(instance, tuners.key_for(instance, args, meta), kwargs["config"], float(median))
    except Exception:  # bookkeeping only: never disturb tuning
        log.debug("could not record an autotuner timing", exc_info=True)
    return result


PATCH = Patch(__name__, target="triton.runtime.autotuner.Autotuner._bench", modules=("triton",), supported=TRITON,
              checked=TRITON_CHECKED, observe_safe=True,  # only observes
              layers={Layer("triton.runtime.autotuner", "Autotuner._bench"): wrapt_layer(_record)})
