"""The calibrated estimate: bounds on the shared memory of a matmul-like compile, without compiling.

For matmul-like configs (``BLOCK_M``/``BLOCK_N``/``BLOCK_K`` constexprs) inside the calibrated domain
(sm_70, sm_75, sm_80, sm_89, sm_90, sm_120: fp16, bf16 or fp32 operands; gfx90a, gfx942, gfx950: fp16
or bf16; tiles 32 to 256, BLOCK_K 32 to 128, 1 to 5 stages, 4 or 8 warps) an interval estimate decides
the clear cases. With A and B the bytes of one A and one B tile, T = A + B (one stage), E those of
one output tile and S the stages:

=================================================================  ==================================
code path                                                          interval (bytes)
=================================================================  ==================================
registers: sm_70, sm_75 (no cp.async), 2-byte operands, any S      [2·max(A, B), max(2·max(A, B), E)]
registers: sm_70, sm_75, fp32 operands, any S                      [T, max(T, E)]
wgmma: sm_90, BLOCK_M >= 64, pipelined                             [S·T, S·T]
mma: sm_80/89/120, or BLOCK_M < 64, pipelined                      [(S-1)·T, max((S-1)·T, E)]
one stage: misaligned 2-byte operands (cp.async needs 4 bytes)     [T, max(T, E)]
launches with arguments == 1 (sm_80 and later)                     [T, S·T + E]
=================================================================  ==================================

"Pipelined" means cp.async can feed the stages: 16-byte aligned, or 4-byte elements (fp32 is
pipelined even misaligned). Before sm_80 Triton runs no software pipeliner (3.4 to 3.9): every
load goes through registers, aligned or not, and ``num_stages`` changes nothing; a 2-byte operand
tile then takes a buffer the size of the larger of the two (mma), fp32 the two tiles (FMA).
sm_120 is pipelined as sm_80/89 (mma, no wgmma). Calibration: every measurement lies inside its
interval, so the estimate is off by at most the interval's width (nothing for wgmma; up to
E - (S-1)·T where an epilogue scratch dominates; measured: docs/MEASURED.md,
smemguard/kernels/estimate.py). The textbook S·T is off by S/(S-1) on sm_80/89/120 and by up to S on
sm_70/75: it drops configs that fit.

On AMD (gfx90a, gfx942, gfx950; fp16 or bf16 operands; same tiles, stages and warps), with A and
B the bytes of one A and one B tile (T = A + B), measured by ``benchmarks/smem_sweep.py``:

=================================================================  ===========================
code path                                                          interval (bytes)
=================================================================  ===========================
one stage; misaligned on gfx942 and gfx90a: nothing pipelined      [max(A, B), max(A, B)]
LDS pipelined: aligned, without async copy                         [(S-1)·T, (S-1)·T]
misaligned on gfx950 without async copy (3.4: one tile, 3.6: S-1)  [max(A, B), (S-1)·T]
async copy into LDS (gfx950 from Triton 3.8), aligned              [S·T, S·T + 5%]
async copy into LDS, misaligned                                    [S·T, S·T]
=================================================================  ===========================

Triton's stream pipeliner on AMD prefetches one stage into registers and keeps S-1 in LDS; at one
stage (and when the loads are not vectorized) the A and B tiles share one buffer in turn. With
direct-to-LDS async copies (``TRITON_HIP_USE_ASYNC_COPY``, Triton's default on gfx950 from 3.8)
every stage lives in LDS, padded against bank conflicts (4.96% at most). ``waves_per_eu`` and
``kpack`` never change the bytes; ``matrix_instr_nonkdim`` only the gfx950 padding, under 1 KiB
(measured: docs/MEASURED.md, smemguard/kernels/estimate.py).

A verdict is taken from the estimate only when the whole interval is :data:`ESTIMATE_MARGIN` clear of the
limit, and only for a kernel whose measured configs agree with the model on that arch,
specialization and code path (:mod:`smemguard.preflight.check` decides which): the configs nearest the limit on each
side are always compiled, and one measurement outside its interval makes the check compile every
config of that group. One exception to the margin: where stages change nothing
(:func:`stages_change_bytes`: sm_70/75, and the code paths of :data:`STAGE_FREE_REGIMES`), a config
that differs from a compiled one only in ``num_stages`` takes that compile's bytes (an interval of
width 0, near the limit too), once two stage variants of the group's cheapest config have compiled
to the same bytes; any two that differ make the check compile every config of the group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Bytes per element of each Triton scalar type a pointer can point to.
ELEMENT_BYTES = {"fp8e4nv": 1, "fp8e5": 1, "fp8e4b15": 1, "fp8e4b8": 1, "fp8e5b16": 1, "i8": 1, "u8": 1,
                 "fp16": 2, "bf16": 2, "i16": 2, "u16": 2, "fp32": 4, "i32": 4, "u32": 4, "fp64": 8, "i64": 8,
                 "u64": 8}

#: The verdicts an estimate can decide (the check's words for them).
FITS = "fits"
OVERFLOWS = "overflows"

#: How far (relative) an estimate's whole interval must be from the limit to decide a verdict.
#: Every calibration measurement lies inside its interval; the margin covers other Triton releases
#: and kernels that differ from the calibrated ones in ways the validation compiles did not catch.
ESTIMATE_MARGIN = 0.10

#: Archs with calibration data. Others (sm_86, sm_100, gfx1100, ...) are always compiled.
CALIBRATED_ARCHS = (70, 75, 80, 89, 90, 120, "gfx90a", "gfx942", "gfx950")

#: Code paths on which the calibration measured the same bytes at every ``num_stages`` of a config:
#: loads through registers (sm_70, sm_75), one stage (misaligned 2-byte operands), unpipelined LDS.
STAGE_FREE_REGIMES = ("registers", "one stage", "unpipelined")

#: Element types of the A operand with calibration data on AMD.
CALIBRATED_AMD_OPERANDS = ("fp16", "bf16")

#: How far the padding of async-copy LDS buffers (gfx950) may lift the bytes above S·T; measured up to 5%.
ASYNC_COPY_PADDING = 0.05

#: Element types of the A operand with calibration data.
CALIBRATED_OPERANDS = ("fp16", "bf16", "fp32")

_TILE_NAME = re.compile(r"^(?:BLOCK|BLOCK_SIZE|TILE|TILE_SIZE)_?([MNK])$|^B([MNK])$")


def matmul_tiles(constexprs: dict) -> tuple[int, int, int] | None:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of a matmul-like kernel's constexprs (``BLOCK_SIZE_M``, ``TILE_M``, ``BM``...),
    or None when it does not name all three."""
    dims: dict[str, int] = {}
    for name, value in constexprs.items():
        match = _TILE_NAME.match(name)
        if match and isinstance(value, int) and not isinstance(value, bool):
            dims[match.group(1) or match.group(2)] = value
    return (dims["M"], dims["N"], dims["K"]) if len(dims) == 3 else None


