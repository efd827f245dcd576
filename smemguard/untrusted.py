"""Reading what smemguard did not write in this process: incident files, decision files, records.

Such input may be truncated, hand-edited, binary or from another version. Nothing here raises
on it: a check returns one problem line naming the field, the value found and what is
expected, and every value shown back to the user goes through :func:`shown`, so a corrupt
file can neither break the output nor inject terminal control characters into it.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from . import files

#: Longer lines are skipped, not read into memory (a record is a few KiB).
MAX_LINE = 16 * 1024 * 1024
#: An incident file (after gunzip) is read up to this many bytes: a gzip bomb ends there.
MAX_LINES_BYTES = 4 * 2**30


def shown(value: Any, limit: int = 80) -> str:
    """``value`` as JSON on one printable line (non-ASCII and control characters escaped), cut at ``limit``."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def printable(text: str) -> str:
    """Text from a file (a kernel name, a path) safe to print on one line: control characters and
    lone surrogates escaped, everything else as it is."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@dataclass(frozen=True)
class Expect:
    """What a field must hold: ``what`` in words (for the problem line) and a test that never raises."""

    what: str
    test: Callable[[Any], bool]

    def problem(self, name: str, value: Any) -> str | None:
        return None if self.test(value) else f"{name!r} is {shown(value)}, expected {self.what}"

    def or_null(self) -> "Expect":
        return Expect(f"{self.what} or null", lambda value: value is None or self.test(value))


def _integer(value: Any, minimum: int | None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def _bound(minimum: int | None) -> str:
    return "" if minimum is None else f" >= {minimum}"


def integer(minimum: int | None = None) -> Expect:
    return Expect("an integer" + _bound(minimum), lambda value: _integer(value, minimum))


def integers(minimum: int | None = None, lengths: range | None = None) -> Expect:
    """A list of integers (each ``>= minimum``), its length in ``lengths``."""
    what = "a list of integers" + _bound(minimum)
    if lengths is not None:
        what += f" ({lengths.start} to {lengths.stop - 1} of them)"
    return Expect(what, lambda value: isinstance(value, list) and all(_integer(v, minimum) for v in value)
                  and (lengths is None or len(value) in lengths))


TEXT = Expect("text", lambda value: isinstance(value, str))
NAME = Expect("non-empty text", lambda value: isinstance(value, str) and value.strip() != "")
OBJECT = Expect("an object {...}", lambda value: isinstance(value, dict))
NUMBER = Expect("a number >= 0", lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and value >= 0)
SCALAR = Expect("a number, true/false, text or null",
                lambda value: value is None or isinstance(value, (int, float, str)))


def one_of(*choices: str) -> Expect:
    return Expect("one of " + ", ".join(choices), lambda value: isinstance(value, str) and value in choices)


def problems(record: Mapping, required: Mapping[str, Expect], optional: Mapping[str, Expect] | None = None,
             prefix: str = "") -> list[str]:
    """One line per missing required field and per field of the wrong type (optional ones only when present)."""
    found = []
    for name, expect in required.items():
        if name not in record:
            found.append(f"no {prefix + name!r} field ({expect.what})")
        elif (problem := expect.problem(prefix + name, record[name])) is not None:
            found.append(problem)
    for name, expect in (optional or {}).items():
        if name in record and (problem := expect.problem(prefix + name, record[name])) is not None:
            found.append(problem)
    return found


class _NotStrict(ValueError):
    """What strict JSON (RFC 8259) has no room for, though Python's parser takes it."""


def _no_constant(name: str):
    raise _NotStrict(f"{name} is not a JSON number")


def _unique_keys(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicate = next(key for key in keys if keys.count(key) > 1)
        raise _NotStrict(f"the key {shown(duplicate, 40)} appears twice in one object")
    return dict(pairs)


def loads(text: str) -> tuple[Any, str | None]:
    """(the JSON value of ``text``, None), or (None, why it is not strict JSON): ``NaN``, ``Infinity`` and a key
    repeated in one object are refused, as every strict parser refuses them (Python's alone takes them)."""
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys), None
    except json.JSONDecodeError as error:
        return None, f"not JSON ({error.msg} at column {error.colno})"
    except _NotStrict as error:
        return None, f"not strict JSON ({error})"
    except (ValueError, RecursionError) as error:  # a 5000-digit number, nesting too deep
        return None, f"not JSON ({type(error).__name__}: {str(error).splitlines()[0][:80]})"


@dataclass(frozen=True)
class Line:
    """One line of a JSON-lines file: its value when it is JSON, else why it is not."""

    number: int
    value: Any = None
    problem: str | None = None


def _raw_lines(stream) -> Iterator[tuple[int, bytes | None]]:
    """Numbered lines; None for one longer than MAX_LINE (read past, not kept). OverflowError past
    MAX_LINES_BYTES."""
    number = total = 0
    while True:
        chunk = stream.readline(MAX_LINE)
        total += len(chunk)
        if total > MAX_LINES_BYTES:
            raise OverflowError(number)
        if not chunk:
            return
        number += 1
        if len(chunk) == MAX_LINE and not chunk.endswith(b"\n"):
            while chunk and not chunk.endswith(b"\n"):
                chunk = stream.readline(MAX_LINE)
                total += len(chunk)
                if total > MAX_LINES_BYTES:
                    raise OverflowError(number)
            yield number, None
        else:
            yield number, chunk


def json_lines(path: Path) -> Iterator[Line]:
    """The lines of a JSON-lines file (gzip too), blank ones left out. A file that cannot be read
    (not a regular file among them: a FIFO is never waited on), a gzip stream that breaks off, or
    more than MAX_LINES_BYTES, ends with a Line numbered 0 saying so; never raises."""
    number = 0
    try:
        with files.open_read(path) as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            stream = gzip.GzipFile(fileobj=raw) if gzipped else raw
            for number, chunk in _raw_lines(stream):
                if chunk is None:
                    yield Line(number, problem=f"longer than {MAX_LINE // 2**20} MiB")
                    continue
                try:
                    text = chunk.decode("utf-8")
                except UnicodeDecodeError as error:
                    yield Line(number, problem=f"not UTF-8 text (byte {error.start})")
                    continue
                if text.strip():
                    value, problem = loads(text)
                    yield Line(number, value, problem)
    except OverflowError:
        yield Line(0, problem=f"holds more than {MAX_LINES_BYTES // 2**30} GiB (after gunzip); the lines before "
                              f"line {number + 1} are read")
    except files.Refused as refusal:
        yield Line(0, problem=str(refusal).removeprefix(f"{path} "))
    except IsADirectoryError:
        yield Line(0, problem="is a directory, not an incident file")
    except FileNotFoundError:
        yield Line(0, problem="no such file")
    except (EOFError, zlib.error, gzip.BadGzipFile) as error:
        yield Line(0, problem=f"the gzip stream is broken after line {number} ({error}); the lines before it are read")
    except OSError as error:
        yield Line(0, problem=f"cannot read it ({error.strerror or error})")
