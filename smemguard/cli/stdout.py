"""Every command's stdout, and the one way a command ends when its reader leaves (``smemguard cache show | head
-1``): quietly, with exit status 0, whatever the command was doing."""

from __future__ import annotations

import contextlib
import os
import sys


class ReaderLeft(BaseException):
    """The reader of stdout went away. No OSError: a command's own handling of its files (one line, exit 2) must
    not take it for one of theirs."""


class _Stdout:
    """``sys.stdout`` while a command runs: what it writes, and :class:`ReaderLeft` once nobody reads it."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._unless_the_reader_left(self._stream.write, text)

    def flush(self) -> None:
        self._unless_the_reader_left(self._stream.flush)

    def _unless_the_reader_left(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise ReaderLeft from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def until_the_reader_leaves():
    """While a command runs, its stdout raises :class:`ReaderLeft` once its reader left; so does the flush at the
    end of the block, where a reader that left is seen rather than at exit. A closed stdout (None) stays so."""
    stream = sys.stdout
    sys.stdout = _Stdout(stream) if stream is not None else None
    try:
        yield
        if sys.stdout is not None:
            sys.stdout.flush()
    finally:
        sys.stdout = stream


def discard_the_rest() -> None:
    """What is left of stdout goes nowhere, once its reader left: the flush at exit says nothing either."""
    with open(os.devnull, "w") as nowhere:
        os.dup2(nowhere.fileno(), sys.stdout.fileno())
