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

class FewerStages:
    """The one search for fewer stages, every path's: the stage counts to compile below a kernel that needs
    ``required`` bytes at ``stages`` over ``limit``, most stages first. ``first`` is the first count to try (one
    fewer by default; the ladder predicts it from its calibrated estimate); after it, the count the bytes one stage
    was measured to cost predict to fit (:func:`next_stage_count`), one fewer again while a compile still overflows
    or did not compile. The caller compiles each count it is given and tells :meth:`measured` what it needs; the
    search ends when a count fits, at one stage, or when fewer stages saved nothing (:attr:`inert`: no count will
    fit)."""

    def __init__(self, stages: int, required: int, limit: int, first: int | None = None):
        self.limit = limit
        self.previous = (stages, required)
        self.count = stages - 1 if first is None else first
        self.inert = False  # fewer stages measured no fewer bytes: (stages, bytes) before and after
        self.done = False

    def __iter__(self) -> Iterator[int]:
        while not self.done and self.count >= 1:
            count = self.count
            yield count
            if self.count == count and not self.done:  # the caller told nothing: try one fewer
                self.count -= 1

    def measured(self, count: int, shared: int | None) -> None:
        """``count`` stages needed ``shared`` bytes (None: the compile failed, one fewer is tried next)."""
        if shared is None:
            self.count = count - 1
        elif shared <= self.limit:
            self.done = True
        else:
            following = next_stage_count(self.previous, count, shared, self.limit)
            if following is None:
                self.inert, self.done = (self.previous, (count, shared)), True
            else:
                self.previous, self.count = (count, shared), following

