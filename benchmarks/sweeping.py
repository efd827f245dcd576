"""What the shared-memory sweeps (``amd_lds_sweep.py``, ``nvidia_smem_sweep.py``) have in common.

Every row is one compile by ``smemguard check``'s own compiler (``preflight.build_request`` and
``compile_request``: the signature, constants and divisibility a launch in that specialization
compiles, a fresh Triton cache so the compile time is real). Rows are appended to the CSV as they
finish, with the Triton version, so a part can be resumed (done rows are skipped) and sweeps of
several Triton releases share one file. A job is ``(kernel, dtype, specialization, arch, config)``;
a config's keys other than the tiles and ``num_warps``/``num_stages`` are compile options, one
CSV column each (the sweep names them).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import functools
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

MATMUL = "smemguard.examples:matmul_kernel"
PERSISTENT = "smemguard.examples:matmul_persistent_kernel"
ATTENTION = "smemguard.examples:attention_fwd_kernel"
ELEMENT = {"fp16": 2, "bf16": 2, "fp32": 4}
_RESULTS = ("shared", "seconds", "error")


def fields(options: Sequence[str]) -> list[str]:
    return ["triton", "arch", "kernel", "dtype", "spec", "BM", "BN", "BK", "num_warps", "num_stages", *options,
            *_RESULTS]


def grid(block_ms=(32, 64, 128, 256), block_ns=(32, 64, 128), block_ks=(32, 64, 128), stages=(2, 3, 4),
         warps=(4, 8)) -> list[dict]:
    """FlagGems' matmul search space by default (216 configs), or the subset named."""
    return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_stages=s, num_warps=w)
            for m in block_ms for n in block_ns for k in block_ks for s in stages for w in warps]


_kernels: dict = {}


def _kernel(target: str, dtype: str):
    """The example kernel as the check sees it: ``matmul_kernel`` also with N == 1, the persistent
    matmul with the specializations of its ``SMEMGUARD_PREFLIGHT`` entry, attention with HEAD_DIM 128."""
    from smemguard import preflight

    if (target, dtype) not in _kernels:
        hints = {"dtype": dtype, "configs": [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)]}
        if target == MATMUL:
            hints["ones"] = [["N"]]
        if target == ATTENTION:
            hints = {"dtype": dtype, "signature": {"sm_scale": "fp32"}, "constants": {"HEAD_DIM": 128},
                     "configs": [dict(BLOCK_M=16, BLOCK_N=16)]}
        [_kernels[target, dtype]] = preflight.discover([target], overrides=hints)
    return _kernels[target, dtype]


def row_key(job: tuple, options: Sequence[str]) -> dict:
    target, dtype, spec, arch, config = job
    return {"arch": arch, "kernel": target.rsplit(":", 1)[1], "dtype": dtype, "spec": spec,
            "BM": config["BLOCK_M"], "BN": config["BLOCK_N"], "BK": config.get("BLOCK_K", ""),
            "num_warps": config["num_warps"], "num_stages": config["num_stages"],
            **{option: config.get(option, "") for option in options}}


def compile_one(job: tuple, options: Sequence[str] = ()) -> dict:
    import triton

    from smemguard import preflight
    from smemguard.preflight.compiling import compile_request

    target, dtype, spec_name, arch, config = job
    kernel = _kernel(target, dtype)
    spec = next(s for s in kernel.specializations if s.name == spec_name)
    result = compile_request(kernel.jit, preflight.build_request(kernel, preflight.Variant.of(config), spec, arch))
    return {**row_key(job, options), "triton": triton.__version__, "shared": result["shared"],
            "seconds": round(result["seconds"], 2), "error": result["error"] or ""}


def identity(row: dict, options: Sequence[str]) -> tuple:
    return tuple(str(row[field]) for field in fields(options) if field not in _RESULTS)