@dataclass(frozen=True)
class Estimate:
    """Bounds on the shared memory a compile will need, and the code path they assume."""

    low: int
    high: int
    # "registers", "wgmma", "mma", "one stage", "arguments == 1"; "any" (an envelope); on AMD "unpipelined",
    # "lds pipelined", "misaligned", "async copy"
    regime: str

    def holds(self, shared: int) -> bool:
        return self.low <= shared <= self.high

    def decides(self, limit: int) -> str | None:
        """FITS or OVERFLOWS when the whole interval is :data:`ESTIMATE_MARGIN` clear of ``limit``."""
        if self.high <= limit * (1 - ESTIMATE_MARGIN):
            return FITS
        if self.low >= limit * (1 + ESTIMATE_MARGIN):
            return OVERFLOWS
        return None

    def distance(self, limit: int) -> float:
        return (limit - self.high) / limit if self.high <= limit else (self.low - limit) / limit


def estimate(request, spec) -> Estimate | None:
    """Calibrated bounds for a matmul-like compile (``request``: a preflight ``CompileRequest``,
    ``spec``: its ``Specialization``), or None outside the calibrated domain (arch, operand type,
    tile sizes, stages, warps): then only a compile can tell."""
    pointer_types = [ty[1:] for ty in request.signature.values() if ty.startswith("*")]
    stages, warps = request.options["num_stages"], request.options["num_warps"]
    domain = _in_domain(request.arch, request.constants, pointer_types, stages, warps)
    if domain is None:
        return None
    element, (block_m, block_n, block_k) = domain
    a_tile, b_tile = block_m * block_k * element, block_k * block_n * element
    if not isinstance(request.arch, int):
        return None if spec.ones else _amd_estimate(request.arch, spec, a_tile, b_tile, stages)
    stage = a_tile + b_tile
    epilogue = block_m * block_n * max(ELEMENT_BYTES[ty] for ty in pointer_types)
    if request.arch < 80:
        return _through_registers(element, a_tile, b_tile, epilogue)
    if spec.ones:
        return Estimate(stage, stages * stage + epilogue, "arguments == 1")
    # cp.async copies 4, 8 or 16 bytes: 4-byte elements are always pipelined, 2-byte ones only
    # from 16-byte aligned addresses; otherwise the loads go through registers, one stage.
    if not spec.aligned and element < 4:
        return Estimate(stage, max(stage, epilogue), "one stage")
    if request.arch == 90 and block_m >= 64:  # wgmma (sm_90 only) reads every stage from shared memory
        return Estimate(stages * stage, stages * stage, "wgmma")
    pipelined = max(stages - 1, 1) * stage  # mma: one stage lives in registers
    return Estimate(pipelined, max(pipelined, epilogue), "mma")


