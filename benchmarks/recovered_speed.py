"""How fast a recovered kernel runs, against the alternatives, for 20 matmul shapes on one GPU.

For each shape and dtype, an autotuned matmul (``smemguard.examples.matmul_kernel`` over
CONFIGS, which include configs too big for small GPUs) is tuned at the GPU's own limit, as it
would be on the big GPU it ships from. Then, under each emulated limit (L4/L20: 101376 B,
A100: 166912 B), its launch is handed to smemguard, and we time (median of
``triton.testing.do_bench``, all on the same GPU, each config launched directly):

  smemguard      the config smemguard ran (the tuned winner if it fits; else its decision)
  best fitting   the fastest of all configs whose compiled shared memory fits the limit
  stages=1       the tuned winner with num_stages=1, the Inductor-style retry (if it fits)
  formula        the fastest config kept by the textbook prune S*(BM*BK+BK*BN)*bytes <= limit
  torch.mm       cuBLAS

Reported as throughput relative to "best fitting" (1.0 = as fast as the best that fits).

    python benchmarks/recovered_speed.py --json out.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import harness
import torch
import triton

import smemguard
from smemguard.examples import autotuned_matmul, matmul_args, matmul_kernel, tiled_grid
from smemguard.facts.settings import Settings

LIMITS = {"L20": 101376, "A100": 166912}
CONFIGS = [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), num_stages=s,
                         num_warps=8 if bm * bn >= 128 * 256 else 4)
           for bm, bn, bk, s in [(256, 128, 64, 4), (128, 256, 64, 4), (128, 128, 64, 5), (128, 128, 64, 4),
                                 (128, 128, 64, 3), (128, 128, 32, 4), (128, 64, 64, 4), (64, 128, 64, 4),
                                 (64, 64, 64, 4), (64, 64, 32, 3), (32, 64, 64, 4), (16, 64, 128, 4),
                                 (16, 128, 64, 5), (32, 32, 64, 3)]]
SHAPES = ([(m, 4096, 4096, torch.float16) for m in (1, 16, 64, 512, 2048, 8192)]
          + [(m, 4096, 4096, torch.bfloat16) for m in (1, 32, 1024, 4096)]
          + [(m, 11008, 4096, torch.float16) for m in (8, 256, 4096)]
          + [(m, 4096, 11008, torch.bfloat16) for m in (4, 2048)]
          + [(m, 4096, 4096, torch.float32) for m in (1, 64, 512, 2048)]
          + [(2048, 1, 4096, torch.float32)])


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def quick_autotune_bench(kernel_call, quantiles):
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def textbook_bytes(config, itemsize: int) -> int:
    k = config.kwargs
    return config.num_stages * (k["BLOCK_M"] * k["BLOCK_K"] + k["BLOCK_K"] * k["BLOCK_N"]) * itemsize


def parse_config(text: str) -> dict:
    """"BLOCK_M=128 BLOCK_N=64 BLOCK_K=64 num_warps=4 num_stages=3" -> kwargs for a direct launch."""
    return {key: int(value) for key, value in (part.split("=") for part in text.split())}


def run_shape(m, n, k, dtype, scratch: Path) -> list[dict]:
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    c = torch.empty(m, n, device="cuda", dtype=dtype)
    args, grid = matmul_args(a, b, c), tiled_grid(m, n)

    def direct(config_kwargs: dict) -> float:
        meta = {name: config_kwargs[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
        launch_grid = (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))
        return bench(lambda: matmul_kernel[launch_grid](*args, **config_kwargs))

    tuned = autotuned_matmul(CONFIGS, do_bench=quick_autotune_bench)
    smemguard.install(Settings())  # records the autotuner's timings per key
    try:
        tuned[grid](*args)
        notes = smemguard.guard.installed_engine().notes
    finally:
        smemguard.uninstall()
    key = next(iter(tuned.cache))
    winner = tuned.cache[key]
    timings = notes.timings(tuned, key)
    shared = {}
    for config in CONFIGS:
        try:
            shared[config] = matmul_kernel.warmup(*args, grid=(1,), **config.all_kwargs()).metadata.shared
        except Exception:  # does not compile: never fits
            shared[config] = float("inf")
    cublas = bench(lambda: torch.mm(a, b, out=c))
    rows = []
    for gpu, limit in LIMITS.items():
        fitting = [cfg for cfg in CONFIGS if shared[cfg] <= limit and timings.get(cfg, float("inf")) < float("inf")]
        if not fitting:
            continue
        best = min(fitting, key=timings.get)
        formula = [cfg for cfg in fitting if textbook_bytes(cfg, a.element_size()) <= limit]
        log = scratch / f"{gpu}-{m}-{n}-{k}-{dtype}.jsonl"
        tuned.cache[key] = winner
        matmul_kernel.device_caches.clear()
        smemguard.install(Settings(max_shared=limit, max_shared_label=gpu, log_path=log))
        try:
            tuned[grid](*args)
            action = "none"
            chosen = winner.all_kwargs()
            if log.exists():
                record = json.loads(log.read_text().splitlines()[-1])
                action = record["action"]
                chosen = parse_config(record["final"]) if record["action"] in (
                    "stages_reduced", "warps_reduced", "config_changed") else None
        finally:
            smemguard.uninstall()
            matmul_kernel.device_caches.clear()
        stage1 = {**winner.all_kwargs(), "num_stages": 1}
        stage1_fits = matmul_kernel.warmup(*args, grid=(1,), **stage1).metadata.shared <= limit
        times = {
            "best fitting": direct(best.all_kwargs()),
            "smemguard": direct(chosen) if chosen else float("nan"),
            "stages=1": direct(stage1) if stage1_fits else float("nan"),
            "formula": direct(min(formula, key=timings.get).all_kwargs()) if formula else float("nan"),
            "torch.mm": cublas,
        }
        rows.append({"shape": f"{m}x{n}x{k}", "dtype": str(dtype).removeprefix("torch."), "gpu": gpu,
                     "limit": limit, "winner": str(winner), "winner_fits": shared[winner] <= limit,
                     "action": action, "chosen": chosen, "times_ms": times,
                     "relative": {name: (times["best fitting"] / t if t == t else None) for name, t in times.items()}})
    return rows


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="run only the first N shapes")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    with harness.scratch("recovered-speed") as scratch:
        for m, n, k, dtype in SHAPES[: args.shapes]:
            rows.extend(run_shape(m, n, k, dtype, Path(scratch)))
            print(f"  done {m}x{n}x{k} {dtype} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    document = harness.write(args.json, rows, seconds=round(time.perf_counter() - started, 1))
    names = ["smemguard", "stages=1", "formula", "torch.mm"]
    print(f"# recovered speed, throughput relative to the best fitting config: {harness.headline(document)}")
    print(f"{'shape':16} {'dtype':8} {'gpu':5} {'action':15} " + " ".join(f"{name:>9}" for name in names))
    for row in rows:
        cells = " ".join(f"{row['relative'][name]:9.3f}" if row["relative"][name] else f"{'-':>9}" for name in names)
        print(f"{row['shape']:16} {row['dtype']:8} {row['gpu']:5} {row['action']:15} {cells}")
    worst = min((row["relative"]["smemguard"] for row in rows if row["relative"]["smemguard"]), default=None)
    print(f"smemguard's worst shape: {worst:.3f} of the best fitting config" if worst else "no recovered shape")
    return 0


if __name__ == "__main__":
    sys.exit(main())
