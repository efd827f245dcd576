"""Does the next process load a recovered torch.compile kernel directly? (on a GPU)

Answered (H200, torch 2.11.0+cu130, Triton 3.6.0, 2026-12-01; raw: benchmarks/results/2026-12-01-h200-session-7/
inductor_remembered.json): yes for a recompiled graph (each stored variant compiled once, no failing load); the graph
from Inductor's FX graph cache failed on a bug fixed after the run and covered on the CPU
(``tests/test_inductor.py::test_a_kernel_from_a_compile_worker_or_the_fx_graph_cache_recovers_too``).

    python benchmarks/experiments/inductor_remembered.py OUT_DIR [--case flex-D128-bf16-h200] [--limit RTX4090]

Runs one FlexAttention case of ``inductor_matrix.py`` three times, each a fresh process sharing one
``SMEMGUARD_CACHE_DIR`` (smemguard's decision file):

1. ``first``: fresh Inductor and Triton caches: the load fails and smemguard recovers (records ``remembered``
   false, candidates compiled);
2. ``recompiled``: fresh Inductor and Triton caches again: Inductor compiles everything anew, smemguard loads the
   stored variants (records ``remembered`` true, one compile per config, no failing load);
3. ``fx_cache``: the Inductor cache of run 2: the graph comes from Inductor's FX graph cache, and the stored
   variants load the same way.

Each run must compile, run and match SDPA. Prints a table and writes ``OUT_DIR/inductor_remembered.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inductor_matrix import Case, _spec, run_case  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--case", default="flex-D128-bf16-h200", help="flex-D<head dim>-<dtype>-<h200|sm8x>")
    parser.add_argument("--limit", default="RTX4090")
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args(argv[1:])
    _, head_dim, dtype, choice = args.case.split("-")
    spec = _spec("flex", dtype, "cuda", 5, True, int(head_dim[1:]), choice)
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="inductor-remembered-"))
    rows, previous = [], None
    for run in ("first", "recompiled", "fx_cache"):
        case = Case(f"{args.case}-{args.limit}-{run}", "flex", "smemguard", args.limit, spec)
        case_dir = scratch / case.id
        if previous is not None:  # the decision file goes on; the compile caches only into the FX-cache run
            shutil.copytree(previous / "cache", case_dir / "cache")
        if run == "fx_cache":
            shutil.copytree(previous / "inductor", case_dir / "inductor")
        record = run_case(case, scratch, args.out, 2, args.timeout)
        previous = case_dir
        rows.append(record)
        print(f"{run:11s} {record['outcome']:6s} records "
              f"{[(r['action'], r['remembered'], r['compiles']) for r in record['incidents']['records']]}",
              flush=True)
    print("(the runs after the first must show remembered=True, one compile per config, and ok)")
    (args.out / "inductor_remembered.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
