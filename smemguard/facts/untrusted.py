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
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from . import files

#: Longer lines are skipped, not read into memory (a record is a few KiB).
MAX_LINE = 16 * 1024 * 1024
#: A file of lines is read up to this many bytes (after gunzip: a gzip bomb ends there) and this many lines that
#: are not blank (each costs a parse: a file of millions of one-byte bad lines ends there, in seconds). A million
#: records of a few KiB each fill both.
MAX_LINES_BYTES = 4 * 2**30
MAX_LINES = 1_000_000
#: Bytes taken from the stream at a time: a run of blank lines is skipped at once, never line by line.
_CHUNK = 2**20
_BLANK = re.compile(rb"[ \t\r\n\x0b\x0c]*")


def shown(value: Any, limit: int = 80) -> str:
    """``value`` as JSON on one printable line (non-ASCII and control characters escaped), cut at ``limit``."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def printable(text: str, limit: int | None = None) -> str:
    """Text from a file (a kernel name, a path) safe to print on one line: control characters and
    lone surrogates escaped, everything else as it is; cut at ``limit`` characters, saying how long it was."""
    shown = text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return shown if limit is None or len(shown) <= limit else f"{shown[:limit]}... ({len(text)} characters)"


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, in the plural but for one: "1 decision", "3 decisions"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


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


#: Bounds of the launch options a stored value (a decision, a pin) may hold: no GPU pipelines more stages, none runs
#: more than 1024 threads (32 warps of 32) per block.
MAX_STAGES = 32
MAX_WARPS = 32


def power_of_two(value: Any, most: int) -> bool:
    return _integer(value, 1) and value <= most and value & (value - 1) == 0


STAGES = Expect(f"an integer from 1 to {MAX_STAGES}", lambda value: _integer(value, 1) and value <= MAX_STAGES)
WARPS = Expect(f"a power of two from 1 to {MAX_WARPS}", lambda value: power_of_two(value, MAX_WARPS))


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


#: One decoder for every call: json.loads would build one per line, most of the cost of a short bad line.
_STRICT = json.JSONDecoder(parse_constant=_no_constant, object_pairs_hook=_unique_keys)


def loads(text: str) -> tuple[Any, str | None]:
    """(the JSON value of ``text``, None), or (None, why it is not strict JSON): ``NaN``, ``Infinity`` and a key
    repeated in one object are refused, as every strict parser refuses them (Python's alone takes them)."""
    try:
        return _STRICT.decode(text), None
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


class _Stopped(Exception):
    """Reading ends before the file does; the message says where and why."""


def _lines_before(number: int) -> str:
    return "" if number <= 1 else f"; lines 1 to {number - 1} are read"


def _lines(stream, gzipped: bool) -> Iterator[tuple[int, bytes | None]]:
    """The lines of a binary stream that are not blank, as (number, bytes); None for one longer than MAX_LINE (read
    past, never kept). _Stopped past MAX_LINES_BYTES or MAX_LINES, or where a gzip stream breaks off."""
    pending = bytearray()  # the start of the line the next chunk goes on with
    too_long = False  # that line is over MAX_LINE: read to its end, not kept
    ended = kept = read = 0  # lines ended (blank ones too), lines kept, bytes read
    while True:
        try:  # read1: what a gzip stream gives before it breaks off comes back, not lost with the error
            chunk = stream.read1(min(_CHUNK, MAX_LINES_BYTES - read + 1))
        except (EOFError, zlib.error, gzip.BadGzipFile) as error:
            raise _Stopped(f"the gzip stream is broken in line {ended + 1} ({error})"
                           f"{_lines_before(ended + 1)}") from None
        if not chunk:
            break
        read += len(chunk)
        over = read > MAX_LINES_BYTES
        chunk = chunk[:-1] if over else chunk
        start = 0
        while start < len(chunk):
            if not pending and not too_long:
                blank = _BLANK.match(chunk, start).end()
                last_newline = chunk.rfind(b"\n", start, blank)
                if last_newline >= 0:
                    ended += chunk.count(b"\n", start, last_newline + 1)
                    start = last_newline + 1
            newline = chunk.find(b"\n", start)
            if newline < 0:
                if not too_long:
                    pending += chunk[start:]
                    if len(pending) > MAX_LINE:
                        too_long = True
                        pending.clear()
                        yield ended + 1, None
                break
            line = chunk[start:newline + 1] if not pending else bytes(pending + chunk[start:newline + 1])
            pending.clear()
            ended += 1
            start = newline + 1
            if too_long:
                too_long = False
            elif len(line) > MAX_LINE:
                yield ended, None
            elif line.strip():
                kept += 1
                if kept > MAX_LINES:
                    raise _Stopped(f"holds more than {MAX_LINES:,} lines that are not blank; reading stopped "
                                   f"at line {ended}{_lines_before(ended)}")
                yield ended, line
        if over:
            raise _Stopped(f"holds more than {MAX_LINES_BYTES // 2**30} GiB"
                           f"{' after gunzip' if gzipped else ''}; reading stopped there, in line "
                           f"{ended + 1}{_lines_before(ended + 1)}")
    if pending.strip():  # the last line, with no newline after it
        ended += 1
        yield ended, bytes(pending)


def json_lines(path: Path) -> Iterator[Line]:
    """The lines of a JSON-lines file (gzip too), blank ones left out. A file that cannot be read
    (not a regular file among them: a FIFO is never waited on), a gzip stream that breaks off, or
    more than MAX_LINES_BYTES or MAX_LINES, ends with a Line numbered 0 saying so; never raises."""
    try:
        with files.open_read(path) as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            for number, chunk in _lines(gzip.GzipFile(fileobj=raw) if gzipped else raw, gzipped):
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
    except _Stopped as stop:
        yield Line(0, problem=str(stop))
    except files.Refused as refusal:
        yield Line(0, problem=str(refusal).removeprefix(f"{path} "))
    except IsADirectoryError:
        yield Line(0, problem="is a directory, not an incident file")
    except FileNotFoundError:
        yield Line(0, problem="no such file")
    except OSError as error:
        yield Line(0, problem=f"cannot read it ({error.strerror or error})")
