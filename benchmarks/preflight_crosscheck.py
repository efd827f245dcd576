"""Cross-check `smemguard check` against real launches on this GPU (written for the H200).

    python benchmarks/preflight_crosscheck.py [--json crosscheck.json]

Needs torch, triton and this repository, nothing else. For 20 configs (fp16 matmul on both sides
of the limit, misaligned matmul, vLLM's persistent fp32 matmul aligned and with N == 1, the
flash-attention example) it:

1. predicts with the preflight for this GPU's table entry (`smemguard check --gpu H200`: sm_90,
   232448 B), compiled on the CPU in worker processes, both `--exact` (bytes) and by default
   (verdicts, estimated where the estimate is sure);
2. launches each config with real tensors in the same specialization, with its own Triton
   cache (so nothing the preflight compiled is reused), and records what the launch did:
   ran with `metadata.shared` bytes, or raised `OutOfResources` with `required` bytes;
3. checks that `smemguard.fits_for(kernel)` keeps exactly the matmul configs that ran.

Prints one table row per config and exits 1 on any mismatch (2 without a GPU or with a GPU
whose limit differs from smemguard's table).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass

import harness
import torch
import triton
from triton import knobs
from triton.runtime import driver
from triton.runtime.errors import OutOfResources

import smemguard
from smemguard.facts import gpus
from smemguard import preflight
from smemguard.examples import attention_args, attention_grid, matmul_args, matmul_kernel, tiled_grid


@dataclass(frozen=True)
class Case:
    target: str  # what the preflight checks: "smemguard.examples:NAME"
    meta: tuple  # constexpr values, then num_warps and num_stages
    specialization: str

    def config(self) -> dict:
        *constexprs, warps, stages = self.meta
        names = ("BLOCK_M", "BLOCK_N", "BLOCK_K")[:len(constexprs)]
        return {**dict(zip(names, constexprs)), "num_warps": warps, "num_stages": stages}


MATMUL = "smemguard.examples:flaggems_matmul"
PERSISTENT = "smemguard.examples:matmul_persistent_kernel"
ATTENTION = "smemguard.examples:attention_fwd"

CASES = [
    # sm_90 aligned needs stages x (BM*BK + BK*BN) x 2 B: six under 232448, six over.
    *(Case(MATMUL, meta, "aligned") for meta in (
        (128, 128, 128, 8, 3), (256, 128, 64, 8, 4), (64, 128, 128, 4, 4), (256, 32, 128, 4, 3),
        (128, 64, 128, 4, 4), (256, 128, 128, 8, 2),
        (128, 128, 128, 8, 4), (256, 64, 128, 8, 3), (256, 128, 128, 8, 3), (256, 32, 128, 4, 4),
        (128, 128, 128, 4, 4), (256, 64, 128, 4, 4))),
    # Misaligned: no TMA/cp.async pipeline, about one stage.
    Case(MATMUL, (256, 128, 128, 8, 4), "misaligned"),
    Case(MATMUL, (128, 128, 128, 4, 4), "misaligned"),
    # vLLM's batch-invariant fp32 matmul, with a wide B and with N == 1.
    *(Case(PERSISTENT, meta, spec) for meta in ((128, 128, 32, 8, 3), (128, 128, 32, 4, 4))
      for spec in ("aligned", "N=1")),
    Case(ATTENTION, (128, 128, 8, 2), "aligned"),
    Case(ATTENTION, (128, 128, 8, 3), "aligned"),
]


def operands(target: str, specialization: str, device="cuda") -> tuple[tuple, object]:
    """Launch arguments and grid that put a launch in ``specialization`` (as the preflight defines it)."""
    if target == ATTENTION:
        heads, seq_len, head_dim = 2, 256, 128
        q, k, v, o = (torch.randn(heads, seq_len, head_dim, device=device, dtype=torch.float16) for _ in range(4))
        return attention_args(q, k, v, o, head_dim ** -0.5), attention_grid(seq_len, heads)
    dtype = torch.float32 if target == PERSISTENT else torch.float16
    if specialization == "N=1":  # a (K, 1) weight and an (M, 1) output: every stride of B and C is 1
        a, b, c = (torch.randn(512, 512, device=device, dtype=dtype), torch.randn(512, 1, device=device, dtype=dtype),
                   torch.empty(512, 1, device=device, dtype=dtype))
    else:
        # Misaligned: every pointer 2 bytes past 16-byte alignment, every size and stride odd.
        n, offset = (512, 0) if specialization == "aligned" else (511, 1)
        a, b, c = (torch.randn(n * n + offset, device=device, dtype=dtype)[offset:].view(n, n) for _ in range(3))
    grid = (132,) if target == PERSISTENT else tiled_grid(a.shape[0], b.shape[1])
    return matmul_args(a, b, c), grid


def launch(kernel: preflight.CheckedKernel, case: Case) -> tuple[str, int]:
    args, grid = operands(case.target, case.specialization)
    meta = {**kernel.constants, **case.config()}
    try:
        compiled = kernel.jit[grid](*args, **meta)
        torch.cuda.synchronize()
    except OutOfResources as error:
        return preflight.OVERFLOWS, error.required
    return preflight.FITS, compiled.metadata.shared


def main() -> int:
    args = harness.parser(__doc__).parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    gpu = gpus.lookup(name)
    device_limit = driver.active.utils.get_device_properties(torch.cuda.current_device())["max_shared_mem"]
    capability = torch.cuda.get_device_capability()
    print(f"{name} (sm_{capability[0]}{capability[1]}, {device_limit} B per block), Triton {triton.__version__}, "
          f"torch {torch.__version__}")
    if gpu is None or gpu.max_shared != device_limit or gpu.capability != capability[0] * 10 + capability[1]:
        print(f"smemguard's GPU table says {gpu} for this device: fix smemguard/facts/gpus.py first", file=sys.stderr)
        return 2

    targets = list(dict.fromkeys(case.target for case in CASES))
    kernels = {}
    for target in targets:
        configs = list(dict.fromkeys(case.meta for case in CASES if case.target == target))
        [kernels[target]] = preflight.discover([target], overrides={"configs": [
            next(case for case in CASES if case.meta == meta and case.target == target).config() for meta in configs]})
    checked = list(kernels.values())
    with tempfile.TemporaryDirectory(prefix="smemguard-crosscheck-") as scratch:
        jobs = min(os.cpu_count() or 1, 16)
        exact = preflight.check(checked, [gpu], exact=True, jobs=jobs)
        default = preflight.check(checked, [gpu], jobs=jobs)
        print(f"preflight: {exact.compiles} compiles in {exact.seconds:.1f} s (--exact); default check "
              f"{default.compiles} compiles, {default.counts()[preflight.ESTIMATED]} verdicts estimated")
        rows = []
        with knobs.cache.scope():
            knobs.cache.dir = f"{scratch}/launches"  # compiled afresh by the launch, not read from the preflight's
            for case in CASES:
                index = targets.index(case.target)
                kernel = kernels[case.target]
                variant = next(v for v, variant in enumerate(kernel.variants)
                               if variant.label() == preflight.Variant.of(case.config()).label())
                predicted = exact.verdict(index, variant, case.specialization, gpu.name)
                quick = default.verdict(index, variant, case.specialization, gpu.name)
                outcome, required = launch(kernel, case)
                ok = (predicted.verdict, predicted.shared) == (outcome, required) and quick.verdict == outcome
                rows.append({"kernel": case.target.rsplit(":", 1)[1], "config": kernel.variants[variant].label(),
                             "specialization": case.specialization, "predicted": predicted.verdict,
                             "predicted_bytes": predicted.shared, "default_check": f"{quick.verdict} ({quick.how})",
                             "launch": "ran" if outcome == preflight.FITS else "OutOfResources",
                             "launch_bytes": required, "match": ok})

            named = dict(zip(matmul_kernel.arg_names, operands(MATMUL, "aligned")[0]))
            aligned = [case for case in CASES if case.target == MATMUL and case.specialization == "aligned"]
            kept = smemguard.fits_for(matmul_kernel)([triton.Config(
                {k: v for k, v in case.config().items() if k.startswith("BLOCK")}, num_warps=case.meta[3],
                num_stages=case.meta[4]) for case in aligned], named)
            kept_labels = {preflight.Variant.of(config).label() for config in kept}
            ran = {row["config"] for row in rows if row["kernel"] == "flaggems_matmul"
                   and row["specialization"] == "aligned" and row["launch"] == "ran"}
    header = ("kernel", "config", "specialization", "predicted", "bytes", "default check", "launch", "bytes", "")
    table = [header] + [(r["kernel"], r["config"], r["specialization"], r["predicted"], str(r["predicted_bytes"]),
                         r["default_check"], r["launch"], str(r["launch_bytes"]), "ok" if r["match"] else "MISMATCH")
                        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    mismatches = sum(not row["match"] for row in rows)
    fits_ok = kept_labels == ran
    print(f"\n{len(rows) - mismatches}/{len(rows)} predictions match the launches; fits_for keeps "
          f"{len(kept_labels)} configs, the ones that ran: {'yes' if fits_ok else 'NO'}")
    harness.write(args.json, {"rows": rows, "fits_for_matches": fits_ok})
    return 0 if mismatches == 0 and fits_ok else 1


if __name__ == "__main__":
    sys.exit(main())
