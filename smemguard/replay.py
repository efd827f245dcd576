"""``smemguard replay``: rebuild a recorded launch from its incident record alone and run it again.

The kernel is imported by the record's ``module:qualname``; tensors get the recorded shapes,
strides, dtypes and 16-byte alignment, filled with random values; scalars and constexprs are
as recorded; the failing config (constexprs, ``num_warps``, ``num_stages``) is launched
directly on the JIT function with the recorded grid.

* With a GPU: the recorded limit is emulated; the original ``OutOfResources`` is reproduced
  (``SMEMGUARD=observe``), then smemguard recovers the launch, and the recovered output is
  compared with the original config run without emulation, where this GPU can hold it.
* Without a GPU: the launch is compiled for the recorded arch on a stand-in device with the
  recorded limit (:func:`smemguard.testing.fake_gpu`), printing the required bytes of the
  recorded config and of every candidate smemguard tries.
"""

from __future__ import annotations

import importlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Callable

from .settings import Settings


class ReplayError(Exception):
    """The record cannot be replayed here; the message says why and what to do."""


def load(path: Path, index: int | None = None, kernel: str | None = None) -> dict:
    """Record ``index`` (0-based; default the last) of ``path``, or the last one whose kernel contains ``kernel``."""
    from .report import Malformed, read

    malformed: list[Malformed] = []
    records = list(read([path], malformed))
    if kernel is not None:
        records = [r for r in records if kernel in r["kernel"]]
    if not records:
        raise ReplayError(f"{path}: no incident record" + (f" for kernel {kernel!r}" if kernel else ""))
    if index is None:
        return records[-1]
    if not -len(records) <= index < len(records):
        raise ReplayError(f"{path}: --index {index} out of range; it holds {len(records)} records (0 to "
                          f"{len(records) - 1})")
    return records[index]


def import_kernel(name: str):
    """The object at ``module:qualname`` and the JIT function under it."""
    from triton.runtime.jit import JITFunction

    module_name, _, qualname = name.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as error:
        raise ReplayError(f"cannot import module {module_name!r} named by the record's kernel {name!r} "
                          f"({type(error).__name__}: {error}). Run replay where that module is importable "
                          "(same environment, PYTHONPATH).") from None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ReplayError(f"module {module_name!r} has no {qualname!r} (the record's kernel {name!r})")
    jit = obj
    while not isinstance(jit, JITFunction):
        if not hasattr(jit, "fn"):
            raise ReplayError(f"{name!r} is a {type(obj).__name__}, not a Triton kernel")
        jit = jit.fn
    return obj, jit


