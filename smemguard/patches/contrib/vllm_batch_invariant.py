"""vLLM's batch-invariant matmul: a batch-invariant torch fallback for ``matmul_kernel_persistent``.

Why: vLLM's batch-invariant mode computes every matmul with ``matmul_kernel_persistent``,
tuned with 128x128 tiles, BLOCK_SIZE_K 32 (fp32) or 64, 3 stages, 8 warps. On a GPU with
101376 B per block (L4, L20, RTX 4090) the fp32 ``N == 1`` specialization needs 131072 B and
the first launch raises; newer vLLM sizes tiles from the device's limit, which an emulated
limit does not change. smemguard's engine first lowers ``num_stages``: same tiles, same
BLOCK_SIZE_K, same order of the K reduction, so rows stay batch-invariant. When no stage
count fits, this module's fallback runs :func:`smemguard.fallbacks.batch_invariant_mm`.

Tiles are never shrunk for this kernel: a smaller BLOCK_SIZE_M/N can change the MMA
instruction, and so the order of products inside a K step, and the decision could differ
between specializations (``M == 1`` against larger M), which would break batch invariance.

Where it applies (:class:`smemguard.patches.Kernels`): wherever a release keeps ``matmul_kernel_persistent(a_ptr,
b_ptr, c_ptr, bias_ptr, M, N, K, ..., HAS_BIAS)``, the parameters the fallback takes: every release from 0.27 to
0.34 (``PATCH.checked``; ``vllm/model_executor/layers/batch_invariant.py`` in 0.27 and 0.28,
``vllm/model_executor/determinism/batch_invariant.py`` from 0.29 on).
"""

from __future__ import annotations

from ...facts.versions import Supported
from ...kernels import registry
from .. import Kernels, Patch, Registration

#: Where vLLM's releases keep the kernel, newest first: 0.29 moved it to ``determinism``.
MODULES = ("vllm.model_executor.determinism.batch_invariant", "vllm.model_executor.layers.batch_invariant")
KERNEL = "matmul_kernel_persistent"

_FALLBACKS = Registration(registry.register_fallback, registry.unregister_fallback, registry.fallback_for,
                          lambda: PATCH.memory())


def _batch_invariant_fallback(a_ptr, b_ptr, c_ptr, bias_ptr=None, HAS_BIAS=False, **_):
    from ...fallbacks import batch_invariant_mm

    batch_invariant_mm(a_ptr, b_ptr, c_ptr, bias_ptr if HAS_BIAS else None)


def _give_fallbacks(engine) -> None:
    """Give every imported vLLM ``matmul_kernel_persistent`` the fallback (again on each import)."""
    for _, module in PATCH.homes():
        _FALLBACKS.add(getattr(module, KERNEL), _batch_invariant_fallback)


PATCH = Patch(__name__, target=KERNEL, kernels=Kernels(MODULES, {KERNEL: ("a_ptr", "b_ptr", "c_ptr", "bias_ptr",
                                                                           "HAS_BIAS")}),
              supported=Supported("vllm", (0, 27), (0, 34), label="vLLM"),
              checked=("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),
              observe_safe=True,  # registers a fallback only: in observe mode the engine records and re-raises anyway
              apply=_give_fallbacks, remove=_FALLBACKS.clear,
              present=lambda: any(_FALLBACKS.holds(getattr(module, KERNEL), _batch_invariant_fallback)
                                  for _, module in PATCH.homes()))
