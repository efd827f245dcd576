"""Two ``smemguard check --json`` reports compared: what a Triton upgrade (or any change of environment) does to the
shared memory of each kernel and config on each GPU, and what newly overflows (``smemguard check --compare``).

The reports are untrusted input: each is read whole up to :data:`MAX_REPORT` bytes (regular files only), parsed as
strict JSON and checked field by field; a report that is not one of ``smemguard check --json`` (schema
``smemguard.check/1``) is refused with one line per problem (the first :data:`MAX_PROBLEMS_SHOWN`, the rest counted),
and nothing is compared. Reading stops at the problem after those: a hostile file costs no more than that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..facts import files, untrusted
from ..facts.untrusted import NAME, OBJECT, TEXT, Expect, integer, one_of, printable
from .report import SCHEMA
from .model import ERROR, ESTIMATED, FITS, OVERFLOWS

#: A report of thousands of configs on a dozen GPUs is a few MiB; larger files are refused unread.
MAX_REPORT = 64 * 2**20
#: Problems of a refused report named one line each; the others are counted in one more line.
MAX_PROBLEMS_SHOWN = 20
#: Version of the ``--compare --json`` document.
COMPARE_SCHEMA = "smemguard.compare/1"

_BOOL = Expect("true or false", lambda value: isinstance(value, bool))
_LIST = Expect("a list [...]", lambda value: isinstance(value, list))
_VERDICT = {"verdict": one_of("fits", "overflows", "error", "not_checked")}
_VERDICT_OPTIONAL = {"how": one_of("measured", "cached", "estimated").or_null(), "shared": integer(0).or_null(),
                     "estimate": OBJECT, "error": TEXT}


class ReportError(ValueError):
    """A file that is not a usable ``smemguard check --json`` report: ``lines`` say why, one problem each."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__(lines[0] if lines else "not a report")
        self.lines = lines


@dataclass(frozen=True)
class Verdict:
    """One cell of a report: a config's verdict for one GPU and specialization."""

    verdict: str
    how: str | None = None
    shared: int | None = None
    low: int | None = None
    high: int | None = None

    def cell(self) -> str:
        """``"131072 fits"``, ``"~<=98304 fits"``, ``"204208 OVER"``, ``"error"``."""
        if self.verdict not in (FITS, OVERFLOWS):
            return self.verdict.replace("_", " ")
        word = "fits" if self.verdict == FITS else "OVER"
        if self.shared is not None:
            return f"{self.shared} {word}"
        bound = self.high if self.verdict == FITS else self.low
        return f"~{'<=' if self.verdict == FITS else '>='}{bound} {word}" if bound is not None else word

    def to_json(self) -> dict:
        data: dict[str, Any] = {"verdict": self.verdict, "how": self.how, "shared": self.shared}
        if self.how == ESTIMATED:
            data["estimate"] = {"low": self.low, "high": self.high}
        return data


@dataclass
class CheckReport:
    """What a comparison needs of one report."""

    path: str
    triton: str
    smemguard: str
    exact: bool
    limits: dict[str, int]  # GPU -> per-block limit, the GPUs checked
    verdicts: dict[tuple[str, str, str, str], Verdict]  # (kernel, config, GPU, specialization) -> verdict
    without_fit: dict[tuple[str, str], list[str]]  # (kernel, GPU) -> specializations with no fitting config
    configs: set[tuple[str, str]] = field(default_factory=set)  # (kernel, config)

    def estimated(self) -> int:
        return sum(verdict.how == ESTIMATED for verdict in self.verdicts.values())


