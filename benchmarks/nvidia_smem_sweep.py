"""Shared memory of Triton kernels compiled for sm_70 (V100), sm_75 (T4) and sm_120 (RTX 5090) on this CPU.

    PYTHONPATH=. python benchmarks/nvidia_smem_sweep.py --part versions --part dtypes --out nvidia_smem_sweep.csv
    PYTHONPATH=. python benchmarks/nvidia_smem_sweep.py --summary --out tests/data/nvidia_smem_sweep.csv

The calibration of ``smemguard check``'s estimate for these archs (``smemguard/kernels/estimate.py``;
sm_80, sm_89 and sm_90 were calibrated on ``tests/data/triton36_smem_sweep.csv``). Every row is one
compile by the check's own compiler (``sweeping.py``), for:

- ``versions``: smemguard's example fp16 matmul on 60 configs (BLOCK_M 32/128/256, BLOCK_N 64/128,
  BLOCK_K 32/64, 1 to 5 stages, 4 warps), aligned and misaligned: what stages change, per release;
- ``dtypes``: bf16 and fp32 operands aligned and misaligned, and fp16 launches with N == 1, on a
  24-config subset (BLOCK_M 64/128/256, BLOCK_N 128, BLOCK_K 32/64, 2 or 4 stages, 4 or 8 warps);
- ``grid``: FlagGems' 216-config grid (the ``--examples`` matmul), fp16 aligned and misaligned;
- ``examples``: the other example kernels in their own configs and specializations (vLLM's
  persistent fp32 matmul, the flash-attention forward).

Each part covers the three archs (``--arch 75`` for one). ``versions``, ``dtypes`` and ``examples`` for
sm_75 and sm_120 (516 compiles) took 55 minutes in one process on a shared 2-core machine; sm_70's
big tiles take minutes each, and ``grid`` (1296 compiles) wants many cores.
"""

from __future__ import annotations

import sys

from sweeping import ATTENTION, MATMUL, PERSISTENT, grid, main

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


PARTS = {"versions": versions, "dtypes": dtypes, "grid": flaggems_grid, "examples": examples}

if __name__ == "__main__":
    sys.exit(main(__doc__, PARTS, "nvidia_smem_sweep.csv"))
