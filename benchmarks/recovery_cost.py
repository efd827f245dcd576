"""What a recovery costs: the first incident, the remembered case in-process, and in a new process.

One fp16 matmul launch (128x128x64 tiles, 4 stages: 131072 B on sm_90) under an emulated
L20 limit (101376 B), in three situations:

  first       a process meets the overflow: time of the failing launch including recovery,
              compiles done (the failing variant and each candidate), from a cold Triton cache
  remembered  the same process launches it again: time per launch, compiles, exceptions
  new process a second process with the same SMEMGUARD_CACHE_DIR (warm Triton cache): its
              first launch, compiles, and whether it compiled the failing variant at all

    python benchmarks/recovery_cost.py --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import harness

WORKER = r"""
import json, sys, time, torch
from triton import knobs
import smemguard
from smemguard.engine import recovery
from smemguard.examples import matmul_args, matmul_kernel

compiled, handled = [], []
knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(kw["compile"]["num_stages"]) or False
handle = recovery.handle
recovery.handle = lambda *a: handled.append(1) or handle(*a)
smemguard.install()
n = 2048
a, b = (torch.randn(n, n, device="cuda", dtype=torch.float16) for _ in range(2))
c = torch.empty(n, n, device="cuda", dtype=torch.float16)
launch = lambda: matmul_kernel[(n // 128, n // 128)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                                     num_stages=4)
torch.cuda.synchronize()
started = time.perf_counter()
kernel = launch()
torch.cuda.synchronize()
first_ms = (time.perf_counter() - started) * 1000
first = {"ms": first_ms, "compiled_stages": list(compiled), "exceptions": len(handled),
         "final_stages": kernel.metadata.num_stages}
compiled.clear(); handled.clear()
times = []
for _ in range(200):
    torch.cuda.synchronize()
    started = time.perf_counter()
    launch()
    torch.cuda.synchronize()
    times.append((time.perf_counter() - started) * 1e6)
again = {"median_us": sorted(times)[len(times) // 2], "compiled_stages": list(compiled), "exceptions": len(handled)}
print(json.dumps({"first": first, "again": again}))
"""


def main() -> int:
    args = harness.parser(__doc__).parse_args()
    with harness.scratch("recovery-cost") as scratch:
        # both processes share the decision store and Triton's cache (warm for the second): a fleet's next process
        env = harness.environment(limit="L20", cache_dir=f"{scratch}/decisions",
                                  triton_cache=harness.TritonCache("warm", Path(scratch)).next())
        first_process = harness.fresh_process(["-c", WORKER], env=env)
        second_process = harness.fresh_process(["-c", WORKER], env=env)
    document = harness.write(args.json, {"first_process": first_process, "second_process": second_process},
                             limit="L20")
    first, again, fresh = first_process["first"], first_process["again"], second_process["first"]
    print(f"# recovery cost: {harness.headline(document)}")
    print(f"{'case':34} {'time':>12} {'compiles (num_stages)':>24} {'exceptions':>10}")
    print(f"{'first incident (cold Triton cache)':34} {first['ms']:9.1f} ms {str(first['compiled_stages']):>24} "
          f"{first['exceptions']:>10}")
    print(f"{'remembered, same process':34} {again['median_us']:9.1f} us {str(again['compiled_stages']):>24} "
          f"{again['exceptions']:>10}")
    print(f"{'remembered, new process':34} {fresh['ms']:9.1f} ms {str(fresh['compiled_stages']):>24} "
          f"{fresh['exceptions']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