def _tensor(spec: dict, device: str, generator):
    import torch

    dtype = getattr(torch, spec["dtype"].removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ReplayError(f"unknown dtype {spec['dtype']!r} in the record")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if spec["ptr_mod_16"] % itemsize:
        raise ReplayError(f"a {spec['dtype']} tensor at a pointer offset of {spec['ptr_mod_16']} bytes cannot be rebuilt")
    span = 1 + sum((size - 1) * stride for size, stride in zip(spec["shape"], spec["stride"])) if all(spec["shape"]) else 0
    offset = spec["ptr_mod_16"] // itemsize
    base = torch.empty(span + offset + 16, dtype=dtype, device=device)
    skip = (-base.data_ptr() % 16) // itemsize  # start from a 16-byte boundary, then add the recorded offset
    if dtype.is_floating_point:
        base.uniform_(-1, 1, generator=generator)
    else:
        base.random_(0, 8, generator=generator)
    return base.as_strided(spec["shape"], spec["stride"], skip + offset)


def _descriptor(spec: dict, device: str, generator):
    """A host TMA descriptor over a fresh base tensor, with the block shape it had at the failure."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        raise ReplayError("the record has a TMA tensor descriptor, and this Triton has no "
                          "triton.tools.tensor_descriptor") from None
    return TensorDescriptor(_tensor(spec["base"], device, generator), spec["shape"], spec["strides"],
                            spec["block_shape"])


def arguments(record: dict, device: str, seed: int = 0) -> dict:
    """Every kernel parameter by name: fresh tensors (and TMA descriptors over them) as recorded (same seed,
    same values), scalars, constexprs."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    named = {}
    for name, value in record["args"].items():
        if isinstance(value, dict):
            rebuild = _descriptor if value.get("descriptor") else _tensor
            named[name] = rebuild(value, device, generator)
        else:
            named[name] = value
    named.update(record["constexprs"])
    return named


def _launcher(jit, record: dict, device: str) -> Callable[[], dict]:
    grid = tuple(record["grid"])
    options = {"num_warps": record["num_warps"], "num_stages": record["num_stages"]}

    def launch() -> dict:
        named = arguments(record, device)
        jit[grid](**named, **options)
        return named

    return launch


def _limit_line(record: dict) -> str:
    limits = record.get("limit") or {}
    emulated = f", emulated {limits['emulated']} B" if limits.get("emulated") else ""
    return f"limit {record['limit_hit']} B (device {limits.get('device')} B{emulated})"


def replay(record: dict, limit: int | None, say: Callable[[str], None]) -> int:
    """Run ``record`` again; ``say`` prints each step. Returns the exit status."""
    import torch

    obj, jit = import_kernel(record["kernel"])
    limit = limit or record["limit_hit"]
    say(f"record {record.get('id', '?')}: {record['kernel']} ({record.get('source', '?')}), {record['resource']} "
        f"{record['required']} B > {_limit_line(record)}")
    say(f"  config {record['config']}, grid {record['grid']}, action then: {record['action']}")
    if record["resource"] != "shared memory":
        say(f"  note: replay emulates shared memory only; this record is about {record['resource']}")
    if torch.cuda.is_available():
        return _replay_on_gpu(jit, record, limit, say)
    return _replay_compile_only(obj, jit, record, limit, say)


def _guarded(settings: Settings, attempt: Callable[[], dict]):
    """Run ``attempt`` with smemguard installed as ``settings``; return (result or error, the new incident record).

    smemguard's own log lines are held back meanwhile: replay prints the record's contents itself.
    """
    import smemguard

    logger = logging.getLogger("smemguard")
    level = logger.level
    logger.setLevel(logging.ERROR)
    smemguard.install(settings)
    try:
        try:
            outcome = attempt()
        except Exception as error:  # the replayed launch's own error is the result to show
            outcome = error
    finally:
        smemguard.uninstall()
        logger.setLevel(level)
    lines = settings.log_path.read_text().splitlines() if settings.log_path.exists() else []
    return outcome, (json.loads(lines[-1]) if lines else None)


def _show_attempts(incident: dict | None, say) -> None:
    if incident is None:
        return
    for attempt in incident["attempts"][1:]:
        verdict = attempt["error"] or ("fits" if attempt["fits"] else "too big")
        say(f"    tried {attempt.get('changes') or attempt.get('config')}: {attempt['required']} B, "
            f"limit {attempt['limit']} B: {verdict}")
    say(f"  smemguard: {incident['action']}" + (f" -> {incident['final']}" if incident.get("final") else ""))


def _replay_compile_only(obj, jit, record: dict, limit: int, say) -> int:
    from triton.runtime.errors import OutOfResources

    from .testing import fake_gpu

    arch = record["device"]["arch"]
    if record["device"].get("backend") != "cuda" or not isinstance(arch, int):
        raise ReplayError(f"no GPU here, and only NVIDIA targets compile without one (the record has "
                          f"{record['device'].get('backend')} {arch})")
    say(f"no GPU: compiling for sm_{arch} on a stand-in device with a {limit} B limit (nothing executes)")
    launch = _launcher(jit, record, "cpu")
    with tempfile.TemporaryDirectory(prefix="smemguard-replay-") as scratch, fake_gpu(arch, max_shared=limit):
        try:
            launch()
            say("  the recorded config fits this limit: nothing to reproduce")
            reproduced = None
        except OutOfResources as error:
            reproduced = error
            same = "same as recorded" if error.required == record["required"] else f"recorded {record['required']} B"
            say(f"  reproduced: OutOfResources {error.name}, required {error.required} B, limit {error.limit} B ({same})")
        if reproduced is not None:
            outcome, incident = _guarded(Settings(log_path=Path(scratch) / "replay.jsonl"), launch)
            _show_attempts(incident, say)
            if isinstance(outcome, Exception):
                say(f"  the launch still fails: {type(outcome).__name__}")
        if obj is not jit and hasattr(obj, "configs"):
            say(f"  {type(obj).__name__} configs, compiled for this specialization:")
            named = arguments(record, "cpu")
            for config in obj.configs:
                untuned = {name: value for name, value in named.items() if name not in config.kwargs}
                try:
                    kernel = jit.warmup(**untuned, **config.all_kwargs(), grid=tuple(record["grid"]))
                    verdict = f"{kernel.metadata.shared} B: {'fits' if kernel.metadata.shared <= limit else 'too big'}"
                except Exception as error:
                    verdict = f"{type(error).__name__}"
                say(f"    {config}: {verdict}")
    return 0 if reproduced is None or reproduced.required == record["required"] else 1


def _replay_on_gpu(jit, record: dict, limit: int, say) -> int:
    import torch
    from triton.runtime.errors import OutOfResources

    launch = _launcher(jit, record, "cuda")
    device_limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    say(f"GPU {torch.cuda.get_device_name(0)} ({device_limit} B per block); emulating {limit} B")
    reference = None
    if record["required"] <= device_limit:
        jit.device_caches.clear()
        reference = launch()
        torch.cuda.synchronize()
        say("  original config run without emulation: reference output kept")
    with tempfile.TemporaryDirectory(prefix="smemguard-replay-") as scratch:
        log_path = Path(scratch) / "replay.jsonl"
        jit.device_caches.clear()
        outcome, _ = _guarded(Settings(mode="observe", max_shared=limit, max_shared_label=str(limit),
                                       log_path=log_path), launch)
        if not isinstance(outcome, OutOfResources):
            say(f"  not reproduced: the recorded config ran under {limit} B")
            return 1
        say(f"  reproduced: OutOfResources {outcome.name}, required {outcome.required} B, limit {outcome.limit} B")
        jit.device_caches.clear()
        outcome, incident = _guarded(Settings(max_shared=limit, max_shared_label=str(limit), log_path=log_path),
                                     launch)
        _show_attempts(incident, say)
        if isinstance(outcome, Exception):
            say(f"  not recovered: {type(outcome).__name__}: {str(outcome).splitlines()[0]}")
            return 1
        torch.cuda.synchronize()
    if reference is None:
        say("  no reference: the recorded config does not fit this GPU either")
        return 0
    exact = incident is not None and incident["action"] in ("stages_reduced", "warps_reduced")
    for name, value in reference.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            got = outcome[name]
            same = torch.equal(got, value) if exact else torch.allclose(got, value, rtol=1e-2, atol=1e-2)
            if not same:
                say(f"  MISMATCH in {name} against the original config")
                return 1
    say("  recovered output equals the original config's " + ("bitwise" if exact else "within 1e-2"))
    return 0
