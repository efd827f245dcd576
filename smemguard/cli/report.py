"""``smemguard report``: what happened, from incident records (one file per rank, gzip too)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterable, Iterator

from ..facts import untrusted
from ..facts.untrusted import NAME, NUMBER, TEXT, Expect, printable
from ..store import record_fields
from ..store.record_fields import TIME_FORMAT

#: The lines not fully used that are named one by one, over all the files read; the others are only counted: a file
#: of a million bad lines gives a screenful, and nothing is kept per line.
MAX_NAMED = 20
#: The distinct shapes shown per kernel and GPU, the most seen first: in the table, and listed by --json.
MAX_SHAPES = 5
MAX_SHAPES_LISTED = 100


@dataclass
class Malformed:
    """A line (``line`` 0: the whole file) the report could not fully use, and why."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{printable(where)}: {self.reason}"


@dataclass
class OtherSchema:
    """The records of one file that are of another schema than this smemguard's: how many, and the first."""

    path: str
    line: int
    why: str
    count: int = 0

    def __str__(self) -> str:
        return (f"{printable(self.path)}: {self.count} record(s) of another schema skipped; the first, line "
                f"{self.line}: {self.why}")


@dataclass
class Problems:
    """What :func:`read` could not use: every file it could not read to the end, the first MAX_NAMED lines not
    fully used (the others counted), and per file the records of another schema (counted)."""

    named: list[Malformed] = field(default_factory=list)
    lines: int = 0
    other_schema: dict[str, OtherSchema] = field(default_factory=dict)

    def line(self, path: str, number: int, reason: str) -> None:
        self.lines += 1
        if self.lines <= MAX_NAMED:
            self.named.append(Malformed(path, number, reason))

    def file(self, path: str, reason: str) -> None:
        self.named.append(Malformed(path, 0, reason))

    def schema(self, path: str, number: int, why: str) -> None:
        self.other_schema.setdefault(path, OtherSchema(path, number, why)).count += 1

    def unreadable(self, path: str) -> str | None:
        """Why ``path`` could not be read to its end, if it could not."""
        return next((bad.reason for bad in self.named if bad.line == 0 and bad.path == path), None)

    def __bool__(self) -> bool:
        return bool(self.named or self.other_schema)

    def text(self, rest: str, files: bool = True) -> list[str]:
        """The lines to print: each problem named, then one line counting the lines not fully used (``rest``
        ends it), then one per file of records of another schema; ``files=False`` leaves out the files that
        could not be read to the end (where the command says so itself)."""
        shown = [str(bad) for bad in self.named if files or bad.line]
        if self.lines:
            listed = "listed above" if self.lines <= MAX_NAMED else f"the first {MAX_NAMED} listed above"
            shown.append(f"{self.lines} line(s) not fully used, {listed}; {rest}")
        return shown + [str(skipped) for skipped in self.other_schema.values()]

    def as_json(self) -> dict:
        return {"malformed": [vars(bad) for bad in self.named], "malformed_not_listed": max(self.lines - MAX_NAMED, 0),
                "other_schema": [vars(skipped) for skipped in self.other_schema.values()]}


@dataclass
class Row:
    kernel: str
    resource: str
    gpu: str
    count: int = 0
    shapes: Counter = field(default_factory=Counter)  # the tensors' shapes of each record -> how many records
    actions: Counter = field(default_factory=Counter)
    first: datetime | None = None
    last: datetime | None = None
    recovery_ms: float = 0.0

    def seen(self, moment: datetime | None) -> str:
        return moment.strftime(TIME_FORMAT) if moment else "-"

    def as_json(self) -> dict:
        return {"kernel": self.kernel, "resource": self.resource, "gpu": self.gpu, "count": self.count,
                "distinct_shapes": len(self.shapes), "actions": dict(self.actions),
                "shapes": [{"args": dict(shape), "count": count}
                           for shape, count in self.shapes.most_common(MAX_SHAPES_LISTED)],
                "first_seen": self.seen(self.first), "last_seen": self.seen(self.last),
                "recovery_ms": round(self.recovery_ms, 3)}


