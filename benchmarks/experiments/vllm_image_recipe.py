"""README's vLLM image recipe for L4s, run without Docker, and whether its decisions reach vLLM's own launch.

Answered (2-core CPU, vLLM 0.33.0 CUDA wheel, Triton 3.8.0, torch 2.14.0+cu130, 2026-12-02; raw:
benchmarks/results/2026-12-02-cpu-session-8/vllm_image_recipe.txt): yes. The check found 4 of the kernel's 12
configs overflowing an L4 (115468 and 131852 B at 4 stages) and wrote 4 decisions (-> 3 stages); with them the
kernel's autotuner compiled 8 configs instead of 12 (the 4 refused before compiling), the same choice, no incident.
Hints that were not what vLLM passes wrote decisions that matched nothing.

    CUDA_VISIBLE_DEVICES="" python benchmarks/experiments/vllm_image_recipe.py [--out DIR]

Needs the CUDA vLLM 0.33 wheel (imported without a GPU). Three steps, each in a fresh process: the recipe's
``smemguard check ... --decisions`` for FLA's gated-delta-rule prefill kernel on an L4 and ``smemguard cache
import`` into ``DIR/imported``; then vLLM's own ``chunk_gated_delta_rule`` (the prefill call of
``benchmarks/vllm_kernel_scan.py``, Triton compiling for an L4 stand-in, ``smemguard.testing.fake_gpu``) with
that cache, and again with an empty one. Printed last: the configs the kernel's autotuner compiled in each run
(a decision that matches is refused before compiling in the autotuner's benchmark) and what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KERNEL = "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
TARGET = f"vllm.third_party.flash_linear_attention.ops.chunk_delta_h:{KERNEL}"
#: As README's Dockerfile passes them: Qwen3-Next's linear attention as vLLM calls the kernel.
HINTS = ["--const", "H=32,Hg=32,K=128,V=128,BT=64,USE_EXP2=False", "--dtype", "bf16",
         "--sig", "g=*fp32,gk=none,h0=*fp32,ht=*fp32,cu_seqlens=*i32,chunk_offsets=*i32"]


def prefill(cache_dir: str) -> dict:
    """vLLM's prefill call on an L4 stand-in with smemguard using ``cache_dir``: what the kernel compiled and ran."""
    import importlib

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import vllm_kernel_scan as scan

    for module in scan.VLLM_MODULES:
        importlib.import_module(module)
    scan.as_cuda_gpu("L4")
    from triton import knobs

    import smemguard
    from smemguard.facts.settings import Settings
    from smemguard.testing import fake_gpu

    compiled = []

    def on_compile(**kw):
        if kw["fn"].name.endswith(KERNEL):
            compiled.append(f"{kw['compile']['num_warps']} warps, {kw['compile']['num_stages']} stages")
        return False

    knobs.runtime.jit_cache_hook = on_compile
    log = Path(tempfile.mkdtemp()) / "incidents.jsonl"
    smemguard.install(Settings(mode="on", cache_dir=Path(cache_dir), log_path=log))
    with fake_gpu("L4", cache_dir=tempfile.mkdtemp()) as gpu:
        scan.gdn("L4", "prefill")
    ran = sorted({(launch.num_stages, launch.shared) for launch in gpu.launches if launch.kernel.endswith(KERNEL)})
    return {"compiled": compiled, "ran": ran, "incidents": len(log.read_text().splitlines()) if log.exists() else 0}


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, help="where the decision file and caches go (default: a temporary folder)")
    parser.add_argument("--prefill", help=argparse.SUPPRESS)  # one run, in its own process
    args = parser.parse_args(argv)
    if args.prefill:
        print(json.dumps(prefill(args.prefill)))
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="smemguard-recipe-"))
    out.mkdir(parents=True, exist_ok=True)
    smemguard = [sys.executable, "-c", "import sys; from smemguard.cli.commands import main; sys.exit(main())"]
    started = time.perf_counter()
    check = run([*smemguard, "check", "--gpu", "L4", "--decisions", str(out / "l4-decisions.json"), "--quiet",
                 TARGET, *HINTS])
    check_s = time.perf_counter() - started
    print(check.stdout)
    if check.returncode not in (0, 1):
        print(check.stderr[-3000:])
        return 2
    results = {}
    for name in ("imported", "empty"):
        (out / name).mkdir(mode=0o700, parents=True, exist_ok=True)
        if name == "imported":
            print(run([*smemguard, "cache", "import", str(out / "l4-decisions.json"), "--dir", str(out / name)]).stdout)
        prefilled = run([sys.executable, __file__, "--prefill", str(out / name)])
        if prefilled.returncode != 0:
            print(prefilled.stderr[-3000:])
            return 2
        results[name] = json.loads(prefilled.stdout.strip().splitlines()[-1])
    decided = json.loads((out / "l4-decisions.json").read_text())
    print(f"check: exit {check.returncode}, {check_s:.0f} s, {len(decided['compile'])} compile and "
          f"{len(decided['launch'])} launch decisions")
    print("| cache | configs compiled | (stages, bytes) ran | incidents |")
    print("| --- | --- | --- | --- |")
    for name, result in results.items():
        print(f"| {name} | {len(result['compiled'])}: {', '.join(result['compiled'])} | {result['ran']} | "
              f"{result['incidents']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
