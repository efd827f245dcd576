"""What a candidate is, shared by every path that compiles one: the launch ladder (:mod:`smemguard.engine.ladder`), the
compile-time core (:mod:`.compile_fit`) and torch.compile's load-time recovery (:mod:`.inductor`).

A candidate is a config with other options (and the parameters that follow them); the steps are fewer warps when
threads do not fit and fewer stages when shared memory does not, the stage count chosen from the bytes one stage
was measured to cost; one budget of compiles bounds an incident on every path, since compiles take seconds and a
kernel with a long config list must not stall a server for minutes. What is a path's own stays there: racing and
the calibrated estimate (the ladder), halving blocks (Inductor).
"""

from __future__ import annotations

import copy
import math
from typing import Iterator

#: Candidate compiles allowed for one incident.
MAX_CANDIDATES = 16


def variant(config, kwargs: dict | None = None, **options):
    """``config`` with other options (``num_stages=2``) and kwargs, leaving the original untouched."""
    changed = copy.copy(config)
    changed.kwargs = {**config.kwargs, **(kwargs or {})}  # its own dict: a shallow copy would share the original's
    for option, value in options.items():
        setattr(changed, option, value)
    return changed


def fewer_warps(warps: int) -> Iterator[int]:
    """Half as many warps each step, down to one: for a kernel whose threads do not fit."""
    warps //= 2
    while warps >= 1:
        yield warps
        warps //= 2


def next_stage_count(previous: tuple[int, int], stages: int, shared: int, limit: int) -> int | None:
    """The stage count to compile after ``stages`` measured ``shared`` bytes over ``limit``, ``previous`` being the
    (stages, bytes) measured before it: the most stages the bytes one stage costs predict to fit, fewer than
    ``stages``, one at least (without pipelining a kernel may need far less than the line predicts); 0 when
    ``stages`` was one. None when fewer stages saved nothing: no count will fit."""
    per_stage = (previous[1] - shared) / (previous[0] - stages)
    if per_stage <= 0:
        return None
    predicted = min(stages - 1, stages - math.ceil((shared - limit) / per_stage))
    return max(predicted, 1) if stages > 1 else 0
