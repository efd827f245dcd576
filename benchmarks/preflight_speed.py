"""How long `smemguard check --examples --gpu T4,L4,A100,H100,MI300X` takes cold, and whether it is right.

    python benchmarks/preflight_speed.py                 # the timing (goal: under 3 minutes on 2 cores)
    python benchmarks/preflight_speed.py --verify        # then compile every config and compare verdicts
    python benchmarks/preflight_speed.py --target smemguard.examples:flaggems_matmul --gpu L4,A100,H100

Cold means an empty smemguard result cache (a temporary directory; the check writes nothing to
Triton's cache). The run is the library call behind the command, in each kernel's specializations
(aligned, misaligned, and the example persistent matmul's N == 1). `--verify` repeats it with
`--exact` (every config compiled, into a result cache of its own) and counts the verdicts where the
estimate and the measurement disagree, which must be zero, and the measurements outside their
calibrated interval.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import harness

from smemguard.facts import gpus
from smemguard import preflight
from smemguard.cli.check import parse_gpus

GPUS = "T4,L4,A100,H100,MI300X"
GOAL_SECONDS = 180.0


def run(kernels: list, chosen: list, scratch: Path, exact: bool, jobs: int) -> preflight.Report:
    """The check with its own result cache under ``scratch``."""
    return preflight.check(kernels, chosen, exact=exact, jobs=jobs,
                           cache=preflight.ResultCache(scratch / ("exact" if exact else "estimated")),
                           progress=_progress)


def _progress(event: preflight.Progress) -> None:
    if event.done % 25 == 0 or event.done == event.planned:
        print(f"[{event.done}/{event.planned} compiles] {event.elapsed:.0f} s", file=sys.stderr, flush=True)


def describe(report: preflight.Report) -> dict:
    summary = report.to_json()["summary"]
    return {"seconds": round(report.seconds, 1), "compiles": report.compiles, "verdicts": report.counts(),
            "fit": {gpu.name: summary[gpu.name]["fit"] for gpu in report.gpus},
            "configs": sum(len(kernel.variants) for kernel in report.kernels), "exit_status": report.exit_status}


def disagreements(estimated: preflight.Report, exact: preflight.Report) -> list[str]:
    """Verdicts without an answer (errors, GPUs not checked) and estimated ones the compile contradicts."""
    wrong = []
    for key, verdict in estimated.verdicts.items():
        measured = exact.verdicts[key]
        if verdict.verdict not in (preflight.FITS, preflight.OVERFLOWS) or verdict.verdict != measured.verdict:
            kernel, variant, spec, gpu = key
            wrong.append(f"{estimated.kernels[kernel].name} {estimated.kernels[kernel].variants[variant].label()} "
                         f"{spec} {gpu}: {verdict.how} {verdict.verdict} [{verdict.low}, {verdict.high}], "
                         f"compiled {measured.shared} B {measured.error or ''}")
    return wrong


def calibration(exact: preflight.Report) -> dict:
    """Per arch and specialization: how many measured values fall outside the estimate's interval."""
    table: dict[str, dict] = {}
    for (k, v, spec_name, gpu_name), verdict in exact.verdicts.items():
        arch = gpus.lookup(gpu_name).target_arch
        if gpu_name != next(gpu.name for gpu in exact.gpus if gpu.target_arch == arch):
            continue  # one GPU per arch
        kernel = exact.kernels[k]
        spec = next(spec for spec in kernel.specializations if spec.name == spec_name)
        interval = preflight.estimate(preflight.build_request(kernel, kernel.variants[v], spec, arch), spec)
        row = table.setdefault(f"{gpus.lookup(gpu_name).arch} {kernel.name} {spec_name}",
                               {"configs": 0, "estimated": 0, "outside": 0, "examples": []})
        row["configs"] += 1
        row["estimated"] += interval is not None
        if interval is not None and verdict.shared is not None and not interval.holds(verdict.shared):
            row["outside"] += 1
            row["examples"] = (row["examples"] + [f"{kernel.variants[v].label()}: {verdict.shared} not in "
                                                  f"[{interval.low}, {interval.high}] ({interval.regime})"])[:3]
    return table


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--target", action="append", help="what to check (default: smemguard's example kernels)")
    parser.add_argument("--gpu", default=GPUS, help=f"GPUs to check against (default {GPUS})")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--verify", action="store_true", help="also compile every config and compare the verdicts")
    args = parser.parse_args()
    kernels = preflight.discover(args.target or [], examples=not args.target)
    chosen = parse_gpus([args.gpu])
    setup = {"jobs": args.jobs, "targets": args.target or ["--examples"], "gpus": [gpu.name for gpu in chosen]}
    print(json.dumps(setup), flush=True)
    result = {}
    status = 0
    with harness.scratch("preflight-speed") as scratch:
        report = run(kernels, chosen, Path(scratch), exact=False, jobs=args.jobs)
        result["check"] = describe(report)
        print(json.dumps(result["check"]), flush=True)
        if args.verify:
            exact = run(kernels, chosen, Path(scratch), exact=True, jobs=args.jobs)
            wrong = disagreements(report, exact)
            result.update(exact=describe(exact), calibration=calibration(exact), verdicts_wrong=wrong)
            print(json.dumps(result["exact"]))
            print("measured values outside the calibrated interval:", json.dumps(result["calibration"], indent=1))
            print(f"verdicts without an answer or differing from the compiled ones: {len(wrong)}")
            for line in wrong:
                print("  " + line)
            status = 1 if wrong else 0
    result["load_after"] = os.getloadavg()[0]
    print(harness.headline(harness.write(args.json, result, **setup)))
    print(f"cold check: {report.seconds:.1f} s for {len(report.verdicts)} verdicts, {report.compiles} compiles "
          f"({'within' if report.seconds <= GOAL_SECONDS else 'OVER'} the {GOAL_SECONDS:.0f} s goal)")
    return status


if __name__ == "__main__":
    sys.exit(main())
