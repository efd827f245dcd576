"""LDS (shared memory) of Triton kernels compiled for AMD GPUs on this CPU: what each option changes.

    PYTHONPATH=. python benchmarks/amd_lds_sweep.py --part grid --out benchmarks/results/amd_lds_sweep.csv

Every row is one compile by ``smemguard check``'s own compiler (``preflight.build_request`` and
``compile_request``: the signature, constants and divisibility a launch in that specialization
compiles, Triton's HIP backend, a fresh Triton cache so the compile time is real), for:

- ``grid``: smemguard's example fp16 matmul over FlagGems' 216-config grid (BLOCK_M 32-256,
  BLOCK_N 32-128, BLOCK_K 32-128, 2-4 stages, 4 or 8 warps), aligned and misaligned, on gfx942
  (MI300X/MI325X), gfx950 (MI355X) and gfx90a (MI250X/MI210);
- ``dtypes``: bf16 and fp32 operands, and launches with N == 1, on a 36-config subset;
- ``options``: the AMD compile options on 12 configs: ``waves_per_eu`` 2, ``matrix_instr_nonkdim``
  16 and 32, ``kpack`` 2, ``num_stages`` 1 to 4 and ``num_warps`` 4 and 8;
- ``attention``: the example flash-attention forward at 1 to 4 stages;
- ``rdna``: gfx1100 (RX 7900 XTX, wave32) on a 24-config subset;
- ``versions``: a 48-config subset of ``grid`` (1 to 4 stages), to repeat on other Triton releases.

Rows are appended as they finish (a part can be resumed; done rows are skipped), with the
Triton version, so sweeps of several Triton releases share one file. ``--summary`` prints what
the rows say per arch, specialization and option.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path

FIELDS = ["triton", "arch", "kernel", "dtype", "spec", "BM", "BN", "BK", "num_warps", "num_stages", "waves_per_eu",
          "matrix_instr_nonkdim", "kpack", "shared", "seconds", "error"]
MATMUL = "smemguard.examples:matmul_kernel"
ATTENTION = "smemguard.examples:attention_fwd_kernel"
ARCHS = ("gfx942", "gfx950", "gfx90a")
AMD_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
PARTS = ("grid", "dtypes", "options", "attention", "rdna", "versions")


def grid(block_ms=(32, 64, 128, 256), block_ns=(32, 64, 128), block_ks=(32, 64, 128), stages=(2, 3, 4),
         warps=(4, 8)):
    return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_stages=s, num_warps=w)
            for m in block_ms for n in block_ns for k in block_ks for s in stages for w in warps]


def jobs_for(part: str) -> list[tuple]:
    """(kernel, dtype, specialization, arch, config) for each compile of ``part``."""
    if part == "grid":
        return [(MATMUL, "fp16", spec, arch, config) for arch in ARCHS for spec in ("aligned", "misaligned")
                for config in grid()]
    if part == "dtypes":
        subset = grid(block_ms=(64, 128, 256), block_ns=(64, 128), block_ks=(32, 64), stages=(2, 3, 4), warps=(4,))
        return ([(MATMUL, dtype, spec, arch, config) for arch in ARCHS for dtype in ("bf16", "fp32")
                 for spec in ("aligned", "misaligned") for config in subset]
                + [(MATMUL, "fp16", "N=1", arch, config) for arch in ARCHS for config in subset])
    if part == "options":
        base = grid(block_ms=(64, 128, 256), block_ns=(128,), block_ks=(32, 64), stages=(2,), warps=(4, 8))
        variants = [{}, {"waves_per_eu": 2}, {"matrix_instr_nonkdim": 16}, {"matrix_instr_nonkdim": 32}, {"kpack": 2}]
        by_stages = [{**config, "num_stages": stages} for config in base for stages in (1, 3, 4)]
        return ([(MATMUL, "fp16", spec, arch, {**config, **options}) for arch in ARCHS
                 for spec in ("aligned", "misaligned") for config in base for options in variants]
                + [(MATMUL, "fp16", "aligned", arch, config) for arch in ARCHS for config in by_stages])
    if part == "attention":
        configs = [dict(BLOCK_M=m, BLOCK_N=n, num_stages=s, num_warps=w)
                   for m, n, w in ((64, 32, 4), (64, 64, 4), (128, 64, 8), (128, 128, 8)) for s in (1, 2, 3, 4)]
        return [(ATTENTION, "fp16", spec, arch, config) for arch in ARCHS for spec in ("aligned", "misaligned")
                for config in configs]
    if part == "versions":
        subset = grid(block_ms=(32, 128, 256), block_ns=(64, 128), block_ks=(32, 128), stages=(1, 2, 3, 4), warps=(4,))
        return [(MATMUL, "fp16", spec, arch, config) for arch in ARCHS for spec in ("aligned", "misaligned")
                for config in subset]
    if part == "rdna":
        subset = grid(block_ms=(64, 128, 256), block_ns=(64, 128), block_ks=(32, 64), stages=(2, 3), warps=(4,))
        return [(MATMUL, "fp16", spec, "gfx1100", config) for spec in ("aligned", "misaligned") for config in subset]
    raise SystemExit(f"unknown part {part!r}")


_kernels: dict = {}


def _kernel(target: str, dtype: str):
    from smemguard import preflight

    if (target, dtype) not in _kernels:
        hints = {"dtype": dtype, "ones": [["N"]], "configs": [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)]}
        if target == ATTENTION:
            hints = {"dtype": dtype, "signature": {"sm_scale": "fp32"}, "constants": {"HEAD_DIM": 128},
                     "configs": [dict(BLOCK_M=16, BLOCK_N=16)]}
        [_kernels[target, dtype]] = preflight.discover([target], overrides=hints)
    return _kernels[target, dtype]


def compile_one(job: tuple) -> dict:
    import triton

    from smemguard import preflight
    from smemguard.preflight.compiling import compile_request

    target, dtype, spec_name, arch, config = job
    kernel = _kernel(target, dtype)
    spec = next(s for s in kernel.specializations if s.name == spec_name)
    variant = preflight.Variant.of(config)
    result = compile_request(kernel.jit, preflight.build_request(kernel, variant, spec, arch))
    return {**row_key(job), "triton": triton.__version__, "shared": result["shared"],
            "seconds": round(result["seconds"], 2), "error": result["error"] or ""}


def row_key(job: tuple) -> dict:
    target, dtype, spec, arch, config = job
    return {"arch": arch, "kernel": target.rsplit(":", 1)[1], "dtype": dtype, "spec": spec,
            "BM": config["BLOCK_M"], "BN": config["BLOCK_N"], "BK": config.get("BLOCK_K", ""),
            "num_warps": config["num_warps"], "num_stages": config["num_stages"],
            **{option: config.get(option, "") for option in AMD_OPTIONS}}


def _identity(row: dict) -> tuple:
    return tuple(str(row[field]) for field in FIELDS if field not in ("shared", "seconds", "error"))


def _init_worker(cache: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache


def sweep(parts: list[str], out: Path, jobs: int) -> None:
    import triton

    done = set()
    if out.exists():
        done = {_identity(row) for row in csv.DictReader(out.open())}
    todo = [job for part in parts for job in jobs_for(part)
            if _identity({**row_key(job), "triton": triton.__version__}) not in done]
    print(f"{len(todo)} compiles to run ({len(done)} rows already in {out})", file=sys.stderr, flush=True)
    new_file = not out.exists()
    with out.open("a", newline="") as handle, tempfile.TemporaryDirectory(prefix="amd-sweep-") as cache:
        writer = csv.DictWriter(handle, FIELDS)
        if new_file:
            writer.writeheader()
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_init_worker, initargs=(cache,)) as pool:
            for count, row in enumerate(pool.map(compile_one, todo, chunksize=4), 1):
                writer.writerow(row)
                handle.flush()
                if count % 25 == 0 or count == len(todo):
                    print(f"[{count}/{len(todo)}] {row['arch']} {row['spec']} {row['BM']}x{row['BN']}x{row['BK']} "
                          f"s{row['num_stages']} w{row['num_warps']}: {row['shared']} B ({row['seconds']} s)",
                          file=sys.stderr, flush=True)


def summary(out: Path) -> None:
    """Per Triton, arch, kernel, dtype and specialization: how the bytes relate to one stage of
    the A and B tiles (T), and whether each AMD option changed them."""
    rows = [row for row in csv.DictReader(out.open()) if row["shared"]]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["triton"], row["arch"], row["kernel"], row["dtype"], row["spec"]), []).append(row)
    print("| triton | arch | kernel | dtype | spec | compiles | median s | max s | shared / T by stages |")
    print("|---|---|---|---|---|---|---|---|---|")
    element = {"fp16": 2, "bf16": 2, "fp32": 4}
    for key, group in sorted(groups.items()):
        seconds = sorted(float(row["seconds"]) for row in group)
        ratios: dict[str, set] = {}
        if key[2] == "matmul_kernel":
            for row in group:
                if any(row[option] for option in AMD_OPTIONS):
                    continue
                tile = (int(row["BM"]) * int(row["BK"]) + int(row["BK"]) * int(row["BN"])) * element[row["dtype"]]
                ratios.setdefault(row["num_stages"], set()).add(round(int(row["shared"]) / tile, 2))
        text = "; ".join(f"S={stages}: {min(r)}-{max(r)}" for stages, r in sorted(ratios.items()))
        print(f"| {' | '.join(key)} | {len(group)} | {seconds[len(seconds) // 2]:.1f} | {seconds[-1]:.1f} | {text} |")
    print()
    print("| triton | arch | spec | option | configs | bytes changed in | largest change |")
    print("|---|---|---|---|---|---|---|")
    plain = {(_identity({**row, **{option: '' for option in AMD_OPTIONS}})): int(row["shared"]) for row in rows
             if not any(row[option] for option in AMD_OPTIONS)}
    changed: dict[tuple, list[int]] = {}
    for row in rows:
        for option in AMD_OPTIONS:
            if row[option]:
                base = plain.get(_identity({**row, **{o: '' for o in AMD_OPTIONS}}))
                if base is not None:
                    changed.setdefault((row["triton"], row["arch"], row["spec"], f"{option}={row[option]}"),
                                       []).append(int(row["shared"]) - base)
    for key, deltas in sorted(changed.items()):
        moved = [delta for delta in deltas if delta]
        largest = max(moved, key=abs) if moved else 0
        print(f"| {' | '.join(key)} | {len(deltas)} | {len(moved)} | {largest:+d} B |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", action="append", choices=PARTS, help="what to sweep (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("amd_lds_sweep.csv"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--summary", action="store_true", help="print the summary tables of --out")
    args = parser.parse_args()
    if args.part:
        sweep(args.part, args.out, args.jobs)
    if args.summary:
        summary(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
