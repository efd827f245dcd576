"""``smemguard report``: what happened, from incident records (one file per rank, gzip too)."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterable, Iterator

from .incidents import TIME_FORMAT



@dataclass
class Malformed:
    path: str
    line: int
    reason: str


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


def _open(path: Path):
    with open(path, "rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt", encoding="utf-8") if gzipped else open(path, encoding="utf-8")


def read(paths: Iterable[Path], malformed: list[Malformed]) -> Iterator[dict]:
    """The records of every file, in order; unreadable lines go to ``malformed`` (never fatal)."""
    for path in paths:
        try:
            with _open(path) as lines:
                for number, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as error:
                        malformed.append(Malformed(str(path), number, f"not JSON ({error.msg})"))
                        continue
                    if not isinstance(record, dict) or "kernel" not in record or "action" not in record:
                        malformed.append(Malformed(str(path), number, "not an incident record"))
                        continue
                    yield record
        except (OSError, EOFError, UnicodeDecodeError) as error:
            malformed.append(Malformed(str(path), 0, f"unreadable file ({error})"))


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """``2026-11-30``, ``2026-11-30T08:00``, or a duration back from now: ``90m``, ``6h``, ``2d``."""
    now = now or datetime.now(timezone.utc)
    duration = re.fullmatch(r"(\d+)([mhd])", text.strip())
    if duration:
        units = {"m": "minutes", "h": "hours", "d": "days"}
        return now - timedelta(**{units[duration.group(2)]: int(duration.group(1))})
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: expected a date (2026-11-30), a time (2026-11-30T08:00) "
                         "or a duration (90m, 6h, 2d)") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=now.astimezone().tzinfo)


def _when(record: dict) -> datetime | None:
    try:
        return datetime.strptime(record.get("time", ""), TIME_FORMAT)
    except ValueError:
        return None


def _shape_signature(record: dict) -> tuple:
    return tuple(sorted((name, tuple(arg["shape"])) for name, arg in (record.get("args") or {}).items()
                        if isinstance(arg, dict) and "shape" in arg))


def _gpu(record: dict) -> str:
    device = record.get("device") or {}
    return device.get("name") or f"{device.get('backend', '?')}:{device.get('arch', '?')}"


def summarize(records: Iterable[dict], kernel: str | None = None, since: datetime | None = None) -> list[Row]:
    rows: dict[tuple, Row] = {}
    for record in records:
        if kernel and kernel not in record["kernel"]:
            continue
        when = _when(record)
        if since and (when is None or when < since):
            continue
        key = (record["kernel"], record.get("resource", "?"), _gpu(record))
        row = rows.setdefault(key, Row(*key))
        row.count += 1
        row.shapes.add(_shape_signature(record))
        row.actions[record["action"]] += 1
        if when is not None:
            row.first = min(row.first or when, when)
            row.last = max(row.last or when, when)
        row.recovery_ms += float(record.get("recovery_ms") or 0.0)
    return sorted(rows.values(), key=lambda r: (-r.count, r.kernel))


def format_table(rows: list[Row]) -> str:
    header = ("kernel", "resource", "GPU", "count", "shapes", "actions", "first seen", "last seen", "recovering")
    lines = [header]
    for row in rows:
        actions = ", ".join(f"{action} {n}" for action, n in row.actions.most_common())
        lines.append((row.kernel, row.resource, row.gpu, str(row.count), str(len(row.shapes)), actions,
                      row.seen(row.first), row.seen(row.last), f"{row.recovery_ms / 1000:.2f} s"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    numeric = {3, 4, 8}
    return "\n".join("  ".join(cell.rjust(w) if i in numeric else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(line, widths))).rstrip() for line in lines)


def format_prometheus(records: Iterable[dict], kernel: str | None = None, since: datetime | None = None) -> str:
    """The series smemguard exports (:mod:`smemguard.metrics`; all but ``smemguard_info``, which
    records do not carry), counted from the records that pass the filters of :func:`summarize`."""
    from .metrics import Tally

    def selected(record: dict) -> bool:
        when = _when(record)
        return (not kernel or kernel in record["kernel"]) and not (since and (when is None or when < since))

    return Tally.of(filter(selected, records)).exposition()
