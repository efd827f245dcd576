"""`smemguard check --examples --gpu MI300X,MI355X`: a verdict for every config, each checked against a compile.

    PYTHONPATH=. python benchmarks/amd_preflight_check.py [--json amd_preflight_check.json]

Runs the check as the command does (estimated where the calibrated estimate is sure), cold (empty
result and Triton caches), then again with every config compiled (`--exact`; the Triton cache of
the first run is reused, so only what the first run estimated is compiled now), and counts the
verdicts that are missing (not checked, errors) or differ between the two runs: both must be zero.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import triton

from smemguard.facts import gpus
from smemguard import preflight

GPUS = ("MI300X", "MI355X")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    chosen = [gpus.lookup(name) for name in GPUS]
    kernels = preflight.discover([], examples=True)
    with tempfile.TemporaryDirectory(prefix="smemguard-amd-check-") as scratch:
        started = time.perf_counter()
        estimated = preflight.check(kernels, chosen, jobs=args.jobs,
                                    cache=preflight.ResultCache(Path(scratch) / "estimated"))
        estimated_seconds = time.perf_counter() - started
        started = time.perf_counter()
        exact = preflight.check(kernels, chosen, exact=True, jobs=args.jobs,
                                cache=preflight.ResultCache(Path(scratch) / "exact"))
        exact_seconds = time.perf_counter() - started
    missing = [key for key, verdict in estimated.verdicts.items()
               if verdict.verdict not in (preflight.FITS, preflight.OVERFLOWS)]
    differ = [key for key, verdict in estimated.verdicts.items() if verdict.verdict != exact.verdicts[key].verdict]
    result = {
        "triton": triton.__version__, "python": platform.python_version(), "cpus": os.cpu_count(), "jobs": args.jobs,
        "gpus": list(GPUS), "configs": sum(len(kernel.variants) for kernel in kernels),
        "verdicts": len(estimated.verdicts), "estimated_run": {"seconds": round(estimated_seconds, 1),
                                                               "compiles": estimated.compiles, **estimated.counts()},
        "exact_run": {"seconds": round(exact_seconds, 1), "compiles": exact.compiles},
        "without_a_verdict": len(missing), "estimate_differs_from_compile": len(differ),
        "fit": estimated.to_json()["summary"],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if missing or differ else 0


if __name__ == "__main__":
    sys.exit(main())