def _time(value) -> datetime | None:
    try:
        return datetime.strptime(value, TIME_FORMAT) if isinstance(value, str) else None
    except ValueError:
        return None


def _device(value) -> bool:
    return isinstance(value, dict) and all(
        expect.test(value[name]) for name, expect in DEVICE_FIELDS.items() if name in value)


def _arguments(value) -> bool:
    """Tensors' shapes must be lists of integers (a shape is what makes records of a kernel distinct)."""
    return isinstance(value, dict) and all(untrusted.integers().test(arg["shape"]) for arg in value.values()
                                           if isinstance(arg, dict) and "shape" in arg)


DEVICE_FIELDS = {"name": TEXT.or_null(), "backend": TEXT, "arch": Expect("an integer or text", lambda value: (
    isinstance(value, (int, str)) and not isinstance(value, bool)))}

#: A record of another schema (one written by another version, or no record of smemguard's) is skipped, and counted.
SCHEMA = Expect(f"{record_fields.SCHEMA}, the schema this smemguard reads", lambda value: (
    untrusted.integer().test(value) and value == record_fields.SCHEMA))

#: How the report checks each field it reads; record_fields.FIELDS says which a record must have. Without a
#: required one a line is not an incident record the report can count; a wrong optional one is left out of the
#: report (and listed), the record counted.
CHECKS = {
    "kernel": NAME,
    "action": NAME,
    "resource": NAME,
    "time": Expect(f"a time like {datetime(2026, 11, 30, 8, tzinfo=timezone.utc).strftime(TIME_FORMAT)}",
                   lambda value: _time(value) is not None),
    "device": Expect("an object {name, backend, arch}", _device),
    # A recovery takes seconds at most: a day bounds the sums, which stay finite (and JSON).
    "recovery_ms": Expect("a number of milliseconds from 0 to 86400000 (a day)", lambda value: (
        NUMBER.test(value) and value <= 86_400_000)),
    "args": Expect("an object of arguments, tensors' shapes lists of integers", _arguments),
}
REQUIRED, OPTIONAL = record_fields.required_and_optional("report", CHECKS)


@dataclass(frozen=True)
class Record:
    path: str
    line: int
    fields: dict  # the record, less any optional field of the wrong type


def read(paths: Iterable[Path], problems: Problems) -> Iterator[Record]:
    """The incident records of every file, in order; every line or file that cannot be used, or
    only in part, goes to ``problems`` with the reason (never fatal), and so does each record of another schema."""
    for path in map(str, paths):
        for line in untrusted.json_lines(Path(path)):
            if line.number == 0:
                problems.file(path, line.problem)
            elif line.problem is not None:
                problems.line(path, line.number, f"{line.problem}; line skipped")
            elif not isinstance(line.value, dict):
                problems.line(path, line.number, "not an incident record but "
                              f"{untrusted.shown(line.value, 40)}; line skipped")
            elif other := untrusted.problems(line.value, {"schema": SCHEMA}):
                problems.schema(path, line.number, other[0])
            elif fatal := untrusted.problems(line.value, REQUIRED):
                problems.line(path, line.number, f"not an incident record: {'; '.join(fatal)}; line skipped")
            else:
                yield Record(path, line.number, _usable(path, line, problems))


def _usable(path: str, line: untrusted.Line, problems: Problems) -> dict:
    """The record less any optional field of the wrong type, named in ``problems`` (one line for the line)."""
    wrong = {name: problem for name, expect in OPTIONAL.items()
             if name in line.value and (problem := expect.problem(name, line.value[name])) is not None}
    if wrong:
        problems.line(path, line.number, "; ".join(wrong.values()) + "; counted without "
                      + ("it" if len(wrong) == 1 else "them"))
    return {name: value for name, value in line.value.items() if name not in wrong}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """``2026-11-30``, ``2026-11-30T08:00``, or a duration back from now: ``90m``, ``6h``, ``2d``."""
    now = now or datetime.now(timezone.utc)
    duration = re.fullmatch(r"([0-9]+)([mhd])", text.strip())
    if duration:
        units = {"m": "minutes", "h": "hours", "d": "days"}
        try:
            return now - timedelta(**{units[duration.group(2)]: int(duration.group(1))})
        except OverflowError:
            raise ValueError(f"--since {text!r} reaches back before the year 1") from None
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: expected a date (2026-11-30), a time (2026-11-30T08:00) "
                         "or a duration (90m, 6h, 2d)") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=now.astimezone().tzinfo)


