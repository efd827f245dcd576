"""The per-block opt-in shared-memory limit of the GPUs smemguard knows by name.

One table, used by ``SMEMGUARD_MAX_SHARED=<name>``, the CPU test harness, ``smemguard check``
and the docs. The limits are the per-block *opt-in* maximum that Triton compares a kernel's
``metadata.shared`` against (``cudaDevAttrMaxSharedMemoryPerBlockOptin``; on AMD the LDS one
workgroup may use, ``hipDeviceAttributeMaxSharedMemoryPerBlock``), and where the GPU has tensor
memory, the columns Triton's load check allows a kernel's ``metadata.tmem_size``.

Where each figure comes from (one source per arch, named again at its rows):

* NVIDIA, per compute capability: CUDA C++ Programming Guide, "Technical Specifications per Compute
  Capability" (shared memory per SM and per block, 1 KB of each SM's reserved for the system from
  cc 8.0 on), as NVIDIA's CUTLASS keeps it: ``SMEM_CAPACITY_MAP`` in
  ``python/CuTeDSL/cutlass/cutlass_dsl/cutlass.py`` (sm_80/87 (164 - 1) KB, sm_86/89/120/121
  (100 - 1) KB, sm_90/100/101/103/110 (228 - 1) KB) and ``sm100_smem_capacity_bytes`` /
  ``sm120_smem_capacity_bytes`` in ``include/cutlass/arch/arch.h`` (232448, 101376; ``Sm103`` and
  ``Sm101``, Thor's arch before CUDA 13 named it sm_110, use the first).
* Tensor memory (sm_100 family only: tcgen05; sm_120/121 have none): 512 columns of 128 lanes per CTA
  (PTX ISA, "Tensor Memory"); Triton's ``CompiledKernel._init_handles`` allows 512, and 576 on arch 107
  (Rubin), in 3.8 and 3.9.
* AMD: the LDS one workgroup may allocate, Triton's ``TargetInfo::getSharedMemorySize``
  (``third_party/amd/lib/TritonAMDGPUToLLVM/TargetInfo.cpp``: 64 KiB, 160 KiB on CDNA4), which is
  LLVM's ``FeatureAddressableLocalMemorySize65536`` for gfx9 to gfx12 ("the maximum number of bytes of
  LDS that can be allocated to a single workgroup", ``llvm/lib/Target/AMDGPU/AMDGPU.td``). ROCm's
  "GPU hardware specifications" table lists LDS per CU (CDNA: 64 KiB, MI100 included) or per WGP (RDNA:
  128 KiB, two CUs), not per workgroup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import versions


@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str  # "sm_89", "gfx942"
    max_shared: int  # bytes per block, opt-in
    aliases: tuple[str, ...] = ()
    tensor_memory: int | None = None  # columns per CTA (sm_100 family); None: no tensor memory

    @property
    def shared_per_sm(self) -> int | None:
        """Shared memory per SM in bytes on NVIDIA, as the CUDA guide's table gives it: the per-block opt-in
        plus the 1 KB reserved for the system from cc 8.0 on, equal to it before; None on AMD, where HIP's
        per-CU figure is no documented function of the per-workgroup one."""
        if self.capability is None:
            return None
        return self.max_shared + 1024 if self.capability >= 80 else self.max_shared

    @property
    def device_name(self) -> str:
        """The name a process emulating this GPU reports for it: ``"NVIDIA L4"``, ``"AMD MI300X"``. Device names
        differ per board ("NVIDIA H100 80GB HBM3"); :func:`lookup` finds the GPU from either."""
        return f"{'NVIDIA' if self.backend == 'cuda' else 'AMD'} {self.name}"

    @property
    def capability(self) -> int | None:
        """Triton's integer target arch for NVIDIA GPUs (89 for sm_89); None for AMD."""
        return int(self.arch[3:]) if self.arch.startswith("sm_") else None

    @property
    def backend(self) -> str:
        """Triton's backend for the GPU: "cuda" or "hip"."""
        return "cuda" if self.capability is not None else "hip"

    @property
    def target_arch(self) -> int | str:
        """The arch of Triton's ``GPUTarget``: 89 for sm_89, "gfx942" for AMD."""
        return self.capability if self.capability is not None else self.arch

    @property
    def warp_size(self) -> int:
        return warp_size(self.target_arch)


def warp_size(arch: int | str) -> int:
    """Threads per warp (wavefront) of a target arch: 32 on NVIDIA and on RDNA (gfx10 and later),
    64 on CDNA (gfx9), as Triton's HIP backend sets it."""
    if isinstance(arch, int):
        return 32
    return 32 if int(arch[3:-2]) >= 10 else 64


#: Tensor memory columns per CTA of the sm_100 family (see the module's docstring), and Rubin's (arch 107).
BLACKWELL_TMEM = 512
RUBIN_TMEM = 576

