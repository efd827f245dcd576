"""The per-block opt-in shared-memory limit of the GPUs smemguard knows by name.

One table, used by ``SMEMGUARD_MAX_SHARED=<name>``, the CPU test harness, ``smemguard check``
and the docs. The limits are the per-block *opt-in* maximum that Triton compares a kernel's
``metadata.shared`` against (``cudaDevAttrMaxSharedMemoryPerBlockOptin``; on AMD the LDS one
workgroup may use, ``hipDeviceAttributeMaxSharedMemoryPerBlock``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str  # "sm_89", "gfx942"
    max_shared: int  # bytes per block, opt-in
    aliases: tuple[str, ...] = ()

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


GPUS: tuple[Gpu, ...] = (
    Gpu("V100", "sm_70", 98304),
    Gpu("T4", "sm_75", 65536),
    Gpu("RTX2080Ti", "sm_75", 65536, ("2080Ti",)),
    Gpu("A100", "sm_80", 166912),
    Gpu("A800", "sm_80", 166912),
    Gpu("A10", "sm_86", 101376, ("A10G",)),
    Gpu("A40", "sm_86", 101376),
    Gpu("RTX3090", "sm_86", 101376, ("3090",)),
    Gpu("A6000", "sm_86", 101376, ("RTXA6000",)),
    Gpu("L4", "sm_89", 101376),
    Gpu("L20", "sm_89", 101376),
    Gpu("L40S", "sm_89", 101376, ("L40",)),
    Gpu("RTX4090", "sm_89", 101376, ("4090",)),
    Gpu("H100", "sm_90", 232448),
    Gpu("H200", "sm_90", 232448),
    Gpu("H20", "sm_90", 232448),
    Gpu("H800", "sm_90", 232448),
    Gpu("B200", "sm_100", 232448),
    Gpu("GB200", "sm_100", 232448),
    Gpu("RTX5090", "sm_120", 101376, ("5090",)),
    Gpu("RTXPRO6000", "sm_120", 101376, ("RTXPRO6000Blackwell",)),
    Gpu("MI210", "gfx90a", 65536),
    Gpu("MI250", "gfx90a", 65536),
    Gpu("MI250X", "gfx90a", 65536),
    Gpu("MI300A", "gfx942", 65536),
    Gpu("MI300X", "gfx942", 65536),
    Gpu("MI325X", "gfx942", 65536),
    Gpu("MI350X", "gfx950", 163840),
    Gpu("MI355X", "gfx950", 163840),
    Gpu("RX7900XTX", "gfx1100", 65536, ("7900XTX",)),
    Gpu("W7900", "gfx1100", 65536, ("PROW7900",)),
)

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
