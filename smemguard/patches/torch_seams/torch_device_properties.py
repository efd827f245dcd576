"""What torch says of the device, under an emulated GPU: wraps ``torch.cuda.get_device_properties``.

Why: ``SMEMGUARD_MAX_SHARED`` lowers the limit Triton enforces (``patches/triton_seams/max_shared_mem``), but
libraries size
themselves from torch's view of the device, read before any launch: SGLang's fused-MoE FP8 default takes a smaller
tile where ``shared_memory_per_block_optin`` is under 128 KiB (0.5.14 and later), vLLM's FlexAttention backend and
its bundled ``triton_kernels`` cap their blocks by it, other code keys tables by ``torch.cuda.get_device_name()``.
Under an emulated L4 on an H100 they would choose the H100's configuration, so an emulated run would show neither
what the library does on the L4 nor its overflows there.

What: while a limit is emulated (and ``SMEMGUARD_EMULATE_PROPERTIES`` is not off), the properties torch returns are
a proxy (``wrapt.ObjectProxy``: ``isinstance`` and every other attribute are the device's) in which
``shared_memory_per_block_optin`` is the emulated limit where it is lower. When ``SMEMGUARD_MAX_SHARED`` names a GPU
of the device's vendor, also ``shared_memory_per_multiprocessor`` (NVIDIA: the CUDA guide's figure of that arch,
where lower) and ``name`` are the emulated GPU's; ``get_device_name`` and ``get_device_capability`` read them
through this function, so they follow.

The capability stays the device's unless code built for the emulated one runs on the device: the same major and a
minor no higher (an A10's 8.6 on an L40S's 8.9: one info line says which otherwise). Triton compiles for the
device its own driver reports, so its kernels stay right either way, but libraries pick prebuilt kernels by the
capability (CUTLASS, FlashInfer, sgl-kernel), and those of another major do not run. So under an emulated L4 on
an H100 code that picks tiles by capability (vLLM's ``get_block_size``, SGLang's sm_120 attention tiles) still
sees sm_90. smemguard's own records read the device as it is (``process.own_device_properties``).

``torch/cuda/__init__.py``: ``get_device_properties(device)`` returns the C ``_CudaDeviceProperties``;
``get_device_name`` and ``get_device_capability`` call it (2.11, 2.13 to 2.15).
"""

from __future__ import annotations

import logging
import re

import wrapt

from ...facts import gpus, process
from ...facts.versions import Supported
from .. import Layer, Patch, wrapt_layer

log = logging.getLogger(__name__)

_LAYER = Layer("torch.cuda", "get_device_properties", rebind=True)


class EmulatedProperties(wrapt.ObjectProxy):
    """The device's properties, with the emulated GPU's figures in place of some (``__self_emulated``)."""

    def __init__(self, properties, emulated: dict) -> None:
        super().__init__(properties)
        self._self_emulated = emulated

    def __repr__(self) -> str:
        text = repr(self.__wrapped__)
        for name, value in self._self_emulated.items():
            text = re.sub(rf"\b{name}=('[^']*'|\w+)", lambda _, shown=f"{name}={value!r}": shown, text)
        return text

    __str__ = __repr__


def _emulated_field(name: str) -> property:
    return property(lambda self: self._self_emulated[name] if name in self._self_emulated
                    else getattr(self.__wrapped__, name))


for _name in ("name", "major", "minor", "shared_memory_per_block_optin", "shared_memory_per_multiprocessor"):
    setattr(EmulatedProperties, _name, _emulated_field(_name))


def _device_backend() -> str:
    import torch

    return "hip" if getattr(torch.version, "hip", None) else "cuda"


def _capability_runs_here(gpu: gpus.Gpu, properties) -> bool:
    """Whether code built for ``gpu``'s capability runs on the device: the same major, a minor no higher."""
    major, minor = divmod(gpu.capability, 10)
    return major == properties.major and minor <= properties.minor


def emulated_figures(settings, properties) -> dict:
    """The attributes of ``properties`` (the device's) that the emulation under ``settings`` changes."""
    figures = {}
    limit = settings.max_shared
    if limit is None or not settings.emulate_properties:  # a layer kept alive by another tool, under a later install
        return figures
    if hasattr(properties, "shared_memory_per_block_optin") and limit < properties.shared_memory_per_block_optin:
        figures["shared_memory_per_block_optin"] = limit
    gpu = settings.emulated_gpu
    if gpu is None or gpu.backend != _device_backend():
        return figures
    figures["name"] = gpu.device_name
    per_sm = gpu.shared_per_sm
    if per_sm is not None and per_sm < getattr(properties, "shared_memory_per_multiprocessor", per_sm):
        figures["shared_memory_per_multiprocessor"] = per_sm
    if gpu.capability is not None and _capability_runs_here(gpu, properties):
        figures["major"], figures["minor"] = divmod(gpu.capability, 10)
    elif gpu.capability is not None:
        process.warn_once(log, ("capability kept", gpu.name), "smemguard: torch reports this GPU's own capability "
                          "%d.%d under the emulated %s (%s): libraries pick prebuilt kernels by it, and those built "
                          "for %s do not run here", properties.major, properties.minor, gpu.name, gpu.arch, gpu.arch,
                          level=logging.INFO)
    return figures


def _as_emulated(wrapped, instance, args, kwargs):
    properties = wrapped(*args, **kwargs)
    engine = PATCH.engine
    if engine is None or process.device_as_is:
        return properties
    try:
        figures = emulated_figures(engine.settings, properties)
    except Exception:  # the device's own properties rather than an error of ours
        process.warn_once(log, ("emulated properties",), "smemguard: could not emulate torch's device properties; "
                          "they stay the device's", exc_info=True)
        return properties
    return EmulatedProperties(properties, figures) if figures else properties


PATCH = Patch(__name__, target="torch.cuda.get_device_properties", modules=("torch.cuda",),
              supported=Supported("torch", (2, 8), (2, 15), label="PyTorch"),
              checked=("2.11.0", "2.13.0", "2.14.0", "2.15.0"),
              observe_safe=True,  # observe mode emulates the GPU too: what the libraries choose there is observed
              wanted=lambda settings: settings.max_shared is not None and settings.emulate_properties,
              layers={_LAYER: wrapt_layer(_as_emulated)})
