"""Shared memory of Triton kernels compiled on this CPU for NVIDIA and AMD archs: the calibration of the estimate.

    python benchmarks/smem_sweep.py --vendor nvidia --part versions --part dtypes --out nvidia_smem_sweep.csv
    python benchmarks/smem_sweep.py --vendor nvidia --summary --out tests/data/nvidia_smem_sweep.csv
    python benchmarks/smem_sweep.py --vendor amd --part grid --out amd_lds_sweep.csv
    python benchmarks/smem_sweep.py --vendor amd --summary --out tests/data/amd_lds_sweep.csv

The question it answers for each Triton release: what each config needs on each arch, so that ``smemguard check``'s
calibrated estimate (``smemguard/kernels/estimate.py``) and recovery's model stay true; the rows are the data in
``tests/data/`` the estimate's tests check against. Every row is one compile by ``smemguard check``'s own compiler
(``preflight.build_request`` and ``compile_request``: the signature, constants and divisibility a launch in that
specialization compiles, a fresh Triton cache so the compile time is real). Rows are appended to the CSV as they
finish, with the Triton version, so a part can be resumed (done rows are skipped) and sweeps of several Triton
releases share one file. A job is ``(kernel, dtype, specialization, arch, config)``; a config's keys other than the
tiles and ``num_warps``/``num_stages`` are compile options, one CSV column each.

NVIDIA (sm_75, sm_120 and sm_70; sm_80, sm_89 and sm_90 were calibrated on ``tests/data/triton36_smem_sweep.csv``):

- ``versions``: the example fp16 matmul on 60 configs (BLOCK_M 32/128/256, BLOCK_N 64/128, BLOCK_K 32/64, 1 to 5
  stages, 4 warps), aligned and misaligned: what stages change, per release;
- ``dtypes``: bf16 and fp32 operands aligned and misaligned, and fp16 launches with N == 1, on a 24-config subset;
- ``grid``: FlagGems' 216-config grid (the ``--examples`` matmul), fp16 aligned and misaligned;
- ``examples``: the persistent fp32 matmul and the flash-attention forward in their own configs.

AMD, through Triton's HIP backend (gfx942, gfx950, gfx90a; ``rdna``: gfx1100):

- ``grid``: FlagGems' 216-config grid, aligned and misaligned; ``dtypes``: bf16, fp32 and N == 1 on a 36-config
  subset; ``options``: ``waves_per_eu`` 2, ``matrix_instr_nonkdim`` 16 and 32, ``kpack`` 2, stages 1 to 4 and 4 or
  8 warps on 12 configs; ``attention``: the flash-attention forward at 1 to 4 stages; ``rdna``: gfx1100 (wave32)
  on 24 configs; ``versions``: a 48-config subset at 1 to 4 stages, to repeat on other Triton releases.

``--summary`` prints what the rows say per arch, specialization (and, for AMD, option). Costs: on a shared 2-core
machine sm_75 and sm_120's ``versions``, ``dtypes`` and ``examples`` (516 compiles) took 55 minutes in one process;
sm_70's big tiles take minutes each; the ``grid`` parts want many cores.
"""

from __future__ import annotations

import concurrent.futures
import csv
import functools
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import harness

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



# -- NVIDIA ---------------------------------------------------------------------------------------

ARCHS = (75, 120, 70)  # sm_70 last: its big tiles take minutes each
SPECS = ("aligned", "misaligned")


def versions() -> list[tuple]:
    configs = grid(block_ms=(32, 128, 256), block_ns=(64, 128), block_ks=(32, 64), stages=(1, 2, 3, 4, 5),
                   warps=(4,))
    return [(MATMUL, "fp16", spec, arch, config) for arch in ARCHS for spec in SPECS for config in configs]


def dtypes() -> list[tuple]:
    configs = grid(block_ms=(64, 128, 256), block_ns=(128,), block_ks=(32, 64), stages=(2, 4), warps=(4, 8))
    return ([(MATMUL, dtype, spec, arch, config) for arch in ARCHS for dtype in ("bf16", "fp32") for spec in SPECS
             for config in configs]
            + [(MATMUL, "fp16", "N=1", arch, config) for arch in ARCHS for config in configs])


def flaggems_grid() -> list[tuple]:
    return [(MATMUL, "fp16", spec, arch, config) for arch in ARCHS for spec in SPECS for config in grid()]


def examples() -> list[tuple]:
    from smemguard.examples import ATTENTION_CONFIGS, PERSISTENT_MATMUL_CONFIGS

    def as_dict(config) -> dict:
        return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}

    return ([(PERSISTENT, "fp32", spec, arch, as_dict(config)) for arch in ARCHS
             for spec in (*SPECS, "N=1") for config in PERSISTENT_MATMUL_CONFIGS]
            + [(ATTENTION, "fp16", spec, arch, as_dict(config)) for arch in ARCHS for spec in SPECS
               for config in ATTENTION_CONFIGS])


NVIDIA_PARTS = {"versions": versions, "dtypes": dtypes, "grid": flaggems_grid, "examples": examples}


# -- AMD ------------------------------------------------------------------------------------------

AMD_ARCHS = ("gfx942", "gfx950", "gfx90a")
AMD_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")