def read(path: Path) -> CheckReport:
    """The report at ``path``; ReportError (one line per problem, the path left out) when it cannot be used."""
    try:
        raw = files.read_bytes(path, MAX_REPORT)
    except files.Refused as refusal:
        raise ReportError([str(refusal).removeprefix(f"{path} ")]) from None
    except FileNotFoundError:
        raise ReportError(["no such file"]) from None
    except IsADirectoryError:
        raise ReportError(["is a directory, not a report"]) from None
    except OSError as error:
        raise ReportError([f"cannot read it ({error.strerror or error})"]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ReportError([f"not UTF-8 text (byte {error.start})"]) from None
    document, problem = untrusted.loads(text)
    if problem is not None:
        raise ReportError([problem])
    return _parsed(str(path), document)


def _parsed(path: str, document: Any) -> CheckReport:
    problems: list[str] = []
    if not isinstance(document, dict):
        raise ReportError([f"holds {untrusted.shown(document, 40)}, not a report {{...}}"])
    if document.get("schema") != SCHEMA:
        raise ReportError([f"'schema' is {untrusted.shown(document.get('schema'), 60)}, expected {SCHEMA!r}: not a "
                           "report of 'smemguard check --json' (or of another version of it)"])
    problems += untrusted.problems(document, {"triton": TEXT, "exact": _BOOL, "gpus": _LIST, "kernels": _LIST,
                                              "summary": OBJECT}, {"smemguard": TEXT})
    if problems:
        raise ReportError(problems)
    report = CheckReport(path, document["triton"], document.get("smemguard", "unknown"), document["exact"], {}, {}, {})
    for index, gpu in enumerate(document["gpus"]):
        where = f"gpus[{index}]."
        found = untrusted.problems(gpu, {"name": NAME, "limit": integer(1), "checked": _BOOL}, prefix=where) \
            if isinstance(gpu, dict) else [f"{where[:-1]!r} is {untrusted.shown(gpu, 40)}, expected an object {{...}}"]
        problems += found
        if not found and gpu["checked"]:
            report.limits[gpu["name"]] = gpu["limit"]
    for index, kernel in enumerate(document["kernels"]):
        _read_kernel(report, kernel, f"kernels[{index}]", problems)
    if len(problems) <= MAX_PROBLEMS_SHOWN:
        problems += _read_summary(report, document["summary"])
    if problems:
        raise ReportError(problems)
    return report


def _enough(problems: list[str]) -> bool:
    """Whether ``problems`` says enough that the document is no report: the rest is not read."""
    return len(problems) > MAX_PROBLEMS_SHOWN


def _read_kernel(report: CheckReport, kernel: Any, where: str, problems: list[str]) -> None:
    if _enough(problems):
        return
    if not isinstance(kernel, dict):
        problems.append(f"{where!r} is {untrusted.shown(kernel, 40)}, expected an object {{...}}")
        return
    found = untrusted.problems(kernel, {"kernel": NAME, "configs": _LIST}, prefix=f"{where}.")
    problems += found
    for number, config in enumerate([] if found else kernel["configs"]):
        at = f"{where}.configs[{number}]"
        found = untrusted.problems(config, {"config": TEXT, "gpus": OBJECT}, prefix=f"{at}.") \
            if isinstance(config, dict) else [f"{at!r} is {untrusted.shown(config, 40)}, expected an object {{...}}"]
        problems += found
        if _enough(problems):
            return
        if found:
            continue
        report.configs.add((kernel["kernel"], config["config"]))
        for gpu, cell in config["gpus"].items():
            problems += _read_cell(report, (kernel["kernel"], config["config"], gpu), cell, f"{at}.gpus[{gpu!r}]")


def _read_cell(report: CheckReport, key: tuple[str, str, str], cell: Any, where: str) -> list[str]:
    specializations = cell.get("specializations") if isinstance(cell, dict) else None
    if not isinstance(specializations, dict):
        return [f"{where + '.specializations'!r} is {untrusted.shown(specializations, 40)}, expected an object {{...}}"]
    problems = []
    for spec, verdict in specializations.items():
        at = f"{where}.specializations[{spec!r}]."
        found = untrusted.problems(verdict, _VERDICT, _VERDICT_OPTIONAL, prefix=at) if isinstance(verdict, dict) \
            else [f"{at[:-1]!r} is {untrusted.shown(verdict, 40)}, expected an object {{...}}"]
        estimate = verdict.get("estimate") if not found else None
        if estimate is not None:
            found = untrusted.problems(estimate, {"low": integer(0), "high": integer(0)}, prefix=f"{at}estimate.")
        if found:
            problems += found
            continue
        report.verdicts[(*key, spec)] = Verdict(verdict["verdict"], verdict.get("how"), verdict.get("shared"),
                                                *((estimate["low"], estimate["high"]) if estimate else ()))
    return problems


def _read_summary(report: CheckReport, summary: dict) -> list[str]:
    problems = []
    for gpu, entry in summary.items():
        missing = entry.get("kernels_without_fit") if isinstance(entry, dict) else None
        if not isinstance(missing, list):
            problems.append(f"{f'summary[{gpu!r}].kernels_without_fit'!r} is {untrusted.shown(missing, 40)}, expected "
                            "a list")
            continue
        for index, item in enumerate(missing):
            at = f"summary[{gpu!r}].kernels_without_fit[{index}]."
            found = untrusted.problems(item, {"kernel": NAME, "specializations": _LIST}, prefix=at) \
                if isinstance(item, dict) else [f"{at[:-1]!r} is {untrusted.shown(item, 40)}, expected an object"]
            if not found and not all(isinstance(spec, str) for spec in item["specializations"]):
                found = [f"{at + 'specializations'!r} holds something other than text"]
            problems += found
            if not found:
                report.without_fit[(item["kernel"], gpu)] = list(item["specializations"])
    return problems


@dataclass(frozen=True)
class Change:
    """A verdict that differs between the reports: other bytes, or another verdict."""

    kernel: str
    config: str
    gpu: str
    specialization: str
    before: Verdict
    after: Verdict

    @property
    def newly_overflows(self) -> bool:
        """Fit before, and overflows (or no longer compiles) now."""
        return self.before.verdict == FITS and self.after.verdict in (OVERFLOWS, ERROR)

    def bytes_moved(self) -> int | None:
        if self.before.shared is None or self.after.shared is None:
            return None
        return self.after.shared - self.before.shared


@dataclass
class Comparison:
    old: CheckReport
    new: CheckReport
    gpus: list[str]  # checked in both
    changes: list[Change]
    unchanged: int
    newly_without_fit: list[tuple[str, str, list[str]]]  # (kernel, GPU, specializations)
    notes: list[str]  # what the comparison could not see, one line each

    @property
    def exit_status(self) -> int:
        """1 when something that fit a GPU in OLD does not in NEW, else 0."""
        return 1 if self.newly_without_fit or any(change.newly_overflows for change in self.changes) else 0


def compare(old: CheckReport, new: CheckReport) -> Comparison:
    """What changed from ``old`` to ``new``, on the GPUs both checked, for the configs both hold."""
    gpus = [gpu for gpu in new.limits if gpu in old.limits]
    changes, unchanged = [], 0
    for key, before in old.verdicts.items():
        after = new.verdicts.get(key)
        if after is None or key[2] not in gpus:
            continue
        if after == before:
            unchanged += 1
        else:
            changes.append(Change(*key, before, after))
    kernels = {kernel for kernel, _ in old.configs} & {kernel for kernel, _ in new.configs}
    newly_without_fit = [(kernel, gpu, specs) for (kernel, gpu), specs in new.without_fit.items()
                         if kernel in kernels and gpu in gpus and (kernel, gpu) not in old.without_fit]
    return Comparison(old, new, gpus, changes, unchanged, newly_without_fit, _notes(old, new, gpus))


def _notes(old: CheckReport, new: CheckReport, gpus: list[str]) -> list[str]:
    notes = []
    for name, report in (("OLD", old), ("NEW", new)):
        estimated = report.estimated()
        if estimated:
            notes.append(f"{name} was made without --exact: {estimated} of its verdicts are estimated, from a model "
                         "that does not know the Triton release; make both reports with --exact to compare every "
                         "config's bytes")
    for name, mine, other in (("OLD", old, new), ("NEW", new, old)):
        alone = [gpu for gpu in mine.limits if gpu not in other.limits]
        if alone:
            notes.append(f"GPUs checked in {name} only, not compared: {', '.join(map(printable, alone))}")
        count = len(mine.configs - other.configs)
        if count:
            notes.append(f"{count} configs in {name} only, not compared (kernels or configs added or removed)")
    for gpu in gpus:
        if old.limits[gpu] != new.limits[gpu]:
            notes.append(f"{printable(gpu)}'s limit is {old.limits[gpu]} B in OLD and {new.limits[gpu]} B in NEW "
                         "(another smemguard's GPU table): verdicts compared as each report gives them")
    return notes


def _short(kernel: str) -> str:
    return printable(kernel.rsplit(":", 1)[-1])


def format_text(comparison: Comparison) -> str:
    """The comparison as a table of the changed verdicts and the lines a CI log needs."""
    old, new = comparison.old, comparison.new
    lines = [f"OLD {printable(old.path)} (Triton {printable(old.triton)}) -> NEW {printable(new.path)} (Triton "
             f"{printable(new.triton)}); GPUs compared: {', '.join(map(printable, comparison.gpus)) or 'none'}"]
    if comparison.changes:
        header = ["kernel", "config", "GPU", "specialization", "OLD", "NEW", "change"]
        rows = [[_short(change.kernel), printable(change.config), printable(change.gpu),
                 printable(change.specialization), change.before.cell(), change.after.cell(), _what(change)]
                for change in comparison.changes]
        widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
        lines += ["", *("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                        for row in (header, ["-" * width for width in widths], *rows))]
    overflowing = [change for change in comparison.changes if change.newly_overflows]
    if overflowing or comparison.newly_without_fit:
        lines.append("")
    for change in overflowing:
        lines.append(f"NEWLY OVERFLOWS: {printable(change.kernel)} {printable(change.config)} on "
                     f"{printable(change.gpu)} [{printable(change.specialization)}]: {change.before.cell()} -> "
                     f"{change.after.cell()} (limit {new.limits[change.gpu]} B)")
    for kernel, gpu, specs in comparison.newly_without_fit:
        lines.append(f"NO FITTING CONFIG NOW: {printable(kernel)} on {printable(gpu)} when launched "
                     f"{' / '.join(map(printable, specs))}: OutOfResources there whatever the autotuner picks")
    moved = [change.bytes_moved() for change in comparison.changes if change.bytes_moved()]
    lines += ["", f"summary: {len(comparison.changes)} verdicts changed ({sum(m > 0 for m in moved)} need more bytes, "
              f"{sum(m < 0 for m in moved)} fewer), {comparison.unchanged} unchanged; {len(overflowing)} newly "
              f"overflow (or no longer compile), {len(comparison.newly_without_fit)} kernels newly without a fitting "
              f"config; exit status {comparison.exit_status}"]
    return "\n".join(lines)


def _what(change: Change) -> str:
    moved = change.bytes_moved()
    parts = [f"{moved:+d} B"] if moved else []
    if change.newly_overflows:
        parts.append("NEWLY OVERFLOWS")
    elif change.before.verdict != change.after.verdict:
        parts.append(f"{change.before.verdict} -> {change.after.verdict}")
    return ", ".join(parts) or "estimate moved"


def to_json(comparison: Comparison) -> dict:
    """The ``--compare --json`` document (schema ``smemguard.compare/1``)::

        {"schema": "smemguard.compare/1", "exit_status": 1, "gpus": ["L40S", "MI355X"],
         "old": {"path", "triton", "smemguard", "exact"}, "new": {...},
         "changed": [{"kernel", "config", "gpu", "specialization", "before": VERDICT, "after": VERDICT,
                      "bytes": after - before or null, "newly_overflows": true}],
         "newly_without_fit": [{"kernel", "gpu", "specializations"}], "unchanged": 12, "notes": ["..."]}

    VERDICT as in ``check --json`` (``verdict``, ``how``, ``shared``, ``estimate``)."""
    def side(report: CheckReport) -> dict:
        return {"path": report.path, "triton": report.triton, "smemguard": report.smemguard, "exact": report.exact}

    return {"schema": COMPARE_SCHEMA, "exit_status": comparison.exit_status, "gpus": comparison.gpus,
            "old": side(comparison.old), "new": side(comparison.new),
            "changed": [{"kernel": change.kernel, "config": change.config, "gpu": change.gpu,
                         "specialization": change.specialization, "before": change.before.to_json(),
                         "after": change.after.to_json(), "bytes": change.bytes_moved(),
                         "newly_overflows": change.newly_overflows} for change in comparison.changes],
            "newly_without_fit": [{"kernel": kernel, "gpu": gpu, "specializations": specs}
                                  for kernel, gpu, specs in comparison.newly_without_fit],
            "unchanged": comparison.unchanged, "notes": comparison.notes}


def run(old_path: Path, new_path: Path, *, as_json: bool, quiet: bool, say, err) -> int:
    """``smemguard check --compare OLD NEW``: print the comparison with ``say`` (stdout), problems and notes with
    ``err`` (stderr); the exit status (0 nothing newly overflows, 1 something does, 2 a report cannot be used)."""
    reports = []
    for name, path in (("OLD", old_path), ("NEW", new_path)):
        try:
            reports.append(read(path))
        except ReportError as error:
            for line in error.lines[:MAX_PROBLEMS_SHOWN]:
                err(f"smemguard check --compare: {name} {printable(str(path))}: {line}")
            if len(error.lines) > MAX_PROBLEMS_SHOWN:
                err(f"smemguard check --compare: {name} {printable(str(path))}: and more problems (reading stopped "
                    "there)")
            err(f"smemguard check --compare: nothing compared. Fix: make {name} with 'smemguard check ... --json > "
                "FILE'")
            return 2
    comparison = compare(*reports)
    say(json.dumps(to_json(comparison), indent=2) if as_json else format_text(comparison))
    if not quiet:
        for note in comparison.notes:
            err(f"smemguard check --compare: {note}")
    return comparison.exit_status

