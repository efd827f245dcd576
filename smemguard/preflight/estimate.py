"""The calibrated estimate: bounds on the shared memory of a matmul-like compile, without compiling.

For matmul-like configs (``BLOCK_M``/``BLOCK_N``/``BLOCK_K`` constexprs) inside the calibrated domain
(sm_80, sm_89, sm_90: fp16, bf16 or fp32 operands; gfx90a, gfx942, gfx950: fp16 or bf16; tiles
32 to 256, BLOCK_K 32 to 128, 1 to 5 stages, 4 or 8 warps) an interval estimate decides the clear
cases. With T the bytes of one stage of the A and B tiles, E those of one output tile and S the stages:

=================================================================  ===========================
code path                                                          interval (bytes)
=================================================================  ===========================
wgmma: sm_90, BLOCK_M >= 64, pipelined                             [S·T, S·T]
mma: sm_80/89, or BLOCK_M < 64, pipelined                          [(S-1)·T, max((S-1)·T, E)]
one stage: misaligned 2-byte operands (cp.async needs 4 bytes)     [T, max(T, E)]
launches with arguments == 1                                       [T, S·T + E]
=================================================================  ===========================

"Pipelined" means cp.async can feed the stages: 16-byte aligned, or 4-byte elements (fp32 is
pipelined even misaligned). Calibration: every measurement lies inside its interval, so the
estimate is off by at most the interval's width (nothing for wgmma; up to E - (S-1)·T where an
epilogue scratch dominates, 16 of 446 configs in the Triton 3.6 sweep). Measured: the 743
configs of ``tests/data/triton36_smem_sweep.csv`` (Triton 3.6; fp16, fp32; aligned,
misaligned, N == 1; sm_80/89/90) and, with Triton 3.9.0 on the same archs, 3096 compiles:
FlagGems' 216-config grid in fp16 and 138 configs in bf16 (aligned, misaligned), 108 in fp32
(aligned, misaligned, N == 1). The textbook S·T is off by S/(S-1) on sm_80/89: it drops configs that fit.

On AMD (gfx90a, gfx942, gfx950; fp16 or bf16 operands; same tiles, stages and warps), with A and
B the bytes of one A and one B tile (T = A + B), measured by ``benchmarks/amd_lds_sweep.py``:

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
``kpack`` never change the bytes; ``matrix_instr_nonkdim`` only the gfx950 padding (under 1 KiB).
Measured: ``tests/data/amd_lds_sweep.csv`` (Triton 3.9.0: FlagGems' 216-config grid aligned and
misaligned on the three archs, the AMD options on 12 configs, bf16 and fp32 subsets; 3.4.0 and
3.6.0: 48 configs at 1 to 4 stages, aligned and misaligned, on the three archs).

A verdict is taken from the estimate only when the whole interval is :data:`ESTIMATE_MARGIN` clear of the
limit, and only for a kernel whose measured configs agree with the model on that arch,
specialization and code path (:mod:`.check` decides which): the configs nearest the limit on each
side are always compiled, and one measurement outside its interval makes the check compile every
config of that group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .compiling import CompileRequest
from .model import BY_ORDER, ELEMENT_BYTES, FITS, OVERFLOWS, Specialization

#: How far (relative) an estimate's whole interval must be from the limit to decide a verdict.
#: Every calibration measurement lies inside its interval; the margin covers other Triton releases
#: and kernels that differ from the calibrated ones in ways the validation compiles did not catch.
ESTIMATE_MARGIN = 0.10

#: Archs with calibration data. Others (sm_86, sm_100, sm_120, gfx1100, ...) are always compiled.
CALIBRATED_ARCHS = (80, 89, 90, "gfx90a", "gfx942", "gfx950")

#: Element types of the A operand with calibration data on AMD.
CALIBRATED_AMD_OPERANDS = ("fp16", "bf16")

#: How far the padding of async-copy LDS buffers (gfx950) may lift the bytes above S·T; measured up to 5%.
ASYNC_COPY_PADDING = 0.05

#: Element types of the A operand with calibration data.
CALIBRATED_OPERANDS = ("fp16", "bf16", "fp32")

_TILE_NAME = re.compile(r"^(?:BLOCK|BLOCK_SIZE|TILE|TILE_SIZE)_?([MNK])$|^B([MNK])$")


def _tiles(constexprs: dict) -> tuple[int, int, int] | None:
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
    # "wgmma", "mma", "one stage", "arguments == 1"; on AMD "unpipelined", "lds pipelined", "misaligned", "async copy"
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


def estimate(request: CompileRequest, spec: Specialization) -> Estimate | None:
    """Calibrated bounds for a matmul-like compile, or None outside the calibrated domain
    (arch, operand type, tile sizes, stages, warps, unit inner strides): then only a compile can tell."""
    tiles = _tiles(request.constants)
    pointer_types = [ty[1:] for ty in request.signature.values() if ty.startswith("*")]
    # The calibration launches had unit inner strides, as *x.stride() passes them for contiguous tensors;
    # other strides change what can be pipelined.
    if request.arch not in CALIBRATED_ARCHS or tiles is None or not pointer_types or \
            spec.unit_guess not in (None, BY_ORDER):
        return None
    operand, stages, warps = pointer_types[0], request.options["num_stages"], request.options["num_warps"]
    block_m, block_n, block_k = tiles
    operands = CALIBRATED_OPERANDS if isinstance(request.arch, int) else CALIBRATED_AMD_OPERANDS
    in_domain = (operand in operands and all(ty in ELEMENT_BYTES for ty in pointer_types)
                 and 32 <= min(block_m, block_n) and max(block_m, block_n) <= 256 and 32 <= block_k <= 128
                 and 1 <= stages <= 5 and warps in (4, 8))
    if not in_domain:
        return None
    element = ELEMENT_BYTES[operand]
    if not isinstance(request.arch, int):
        return None if spec.ones else _amd_estimate(request.arch, spec, block_m * block_k * element,
                                                    block_k * block_n * element, stages)
    stage = (block_m * block_k + block_k * block_n) * element
    epilogue = block_m * block_n * max(ELEMENT_BYTES[ty] for ty in pointer_types)
    if spec.ones:
        return Estimate(stage, stages * stage + epilogue, "arguments == 1")
    # cp.async copies 4, 8 or 16 bytes: 4-byte elements are always pipelined, 2-byte ones only
    # from 16-byte aligned addresses; otherwise the loads go through registers, one stage.
    if not spec.aligned and element < 4:
        return Estimate(stage, max(stage, epilogue), "one stage")
    if request.arch >= 90 and block_m >= 64:  # wgmma reads every stage from shared memory
        return Estimate(stages * stage, stages * stage, "wgmma")
    pipelined = max(stages - 1, 1) * stage  # mma: one stage lives in registers
    return Estimate(pipelined, max(pipelined, epilogue), "mma")


def _amd_estimate(arch: str, spec: Specialization, a_tile: int, b_tile: int, stages: int) -> Estimate:
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
