"""The compile-time core on a real GPU: first launches under an emulated smaller GPU, and the cost on healthy compiles.

    python benchmarks/compile_core.py [--limit 101376] [--json results.json]

Each case runs in this process on the current CUDA device, under an emulated limit (``SMEMGUARD_MAX_SHARED``'s
mechanism, ``Settings(max_shared=...)``), with Triton's load check (``CompiledKernel._init_handles``) counting every
``OutOfResources`` it raises, caught or not:

* ``plain``: a ``@triton.jit`` matmul, 128x128x64 fp16 at 5 stages (131072 B on sm_89 and sm_90), launched once;
  its output compared bitwise with the same launch unguarded on the full GPU;
* ``autotuned``: ``triton.autotune`` over the 5-stage config and a 64x64 one; output against ``torch.mm``;
* ``inductor-mm``: ``torch.compile(mode="max-autotune-no-cudagraphs")`` of a matmul (Inductor's templates and its
  own benchmark); output against eager;
* ``flex``: FlexAttention forward, head dim 128, fp16, compiled; output against eager (unguarded);
* ``healthy``: the cost the core adds to a compile that fits: ``triton.compile`` answered from Triton's cache
  (the cheapest compile there is), guarded against unguarded, interleaved, median of each.

The table at the end is the one docs/BENCHMARKS.md quotes.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="compile-core-triton-"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="compile-core-inductor-"))

import torch  # noqa: E402
import triton  # noqa: E402

import smemguard  # noqa: E402
from smemguard.examples import autotuned_matmul, matmul_args, matmul_kernel  # noqa: E402
from smemguard.facts.settings import Settings  # noqa: E402
from smemguard.testing import load_check_failures as load_checks  # noqa: E402


@contextlib.contextmanager
def guarded(limit: int, log: Path):
    assert smemguard.install(Settings(max_shared=limit, log_path=log, cache_dir=None))
    try:
        yield
    finally:
        smemguard.uninstall()


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def plain(limit: int, log: Path) -> dict:
    a, b = (torch.randn(1024, 1024, device="cuda", dtype=torch.float16) for _ in range(2))
    expected = torch.empty(1024, 1024, device="cuda", dtype=torch.float16)
    matmul_kernel[(8, 8)](*matmul_args(a, b, expected), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5)
    matmul_kernel.device_caches.clear()
    out = torch.empty_like(expected)
    with guarded(limit, log), load_checks() as raised:
        matmul_kernel[(8, 8)](*matmul_args(a, b, out), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5)
        torch.cuda.synchronize()
    matmul_kernel.device_caches.clear()
    return {"raised": raised, "bitwise_equal": bool(torch.equal(out, expected)), "records": records(log)}


def autotuned(limit: int, log: Path) -> dict:
    configs = [triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64), num_stages=5, num_warps=4),
               triton.Config(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64), num_stages=2, num_warps=4)]
    kernel = autotuned_matmul(configs)
    a, b = (torch.randn(1024, 1024, device="cuda", dtype=torch.float16) for _ in range(2))
    out = torch.empty(1024, 1024, device="cuda", dtype=torch.float16)
    grid = lambda meta: (triton.cdiv(1024, meta["BLOCK_M"]), triton.cdiv(1024, meta["BLOCK_N"]))  # noqa: E731
    with guarded(limit, log), load_checks() as raised:
        kernel[grid](*matmul_args(a, b, out))
        torch.cuda.synchronize()
    return {"raised": raised, "max_abs_err": float((out.float() - (a.float() @ b.float())).abs().max()),
            "chosen": str(kernel.best_config), "records": records(log)}


def inductor_mm(limit: int, log: Path) -> dict:
    import torch._dynamo

    a, b = (torch.randn(2048, 2048, device="cuda", dtype=torch.float16) for _ in range(2))
    expected = a @ b
    torch._dynamo.reset()
    with guarded(limit, log), load_checks() as raised:
        out = torch.compile(lambda x, y: x @ y, mode="max-autotune-no-cudagraphs")(a, b)
        torch.cuda.synchronize()
    return {"raised": raised, "max_abs_err": float((out.float() - expected.float()).abs().max()),
            "records": records(log)}


def flex(limit: int, log: Path) -> dict:
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    expected = flex_attention(q, k, v)
    torch._dynamo.reset()
    with guarded(limit, log), load_checks() as raised:
        out = torch.compile(flex_attention)(q, k, v)
        torch.cuda.synchronize()
    return {"raised": raised, "max_abs_err": float((out.float() - expected.float()).abs().max()),
            "records": records(log)}


def healthy(limit: int, log: Path, rounds: int = 200) -> dict:
    a, b, c = (torch.randn(256, 256, device="cuda", dtype=torch.float16) for _ in range(3))
    kernel = matmul_kernel.warmup(*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_stages=2, grid=(1,))
    source, target, options = kernel.src, kernel.metadata.target, {"num_stages": 2, "num_warps": 4}
    triton.compile(source, target=target, options=options)  # in Triton's cache from here on
    times = {"unguarded": [], "guarded": []}
    for _ in range(rounds):
        for mode in ("unguarded", "guarded"):
            context = guarded(limit, log) if mode == "guarded" else contextlib.nullcontext()
            with context:
                started = time.perf_counter()
                triton.compile(source, target=target, options=options)
                times[mode].append(time.perf_counter() - started)
    medians = {mode: statistics.median(values) * 1e6 for mode, values in times.items()}
    return {"median_us": medians, "ratio": medians["guarded"] / medians["unguarded"], "records": records(log)}


CASES = {"plain": plain, "autotuned": autotuned, "inductor-mm": inductor_mm, "flex": flex, "healthy": healthy}


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--limit", type=int, default=101376, help="emulated per-block limit (default: an L4's)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("compile_core: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = {"cases": {}}
    scratch = Path(tempfile.mkdtemp(prefix="compile-core-"))
    for name in args.cases.split(","):
        started = time.perf_counter()
        try:
            result = CASES[name](args.limit, scratch / f"{name}.jsonl")
        except Exception as error:  # one case's failure is its row, not the end of the run
            result = {"error": f"{type(error).__name__}: {error}"[:400]}
        result["raised"] = [f"{error.required}>{error.limit}" for error in result.get("raised", [])]
        result["seconds"] = round(time.perf_counter() - started, 1)
        results["cases"][name] = result
        print(name, json.dumps({k: v for k, v in result.items() if k != "records"})[:600], flush=True)
    document = harness.write(args.json, results, limit=args.limit)
    print(f"\n{harness.headline(document)}, emulated limit {args.limit} B")
    print(f"{'case':12s} {'OutOfResources raised':>22s} {'incident records':>17s}  result")
    for name, result in results["cases"].items():
        if "error" in result:
            print(f"{name:12s} {'-':>22s} {'-':>17s}  error: {result['error'][:120]}")
            continue
        phases = ",".join(sorted({f"{r.get('phase')}:{r.get('action')}" for r in result["records"]})) or "none"
        outcome = ("bitwise equal" if result.get("bitwise_equal") else
                   f"max abs err {result['max_abs_err']:.3g}" if "max_abs_err" in result else
                   f"guarded/unguarded {result['ratio']:.3f} ({result['median_us']['guarded']:.0f} vs "
                   f"{result['median_us']['unguarded']:.0f} us)" if "ratio" in result else "DIFFERENT")
        print(f"{name:12s} {len(result.get('raised', [])):>22d} {len(result['records']):>4d} {phases:>12s}  {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