def amd_jobs(part: str) -> list[tuple]:
    """(kernel, dtype, specialization, arch, config) for each compile of ``part``."""
    if part == "grid":
        return [(MATMUL, "fp16", spec, arch, config) for arch in AMD_ARCHS for spec in ("aligned", "misaligned")
                for config in grid()]
    if part == "dtypes":
        subset = grid(block_ms=(64, 128, 256), block_ns=(64, 128), block_ks=(32, 64), stages=(2, 3, 4), warps=(4,))
        return ([(MATMUL, dtype, spec, arch, config) for arch in AMD_ARCHS for dtype in ("bf16", "fp32")
                 for spec in ("aligned", "misaligned") for config in subset]
                + [(MATMUL, "fp16", "N=1", arch, config) for arch in AMD_ARCHS for config in subset])
    if part == "options":
        base = grid(block_ms=(64, 128, 256), block_ns=(128,), block_ks=(32, 64), stages=(2,), warps=(4, 8))
        variants = [{}, {"waves_per_eu": 2}, {"matrix_instr_nonkdim": 16}, {"matrix_instr_nonkdim": 32}, {"kpack": 2}]
        by_stages = [{**config, "num_stages": stages} for config in base for stages in (1, 3, 4)]
        return ([(MATMUL, "fp16", spec, arch, {**config, **options}) for arch in AMD_ARCHS
                 for spec in ("aligned", "misaligned") for config in base for options in variants]
                + [(MATMUL, "fp16", "aligned", arch, config) for arch in AMD_ARCHS for config in by_stages])
    if part == "attention":
        configs = [dict(BLOCK_M=m, BLOCK_N=n, num_stages=s, num_warps=w)
                   for m, n, w in ((64, 32, 4), (64, 64, 4), (128, 64, 8), (128, 128, 8)) for s in (1, 2, 3, 4)]
        return [(ATTENTION, "fp16", spec, arch, config) for arch in AMD_ARCHS for spec in ("aligned", "misaligned")
                for config in configs]
    if part == "versions":
        subset = grid(block_ms=(32, 128, 256), block_ns=(64, 128), block_ks=(32, 128), stages=(1, 2, 3, 4), warps=(4,))
        return [(MATMUL, "fp16", spec, arch, config) for arch in AMD_ARCHS for spec in ("aligned", "misaligned")
                for config in subset]
    if part == "rdna":
        subset = grid(block_ms=(64, 128, 256), block_ns=(64, 128), block_ks=(32, 64), stages=(2, 3), warps=(4,))
        return [(MATMUL, "fp16", spec, "gfx1100", config) for spec in ("aligned", "misaligned") for config in subset]
    raise SystemExit(f"unknown part {part!r}")


def option_changes(out: Path) -> None:
    """Per Triton, arch, specialization and AMD option: in how many configs the option changed the bytes."""
    rows = [row for row in csv.DictReader(out.open()) if row["shared"]]
    print("| triton | arch | spec | option | configs | bytes changed in | largest change |")
    print("|---|---|---|---|---|---|---|")

    def without_options(row: dict) -> tuple:
        return identity({**row, **{option: "" for option in AMD_OPTIONS}}, AMD_OPTIONS)

    plain = {without_options(row): int(row["shared"]) for row in rows if not any(row[option] for option in AMD_OPTIONS)}
    changed: dict[tuple, list[int]] = {}
    for row in rows:
        for option in AMD_OPTIONS:
            if row[option]:
                base = plain.get(without_options(row))
                if base is not None:
                    changed.setdefault((row["triton"], row["arch"], row["spec"], f"{option}={row[option]}"),
                                       []).append(int(row["shared"]) - base)
    for key, deltas in sorted(changed.items()):
        moved = [delta for delta in deltas if delta]
        largest = max(moved, key=abs) if moved else 0
        print(f"| {' | '.join(key)} | {len(deltas)} | {len(moved)} | {largest:+d} B |")


AMD_PARTS = ("grid", "dtypes", "options", "attention", "rdna", "versions")



VENDORS = {  # vendor: (its parts, the default CSV, its option columns, its extra summaries)
    "nvidia": (NVIDIA_PARTS, "nvidia_smem_sweep.csv", (), ()),
    "amd": ({part: (lambda part=part: amd_jobs(part)) for part in AMD_PARTS}, "amd_lds_sweep.csv", AMD_OPTIONS,
            (option_changes,)),
}


def main() -> int:
    """``--vendor`` and its ``--part`` (repeatable) to compile, ``--summary`` to print the tables."""
    parser = harness.parser(__doc__, results=False)
    parser.add_argument("--vendor", choices=sorted(VENDORS), required=True)
    parser.add_argument("--part", action="append", help="what to sweep (repeatable; the vendor's parts above)")
    parser.add_argument("--out", type=Path, help="the CSV (default: nvidia_smem_sweep.csv or amd_lds_sweep.csv)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--arch", action="append", help="only this arch (repeatable): 75, gfx942, ...")
    parser.add_argument("--summary", action="store_true", help="print the summary tables of --out")
    args = parser.parse_args()
    parts, default_out, options, summaries = VENDORS[args.vendor]
    out = args.out or Path(default_out)
    unknown = sorted(set(args.part or ()) - set(parts))
    if unknown:
        parser.error(f"--vendor {args.vendor} has no part {', '.join(unknown)}; its parts: {', '.join(parts)}")
    if args.part:
        todo = [job for part in args.part for job in parts[part]()]
        sweep([job for job in todo if not args.arch or str(job[3]) in args.arch], out, args.jobs, options)
    if args.summary:
        summary(out, options)
        for extra in summaries:
            print()
            extra(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
