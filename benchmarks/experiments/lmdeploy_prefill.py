"""LMDeploy's Triton prefill attention on the CPU harness: which launches fit, without smemguard and under it.

Answered (CPU harness, LMDeploy 0.18.0, Triton 3.6.0, torch 2.13.0 CPU, 2026-12-05; raw:
benchmarks/results/lmdeploy_prefill.txt and .json): 40 cases, 10 do not fit, 9 recovered (fewer stages, or the
pack's smaller tiles), 1 left (the absorbed MLA 576/512 on a T4: 69632 B at 16x16), 0 broken. LMDeploy's own tests
on a GPU are a field suite now (``benchmarks/field_suites.py --suites lmdeploy``).

``lmdeploy.pytorch.kernels.cuda.flashattention.flash_attn_varlen_func`` picks its tiles and stages from the compute
capability and the head size. For each GPU of the table, head sizes (q/k, v) and keys shared with values or not,
one causal prefill of 256 tokens, 8 heads, fp16 is launched on ``smemguard.testing.fake_gpu`` (Triton compiles for
that arch and limit, nothing executes), once in a process without smemguard and once in a process with
``smemguard.install()`` (the default install, with the pack ``patches/contrib/lmdeploy_flash_attention``). Each
process has a
Triton cache of its own. ``BLOCK_M`` is read from the launch's grid, ``(cdiv(256, BLOCK_M), 8, 1)``.

    python benchmarks/experiments/lmdeploy_prefill.py [--json PATH]

Needs LMDeploy 0.18 and a Triton it compiles with (3.4 to 3.7; see tests/test_lmdeploy.py for what to install).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPUS = {"RTX5090": (12, 0), "L4": (8, 9), "RTX3090": (8, 6), "A100": (8, 0), "T4": (7, 5)}
HEAD_SIZES = ((64, 64), (128, 128), (192, 128), (256, 256), (576, 512))  # (192, 128): DeepSeek-V3's MLA prefill
TOKENS, HEADS = 256, 8


def cases():
    return [(gpu, dims, shared) for gpu, dims, shared in itertools.product(GPUS, HEAD_SIZES, (False, True))
            if not shared or dims[0] == dims[1]]  # LMDeploy shares keys and values only at equal head sizes


def worker(guarded: bool) -> list[dict]:
    import torch
    from triton.runtime.errors import OutOfResources

    import lmdeploy.pytorch.kernels.cuda.flashattention as attention
    from smemguard.testing import fake_gpu

    if guarded:
        import smemguard

        smemguard.install()
    results = []
    for gpu, (head_dim, head_dim_v), shared in cases():
        props = {"compute_capability": GPUS[gpu], "multi_processor_count": 80}
        attention.get_device_props = lambda device=None, props=props: props
        q = torch.empty(TOKENS, HEADS, head_dim, dtype=torch.float16)
        k = torch.empty(1, TOKENS, head_dim, dtype=torch.float16)
        v = k if shared else torch.empty(1, TOKENS, head_dim_v, dtype=torch.float16)
        starts = torch.tensor([0, TOKENS], dtype=torch.int32)
        with fake_gpu(gpu, cache_dir=os.environ["TRITON_CACHE_DIR"]) as device:
            try:
                attention.flash_attn_varlen_func(q, k, v, starts, starts, TOKENS, TOKENS, causal=True)
                launch = device.launches[-1]
                outcome = {"fits": True, "num_stages": launch.num_stages, "shared": launch.shared,
                           "block_m": TOKENS // launch.grid[0]}  # the grid is (cdiv(tokens, BLOCK_M), heads, 1)
            except OutOfResources as error:
                outcome = {"fits": False, "required": error.required}
        results.append({"gpu": gpu, "head_dim": head_dim, "head_dim_v": head_dim_v, "shared_kv": shared, **outcome})
    return results


def run(guarded: bool) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="lmdeploy-prefill-") as scratch:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SMEMGUARD")}
        env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), TRITON_CACHE_DIR=scratch,
                   SMEMGUARD_LOG=os.path.join(scratch, "incidents.jsonl"),
                   SMEMGUARD_CACHE_DIR=os.path.join(scratch, "decisions"))
        done = subprocess.run([sys.executable, __file__, "--worker", "on" if guarded else "off"], env=env,
                              capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit((done.stderr.strip().splitlines() or ["the worker failed"])[-1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the cases here")
    parser.add_argument("--worker", choices=("on", "off"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(worker(options.worker == "on")))
        return
    import torch
    import triton

    plain, guarded = run(False), run(True)
    print(f"LMDeploy prefill on the CPU harness · torch {torch.__version__} · triton {triton.__version__}")
    print(f"{'gpu':8} {'head q/k, v':>12} {'shared kv':>9}  {'without smemguard':<38} with smemguard")
    for before, after in zip(plain, guarded):
        dims = f"{before['head_dim']}, {before['head_dim_v']}"
        print(f"{before['gpu']:8} {dims:>12} {str(before['shared_kv']):>9}  {describe(before):<38} {describe(after)}")
    failing = [after for before, after in zip(plain, guarded) if not before["fits"]]
    broken = sum(before["fits"] and not after["fits"] for before, after in zip(plain, guarded))
    print(f"{len(plain)} cases: {len(failing)} do not fit without smemguard, {sum(a['fits'] for a in failing)} "
          f"recovered, {broken} broken")
    if options.json:
        Path(options.json).write_text(json.dumps({"plain": plain, "smemguard": guarded}, indent=1))


def describe(outcome: dict) -> str:
    if outcome["fits"]:
        return f"BLOCK_M={outcome['block_m']} num_stages={outcome['num_stages']}, {outcome['shared']} B"
    return f"OutOfResources {outcome['required']} B"


if __name__ == "__main__":
    main()
