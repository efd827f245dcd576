"""On a GPU: does changing each loop or config knob keep a kernel's output bitwise the same?

Answered (H200, Triton 3.6.0, torch 2.11.0+cu130, 2026-12-01; raw: benchmarks/results/2026-12-01-h200-session-7/
knob_bitwise.json): every stage change (a loop's literal, the launch option, smemguard's lowering of ``NUM_STAGES``
with the option, 4 -> 3) is bitwise equal; so are ``loop_unroll_factor=2``, ``flatten``, ``maxnreg`` and
``disallow_acc_multi_buffer``; ``warp_specialize=True`` does not compile on the pointer-load kernels and gives NaNs
on the TMA one. The GPU tests keep the stage claim tested (``tests/test_knobs.py``).

    python benchmarks/experiments/knob_bitwise.py results.json        # about a minute on an H200

Launches the kernels and knob variants of ``knob_sweep.py`` (which measures their shared memory on
a CPU) on 2048x2048x2048 fp16 operands, each variant's output compared with its kernel's baseline
(``torch.equal``: bitwise), then smemguard's own recovery of a kernel whose pipeline depth is a
parameter (``NUM_STAGES`` lowered with the launch option under an emulated limit one byte below
what it needs). A variant the GPU or this Triton does not take is reported with its error.
Prints a table at the end and writes every row as JSON to the path given.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from knob_sweep import BASE, VARIANTS, _KERNELS  # noqa: E402

SIZE = 2048


def launch(kernel: str, a, b, constexprs: dict, options: dict):
    out = torch.full((SIZE, SIZE), float("nan"), device="cuda", dtype=torch.float16)
    if kernel == "persistent":
        grid = (constexprs["NUM_SMS"],)
    else:
        grid = (SIZE // constexprs["BLOCK_M"], SIZE // constexprs["BLOCK_N"])
    compiled = _KERNELS[kernel][grid](a, b, out, SIZE, SIZE, SIZE, a.stride(0), b.stride(0), out.stride(0),
                                      **constexprs, **options)
    torch.cuda.synchronize()
    return out, compiled


def knob_rows(a, b) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    baselines: dict = {}
    rows = []
    for kernel, knob, constexprs, options in VARIANTS:
        base = dict(BASE[kernel], **({"NUM_SMS": sms} if kernel == "persistent" else {}))
        row = {"kernel": kernel, "knob": knob}
        try:
            out, compiled = launch(kernel, a, b, {**base, **constexprs}, options)
        except Exception as error:
            row.update(error=f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:120]}")
            rows.append(row)
            continue
        reference = baselines.setdefault(kernel, out)
        row.update(shared=compiled.metadata.shared, bitwise_equal=bool(torch.equal(out, reference)),
                   max_abs_diff=float((out.float() - reference.float()).abs().max()))
        rows.append(row)
    return rows


def recovery_row(a, b) -> dict:
    """smemguard lowering a pipeline-depth parameter with the option, compared with the unguarded run."""
    import smemguard
    from smemguard.facts.settings import Settings
    from kernels import depth_parameter_matmul, matmul_args

    tile = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, NUM_STAGES=4, num_stages=4)
    grid = (SIZE // 128, SIZE // 128)
    original = torch.empty(SIZE, SIZE, device="cuda", dtype=torch.float16)
    kernel = depth_parameter_matmul[grid](*matmul_args(a, b, original), **tile)
    limit = kernel.metadata.shared - 1
    depth_parameter_matmul.device_caches.clear()
    smemguard.install(Settings(max_shared=limit, max_shared_label="one byte short", log_path=None))
    try:
        recovered = torch.full_like(original, float("nan"))
        replacement = depth_parameter_matmul[grid](*matmul_args(a, b, recovered), **tile)
        torch.cuda.synchronize()
    finally:
        smemguard.uninstall()
    return {"kernel": "depth_parameter_matmul", "knob": "smemguard: NUM_STAGES and num_stages 4 -> "
            f"{replacement.metadata.num_stages}", "shared": replacement.metadata.shared,
            "bitwise_equal": bool(torch.equal(recovered, original)),
            "max_abs_diff": float((recovered.float() - original.float()).abs().max())}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    torch.manual_seed(0)
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    a = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.float16)
    b = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.float16)
    started = time.perf_counter()
    rows = knob_rows(a, b)
    try:
        rows.append(recovery_row(a, b))
    except Exception as error:
        rows.append({"kernel": "depth_parameter_matmul", "knob": "smemguard recovery",
                     "error": f"{type(error).__name__}: {error}"[:200]})
    document = {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
                "triton": triton.__version__, "torch": torch.__version__, "size": SIZE,
                "seconds": round(time.perf_counter() - started, 1), "rows": rows}
    Path(argv[0]).write_text(json.dumps(document, indent=1))
    print(f"{document['gpu']}, Triton {document['triton']}, torch {document['torch']}, {SIZE}^3 fp16")
    print(f"{'kernel':24} {'knob':48} {'shared B':>9}  bitwise")
    for row in rows:
        verdict = row.get("error") or ("equal" if row["bitwise_equal"]
                                       else f"DIFFERENT (max {row['max_abs_diff']:.3g})")
        print(f"{row['kernel']:24} {row['knob']:48} {row.get('shared', '-'):>9}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
