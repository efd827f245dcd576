"""DeepGEMM paged-MQA schedule: wraps vLLM's ``vllm.utils.deep_gemm.get_paged_mqa_logits_metadata``.

What: vLLM's wrapper ``get_paged_mqa_logits_metadata(context_lens, block_size, num_sms,
indices=None)`` calls DeepGEMM's function of the same name, which returns the int32
``[num_sms + 1, 2]`` schedule of the paged-MQA-logits kernel; the MLA indexer
(``vllm/v1/attention/backends/mla/indexer.py``) calls it on every decode step and copies the
result into its ``scheduler_metadata_buffer``. When DeepGEMM refuses the batch for shared
memory, this wrapper returns the same schedule computed by
:func:`smemguard.fallbacks.paged_mqa_logits_metadata` on the same device, logs one warning
and writes one incident record. The decision is remembered: later calls with as large a
batch skip DeepGEMM (a failed JIT build would otherwise rerun NVCC on every step).

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
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ...facts import process
from ...facts.versions import Supported
from ...kernels.recorded import describe_arg
from ...store import incidents
from ...store.decision import FALLBACK as FALLBACK_ACTION
from .. import Layer, Patch, wrapt_layer

log = logging.getLogger(__name__)

TARGET_MODULE = "vllm.utils.deep_gemm"
FUNCTION = "get_paged_mqa_logits_metadata"
_LAYER = Layer(TARGET_MODULE, FUNCTION, rebind=True)  # the MLA indexer imports the function by name

KERNEL = "deep_gemm:get_paged_mqa_logits_metadata"
FALLBACK = "smemguard.fallbacks:paged_mqa_logits_metadata"
EXPECTED_PARAMETERS = ("context_lens", "block_size", "num_sms")

#: ptxas' refusal, when a DeepGEMM build puts it into the exception text.
_SHARED_DATA = "uses too much shared data"
#: DeepGEMM's host assertion on the scheduler's shared memory.
_HOST_ASSERTION = re.compile(r"\): smem_size <= (?:SM\d+ArchSpec::smem_capacity|meta_smem_cap)\s*$")
#: DeepGEMM's JIT build failures (the compiler output itself went to stdout).
_BUILD_FAILURE = re.compile(r'"NVCC compilation failed"|NVRTC error \([^)]*compiler\.hpp:\d+\)')
#: Static shared memory a kernel may declare: NVCC refuses more.
STATIC_SHARED_LIMIT = 48 * 1024

# Fingerprints of the scheduler kernel in DeepGEMM's headers, whitespace collapsed.
_REVERSED_SPLIT = "sm_idx > pivot ? sm_idx - pivot : 0"  # the last SMs take the extra unit
_FRONT_SPLIT = "min(sm_idx, r)"  # the first SMs take the extra unit
_ATOMS_INLINE = "ceil_div(next_n, next_n_atom)"  # atoms = ceil(next_n / 2), for any next_n
_ATOMS_FROM_HOST = "const uint32_t num_next_n_atoms,"  # the count comes from compiled host code
_CLAMPED = "min(lo, batch_size - 1)"  # nv_dev: idle SMs point at the last request
_KERNEL_SIGNATURE = re.compile(r"void (?:smxx|sm90|sm100)_paged_mqa_logits_metadata\(")
_STATIC_ARRAY = re.compile(r"__shared__ uint32_t \w+\[kAlignedBatchSize\]")
_TOKEN_WEIGHTED = ("info.num_kv_splits * info.num_q_tokens", "sm_idx < rem ? sm_idx : rem",
                   "w_in_request / info.num_q_tokens")


@dataclass(frozen=True)
class Scheduler:
    """The installed DeepGEMM scheduler, as far as the fallback needs it."""

    variant: str  # a smemguard.fallbacks.VARIANTS name
    static_arrays: int  # per-request arrays in static shared memory (0: dynamic)
    header: str  # the header it was read from


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
    if PATCH.engine is None:  # uninstalled while another tool's layer kept ours alive
        return wrapped(*args, **kwargs)
    schedule = _remembered_schedule(wrapped, args, kwargs)
    if schedule is not None:
        return schedule
    try:
        return wrapped(*args, **kwargs)
    except RuntimeError as error:
        schedule = _fallback(wrapped, args, kwargs, error)
        if schedule is None:
            raise
        return schedule


def _remembered_schedule(wrapped, args, kwargs):
    """The torch schedule when DeepGEMM already refused this case with a batch no larger; else None."""
    refusals = PATCH.memory()  # (device, slots, next_n, block_size) -> (smallest batch refused, variant)
    if not refusals:
        return None
    try:
        call = _bind(wrapped, args, kwargs)
        refused = refusals.get(call.key)
        if call.indices is not None or refused is None or call.batch < refused[0]:
            return None
        from ...fallbacks import paged_mqa_logits_metadata

        return paged_mqa_logits_metadata(call.context_lens, call.block_size, call.slots, variant=refused[1])
    except Exception:  # bookkeeping only: DeepGEMM gets the call
        log.debug("smemguard: could not reuse the DeepGEMM schedule decision", exc_info=True)
        return None


def _fallback(wrapped, args, kwargs, error: RuntimeError):
    """The torch schedule when ``error`` is DeepGEMM refusing the batch for shared memory; else None."""
    try:
        reason = _refusal(str(error))
        if reason is None:
            return None
        call = _bind(wrapped, args, kwargs)
        if call.indices is not None:
            process.warn_once(log, (KERNEL, "varlen"), "smemguard: %s refused a varlen batch (%s); smemguard has no "
                                "torch schedule for varlen calls, so the error is raised", KERNEL, error)
            return None
        deep_gemm = _deep_gemm(wrapped)
        scheduler = installed_scheduler(_include_dir(deep_gemm), _arch_major(call.context_lens.device),
                                        call.next_n, call.block_size)
        if scheduler is None:
            process.warn_once(log, (KERNEL, "unknown"), "smemguard: %s refused the batch (%s), but the installed "
                                "DeepGEMM's scheduler is not one smemguard can reproduce exactly; the error is "
                                "raised", KERNEL, error)
            return None
        if reason == "build" and not _needs_static_overflow(scheduler, call.batch):
            log.debug("smemguard: %s did not build for %d requests, which shared memory does not explain",
                      KERNEL, call.batch)
            return None
        from ...fallbacks import paged_mqa_logits_metadata

        started = time.perf_counter()
        schedule = paged_mqa_logits_metadata(call.context_lens, call.block_size, call.slots,
                                             variant=scheduler.variant)
        engine = PATCH.engine
        if engine is not None:
            with engine.memory.lock:
                refusals = PATCH.memory()
                known = refusals.get(call.key)
                if known is None or call.batch < known[0]:
                    refusals[call.key] = (call.batch, scheduler.variant)
        _report(call, scheduler, deep_gemm, error, reason, started)
        return schedule
    except Exception:  # our own failure must not replace DeepGEMM's error
        log.debug("smemguard: no DeepGEMM schedule fallback", exc_info=True)
        return None


def _refusal(text: str) -> str | None:
    if _SHARED_DATA in text:
        return "shared data"
    if _HOST_ASSERTION.search(text):
        return "host assertion"
    if _BUILD_FAILURE.search(text):
        return "build"
    return None


def _needs_static_overflow(scheduler: Scheduler, batch: int) -> bool:
    aligned = -(-batch // 32) * 32  # DeepGEMM sizes the arrays for the batch rounded up to a warp
    return scheduler.static_arrays * aligned * 4 >= STATIC_SHARED_LIMIT


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


def _include_dir(deep_gemm) -> Path:
    # DeepGEMM's JIT compiles from <package>/include (its _C.init gets the package directory).
    return Path(deep_gemm.__file__).parent / "include" / "deep_gemm"


def _arch_major(device) -> int | None:
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return torch.cuda.get_device_capability(device)[0]


def _kernel_text(path: Path) -> str | None:
    """The metadata kernel's source in ``path``, whitespace collapsed: from its signature to the
    next template (the headers also hold the logits kernels, with shared memory of their own)."""
    try:
        text = " ".join(path.read_text(encoding="utf-8", errors="replace").split())
    except OSError:
        return None
    found = _KERNEL_SIGNATURE.search(text)
    if found is None:
        return None
    end = text.find("template <", found.end())
    return text[found.start():end if end >= 0 else len(text)]


def installed_scheduler(include_dir: Path, arch_major: int | None, next_n: int, block_size) -> Scheduler | None:
    """Which schedule the DeepGEMM at ``include_dir`` computes for this call, or None when unsure.

    Three header layouts: ``scheduler/sm90_paged_mqa_logits.cuh`` and
    ``scheduler/sm100_paged_mqa_logits.cuh`` (2.6), ``scheduler/paged_mqa_logits.cuh``
    (2.4-2.5 and the nv_dev branch, one kernel for SM90 and SM100), and
    ``impls/sm90_fp8_paged_mqa_logits.cuh`` (2.0-2.3). Only SM90 and SM100 are covered
    (nv_dev splits differently on SM120).
    """
    if arch_major not in (9, 10):
        return None
    per_arch = include_dir / "scheduler" / "sm90_paged_mqa_logits.cuh"
    if per_arch.exists():
        if arch_major == 10:
            header = include_dir / "scheduler" / "sm100_paged_mqa_logits.cuh"
            text = _kernel_text(header)
            if text is None or not all(mark in text for mark in _TOKEN_WEIGHTED):
                return None
            return Scheduler("sm100", _static_arrays(text), str(header))
        return _request_major(per_arch, next_n)
    shared = include_dir / "scheduler" / "paged_mqa_logits.cuh"
    if shared.exists():
        return _request_major(shared, next_n)
    legacy = include_dir / "impls" / "sm90_fp8_paged_mqa_logits.cuh"
    text = _kernel_text(legacy)
    # No atoms yet (one unit per request and split) and splits of 4 * block_kv tokens.
    if text is None or _FRONT_SPLIT not in text:
        return None
    if next_n > 2 or block_size != 64:
        return None
    return Scheduler("older", _static_arrays(text), str(legacy))


def _request_major(header: Path, next_n: int) -> Scheduler | None:
    text = _kernel_text(header)
    if text is None:
        return None
    reversed_split, front_split = _REVERSED_SPLIT in text, _FRONT_SPLIT in text
    if reversed_split == front_split:
        return None
    # One atom for next_n <= 2 under every rule DeepGEMM used; beyond, only the inline ceil rule is ours.
    atoms_known = next_n <= 2 or (_ATOMS_INLINE in text and _ATOMS_FROM_HOST not in text)
    if not atoms_known:
        return None
    if _CLAMPED in text:
        variant = "nv_dev" if reversed_split else None
    else:
        variant = "current" if reversed_split else "older"
    return None if variant is None else Scheduler(variant, _static_arrays(text), str(header))


def _static_arrays(text: str) -> int:
    return 0 if "extern __shared__" in text else len(_STATIC_ARRAY.findall(text))


def _report(call: _Call, scheduler: Scheduler, deep_gemm, error: RuntimeError, reason: str, started: float) -> None:
    why = {"shared data": "ptxas: uses too much shared data",
           "host assertion": "DeepGEMM's host assertion on the scheduler's shared memory",
           "build": f"the scheduler did not build, and {scheduler.static_arrays} static per-request "
                    f"arrays for {call.batch} requests need {STATIC_SHARED_LIMIT} B or more"}[reason]
    incident = incidents.Incident(
        kernel=KERNEL, launched_as=f"{TARGET_MODULE}:{FUNCTION}", phase="launch", action=FALLBACK_ACTION,
        final=f"fallback {FALLBACK}", resource="shared memory", required=None, limit_hit=None, started=started,
        reason=why, extras={
            "args": {"context_lens": describe_arg(call.context_lens), "block_size": call.block_size,
                     "num_sms": call.num_sms, "indices": describe_arg(call.indices)},
            "slots": call.slots, "variant": scheduler.variant,
            "deep_gemm": {"version": getattr(deep_gemm, "__version__", None), "header": scheduler.header},
            "error": f"{type(error).__name__}: {error}"})
    incidents.report(incident, PATCH.records_path(), (KERNEL, *call.key),
                     "smemguard: %s: DeepGEMM refused a batch of %d requests (%s); the same schedule (%s) is computed "
                     "in torch from now on for batches this large", KERNEL, call.batch, why, scheduler.variant)


PATCH = Patch(__name__, target=f"{TARGET_MODULE}.{FUNCTION}", modules=(TARGET_MODULE,),
              supported=Supported("vllm", (0, 27), (0, 34), label="vLLM"),
              checked=("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),
              observe_safe=False,  # runs its fallback itself when DeepGEMM refuses a batch: never in observe mode
              apply=_check_target, layers={_LAYER: wrapt_layer(_fallback_on_refusal)})