def envelope(arch, constants: dict, pointer_types: list[str], stages: int, warps: int) -> Estimate | None:
    """Bounds that hold in every specialization (aligned, misaligned, ``N == 1``) of a matmul-like
    compile, or None outside the calibrated domain: from one stage of its A and B tiles to all its
    stages and an output tile, on NVIDIA from sm_80 (before, the one interval of loads through
    registers). None on AMD: its intervals were calibrated without
    arguments equal to 1, and a launch cannot tell an ``N == 1`` from a unit stride.

    What recovery uses, knowing only a launch: a kernel whose measured bytes lie inside its envelope
    is taken for a matmul like the calibrated ones, and its candidates whose lower bound is
    :data:`ESTIMATE_MARGIN` above the limit are not compiled."""
    domain = _in_domain(arch, constants, pointer_types, stages, warps)
    if domain is None or not isinstance(arch, int):
        return None
    element, (block_m, block_n, block_k) = domain
    a_tile, b_tile = block_m * block_k * element, block_k * block_n * element
    epilogue = block_m * block_n * max(ELEMENT_BYTES[ty] for ty in pointer_types)
    if arch < 80:  # one code path in every specialization
        return _through_registers(element, a_tile, b_tile, epilogue)
    return Estimate(a_tile + b_tile, stages * (a_tile + b_tile) + epilogue, "any")


def _through_registers(element: int, a_tile: int, b_tile: int, epilogue: int) -> Estimate:
    """No cp.async before Ampere: loads go through registers, whatever the stages; 2-byte operands
    (mma) take a buffer of the larger tile's size each, fp32 (FMA) the two tiles."""
    operands = 2 * max(a_tile, b_tile) if element < 4 else a_tile + b_tile
    return Estimate(operands, max(operands, epilogue), "registers")


def _in_domain(arch, constants: dict, pointer_types: list[str], stages: int, warps: int):
    """(bytes per operand element, (BLOCK_M, BLOCK_N, BLOCK_K)) inside the calibrated domain, else None."""
    tiles = matmul_tiles(constants)
    if arch not in CALIBRATED_ARCHS or tiles is None or not pointer_types:
        return None
    operand = pointer_types[0]
    block_m, block_n, block_k = tiles
    operands = CALIBRATED_OPERANDS if isinstance(arch, int) else CALIBRATED_AMD_OPERANDS
    in_domain = (operand in operands and all(ty in ELEMENT_BYTES for ty in pointer_types)
                 and 32 <= min(block_m, block_n) and max(block_m, block_n) <= 256 and 32 <= block_k <= 128
                 and 1 <= stages <= 5 and warps in (4, 8))
    return (ELEMENT_BYTES[operand], tiles) if in_domain else None


def stages_change_bytes(arch: int | str, interval: Estimate | None) -> bool:
    """Whether ``num_stages`` may change the shared memory of a compile for ``arch`` estimated as
    ``interval``. Not before sm_80, where Triton (3.4 to 3.9) runs no software pipeliner, and not on
    the code paths where the calibration measured every stage count of a config at the same bytes
    (:data:`STAGE_FREE_REGIMES`)."""
    if isinstance(arch, int) and arch < 80:
        return False
    return interval is None or interval.regime not in STAGE_FREE_REGIMES


def _amd_estimate(arch: str, spec, a_tile: int, b_tile: int, stages: int) -> Estimate:
    stage = a_tile + b_tile
    if stages > 1 and _async_copy(arch):
        high = stage * stages * (1 + ASYNC_COPY_PADDING) if spec.aligned else stage * stages
        return Estimate(stages * stage, int(high), "async copy")
    if stages > 1 and spec.aligned:
        return Estimate((stages - 1) * stage, (stages - 1) * stage, "lds pipelined")
    one_tile = max(a_tile, b_tile)
    if stages > 1 and arch == "gfx950":
        return Estimate(one_tile, max(one_tile, (stages - 1) * stage), "misaligned")
    return Estimate(one_tile, one_tile, "unpipelined")


def _async_copy(arch: str) -> bool:
    """Whether Triton's HIP backend copies global memory straight into LDS for ``arch``: its own rule
    (Triton 3.8 and later: on by default on gfx950), else the ``TRITON_HIP_USE_ASYNC_COPY`` knob."""
    from triton import knobs
    from triton.backends.amd import compiler

    rule = getattr(compiler, "is_async_copy_enabled", None)
    return bool(rule(arch) if rule is not None else knobs.amd.use_async_copy)