GPUS: tuple[Gpu, ...] = (
    Gpu("V100", "sm_70", 98304),  # cc 7.0: 96 KB per SM and per block
    Gpu("T4", "sm_75", 65536),  # cc 7.5: 64 KB
    Gpu("RTX2080Ti", "sm_75", 65536, ("2080Ti",)),
    Gpu("A100", "sm_80", 166912),  # cc 8.0: (164 - 1) KB
    Gpu("A800", "sm_80", 166912),
    Gpu("A10", "sm_86", 101376, ("A10G",)),  # cc 8.6: (100 - 1) KB
    Gpu("A40", "sm_86", 101376),
    Gpu("RTX3090", "sm_86", 101376, ("3090",)),
    Gpu("A6000", "sm_86", 101376, ("RTXA6000",)),
    Gpu("L4", "sm_89", 101376),  # cc 8.9 (Ada): (100 - 1) KB, every Ada board below
    Gpu("L20", "sm_89", 101376),
    Gpu("L40S", "sm_89", 101376, ("L40",)),
    Gpu("RTX4090", "sm_89", 101376, ("4090",)),
    Gpu("RTX4090D", "sm_89", 101376, ("4090D",)),
    Gpu("RTX4080", "sm_89", 101376, ("4080",)),
    Gpu("RTX5880Ada", "sm_89", 101376, ("RTX5880", "RTX5880AdaGeneration")),
    Gpu("H100", "sm_90", 232448),  # cc 9.0: (228 - 1) KB
    Gpu("H200", "sm_90", 232448),
    Gpu("H20", "sm_90", 232448),
    Gpu("H800", "sm_90", 232448),
    Gpu("B200", "sm_100", 232448, tensor_memory=BLACKWELL_TMEM),  # cc 10.0: (228 - 1) KB
    Gpu("GB200", "sm_100", 232448, tensor_memory=BLACKWELL_TMEM),
    Gpu("B300", "sm_103", 232448, tensor_memory=BLACKWELL_TMEM),  # cc 10.3: (228 - 1) KB
    Gpu("GB300", "sm_103", 232448, tensor_memory=BLACKWELL_TMEM),
    # cc 10.7. No public per-block figure: Triton reads Rubin's limit from a device attribute of its own
    # (CU_DEVICE_ATTRIBUTE_MAX_OVERSIZED_SHARED_MEMORY_PER_BLOCK, 150, in 3.8/3.9's driver.c) that no released
    # CUDA header or guide documents yet. The row takes the sm_100 family's documented (228 - 1) KB as a floor:
    # a kernel that fits it fits Rubin; one over it may still fit there.
    Gpu("Rubin", "sm_107", 232448, tensor_memory=RUBIN_TMEM),
    # cc 11.0 (sm_101 before CUDA 13): (228 - 1) KB
    Gpu("JetsonThor", "sm_110", 232448, ("Thor", "JetsonAGXThor"), tensor_memory=BLACKWELL_TMEM),
    Gpu("RTX5090", "sm_120", 101376, ("5090",)),  # cc 12.0: (100 - 1) KB
    Gpu("RTX5080", "sm_120", 101376, ("5080",)),
    Gpu("RTX5070", "sm_120", 101376, ("5070",)),
    Gpu("RTXPRO6000", "sm_120", 101376, ("RTXPRO6000Blackwell",)),
    Gpu("GB10", "sm_121", 101376, ("DGXSpark",)),  # cc 12.1: (100 - 1) KB
    Gpu("MI100", "gfx908", 65536),  # CDNA: 64 KiB, every gfx9 below but gfx950
    Gpu("MI210", "gfx90a", 65536),
    Gpu("MI250", "gfx90a", 65536),
    Gpu("MI250X", "gfx90a", 65536),
    Gpu("MI300A", "gfx942", 65536),
    Gpu("MI300X", "gfx942", 65536),
    Gpu("MI325X", "gfx942", 65536),
    Gpu("MI350X", "gfx950", 163840),  # CDNA4: 160 KiB
    Gpu("MI355X", "gfx950", 163840),
    Gpu("RX7900XTX", "gfx1100", 65536, ("7900XTX",)),  # RDNA3, 3.5 and 4: 64 KiB a workgroup
    Gpu("W7900", "gfx1100", 65536, ("PROW7900",)),
    Gpu("RX7700S", "gfx1102", 65536, ("7700S",)),
    Gpu("StrixHalo", "gfx1151", 65536, ("RyzenAIMax395", "8060S")),
    Gpu("RX9070", "gfx1201", 65536, ("9070", "RX9070XT", "9070XT")),
    Gpu("R9700", "gfx1201", 65536, ("AIPROR9700",)),
)

#: The oldest Triton that compiles for an arch, where an older supported one cannot: measured on the CPU harness
#: (2026-12-07), 3.4, 3.6 and 3.7 abort the process in LLVM for arch 107 ("Cannot select: intrinsic
#: %llvm.nvvm..."), a crash no ``try`` catches; 3.8 compiles for it (Rubin enablement, triton #11108). Every other
#: arch of the table compiles from 3.4 on.
OLDEST_TRITON = {"sm_107": (3, 8)}


def compile_problem(arch: int | str, triton_version: str | None) -> str | None:
    """Why Triton ``triton_version`` cannot compile for ``arch`` (``"sm_107"``, 107, ``"gfx942"``), or None."""
    name = f"sm_{arch}" if isinstance(arch, int) else arch
    oldest, release = OLDEST_TRITON.get(name), versions.parse(triton_version)
    if oldest is None or release is None or release >= oldest:
        return None
    return (f"Triton {triton_version} cannot compile for {name} (its LLVM aborts the process); Triton "
            f"{oldest[0]}.{oldest[1]} or newer can")


# Vendor words that device names carry ("NVIDIA GeForce RTX 4090", "AMD Instinct MI300X")
# but users leave out; dropping them lets torch's device name match the table too.
_VENDOR_WORDS = re.compile(r"nvidia|geforce|tesla|amd|instinct|radeon|pcie|sxm\d*|nvl|oam|\d+gb")


def _normalize(name: str) -> str:
    return _VENDOR_WORDS.sub("", re.sub(r"[^a-z0-9]", "", name.lower()))


_BY_NAME = {_normalize(alias): gpu for gpu in GPUS for alias in (gpu.name, *gpu.aliases)}


def lookup(name: str) -> Gpu | None:
    """The GPU called ``name`` ("L4", "rtx 4090", "NVIDIA H200"), or None."""
    return _BY_NAME.get(_normalize(name))


def names() -> list[str]:
    return [gpu.name for gpu in GPUS]
