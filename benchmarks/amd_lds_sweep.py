"""LDS (shared memory) of Triton kernels compiled for AMD GPUs on this CPU: what each option changes.

    PYTHONPATH=. python benchmarks/amd_lds_sweep.py --part grid --out benchmarks/results/amd_lds_sweep.csv

Every row is one compile by ``smemguard check``'s own compiler through Triton's HIP backend
(``sweeping.py``), for:

- ``grid``: smemguard's example fp16 matmul over FlagGems' 216-config grid (BLOCK_M 32-256,
  BLOCK_N 32-128, BLOCK_K 32-128, 2-4 stages, 4 or 8 warps), aligned and misaligned, on gfx942
  (MI300X/MI325X), gfx950 (MI355X) and gfx90a (MI250X/MI210);
- ``dtypes``: bf16 and fp32 operands, and launches with N == 1, on a 36-config subset;
- ``options``: the AMD compile options on 12 configs: ``waves_per_eu`` 2, ``matrix_instr_nonkdim``
  16 and 32, ``kpack`` 2, ``num_stages`` 1 to 4 and ``num_warps`` 4 and 8;
- ``attention``: the example flash-attention forward at 1 to 4 stages;
- ``rdna``: gfx1100 (RX 7900 XTX, wave32) on a 24-config subset;
- ``versions``: a 48-config subset of ``grid`` (1 to 4 stages), to repeat on other Triton releases.

Rows are appended as they finish, with the Triton version (a part can be resumed). ``--summary``
prints what the rows say per arch, specialization and option.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from sweeping import ATTENTION, MATMUL, grid, identity, main

ARCHS = ("gfx942", "gfx950", "gfx90a")
AMD_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")


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


PARTS = ("grid", "dtypes", "options", "attention", "rdna", "versions")

if __name__ == "__main__":
    sys.exit(main(__doc__, {part: (lambda part=part: jobs_for(part)) for part in PARTS}, "amd_lds_sweep.csv",
                  AMD_OPTIONS, [option_changes]))
