"""Host cost of launching a healthy Triton kernel, with and without smemguard, in one run.

Sides alternate block by block (order flipped every block, so drift hits both alike); each
block times `launches` back-to-back `kernel[grid](...)` calls of a kernel far shorter than
its launch, so the figure is the host-side launch path. Reported per side: the median of
the block means and their 10th-90th percentile spread, and the ratio to unpatched Triton.

Sides:
  triton        unpatched Triton
  smemguard     smemguard.install() with default settings
  emulated      smemguard with SMEMGUARD_MAX_SHARED=L20 (only Triton's first-launch check changes)
  wrapt-run     for comparison only: a wrapt wrapper with try/except around JITFunction.run,
                the patch point the design card first suggested
Workloads:
  jit           a plain @triton.jit vector add
  autotuned     the same kernel behind triton.autotune (tuned before timing)
  recovered     a matmul smemguard recovered under an emulated L20 (num_stages 4 -> 3); its
                later launches run the replacement from Triton's JIT cache

    python benchmarks/launch_overhead.py --blocks 40 --launches 1000 --json out.json
"""

from __future__ import annotations

import statistics
import sys
import time

import harness
import torch
import triton
import triton.language as tl
import wrapt

import smemguard
from smemguard.examples import matmul_args, matmul_kernel
from smemguard.facts.settings import Settings


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)


def _wrapt_run_wrapper(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    except triton.runtime.errors.OutOfResources:
        raise


class Side:
    def __init__(self, name, enter, leave):
        self.name, self.enter, self.leave = name, enter, leave
        self.blocks: dict[str, list[float]] = {}


def _install(**fields):
    return lambda: smemguard.install(Settings(**fields))


def _wrapt_on():
    wrapt.wrap_function_wrapper("triton.runtime.jit", "JITFunction.run", _wrapt_run_wrapper)


def _wrapt_off():
    from triton.runtime.jit import JITFunction

    JITFunction.run = JITFunction.__dict__["run"].__wrapped__


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--blocks", type=int, default=40, help="blocks per side (default 40)")
    parser.add_argument("--launches", type=int, default=1000, help="launches per block (default 1000)")
    args = parser.parse_args()

    n = 4096
    x, y, out = (torch.randn(n, device="cuda") for _ in range(3))
    healthy = lambda: add_kernel[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK=1024)  # noqa: E731

    tuned = triton.autotune([triton.Config({"BLOCK": 1024}, num_warps=4), triton.Config({"BLOCK": 512}, num_warps=4)],
                            key=["n"])(triton.jit(add_kernel.fn))
    autotuned = lambda: tuned[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, out, n)  # noqa: E731

    # A kernel smemguard has recovered: 4 stages of 128x128x64 fp16 overflow an emulated L20 on sm_90.
    a = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    b = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    c = torch.empty(256, 256, device="cuda", dtype=torch.float16)
    recovered_kernel = lambda: matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128,  # noqa: E731
                                                     BLOCK_K=64, num_stages=4)
    smemguard.install(Settings(max_shared=101376, max_shared_label="L20"))
    recovered_kernel()
    smemguard.uninstall()

    sides = [
        Side("triton", lambda: None, lambda: None),
        Side("smemguard", _install(), smemguard.uninstall),
        Side("emulated", _install(max_shared=101376, max_shared_label="L20"), smemguard.uninstall),
        Side("wrapt-run", _wrapt_on, _wrapt_off),
    ]
    workloads = {"jit": healthy, "autotuned": autotuned, "recovered": recovered_kernel}
    for fn in workloads.values():  # compile, tune, warm up
        for _ in range(100):
            fn()
    torch.cuda.synchronize()

    for block in range(args.blocks):
        order = sides if block % 2 == 0 else sides[::-1]
        for side in order:
            side.enter()
            try:
                for workload, fn in workloads.items():
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    for _ in range(args.launches):
                        fn()
                    torch.cuda.synchronize()
                    side.blocks.setdefault(workload, []).append((time.perf_counter() - started) / args.launches * 1e6)
            finally:
                side.leave()

    def summary(values):
        q = statistics.quantiles(values, n=10)
        return statistics.median(values), q[0], q[-1]

    rows = []
    for workload in workloads:
        base = summary(sides[0].blocks[workload])[0]
        for side in sides:
            median, p10, p90 = summary(side.blocks[workload])
            rows.append((workload, side.name, median, p10, p90, median / base))
    document = harness.write(args.json, {"rows": rows, "blocks": {s.name: s.blocks for s in sides}}, "wrapt",
                             blocks=args.blocks, launches_per_block=args.launches)
    print(f"# launch overhead: {harness.headline(document)}, {args.blocks} blocks of {args.launches} launches")
    print(f"{'workload':10} {'side':10} {'median us':>10} {'p10':>7} {'p90':>7} {'ratio':>7}")
    for workload, side, median, p10, p90, ratio in rows:
        print(f"{workload:10} {side:10} {median:10.2f} {p10:7.2f} {p90:7.2f} {ratio:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
