"""What declaring a wrapper's tile choice costs a healthy call (smemguard/engine/wrapper_tiles.py): the same wrapper
undeclared and declared, smemguard installed, interleaved blocks, median microseconds per call.

Answered (CPU harness, 2026-12-04): a healthy declared call costs 0.6 to 0.9 us over the undeclared one (0.74 us
with what it learns kept in the engine's memory, 0.91 before, in the same run).

    PYTHONPATH=.:tests python benchmarks/experiments/wrapper_tiles_cost.py [--calls 2000] [--blocks 15]

On a CUDA GPU the wrapper launches a real 256x256 fp16 matmul (its tile fits: a healthy call); without one, on the
CPU harness (``fake_gpu("L4")``: Triton's own launch path up to the driver, no kernel runs).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=15)
    args = parser.parse_args()

    import contextlib

    import torch
    import triton

    import smemguard
    from smemguard.facts.settings import Settings
    from smemguard.testing import fake_gpu

    from kernels import matmul_args, matmul_kernel

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"

    def block_m_for(rows: int, dtype: str) -> int:
        return 64

    declared_choice = smemguard.tile_choice(kernel=matmul_kernel, tile="BLOCK_M")(block_m_for)

    def wrapper_with(choose):
        def matmul(a, b, c):
            block_m = choose(a.shape[0], str(a.dtype))
            matmul_kernel[(triton.cdiv(a.shape[0], block_m), 2)](*matmul_args(a, b, c), BLOCK_M=block_m, BLOCK_N=128,
                                                                 BLOCK_K=32, num_stages=2)
        return matmul

    sides = {"undeclared": wrapper_with(block_m_for),
             "declared": smemguard.rerun_on_overflow(declared_choice)(wrapper_with(declared_choice))}
    a, b, c = (torch.zeros(256, 256, dtype=torch.float16, device=device) for _ in range(3))
    with contextlib.nullcontext() if gpu else fake_gpu("L4"):
        assert smemguard.install(Settings())
        try:
            for side in sides.values():
                side(a, b, c)  # compiled once, outside the timing
            blocks = {name: [] for name in sides}
            for _ in range(args.blocks):
                for name, side in sides.items():
                    started = time.perf_counter()
                    for _ in range(args.calls):
                        side(a, b, c)
                    if gpu:
                        torch.cuda.synchronize()
                    blocks[name].append((time.perf_counter() - started) / args.calls * 1e6)
        finally:
            smemguard.uninstall()
    where = torch.cuda.get_device_name() if gpu else f"CPU harness ({platform.processor() or platform.machine()})"
    print(f"# {where}, torch {torch.__version__}, Triton {triton.__version__}, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}, {args.blocks} blocks of {args.calls} calls")
    base = statistics.median(blocks["undeclared"])
    for name, times in blocks.items():
        print(f"{name:12} median {statistics.median(times):8.2f} us  ratio {statistics.median(times) / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
