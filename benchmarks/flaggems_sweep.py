"""FlagGems' Hopper matmul over random shapes under an emulated L20 limit, with and without smemguard.

Needs a Hopper GPU and FlagGems (5.0.2). Usage:

    python benchmarks/flaggems_sweep.py --json out.json [--shapes 48] [--seed 0]

Every phase is a fresh process over the same shapes (M from 1 to 8192, log-uniform; N and K
from 1024 to 4096; fp16 and bf16; a third with B column-major; a few A views misaligned by
one element). ``mm_kernel_general_host_tma`` gets 24 configs of its unfiltered list of 216
(tuning all 216 for every shape takes longer than a device session): BLOCK_M 64/128/256,
BLOCK_N 64/128, BLOCK_K 64/128, 3 or 4 stages, 8 warps, of which 15 overflow an L20.

1. ``tune``: no smemguard, the GPU's own limit. FlagGems tunes each shape and files its choice
   in its SQLite database, as a bigger GPU's tuning run would;
2. ``observe``: that database, ``SMEMGUARD_MAX_SHARED=L20``, ``SMEMGUARD=observe`` (the
   limit is enforced, nothing is recovered): what an L20 would do with it;
3. ``on-launch-guard``: the same with ``SMEMGUARD=on`` and the compile-time core off
   (``SMEMGUARD_DISABLE=triton_compile``): recovery after the load check raised, as before the core;
4. ``on``: the same with the core;
5. ``fresh-observe`` and ``fresh-on``: an empty database, so FlagGems tunes under the L20 limit.

Each shape's result is compared with ``torch.mm`` in float32 (cuBLAS). Counted apart: an
``OutOfResources`` reaching the caller, every one Triton's load check raised (caught or not: ``raised``),
FlagGems' own errors by type (its 16-byte alignment
assertion for TMA descriptors, compile errors), and results off the reference.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

import harness

PHASES = {  # name: (environment, database)
    "tune": ({"SMEMGUARD": "off"}, "tuned"),
    "observe": ({"SMEMGUARD": "observe", "SMEMGUARD_MAX_SHARED": "L20"}, "tuned-copy-1"),
    "on-launch-guard": ({"SMEMGUARD": "on", "SMEMGUARD_MAX_SHARED": "L20", "SMEMGUARD_DISABLE": "triton_compile"},
                        "tuned-copy-3"),
    "on": ({"SMEMGUARD": "on", "SMEMGUARD_MAX_SHARED": "L20"}, "tuned-copy-2"),
    "fresh-observe": ({"SMEMGUARD": "observe", "SMEMGUARD_MAX_SHARED": "L20"}, "fresh-1"),
    "fresh-on": ({"SMEMGUARD": "on", "SMEMGUARD_MAX_SHARED": "L20"}, "fresh-2"),
}
TOLERANCE = 2e-2  # max |c - ref| / max |ref|, for fp16/bf16 outputs of a float32-accumulated product


def shapes(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    chosen = []
    for index in range(count):
        chosen.append({"M": max(1, min(8192, round(math.exp(rng.uniform(0, math.log(8192)))))),
                       "N": rng.choice((1024, 2048, 3072, 4096)), "K": rng.choice((1024, 2048, 3072, 4096)),
                       "dtype": rng.choice(("float16", "bfloat16")), "b_column_major": index % 3 == 2,
                       "a_misaligned": index % 16 == 15})
    return chosen


def _config_subset(hopper):
    limit = hopper._get_shared_memory_limit_bytes
    hopper._get_shared_memory_limit_bytes = lambda: None  # FlagGems' own list, before its filter
    try:
        unfiltered = hopper.matmul_get_configs()
    finally:
        hopper._get_shared_memory_limit_bytes = limit
    return [c for c in unfiltered if c.kwargs["BLOCK_M"] >= 64 and c.kwargs["BLOCK_N"] >= 64
            and c.kwargs["BLOCK_K"] >= 64 and c.num_stages >= 3 and c.num_warps == 8]


def worker(shape_list: list[dict]) -> dict:
    import smemguard
    from smemguard.testing import load_check_failures

    with load_check_failures() as raised:
        smemguard.install()
        outcome = _sweep(shape_list)
    outcome["counts"]["raised"] = len(raised)
    return outcome


def _sweep(shape_list: list[dict]) -> dict:
    import flag_gems
    import torch
    from triton.runtime.errors import OutOfResources

    hopper = sys.modules[flag_gems.mm.__module__]  # "hopper.ops.mm": the arch module FlagGems picked
    assert hasattr(hopper, "mm_kernel_general_host_tma"), f"not FlagGems' Hopper matmul: {hopper.__name__}"
    hopper.mm_kernel_general_host_tma.fn.configs = _config_subset(hopper)
    counts = collections.Counter()
    errors = collections.Counter()
    worst = 0.0
    started = time.perf_counter()
    for shape in shape_list:
        dtype = getattr(torch, shape["dtype"])
        M, N, K = shape["M"], shape["N"], shape["K"]
        torch.manual_seed(M * 7 + N + K)
        a = torch.randn(M * K + 1, device="cuda", dtype=dtype)
        a = (a[1:] if shape["a_misaligned"] else a[:-1]).view(M, K)
        b = torch.randn(N, K, device="cuda", dtype=dtype).t() if shape["b_column_major"] else \
            torch.randn(K, N, device="cuda", dtype=dtype)
        reference = a.float() @ b.float()
        counts["shapes"] += 1
        try:
            c = hopper.mm(a, b)
            torch.cuda.synchronize()
        except OutOfResources:
            counts["out_of_resources"] += 1
            continue
        except Exception as error:  # FlagGems' own: counted by type, never mistaken for ours
            errors[f"{type(error).__name__}: {str(error).strip().splitlines()[0][:80]}"] += 1
            continue
        error = ((c.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-6)).item()
        worst = max(worst, error)
        counts["ok" if error <= TOLERANCE else "wrong"] += 1
    counts["seconds"] = round(time.perf_counter() - started, 1)
    return {"counts": dict(counts), "flaggems_errors": dict(errors), "worst_relative_error": worst}


def _incidents(path: str) -> dict:
    """{action: count} of the incident records, and {kernel: count} under "kernels"."""
    actions, kernels = collections.Counter(), collections.Counter()
    if os.path.exists(path):
        for line in open(path):
            record = json.loads(line)
            actions[record["action"]] += 1
            kernels[record["kernel"]] += 1
    return {**actions, "kernels": dict(kernels)} if kernels else {}


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--shapes", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape_list = shapes(args.shapes, args.seed)
    if args.worker:
        print(json.dumps(worker(shape_list)))
        return 0

    work = tempfile.mkdtemp(prefix="flaggems-sweep-")
    results = {"shapes": shape_list, "phases": {}}
    for phase, (env, database) in PHASES.items():
        db_path = os.path.join(work, f"{database}.db")
        if database.startswith("tuned-copy"):
            shutil.copy(os.path.join(work, "tuned.db"), db_path)
        log = os.path.join(work, f"{phase}.jsonl")
        # A decision cache of its own: a phase must not start from the configs an earlier phase switched to; one
        # Triton cache for all (warm after tuning), as on one host.
        full_env = harness.environment(log=log, cache_dir=os.path.join(work, f"{phase}-decisions"),
                                       triton_cache=os.path.join(work, "triton-cache"),
                                       base={k: v for k, v in os.environ.items() if not k.startswith("SMEMGUARD")})
        full_env.update(env, FLAGGEMS_DB_URL=f"sqlite:///{db_path}")
        outcome = harness.fresh_process([__file__, "--worker", phase, "--shapes", str(args.shapes), "--seed",
                                         str(args.seed)], env=full_env, timeout=3600, check=False)
        if "error" in outcome:
            print(f"{phase}: {outcome['error']}", file=sys.stderr)
            results["phases"][phase] = {"failed": outcome["error"]}
            continue
        outcome["incidents"] = _incidents(log)
        results["phases"][phase] = outcome
        print(phase, json.dumps(outcome), flush=True)
    document = harness.write(args.json, results, "flag_gems")
    print(f"\n{harness.headline(document)}, {len(shape_list)} shapes")
    print(f"{'phase':<16} {'ok':>4} {'wrong':>5} {'OOR':>4} {'raised':>6} {'FlagGems errors':>15} {'incidents':<40} "
          f"{'s':>6}")
    for phase, outcome in results["phases"].items():
        if "counts" not in outcome:
            print(f"{phase:<16} failed ({outcome})")
            continue
        c = outcome["counts"]
        print(f"{phase:<16} {c.get('ok', 0):>4} {c.get('wrong', 0):>5} {c.get('out_of_resources', 0):>4} "
              f"{c.get('raised', 0):>6} "
              f"{sum(outcome['flaggems_errors'].values()):>15} "
              f"{json.dumps({k: v for k, v in outcome['incidents'].items() if k != 'kernels'}):<40} "
              f"{c['seconds']:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
