"""The one guard around smemguard's own steps while it handles a failure (sentry's rule: our errors
are swallowed, the user's exception is never replaced).

Recovery and the wrapper-level patches run each step of theirs through :meth:`Steps.run`. A step
that raises is smemguard's bug: it is logged once per (step, kernel) with its traceback, counted in
the incident record (``internal_errors``, ``internal_steps``), and then either the step's stand-in
is used (a step that only saves work, such as reusing another thread's decision, is skipped) or
:class:`StepFailed` ends the handling, whose caller raises the user's own error: never ours, and
never one that recovery could have avoided.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from . import runtime

log = logging.getLogger(__name__)

#: ``otherwise`` for a step that recovery cannot go on without.
REQUIRED = object()


class StepFailed(Exception):
    """A required step of smemguard's failed; the caller raises the user's error instead."""

    def __init__(self, step: str):
        super().__init__(step)
        self.step = step


class Steps:
    """smemguard's own steps in handling one failure of ``subject`` (a kernel's name)."""

    def __init__(self, subject: str):
        self.subject = subject
        self.failed: list[str] = []

    def run(self, step: str, function: Callable[..., Any], *args, otherwise: Any = REQUIRED, **kwargs) -> Any:
        """``function(*args, **kwargs)``; when it raises: ``otherwise()`` where given (a callable), else
        :class:`StepFailed`."""
        try:
            return function(*args, **kwargs)
        except Exception:
            self.note(step, "the original error is raised" if otherwise is REQUIRED else "that step is skipped")
        if otherwise is REQUIRED:
            raise StepFailed(step)
        return otherwise()

    def note(self, step: str, consequence: str = "the original error is raised") -> None:
        """Count and log the exception being handled as a failure of ``step``."""
        self.failed.append(step)
        runtime.warn_once(log, ("internal", step, self.subject),
                            "smemguard: internal error in step %r for %s; %s (smemguard's bug: please report it)",
                            step, self.subject, consequence, exc_info=True)
