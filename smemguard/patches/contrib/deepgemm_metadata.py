"""DeepGEMM paged-MQA schedule: wraps vLLM's ``vllm.utils.deep_gemm.get_paged_mqa_logits_metadata``.

What: vLLM's wrapper ``get_paged_mqa_logits_metadata(context_lens, block_size, num_sms,
indices=None)`` calls DeepGEMM's function of the same name, which returns the int32
``[num_sms + 1, 2]`` schedule of the paged-MQA-logits kernel; the MLA indexer
(``vllm/v1/attention/backends/mla/indexer.py``) calls it on every decode step and copies the
result into its ``scheduler_metadata_buffer``. When DeepGEMM refuses the batch for shared
memory, this wrapper returns the same schedule computed by
:func:`smemguard.fallbacks.paged_mqa_logits_metadata` on the same device, logs one warning
and writes one incident record. The decision is remembered: later calls with as large a
batch skip DeepGEMM (a failed JIT build would otherwise rerun NVCC on every step). The decision is the engine's
(:mod:`smemguard.engine.deepgemm`, through ``Port.on_deepgemm_refusal`` and ``Port.deepgemm_remembered``); this
module is the seam, and what it reads of vLLM's wrapper (the call's arguments, DeepGEMM's slots, the DeepGEMM module
vLLM calls).

Why: DeepGEMM's scheduler kernel keeps per-request arrays in shared memory, so large decode
batches (MTP, big ``max_num_seqs``) kill the worker. The failures recognised, all a
``RuntimeError`` (DeepGEMM's C++ ``DGException`` through pybind11, text
``"<kind> error (<file>:<line>): <detail>"``):

- a text saying ``uses too much shared data`` (ptxas' words);
- the host assertion on the size, ``Assertion error (...): smem_size <=
  SM90ArchSpec::smem_capacity`` (or ``SM100ArchSpec::smem_capacity``, or nv_dev's
  ``meta_smem_cap``), raised before anything is launched, 232448 bytes on SM90 and SM100;
- a failed JIT build, ``Assertion error (.../jit/compiler.hpp:228): false and "NVCC
  compilation failed"`` (or an ``NVRTC error`` from ``compiler.hpp``), but only when the
  installed scheduler keeps its arrays in *static* shared memory and this batch's arrays
  need 48 KiB or more: NVCC prints ptxas' ``uses too much shared data (0x18004 bytes, 0xc000
  max)`` to stdout, not into the exception (DeepGEMM issue #322).

Anything else (another ``RuntimeError``, an ``AssertionError``, a varlen call with
``indices``, an installed scheduler this module cannot identify) propagates as the same
object. The fallback never guesses: the schedule variant is read from the installed
DeepGEMM's JIT headers (``<deep_gemm>/include/deep_gemm/...``: exactly what its JIT compiles)
and the device's arch; see :func:`installed_scheduler`.

Callers import the function by name (the indexer does ``from vllm.utils.deep_gemm import
get_paged_mqa_logits_metadata``), so wrapping the defining module is not enough when the
indexer is already imported: :func:`patch` also rebinds the name in every loaded module
that holds the original, and :func:`unpatch` puts it back. Modules imported later pick up
whatever the defining module holds. An alias under another name is not followed.

Read in every vLLM release checked (0.32 to 0.34 installed and patched in the tests, CI stages 2 and 3; from 0.28
the wrapper takes ``indices`` and hands DeepGEMM ``_paged_mqa_logits_schedule_slots(num_sms, next_n)`` slots,
num_sms // 2 on SM90 with next_n 4, and the fallback asks that same helper; 0.27 has the three-argument form and
hands DeepGEMM ``num_sms``) and stored public
copies of ``vllm/utils/deep_gemm.py`` with the three-argument form and with ``indices``
(release numbers not pinned); all define the function in ``vllm/utils/deep_gemm.py``.
DeepGEMM: the commits listed in docs/MEASURED.md (smemguard/fallbacks.py); the header fingerprints were
checked on each of them and on nv_dev's intermediate commits.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from dataclasses import dataclass

from ...facts.versions import Supported
from .. import Layer, Patch, wrapt_layer

log = logging.getLogger(__name__)

TARGET_MODULE = "vllm.utils.deep_gemm"
FUNCTION = "get_paged_mqa_logits_metadata"
_LAYER = Layer(TARGET_MODULE, FUNCTION, rebind=True)  # the MLA indexer imports the function by name

EXPECTED_PARAMETERS = ("context_lens", "block_size", "num_sms")


@dataclass(frozen=True)
class _Call:
    context_lens: object
    block_size: object
    num_sms: object
    indices: object
    slots: int  # the num_sms DeepGEMM receives
    next_n: int

    @property
    def batch(self) -> int:
        return self.context_lens.shape[0]

    @property
    def key(self) -> tuple:
        return str(self.context_lens.device), self.slots, self.next_n, self.block_size


def _check_target(engine) -> None:
    """Raises ``RuntimeError`` when the function's signature is not one this module was checked against: nothing
    is touched then. The layer is added here and in the modules that imported the function by name."""
    if not _LAYER.present():
        _check_signature(getattr(importlib.import_module(TARGET_MODULE), FUNCTION, None))


def _check_signature(function) -> None:
    if function is None:
        raise RuntimeError(f"{TARGET_MODULE} has no {FUNCTION} (a vLLM without the DeepSeek sparse-attention "
                           "indexer); smemguard leaves it unpatched")
    names = tuple(inspect.signature(function).parameters)[:len(EXPECTED_PARAMETERS)]
    if names != EXPECTED_PARAMETERS:
        raise RuntimeError(f"{TARGET_MODULE}.{FUNCTION}{inspect.signature(function)} does not start with "
                           f"{', '.join(EXPECTED_PARAMETERS)}; smemguard leaves it unpatched")


def _fallback_on_refusal(wrapped, instance, args, kwargs):
    engine = PATCH.engine
    if engine is None:  # uninstalled while another tool's layer kept ours alive
        return wrapped(*args, **kwargs)
    call_of = functools.partial(_bind, wrapped, args, kwargs)
    schedule = engine.deepgemm_remembered(call_of)
    if schedule is not None:
        return schedule
    try:
        return wrapped(*args, **kwargs)
    except RuntimeError as error:
        schedule = engine.on_deepgemm_refusal(call_of, functools.partial(_deep_gemm, wrapped), error)
        if schedule is None:
            raise
        return schedule


@functools.lru_cache(maxsize=8)
def _signature(wrapped) -> inspect.Signature:
    return inspect.signature(wrapped)


def _bind(wrapped, args, kwargs) -> _Call:
    bound = _signature(wrapped).bind(*args, **kwargs)
    context_lens, block_size, num_sms = list(bound.arguments.values())[:3]
    next_n = context_lens.shape[1] if context_lens.dim() == 2 else 1
    # vLLM >= 0.32 hands DeepGEMM fewer slots than SMs in some cases; ask it the same way.
    to_slots = getattr(wrapped, "__globals__", {}).get("_paged_mqa_logits_schedule_slots")
    slots = to_slots(num_sms, next_n) if to_slots is not None else num_sms
    return _Call(context_lens, block_size, num_sms, bound.arguments.get("indices"), slots, next_n)


def _deep_gemm(wrapped):
    """The DeepGEMM module vLLM called: its own resolver where it has one (vendored copy or not)."""
    resolve = getattr(wrapped, "__globals__", {}).get("_import_deep_gemm")
    module = resolve() if resolve is not None else None
    return module if module is not None else importlib.import_module("deep_gemm")


PATCH = Patch(__name__, target=f"{TARGET_MODULE}.{FUNCTION}", modules=(TARGET_MODULE,),
              supported=Supported("vllm", (0, 27), (0, 34), label="vLLM"),
              checked=("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),
              observe_safe=False,  # runs its fallback itself when DeepGEMM refuses a batch: never in observe mode
              apply=_check_target, layers={_LAYER: wrapt_layer(_fallback_on_refusal)})
