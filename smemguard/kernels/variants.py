"""What identifies a compiled variant to other processes: the decision cache's keys (a case: the kernel, its source,
Triton, the arch, the limit enforced, the variant, and for a launch's decision the tuning key).

A case is computed from live Triton objects (an ``ASTSource``, a compiled kernel, the active driver), so it lives
beside the kernels; the store (:mod:`smemguard.store.decision_cache`) keeps plain data keyed by it.
"""

from __future__ import annotations

import hashlib
import json

from ..facts import process
from . import introspect

#: Options that name files on the host (libdevice's path), not what is compiled.
_HOST_OPTIONS = ("extern_libs",)


def variant_id(source, options: dict) -> str:
    """What Triton compiles, however the launch spelled it: the hash of its ``ASTSource`` (the
    kernel's source and the functions it calls, signature, constants, attributes) and its parsed
    options (Triton's ``options.__dict__``, or the same fields of a compiled kernel's metadata)."""
    kept = {name: value for name, value in options.items() if name not in _HOST_OPTIONS}
    text = json.dumps([source.hash(), kept], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def compiled_variant_id(kernel) -> str:
    """:func:`variant_id` of a compiled kernel: its source, and its metadata's option fields."""
    from triton.compiler.compiler import make_backend

    metadata = kernel.metadata._asdict()  # and the option names: fusion named, Triton 3.9 warns of its default unasked
    fields = make_backend(kernel.metadata.target).parse_options({"enable_fp_fusion": True}).__dict__
    return variant_id(kernel.src, {name: metadata[name] for name in fields if name in metadata})


def on_device(device: int) -> dict:
    """The fields that key a case to ``device`` as it is now: the Triton release, its arch, and the limit
    enforced there (the emulated one under ``SMEMGUARD_MAX_SHARED``)."""
    from triton.runtime import driver

    return {"triton": process.triton_version(), "arch": driver.active.get_current_target().arch,
            "limit": process.effective_limit(device)}


def device_case(jit, variant: str, device: int) -> dict:
    """What identifies the compiled ``variant`` (:func:`variant_id`) of ``jit`` on ``device`` to other processes."""
    return {"kernel": introspect.kernel_name(jit), "source_hash": introspect.source_hash(jit), **on_device(device),
            "variant": variant}


def gpu_label(device: int) -> str:
    """The GPU an entry was decided on, for people (torch's name, else backend and arch)."""
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return process.gpu_name(device) or f"{target.backend}:{target.arch}"


def cases_for(launch, failing) -> dict:
    """{"compile": case, "config": case, "launch": case} identifying this failure to other processes
    (see :data:`TABLES` and :func:`case_name`)."""
    case = device_case(launch.jit, compiled_variant_id(failing), process.current_device())
    return {"compile": case, "config": case, "launch": {**case, "tuning_key": repr(launch.tuning_key)}}
