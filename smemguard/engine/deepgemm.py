"""DeepGEMM's paged-MQA schedule when DeepGEMM refuses a batch for shared memory: the decision behind the
``deepgemm_metadata`` patch (:mod:`smemguard.patches.contrib.deepgemm_metadata`, which says why and what it reads of
vLLM). Which refusals are DeepGEMM's scheduler running out of shared memory, which scheduler the installed DeepGEMM
computes (read from its JIT headers: exactly what its JIT compiles), the torch schedule in its place
(:func:`smemguard.fallbacks.paged_mqa_logits_metadata`), the incident record, and the refusal remembered for the
install: a later call with as large a batch skips DeepGEMM (a failed JIT build would otherwise rerun NVCC on every
step). The call reaches here described by the patch (``call``: its ``context_lens``, ``block_size``, ``num_sms``,
``indices``, the ``slots`` DeepGEMM receives, ``next_n``, ``batch`` and ``key``)."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..facts import process
from ..kernels.recorded import describe_arg
from ..store import incidents
from ..store.decision import FALLBACK as FALLBACK_ACTION

log = logging.getLogger(__name__)

KERNEL = "deep_gemm:get_paged_mqa_logits_metadata"
LAUNCHED_AS = "vllm.utils.deep_gemm:get_paged_mqa_logits_metadata"
FALLBACK = "smemguard.fallbacks:paged_mqa_logits_metadata"
#: The install's memory table of refusals: (device, slots, next_n, block_size) -> (smallest batch refused, variant).
MEMORY = "deepgemm_metadata"

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




def remembered(engine, call_of):
    """The torch schedule when DeepGEMM already refused this case with a batch no larger; else None. ``call_of()``
    describes the call (only once something was refused: a healthy call pays one look at an empty table)."""
    refusals = engine.memory.table(MEMORY)
    if not refusals:
        return None
    call = call_of()
    refused = refusals.get(call.key)
    if call.indices is not None or refused is None or call.batch < refused[0]:
        return None
    from ..fallbacks import paged_mqa_logits_metadata

    return paged_mqa_logits_metadata(call.context_lens, call.block_size, call.slots, variant=refused[1])


def on_refusal(engine, call_of, deep_gemm_of, error: RuntimeError):
    """The torch schedule when ``error`` is DeepGEMM refusing the batch for shared memory (recorded, and remembered
    for the install); else None. ``deep_gemm_of()`` is the DeepGEMM module vLLM called."""
    reason = _refusal(str(error))
    if reason is None:
        return None
    call = call_of()
    if call.indices is not None:
        process.warn_once(log, (KERNEL, "varlen"), "smemguard: %s refused a varlen batch (%s); smemguard has no "
                          "torch schedule for varlen calls, so the error is raised", KERNEL, error)
        return None
    deep_gemm = deep_gemm_of()
    scheduler = installed_scheduler(_include_dir(deep_gemm), _arch_major(call.context_lens.device), call.next_n,
                                    call.block_size)
    if scheduler is None:
        process.warn_once(log, (KERNEL, "unknown"), "smemguard: %s refused the batch (%s), but the installed "
                          "DeepGEMM's scheduler is not one smemguard can reproduce exactly; the error is raised",
                          KERNEL, error)
        return None
    if reason == "build" and not _needs_static_overflow(scheduler, call.batch):
        log.debug("smemguard: %s did not build for %d requests, which shared memory does not explain", KERNEL,
                  call.batch)
        return None
    from ..fallbacks import paged_mqa_logits_metadata

    started = time.perf_counter()
    schedule = paged_mqa_logits_metadata(call.context_lens, call.block_size, call.slots, variant=scheduler.variant)
    with engine.memory.lock:
        refusals = engine.memory.table(MEMORY)
        known = refusals.get(call.key)
        if known is None or call.batch < known[0]:
            refusals[call.key] = (call.batch, scheduler.variant)
    _report(call, scheduler, deep_gemm, error, reason, started, engine.settings.log_path)
    return schedule


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


def _report(call, scheduler: Scheduler, deep_gemm, error: RuntimeError, reason: str, started: float,
            log_path: Path | None) -> None:
    why = {"shared data": "ptxas: uses too much shared data",
           "host assertion": "DeepGEMM's host assertion on the scheduler's shared memory",
           "build": f"the scheduler did not build, and {scheduler.static_arrays} static per-request "
                    f"arrays for {call.batch} requests need {STATIC_SHARED_LIMIT} B or more"}[reason]
    incident = incidents.Incident(
        kernel=KERNEL, launched_as=LAUNCHED_AS, phase="launch", action=FALLBACK_ACTION,
        final=f"fallback {FALLBACK}", resource="shared memory", required=None, limit_hit=None, started=started,
        reason=why, extras={
            "args": {"context_lens": describe_arg(call.context_lens), "block_size": call.block_size,
                     "num_sms": call.num_sms, "indices": describe_arg(call.indices)},
            "slots": call.slots, "variant": scheduler.variant,
            "deep_gemm": {"version": getattr(deep_gemm, "__version__", None), "header": scheduler.header},
            "error": f"{type(error).__name__}: {error}"})
    incidents.report(incident, log_path, (KERNEL, *call.key),
                     "smemguard: %s: DeepGEMM refused a batch of %d requests (%s); the same schedule (%s) is computed "
                     "in torch from now on for batches this large", KERNEL, call.batch, why, scheduler.variant)
