"""What the loop and config knobs of Triton kernels do to shared memory and to the arithmetic, on this CPU.

Answered (Triton 3.9.0, 2026-12-01; raw: benchmarks/results/2026-12-01-cpu-knob-sweep-triton39.json; the table and
what smemguard does with each knob: docs/KNOBS.md): a loop's ``num_stages=`` moves the bytes by one stage of tiles
per count with the arithmetic unchanged (the launch option alone moves nothing when the loop sets its own);
``loop_unroll_factor`` multiplies them; ``warp_specialize`` adds 16840 B on sm_90 with TMA loads; ``flatten`` lowers
them; ``maxnreg``, ``disallow_acc_multi_buffer``, ``num_buffers_warp_spec`` and ``num_consumer_groups`` change no
byte.

    python benchmarks/experiments/knob_sweep.py --out OUT.json

Compiles (``triton.compile``, PTX through ptxas for NVIDIA, the AMD code object for gfx950; no GPU)
two fp16 kernels that expose every knob as a parameter, for sm_90 (H100/H200), sm_100 (B200) and
gfx950 (MI355X), each knob changed alone from a baseline:

- ``matmul``: one 128x128x64 tile per program; its K loop is
  ``tl.range(0, K, BLOCK_K, num_stages=STAGES, loop_unroll_factor=UNROLL, warp_specialize=WS,
  disallow_acc_multi_buffer=NO_ACC_BUFFERS)``, and the config options ``maxnreg``,
  ``num_buffers_warp_spec`` and ``num_consumer_groups`` are passed as launches pass them;
- ``persistent``: the tutorial's persistent matmul, its tile loop ``tl.range(..., flatten=FLATTEN,
  warp_specialize=WS)`` around the same K loop;
- ``tma``: the K loop loading through device-side TMA descriptors whose block shape is
  ``[BLOCK_M, TMA_K]`` / ``[TMA_K, BLOCK_N]`` (the loop steps by ``TMA_K``), and warp-specialized.

For each compile: ``metadata.shared``, and the arithmetic as the compiler emitted it: the kinds of
arithmetic ops in the TTGIR (dots, adds, multiplies, conversions) and the matrix instructions in the
PTX / AMDGCN (``wgmma ... m64n128k16``, ``tcgen05.mma``, ``v_mfma_f32_32x32x16_f16``). "same" means
every arithmetic op kind and matrix instruction of the baseline, and no other, is there: the
software pipeline, unrolling and register limits move loads and copies, not these. It is evidence,
not proof: bitwise equality needs a GPU (``knob_bitwise.py`` beside this file).

Writes one JSON document (rows and the Triton version) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter

import triton
import triton.language as tl

ARCHS = (90, 100, "gfx950")
TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)


@triton.jit
def matmul(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bk, stride_cm, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr,
           WS: tl.constexpr, NO_ACC_BUFFERS: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES, loop_unroll_factor=UNROLL, warp_specialize=WS,
                      disallow_acc_multi_buffer=NO_ACC_BUFFERS):
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * stride_bk + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(tl.float16))


@triton.jit
def persistent(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bk, stride_cm, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, FLATTEN: tl.constexpr,
               WS: tl.constexpr, NUM_SMS: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tiles_n, NUM_SMS, flatten=FLATTEN,
                         warp_specialize=WS):
        rm = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            a = tl.load(a_ptr + rm[:, None] * stride_am + (k + rk)[None, :])
            b = tl.load(b_ptr + (k + rk)[:, None] * stride_bk + rn[None, :])
            acc = tl.dot(a, b, acc)
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(tl.float16))


@triton.jit
def tma(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bk, stride_cm, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, TMA_K: tl.constexpr, WS: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, TMA_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_bk, 1], block_shape=[TMA_K, BLOCK_N])
    off_m, off_n = tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, TMA_K, num_stages=STAGES, warp_specialize=WS):
        acc = tl.dot(a_desc.load([off_m, k]), b_desc.load([k, off_n]), acc)
    rm, rn = off_m + tl.arange(0, BLOCK_M), off_n + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(tl.float16))


BASE = {"matmul": dict(TILE, STAGES=3, UNROLL=None, WS=False, NO_ACC_BUFFERS=False),
        "persistent": dict(TILE, STAGES=3, FLATTEN=False, WS=False, NUM_SMS=132),
        "tma": dict(TILE, STAGES=3, TMA_K=64, WS=False)}

#: (kernel, knob as written, constexpr changes, option changes), each compared with its kernel's baseline.
VARIANTS = [
    ("matmul", "baseline (num_stages=3)", {}, {}),
    *[("matmul", f"tl.range num_stages={s}", {"STAGES": s}, {}) for s in (1, 2, 4)],
    ("matmul", "launch option num_stages=1 (loop keeps 3)", {}, {"num_stages": 1}),
    *[("matmul", f"loop_unroll_factor={u}", {"UNROLL": u}, {}) for u in (2, 4)],
    ("matmul", "warp_specialize=True", {"WS": True}, {}),
    ("matmul", "disallow_acc_multi_buffer=True", {"NO_ACC_BUFFERS": True}, {}),
    *[("matmul", f"maxnreg={r}", {}, {"maxnreg": r}) for r in (128, 255)],
    ("matmul", "num_buffers_warp_spec=3 (config option)", {}, {"num_buffers_warp_spec": 3}),
    ("matmul", "num_consumer_groups=2 (config option)", {}, {"num_consumer_groups": 2}),
    ("persistent", "baseline (num_stages=3)", {}, {}),
    ("persistent", "tl.range num_stages=2", {"STAGES": 2}, {}),
    ("persistent", "flatten=True", {"FLATTEN": True}, {}),
    ("persistent", "warp_specialize=True", {"WS": True}, {}),
    ("tma", "baseline (block [128, 64] / [64, 128])", {}, {}),
    ("tma", "tl.range num_stages=2", {"STAGES": 2}, {}),
    ("tma", "TMA block K 32 (the tile's K step)", {"TMA_K": 32}, {}),
    ("tma", "warp_specialize=True", {"WS": True}, {}),
]

_KERNELS = {"matmul": matmul, "persistent": persistent, "tma": tma}
_POINTERS = ("a_ptr", "b_ptr", "c_ptr")
_ARITHMETIC = re.compile(r"\b((?:tt|ttng|ttg|amdgpu|triton_gpu)\.(?:dot\w*|warp_group_dot|tc_gen5_mma\w*|\w*mfma\w*)"
                         r"|arith\.(?:addf|subf|mulf|divf|truncf|extf|maxnumf|minnumf)|math\.fma)\b")
_MATRIX = re.compile(r"(wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.\w+\.\w+\.\w+"
                     r"|tcgen05\.mma\.cta_group::\d\.kind::\w+"
                     r"|mma\.sync\.aligned\.m\d+n\d+k\d+|v_mfma_\w+)")


def compile_one(kernel: str, arch, constexprs: dict, options: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    fn = _KERNELS[kernel]
    signature = {p.name: ("*fp16" if p.name in _POINTERS else "i32") for p in fn.params if not p.is_constexpr}
    signature.update((name, "constexpr") for name in constexprs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if not p.is_constexpr}
    target = GPUTarget("cuda", arch, 32) if isinstance(arch, int) else GPUTarget("hip", arch, 64)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options={"num_warps": 4, "num_stages": 3, **options})


def arithmetic(compiled) -> dict:
    """The arithmetic op kinds of the TTGIR and the matrix instructions of the machine code."""
    machine = compiled.asm.get("ptx") or compiled.asm.get("amdgcn") or ""
    return {"ops": sorted(Counter(_ARITHMETIC.findall(compiled.asm["ttgir"]))),
            "matrix": sorted(set(_MATRIX.findall(machine)))}


def run(archs, kernels) -> list[dict]:
    rows, baselines = [], {}
    for arch in archs:
        for kernel, knob, constexprs, options in VARIANTS:
            if kernel not in kernels:
                continue
            row = {"arch": f"sm_{arch}" if isinstance(arch, int) else arch, "kernel": kernel, "knob": knob}
            started = time.perf_counter()
            try:
                compiled = compile_one(kernel, arch, {**BASE[kernel], **constexprs}, options)
            except Exception as error:  # a knob this target does not take is a result too
                row.update(shared=None, error=f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:160]}")
            else:
                found = arithmetic(compiled)
                row.update(shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps, **found)
                base = baselines.setdefault((arch, kernel), row)
                row["arithmetic"] = "same" if found == {k: base[k] for k in found} else "DIFFERENT"
                row["shared_vs_baseline"] = compiled.metadata.shared - base["shared"]
            row["seconds"] = round(time.perf_counter() - started, 1)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'arch':8} {'kernel':10} {'knob':44} {'shared B':>9} {'vs base':>8}  arithmetic"]
    for row in rows:
        if row.get("error"):
            lines.append(f"{row['arch']:8} {row['kernel']:10} {row['knob']:44} {'-':>9} {'-':>8}  {row['error'][:60]}")
            continue
        lines.append(f"{row['arch']:8} {row['kernel']:10} {row['knob']:44} {row['shared']:>9} "
                     f"{row['shared_vs_baseline']:>+8}  {row['arithmetic']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON rows")
    parser.add_argument("--arch", action="append", help="sm_90 as 90, gfx950 (default: 90, 100, gfx950)")
    parser.add_argument("--kernel", action="append", choices=sorted(_KERNELS), help="default: all")
    args = parser.parse_args(argv)
    archs = [int(a) if a.isdigit() else a for a in args.arch] if args.arch else list(ARCHS)
    rows = run(archs, set(args.kernel or _KERNELS))
    with open(args.out, "w") as out:
        json.dump({"triton": triton.__version__, "rows": rows}, out, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
