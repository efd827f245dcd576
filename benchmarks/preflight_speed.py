"""How long `smemguard check` takes on FlagGems' 216-config matmul grid for three GPUs, cold.

    python benchmarks/preflight_speed.py                 # the timing (goal: under 2 minutes on 2 cores)
    python benchmarks/preflight_speed.py --verify        # then compile every config and compare verdicts

Cold means an empty smemguard result cache and an empty Triton cache (both temporary
directories). The run is the library call behind
`smemguard check smemguard.examples:flaggems_matmul --gpu L4,A100,H100`, in the default
specializations (aligned and misaligned). `--verify` repeats it with `--exact` (every config
compiled; about 7 minutes on 2 cores) and counts the verdicts where the estimate and the
measurement disagree, which must be zero.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import triton

from smemguard import gpus, preflight

TARGET = "smemguard.examples:flaggems_matmul"
GPUS = ("L4", "A100", "H100")


def run(exact: bool, jobs: int) -> preflight.Report:
    with tempfile.TemporaryDirectory(prefix="smemguard-bench-") as scratch:
        kernels = preflight.discover([TARGET])
        chosen = [gpus.lookup(name) for name in GPUS]
        return preflight.check(kernels, chosen, exact=exact, jobs=jobs,
                               cache=preflight.ResultCache(Path(scratch) / "results"),
                               triton_cache_dir=str(Path(scratch) / "triton"))


def describe(report: preflight.Report) -> dict:
    counts = report.counts()
    summary = report.to_json()["summary"]
    return {"seconds": round(report.seconds, 1), "compiles": report.compiles, "verdicts": counts,
            "fit": {gpu: summary[gpu]["fit"] for gpu in GPUS}, "configs": summary[GPUS[0]]["configs"],
            "exit_status": report.exit_status}


def disagreements(estimated: preflight.Report, exact: preflight.Report) -> list[str]:
    wrong = []
    for key, verdict in estimated.verdicts.items():
        measured = exact.verdicts[key]
        if verdict.how == preflight.ESTIMATED and verdict.verdict != measured.verdict:
            kernel, variant, spec, gpu = key
            wrong.append(f"{estimated.kernels[kernel].variants[variant].label()} {spec} {gpu}: estimated "
                         f"{verdict.verdict} [{verdict.low}, {verdict.high}], measured {measured.shared} B")
    return wrong


def calibration(exact: preflight.Report) -> dict:
    """Per arch and specialization: how many measured values fall outside the estimate's interval."""
    table: dict[str, dict] = {}
    for (k, v, spec_name, gpu_name), verdict in exact.verdicts.items():
        kernel = exact.kernels[k]
        spec = next(spec for spec in kernel.specializations if spec.name == spec_name)
        arch = gpus.lookup(gpu_name).capability
        interval = preflight.estimate(preflight.build_request(kernel, kernel.variants[v], spec, arch), spec)
        row = table.setdefault(f"sm_{arch} {spec_name}", {"configs": 0, "outside": 0, "examples": []})
        if gpu_name != next(name for name in GPUS if gpus.lookup(name).capability == arch):
            continue
        row["configs"] += 1
        if verdict.shared is not None and not interval.holds(verdict.shared):
            row["outside"] += 1
            row["examples"] = (row["examples"] + [f"{kernel.variants[v].label()}: {verdict.shared} not in "
                                                  f"[{interval.low}, {interval.high}] ({interval.regime})"])[:3]
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--verify", action="store_true", help="also compile every config and compare the verdicts")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs "
          f"({platform.processor() or platform.machine()}), {args.jobs} compiler processes", flush=True)
    report = run(exact=False, jobs=args.jobs)
    result = {"check": describe(report)}
    print(json.dumps(result["check"]), flush=True)
    status = 0
    if args.verify:
        exact = run(exact=True, jobs=args.jobs)
        wrong = disagreements(report, exact)
        result["exact"] = describe(exact)
        result["estimated_verdicts_wrong"] = len(wrong)
        print(json.dumps(result["exact"]))
        print("measured values outside the calibrated interval:", json.dumps(calibration(exact), indent=1))
        print(f"estimated verdicts that differ from the measured ones: {len(wrong)}")
        for line in wrong:
            print("  " + line)
        status = 1 if wrong else 0
    goal = 120.0
    print(f"cold check: {report.seconds:.1f} s for {len(report.verdicts)} verdicts "
          f"({'within' if report.seconds < goal else 'OVER'} the {goal:.0f} s goal)")
    return status


if __name__ == "__main__":
    sys.exit(main())
