"""Should a FlexAttention graph that no config fits fall back to torch's own eager path? Measured, in one run.

Answered (H200, torch 2.11.0+cu130, Triton 3.6.0, 2026-12-04; raw: benchmarks/results/2026-12-04-h200-issue32/
flex_eager_fallback.json): no automatic eager fallback. The graph that fails is the backward, compiled after the
forward ran and its output was used: moving it to eager means running the forward again, a re-launch after a launch
started. And eager FlexAttention's memory grows with the square of the sequence: 30275 MiB at 8192 tokens against
1345 MiB compiled, more than a T4 has. smemguard's record and warning for such a template say how to run it
uncompiled where the user knows their sequence lengths.

Issue 32's last torch.compile case: FlexAttention with head size 256 in fp32 under a T4's 65536 B. Its forward needs
135424-168064 B at one stage and its backward 66560 B at the smallest tiles (16x16, one stage, 4 warps), so no
config of the template fits and Inductor raises ``No valid triton configs``. The candidate fallback is torch's own
path for that graph: ``flex_attention`` run eagerly (what ``torch._dynamo.config.suppress_errors`` or
``torch.compiler.disable`` gives), which computes the full score matrix. This script measures what that would cost,
side by side with the compiled kernel where it fits (no limit):

1. per sequence length, forward + backward: time, peak GPU memory and the largest error against an fp64 SDPA
   reference, compiled vs eager;
2. in a child process with ``SMEMGUARD=on SMEMGUARD_MAX_SHARED=<limit>``: what compiling that graph raises, and
   whether ``suppress_errors`` rescues the forward and the backward.

    python benchmarks/experiments/flex_eager_fallback.py --json out.json [--lengths 1024,4096,8192] [--limit T4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _case(length: int, *, batch: int, heads: int, dim: int, dtype, device: str, compiled: bool, repeats: int):
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    reference = torch.nn.functional.scaled_dot_product_attention(*(t.detach().double() for t in (q, k, v)))
    times = []
    for _ in range(repeats + 1):  # the first: compile and warm up
        for tensor in (q, k, v):
            tensor.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = attend(q, k, v)
        out.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return {"length": length, "path": "compiled" if compiled else "eager",
            "first_s": round(times[0], 3), "step_ms": round(1e3 * min(times[1:]), 3),
            "peak_mib": None if peak is None else round(peak / 2**20, 1),
            "max_abs_error": float((out.detach().double() - reference).abs().max())}


def measure(args) -> list[dict]:
    import torch

    dtype = getattr(torch, args.dtype)
    rows = []
    for length in args.lengths:
        for compiled in (True, False):
            try:
                rows.append(_case(length, batch=args.batch, heads=args.heads, dim=args.dim, dtype=dtype,
                                  device=args.device, compiled=compiled, repeats=args.repeats))
            except Exception as error:  # an eager OOM at a long sequence is a result
                rows.append({"length": length, "path": "compiled" if compiled else "eager",
                             "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"})
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache() if args.device == "cuda" else None
    return rows


CHILD = """
import json, sys, torch
import smemguard
smemguard.install()
from torch.nn.attention.flex_attention import flex_attention
suppress, length, batch, heads, dim, dtype, device = json.loads(sys.argv[1])
torch._dynamo.config.suppress_errors = suppress
q, k, v = (torch.randn(batch, heads, length, dim, device=device, dtype=getattr(torch, dtype), requires_grad=True)
           for _ in range(3))
result = {"suppress_errors": suppress, "forward": None, "backward": None}
try:
    out = torch.compile(flex_attention, dynamic=False)(q, k, v)
    result["forward"] = "ran"
    out.sum().backward()
    result["backward"] = "ran"
    reference = torch.nn.functional.scaled_dot_product_attention(*(t.detach().double() for t in (q, k, v)))
    result["max_abs_error"] = float((out.detach().double() - reference).abs().max())
except Exception as error:
    lines = str(error).splitlines()
    result["raised"] = type(error).__name__
    result["first_line"] = lines[0][:300] if lines else ""
    result["smemguard_note"] = [line[:400] for line in lines if "smemguard" in line][:3]
print("RESULT " + json.dumps(result))
"""


def under_limit(args) -> list[dict]:
    env = {**os.environ, "SMEMGUARD": "on", "SMEMGUARD_MAX_SHARED": args.limit, "SMEMGUARD_CACHE_DIR": "off",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    rows = []
    for suppress in (False, True):
        spec = json.dumps([suppress, args.lengths[0], args.batch, args.heads, args.dim, args.dtype, args.device])
        try:
            child = subprocess.run([sys.executable, "-c", CHILD, spec], env=env, capture_output=True, text=True,
                                   timeout=args.child_timeout)
            found = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
            row = json.loads(found[-1][7:]) if found else {"suppress_errors": suppress, "exit": child.returncode,
                                                            "stderr": child.stderr[-600:]}
            row["smemguard_warnings"] = [line[:300] for line in child.stderr.splitlines() if "smemguard" in line][:4]
        except subprocess.TimeoutExpired:
            row = {"suppress_errors": suppress, "timeout_s": args.child_timeout}
        row.update(limit=args.limit, length=args.lengths[0])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Writes one JSON object with both parts; prints a line per case.")
    parser.add_argument("--lengths", type=lambda text: [int(part) for part in text.split(",")],
                        default=[1024, 4096, 8192], help="sequence lengths, comma-separated (default 1024,4096,8192)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256, help="head size (default 256)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after the first (default 3)")
    parser.add_argument("--limit", default="T4", help="SMEMGUARD_MAX_SHARED for part 2 (default T4)")
    parser.add_argument("--child-timeout", type=int, default=240)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    import torch

    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "shape": {"batch": args.batch, "heads": args.heads, "dim": args.dim, "dtype": args.dtype},
              "measured": measure(args), "under_limit": under_limit(args)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
