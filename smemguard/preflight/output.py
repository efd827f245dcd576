"""The text report: a table of configs against GPUs and a summary of what fits where."""

from __future__ import annotations

from ..facts import gpus
from ..kernels.estimate import ESTIMATE_MARGIN
from .report import Report, Verdict
from .model import BY_LAYOUT, BY_ORDER, CACHED, ERROR, ESTIMATED, FITS, MEASURED, NON_UNIT, NOT_CHECKED, OVERFLOWS

#: Distinct error messages the text report lists (``--json`` has every one).
MAX_ERRORS_SHOWN = 5


def _cell(verdict: Verdict) -> str:
    if verdict.verdict == NOT_CHECKED:
        return "not checked"
    if verdict.verdict == ERROR:
        return "error"
    word = "fits" if verdict.verdict == FITS else "OVER"
    if verdict.how == ESTIMATED:
        bound = f"<={verdict.high}" if verdict.verdict == FITS else f">={verdict.low}"
        return f"~{bound} {word}"
    return f"{verdict.shared} {word}"


_SEVERITY = {ERROR: 3, OVERFLOWS: 2, FITS: 1, NOT_CHECKED: 0}


def _row_cell(report: Report, k: int, v: int, gpu: gpus.Gpu) -> str:
    """The worst verdict over the specializations, naming the specialization when they disagree."""
    kernel = report.kernels[k]
    verdicts = [(spec.name, report.verdict(k, v, spec.name, gpu.name)) for spec in kernel.specializations]
    worst_name, worst = max(verdicts, key=lambda pair: (_SEVERITY[pair[1].verdict], pair[1].shared or 0))
    if len({verdict.verdict for _, verdict in verdicts}) > 1:
        return f"{_cell(worst)} [{worst_name}]"
    return _cell(worst)


_READINGS = {BY_ORDER: "by argument order", BY_LAYOUT: f"by tile layout ('{BY_LAYOUT}')",
             NON_UNIT: f"none of them ('{NON_UNIT}')"}


def unsure_strides(kernel) -> str:
    """What the check could not tell about the kernel's strides, what it did, and the ``--unit`` that settles it."""
    readings = {spec.unit_guess: spec.guessed_ones for spec in kernel.specializations}
    checked = ", ".join(_READINGS[guess] + (f": {', '.join(ones)} = 1" if ones else "")
                        for guess, ones in readings.items())
    likely = ",".join(arg for arg in kernel.types if arg in kernel.unit_args or arg in readings[BY_ORDER])
    return (f"unsure which strides are 1 at launch: {', '.join(kernel.unsure_unit_args)} (the source does not tell "
            f"which is the innermost of its tensor); checked {checked}; the worse counts. Say which arguments are 1 "
            f"in every launch with --unit (contiguous tensors passed as *x.stride(): --unit {likely}), or --unit none")


def format_table(report: Report) -> str:
    header = ["kernel", "config"] + [f"{gpu.name} ({gpu.max_shared})" for gpu in report.gpus]
    rows = [[kernel.name.rsplit(":", 1)[-1], variant.label()]
            + [_row_cell(report, k, v, gpu) for gpu in report.gpus]
            for k, kernel in enumerate(report.kernels) for v, variant in enumerate(kernel.variants)]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def format_summary(report: Report) -> str:
    lines = []
    for kernel in report.kernels:
        specs = ", ".join(spec.name + (f" ({', '.join(spec.ones)} = 1)" if len(spec.ones) > 1 else "")
                          for spec in kernel.specializations)
        unit = f"; always 1: {', '.join(kernel.unit_args)}" if kernel.unit_args else ""
        lines.append(f"{kernel.name}: {len(kernel.variants)} configs, specializations {specs}{unit}")
        if kernel.unsure_unit_args:
            lines.append("  " + unsure_strides(kernel))
    lines.append("")
    for gpu in report.gpus:
        if not report.checked(gpu):
            lines.append(f"{gpu.name} ({gpu.arch}): not checked: {report.unchecked[gpu.name]}")
            continue
        parts = []
        for k, kernel in enumerate(report.kernels):
            fit = sum(report.fits_everywhere(k, v, gpu.name) for v in range(len(kernel.variants)))
            parts.append(f"{kernel.name.rsplit(':', 1)[-1]} {fit}/{len(kernel.variants)}")
        lines.append(f"{gpu.name} ({gpu.arch}, {gpu.max_shared} B): configs that fit: {', '.join(parts)}")
        for k, kernel in enumerate(report.kernels):
            missing = report.without_fit(k, gpu.name)
            if missing:
                lines.append(f"  NO FITTING CONFIG: {kernel.name} when launched {' / '.join(missing)}: "
                             f"OutOfResources on {gpu.name}")
            failed = report.only_errors(k, gpu.name)
            if failed:
                lines.append(f"  NOT CHECKED: {kernel.name} when launched {' / '.join(failed)}: every config "
                             "failed to compile for another reason (errors below)")
    if report.pinned:
        lines.append("")
        lines.extend(outcome.line() for outcome in report.pinned)
    errors: dict[str, list[str]] = {}
    for (k, v, spec, gpu), verdict in report.verdicts.items():
        if verdict.verdict == ERROR:
            where = (f"{report.kernels[k].name.rsplit(':', 1)[-1]} {report.kernels[k].variants[v].label()} "
                     f"[{spec}] on {gpu}")
            errors.setdefault(verdict.error or "unknown error", []).append(where)
    if errors:
        lines.append("")
        lines.append("errors (a wrong argument type guess? see --sig, --dtype, --const):")
        for message, places in list(errors.items())[:MAX_ERRORS_SHOWN]:
            more = f" and {len(places) - 1} more" if len(places) > 1 else ""
            lines.append(f"  {places[0]}{more}: {message}")
    counts = report.counts()
    lines.append("")
    lines.append(f"verdicts: {counts[MEASURED]} measured by compiling now, {counts[CACHED]} measured earlier (cache), "
                 f"{counts[ESTIMATED]} estimated (~, calibrated bound at least {ESTIMATE_MARGIN:.0%} from the limit, "
                 f"or the bytes of the same config at other num_stages where stages change nothing); "
                 f"{report.compiles} compiles in {report.seconds:.1f} s")
    lines.append("cells: required bytes and verdict in the worst specialization ([name] when they differ); "
                 "--json has every one")
    return "\n".join(lines)