def _shape_signature(record: dict) -> tuple:
    return tuple(sorted((name, tuple(arg["shape"])) for name, arg in record.get("args", {}).items()
                        if isinstance(arg, dict) and "shape" in arg))


def _gpu(record: dict) -> str:
    device = record.get("device") or {}
    return device.get("name") or f"{device.get('backend', '?')}:{device.get('arch', '?')}"


def _selected(records: Iterable[Record], kernel: str | None, since: datetime | None) -> Iterator[tuple[dict, datetime]]:
    """(fields, time) of the records that pass ``--kernel`` and ``--since``."""
    for record in (r.fields for r in records):
        when = _time(record.get("time"))
        if (kernel and kernel not in record["kernel"]) or (since and (when is None or when < since)):
            continue
        yield record, when


def summarize(records: Iterable[Record], kernel: str | None = None, since: datetime | None = None) -> list[Row]:
    rows: dict[tuple, Row] = {}
    for record, when in _selected(records, kernel, since):
        key = (record["kernel"], record.get("resource", "?"), _gpu(record))
        row = rows.setdefault(key, Row(*key))
        row.count += 1
        row.shapes[_shape_signature(record)] += 1
        row.actions[record["action"]] += 1
        if when is not None:
            row.first = min(row.first or when, when)
            row.last = max(row.last or when, when)
        row.recovery_ms += record.get("recovery_ms", 0.0)
    return sorted(rows.values(), key=lambda r: (-r.count, r.kernel))


def format_table(rows: list[Row]) -> str:
    header = ("kernel", "resource", "GPU", "count", "shapes", "actions", "first seen", "last seen", "recovering")
    lines = [header]
    for row in rows:
        actions = ", ".join(f"{printable(action)} {n}" for action, n in row.actions.most_common())
        lines.append((printable(row.kernel), printable(row.resource), printable(row.gpu), str(row.count),
                      str(len(row.shapes)), actions, row.seen(row.first), row.seen(row.last),
                      f"{row.recovery_ms / 1000:.2f} s"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    numeric = {3, 4, 8}
    table = "\n".join("  ".join(cell.rjust(w) if i in numeric else cell.ljust(w)
                                for i, (cell, w) in enumerate(zip(line, widths))).rstrip() for line in lines)
    return table + "\n\nshapes (tensor arguments of each record; most seen first):\n" + "\n".join(
        _shape_lines(row) for row in rows)


def _shape_lines(row: Row) -> str:
    """A row's distinct shapes, the most seen first, at most :data:`MAX_SHAPES`."""
    lines = [f"  {printable(row.kernel)} on {printable(row.gpu)}:"]
    for shape, count in row.shapes.most_common(MAX_SHAPES):
        described = " ".join(f"{printable(name)}{list(extent)}" for name, extent in shape)
        lines.append(f"    {described or '(no tensors recorded: a compile no launch caused)'}  x{count}")
    if len(row.shapes) > MAX_SHAPES:
        lines.append(f"    and {len(row.shapes) - MAX_SHAPES} more shapes (--json lists up to {MAX_SHAPES_LISTED})")
    return "\n".join(lines)


def format_prometheus(records: Iterable[Record], kernel: str | None = None, since: datetime | None = None) -> str:
    """The series smemguard exports (:mod:`smemguard.store.metrics`; all but ``smemguard_info``, which
    records do not carry), counted from the records that pass the filters of :func:`summarize`."""
    from ..store.metrics import Tally

    return Tally.of(record for record, _ in _selected(records, kernel, since)).exposition()