def _init_worker(cache: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache


def sweep(todo: list[tuple], out: Path, jobs: int, options: Sequence[str] = ()) -> None:
    """Compile the jobs of ``todo`` not yet in ``out`` with this Triton, ``jobs`` at a time, appending rows."""
    import triton

    done = {identity(row, options) for row in csv.DictReader(out.open())} if out.exists() else set()
    todo = [job for job in todo if identity({**row_key(job, options), "triton": triton.__version__}, options)
            not in done]
    print(f"{len(todo)} compiles to run with Triton {triton.__version__} ({len(done)} rows already in {out})",
          file=sys.stderr, flush=True)
    new_file = not out.exists()
    with out.open("a", newline="") as handle, tempfile.TemporaryDirectory(prefix="smem-sweep-") as cache:
        writer = csv.DictWriter(handle, fields(options))
        if new_file:
            writer.writeheader()
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_init_worker, initargs=(cache,)) as pool:
            compile_job = functools.partial(compile_one, options=tuple(options))
            for count, row in enumerate(pool.map(compile_job, todo, chunksize=4), 1):
                writer.writerow(row)
                handle.flush()
                if count % 25 == 0 or count == len(todo):
                    print(f"[{count}/{len(todo)}] {row['arch']} {row['dtype']} {row['spec']} "
                          f"{row['BM']}x{row['BN']}x{row['BK']} s{row['num_stages']} w{row['num_warps']}: "
                          f"{row['shared']} B ({row['seconds']} s)", file=sys.stderr, flush=True)


def stage_bytes(row: dict) -> tuple[int, int]:
    """T (one stage of the A and B tiles) and E (one output tile) of a matmul row, in bytes."""
    block_m, block_n, block_k = int(row["BM"]), int(row["BN"]), int(row["BK"])
    element = ELEMENT[row["dtype"]]
    return (block_m * block_k + block_k * block_n) * element, block_m * block_n * element


def summary(out: Path, options: Sequence[str] = ()) -> None:
    """Per Triton, arch, kernel, dtype and specialization: compile times, and how the bytes of
    the matmul rows without compile options relate to T, by stages (and how many equal E)."""
    rows = [row for row in csv.DictReader(out.open()) if row["shared"]]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["triton"], row["arch"], row["kernel"], row["dtype"], row["spec"]), []).append(row)
    print("| triton | arch | kernel | dtype | spec | compiles | median s | max s | shared / T by stages | = E |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, group in sorted(groups.items()):
        seconds = sorted(float(row["seconds"]) for row in group)
        ratios: dict[str, set] = {}
        epilogues = 0
        for row in group:
            if row["BK"] == "" or any(row[option] for option in options):
                continue
            tile, epilogue = stage_bytes(row)
            ratios.setdefault(row["num_stages"], set()).add(round(int(row["shared"]) / tile, 2))
            epilogues += int(row["shared"]) == epilogue != tile
        text = "; ".join(f"S={stages}: {min(r)}-{max(r)}" for stages, r in sorted(ratios.items()))
        print(f"| {' | '.join(key)} | {len(group)} | {seconds[len(seconds) // 2]:.1f} | {seconds[-1]:.1f} | {text} "
              f"| {epilogues} |")


def main(doc: str, parts: dict[str, Callable[[], list[tuple]]], default_out: str, options: Sequence[str] = (),
         summaries: Sequence[Callable[[Path], None]] = ()) -> int:
    """The command line of a sweep: ``--part`` (repeatable) to compile, ``--summary`` to print the tables."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", action="append", choices=list(parts), help="what to sweep (repeatable)")
    parser.add_argument("--out", type=Path, default=Path(default_out))
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--arch", action="append", help="only this arch (repeatable): 75, gfx942, ...")
    parser.add_argument("--summary", action="store_true", help="print the summary tables of --out")
    args = parser.parse_args()
    if args.part:
        todo = [job for part in args.part for job in parts[part]()]
        sweep([job for job in todo if not args.arch or str(job[3]) in args.arch], args.out, args.jobs, options)
    if args.summary:
        summary(args.out, options)
        for extra in summaries:
            print()
            extra(args.out)
    return 0
