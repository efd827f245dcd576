"""vLLM's own shared-memory query, under an emulated limit: wraps ``vllm.utils.mem_utils.get_max_shared_memory_bytes``.

Why: vLLM asks the device for its per-block limit through its C extension
(``_C_cuda_utils.get_max_shared_memory_per_block_device_attribute``, cached by ``get_max_shared_memory_bytes``), not
through torch's properties (``patches/torch_seams/torch_device_properties``) nor Triton's. Its Triton prefill
attention shrinks
its tile to that limit before launching (0.34: ``_fit_block_to_shared_memory``), the LoRA fused-MoE and the
batch-invariant matmul choose configs by it. Under an emulated L4 on an H100 they would choose the H100's, so an
emulated run would neither show what vLLM does on the L4 nor fail where the L4 fails.

What: while a limit is emulated (and ``SMEMGUARD_EMULATE_PROPERTIES`` is not off), the function returns the lower of
the device's answer and the emulated limit, also in the modules that imported it by name (the prefill attention,
the LoRA fused-MoE, the batch-invariant matmul, HiSparse). Its cache is cleared when the layer is added and when it
is taken out, so that neither the device's answer nor the emulated one outlives the emulation; what vLLM computed
from it meanwhile and cached itself (the prefill's ``_fit_block_to_shared_memory``) keeps the smaller tile, which
fits the device too.

``vllm/utils/mem_utils.py``: ``get_max_shared_memory_bytes(gpu=0)``, a ``functools.cache`` over the C query, the
same in 0.32, 0.33 and 0.34.
"""

from __future__ import annotations

import sys

from ...facts import process
from ...facts.versions import Supported
from .. import Layer, Patch, wrapt_layer

_MODULE = "vllm.utils.mem_utils"
_FUNCTION = "get_max_shared_memory_bytes"
_LAYER = Layer(_MODULE, _FUNCTION, rebind=True)


def _lower_of_device_and_emulated(wrapped, instance, args, kwargs):
    device_limit = wrapped(*args, **kwargs)
    engine = PATCH.engine
    settings = engine.settings if engine is not None else None
    if settings is None or settings.max_shared is None or not settings.emulate_properties or process.device_as_is:
        return device_limit
    try:
        return min(device_limit, settings.max_shared)
    except TypeError:  # not a number: vLLM's own answer, as it gave it
        return device_limit


def _forget_the_cached_answer() -> None:
    cached = getattr(sys.modules.get(_MODULE), _FUNCTION, None)  # through wrapt layers, ours or another tool's
    getattr(cached, "cache_clear", lambda: None)()


PATCH = Patch(__name__, target=f"{_MODULE}.{_FUNCTION}", modules=(_MODULE,),
              supported=Supported("vllm", (0, 32), (0, 34), label="vLLM"), checked=("0.32.0", "0.33.0", "0.34.0"),
              observe_safe=True,  # observe mode emulates the GPU too: what vLLM chooses there is observed
              wanted=lambda settings: settings.max_shared is not None and settings.emulate_properties,
              layers={_LAYER: wrapt_layer(_lower_of_device_and_emulated)},
              apply=lambda engine: _forget_the_cached_answer(), remove=_forget_the_cached_answer)
