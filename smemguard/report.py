"""``smemguard report``: what happened, from incident records (one file per rank, gzip too)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterable, Iterator

from . import untrusted
from .incidents import TIME_FORMAT
from .untrusted import NAME, NUMBER, TEXT, Expect, printable


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
class Row:
    kernel: str
    resource: str
    gpu: str
    count: int = 0
    shapes: set = field(default_factory=set)
    actions: Counter = field(default_factory=Counter)
    first: datetime | None = None
    last: datetime | None = None
    recovery_ms: float = 0.0

    def seen(self, moment: datetime | None) -> str:
        return moment.strftime(TIME_FORMAT) if moment else "-"

    def as_json(self) -> dict:
        return {"kernel": self.kernel, "resource": self.resource, "gpu": self.gpu, "count": self.count,
                "distinct_shapes": len(self.shapes), "actions": dict(self.actions),
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

#: Without these a line is not an incident record the report can count.
REQUIRED = {"kernel": NAME, "action": NAME}

#: Fields the report reads when present; a wrong one is left out of the report (and listed), the record counted.
OPTIONAL = {
    "resource": NAME,
    "time": Expect(f"a time like {datetime(2026, 11, 30, 8, tzinfo=timezone.utc).strftime(TIME_FORMAT)}",
                   lambda value: _time(value) is not None),
    "device": Expect("an object {name, backend, arch}", _device),
    # A recovery takes seconds at most: a day bounds the sums, which stay finite (and JSON).
    "recovery_ms": Expect("a number of milliseconds from 0 to 86400000 (a day)", lambda value: (
        NUMBER.test(value) and value <= 86_400_000)),
    "args": Expect("an object of arguments, tensors' shapes lists of integers", _arguments),
}


@dataclass(frozen=True)
class Record:
    path: str
    line: int
    fields: dict  # the record, less any optional field of the wrong type


def read(paths: Iterable[Path], malformed: list[Malformed]) -> Iterator[Record]:
    """The incident records of every file, in order; every line or file that cannot be used, or
    only in part, goes to ``malformed`` with the reason (never fatal)."""
    for path in paths:
        for line in untrusted.json_lines(path):
            if line.problem is not None:
                malformed.append(Malformed(str(path), line.number, line.problem + ("" if line.number == 0 else
                                                                                   "; line skipped")))
                continue
            if not isinstance(line.value, dict):
                malformed.append(Malformed(str(path), line.number, "not an incident record but "
                                           f"{untrusted.shown(line.value, 40)}; line skipped"))
                continue
            fatal = untrusted.problems(line.value, REQUIRED)
            if fatal:
                malformed.append(Malformed(str(path), line.number, f"not an incident record: {'; '.join(fatal)}; "
                                           "line skipped"))
                continue
            fields = dict(line.value)
            for name, expect in OPTIONAL.items():
                if name in fields and (problem := expect.problem(name, fields[name])) is not None:
                    malformed.append(Malformed(str(path), line.number, f"{problem}; counted without it"))
                    del fields[name]
            yield Record(str(path), line.number, fields)


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
        row.shapes.add(_shape_signature(record))
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
    return "\n".join("  ".join(cell.rjust(w) if i in numeric else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(line, widths))).rstrip() for line in lines)


def format_prometheus(records: Iterable[Record], kernel: str | None = None, since: datetime | None = None) -> str:
    """The series smemguard exports (:mod:`smemguard.metrics`; all but ``smemguard_info``, which
    records do not carry), counted from the records that pass the filters of :func:`summarize`."""
    from .metrics import Tally

    return Tally.of(record for record, _ in _selected(records, kernel, since)).exposition()
