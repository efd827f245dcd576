"""The one guard around smemguard's own steps while it handles a failure (sentry's rule: our errors
are swallowed, the user's exception is never replaced).

Recovery and the wrapper-level patches run each step of theirs inside ``with steps.required(name):`` or
``with steps.skippable(name):`` (as sentry's ``capture_internal_exceptions``: the call stays visible where it is
made). A step that raises is smemguard's bug: it is logged once per (step, kernel) with its traceback, counted in
the incident record (``internal_errors``, ``internal_steps``), and then either the code after the block goes on
with what it had before the step (a skippable step only saves work, such as reusing another thread's decision),
or :class:`StepFailed` ends the handling, whose caller raises the user's own error: never ours, and never one that
recovery could have avoided.
"""

from __future__ import annotations

import logging

from ..facts import process

log = logging.getLogger(__name__)


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

    def required(self, step: str) -> "_Step":
        """A block recovery cannot go on without: when it raises, :class:`StepFailed` instead."""
        return _Step(self, step, required=True)

    def skippable(self, step: str) -> "_Step":
        """A block that only saves work: when it raises, the exception is swallowed (logged and counted)."""
        return _Step(self, step, required=False)

    def note(self, step: str, consequence: str = "the original error is raised", error: BaseException | None = None
             ) -> None:
        """Count and log ``error`` (default: the exception being handled) as a failure of ``step``."""
        self.failed.append(step)
        process.warn_once(log, ("internal", step, self.subject),
                          "smemguard: internal error in step %r for %s; %s (smemguard's bug: please report it)",
                          step, self.subject, consequence, exc_info=error if error is not None else True)


class _Step:
    """One step of :class:`Steps` as a ``with`` block."""

    def __init__(self, steps: Steps, step: str, *, required: bool):
        self.steps, self.step, self.required = steps, step, required

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        # KeyboardInterrupt and exits are not our bugs; an inner required step's failure is noted already
        if not isinstance(error, Exception) or isinstance(error, StepFailed):
            return False
        self.steps.note(self.step, "the original error is raised" if self.required else "that step is skipped",
                        error)
        if self.required:
            raise StepFailed(self.step) from None
        return True
