"""How many candidate compiles, and how long, one incident costs: two smemguard trees side by side.

Each scenario runs in a fresh process with a cold Triton cache, for each tree named with
``--tree LABEL=DIR`` (its ``smemguard`` package is imported from DIR), so the numbers of two
versions come from one run:

  autotune-trap   ``matmul_kernel`` autotuned over FlagGems' 216-config grid, the tuner's choice for
                  the key made where 256x128x128 with 4 stages fit, launched under a T4's 65536 B
  smallest-fit    the same, under 8192 B: only the smallest configs of the grid fit
  nothing-fits    the same, under 2048 B: no config fits, the original error is re-raised
  stages-only     a plain ``matmul_kernel`` launch, 128x128x64 with 5 stages, under 40000 B

Compiles are counted with Triton's ``knobs.runtime.jit_cache_hook`` (every JIT cache miss), so
both trees are measured the same way. ``seconds`` is the whole failing launch (the compile of the
config that overflows included); ``smemguard s`` the incident record's ``recovery_ms``: from
catching the error to the decision. On a machine without a GPU, ``--harness`` compiles for
sm_90 on smemguard's CPU stand-in (nothing executes); on a GPU the limit is emulated.

    python benchmarks/incident_compiles.py --tree before=.field/smemguard-base --tree after=. --harness
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import harness

SCENARIOS = {"autotune-trap": 65536, "smallest-fit": 8192, "nothing-fits": 2048, "stages-only": 40000}

WORKER = r"""
import contextlib, json, pathlib, sys, tempfile, time
import torch, triton
from triton import knobs
scenario, limit, harness = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
log = pathlib.Path(tempfile.mkdtemp()) / "incidents.jsonl"
import smemguard
from smemguard.facts.settings import Settings
from smemguard.examples import FLAGGEMS_MATMUL_CONFIGS, autotuned_matmul, matmul_args, matmul_kernel, tiled_grid

compiles = []
knobs.runtime.jit_cache_hook = lambda **kw: compiles.append(1) or False
device = "cpu" if harness else "cuda"
a, b, c = (torch.randn(512, 512, dtype=torch.float16, device=device) for _ in range(3))
if harness:
    from smemguard.testing import fake_gpu
    place = fake_gpu(90, max_shared=limit)
    smemguard.install(Settings(cache_dir=None, log_path=log))
else:
    place = contextlib.nullcontext()
    smemguard.install(Settings(max_shared=limit, cache_dir=None, log_path=log))
with place:
    if scenario == "stages-only":
        launch = lambda: matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                               num_stages=5)
    else:
        tuned = autotuned_matmul(FLAGGEMS_MATMUL_CONFIGS)
        big = next(cfg for cfg in tuned.configs if (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"],
                                                    cfg.num_stages, cfg.num_warps) == (256, 128, 128, 4, 8))
        tuned.cache[(512, 512, 512, "torch.float16", "torch.float16", "torch.float16")] = big
        launch = lambda: tuned[tiled_grid(512, 512)](*matmul_args(a, b, c))
    started = time.perf_counter()
    try:
        launch()
        outcome = "recovered"
    except triton.runtime.errors.OutOfResources:
        outcome = "re-raised"
    seconds = time.perf_counter() - started
record = json.loads(log.read_text().splitlines()[0])
print(json.dumps({"compiles": len(compiles) - 1, "seconds": round(seconds, 3), "outcome": outcome,
                  "recovery_s": round(record["recovery_ms"] / 1000, 3), "smemguard": smemguard.__file__}))
"""


def run(tree: Path, scenario: str, on_harness: bool) -> dict:
    """One scenario in a fresh process importing ``tree``'s smemguard, with a cold Triton cache."""
    with harness.scratch("incident-compiles") as scratch:
        env = harness.environment(triton_cache=harness.TritonCache("cold", Path(scratch)).next(),
                                  base={k: v for k, v in os.environ.items() if not k.startswith("SMEMGUARD")})
        env["PYTHONPATH"] = os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
        # Run from the tree itself: "python -c" puts the working directory first on sys.path.
        return harness.fresh_process(["-c", WORKER, scenario, str(SCENARIOS[scenario]), str(int(on_harness))],
                                     env=env, cwd=tree, timeout=1800, check=False)


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--tree", action="append", required=True, metavar="LABEL=DIR",
                        help="a smemguard checkout to measure (repeat: the first is the baseline)")
    parser.add_argument("--harness", action="store_true", help="compile for sm_90 on the CPU stand-in (no GPU)")
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="default: all")
    args = parser.parse_args()
    trees = [(label, Path(path).resolve()) for label, _, path in (tree.partition("=") for tree in args.tree)]
    results = []
    for scenario in args.scenario or list(SCENARIOS):
        for label, tree in trees:
            result = {"scenario": scenario, "tree": label, "limit": SCENARIOS[scenario],
                      **run(tree, scenario, args.harness)}
            results.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    document = harness.write(args.json, results, harness=args.harness,
                             trees={label: str(tree) for label, tree in trees})
    print(harness.headline(document))
    print(f"{'scenario':14} {'tree':8} {'limit':>7} {'outcome':10} {'compiles':>8} {'seconds':>8} {'smemguard s':>11}")
    for r in results:
        print(f"{r['scenario']:14} {r['tree']:8} {r['limit']:>7} {r.get('outcome', r.get('error', '?'))[:40]:10} "
              f"{r.get('compiles', '-'):>8} {r.get('seconds', '-'):>8} {r.get('recovery_s', '-'):>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
