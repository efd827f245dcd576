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
from collections import deque
from pathlib import Path
from typing import Callable

from ..facts import gpus, untrusted
from ..facts.settings import Settings
from ..facts.untrusted import NAME, OBJECT, SCALAR, TEXT, Expect, integer, one_of, printable, shown
from ..kernels import introspect
from ..store import decision_cache, record_fields
from .report import Problems, Record, read


class ReplayError(Exception):
    """The record cannot be replayed here; the message says why and what to do."""


def load(path: Path, problems: Problems, index: int | None = None, kernel: str | None = None) -> Record:
    """Record ``index`` (0-based, negative from the end; default the last) of ``path``, or of the records whose
    kernel contains ``kernel``. What cannot be used goes to ``problems`` and is not counted by ``index``.

    Only the records ``index`` needs are kept (a file may hold a million), and an ``index`` from the start stops
    reading at its record."""
    from_end = index is None or index < 0
    # No file holds more than MAX_LINES records: a larger -index is out of range, whatever is kept
    last = deque(maxlen=min(-index, untrusted.MAX_LINES) if index is not None and index < 0 else 1)
    count = 0
    for record in read([path], problems):
        if kernel is not None and kernel not in record.fields["kernel"]:
            continue
        if not from_end and count == index:
            return record
        count += 1
        last.append(record)
    shown_path = printable(str(path))
    if not count:
        raise ReplayError(f"{shown_path}: " + (problems.unreadable(str(path)) or "no incident record" + (
            f" for kernel {shown(kernel)}" if kernel else "")))
    if index is None:
        return last[-1]
    if from_end and len(last) == -index:
        return last[0]
    raise ReplayError(f"{shown_path}: --index {index} out of range; it holds {count} records (0 to {count - 1})")


def _kernel_name(value) -> bool:
    module, _, qualname = value.partition(":") if isinstance(value, str) else ("", "", "")
    return all(part.isidentifier() for part in (*module.split("."), *qualname.split(".")))


def _dtype(name: str):
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _bounded(most: int, least: int = 0) -> Expect:
    return Expect(f"an integer from {least} to {most}", lambda value: integer(least).test(value) and value <= most)


def _bounded_list(most: int, least: int = 0, lengths: range = range(0, 9)) -> Expect:
    each = _bounded(most, least)
    return Expect(f"a list of {lengths.start} to {lengths.stop - 1} integers from {least} to {most}", lambda value: (
        isinstance(value, list) and len(value) in lengths and all(each.test(v) for v in value)))


#: Bounds of what a record may ask replay to build: sizes and strides of a tensor (2**40), the
#: bytes it spans (16 GiB), a grid (CUDA's 2**31 - 1), stages and warps (as a stored decision).
MAX_EXTENT = 2**40
MAX_TENSOR_BYTES = 16 * 2**30
MAX_GRID = 2**31 - 1
MAX_INT = 2**63 - 1
#: Where tensors are built when the launch is only compiled: the meta device keeps shapes, strides, dtypes and the
#: recorded alignment (the pointers Triton specializes on), with no memory behind them, so a record of three
#: 16 GiB tensors replays in the memory of a small one.
COMPILING = "meta"

TENSOR = {"shape": _bounded_list(MAX_EXTENT), "stride": _bounded_list(MAX_EXTENT),
          "dtype": Expect("a torch dtype such as torch.float16", lambda value: _dtype(value) is not None
                          and _itemsize(_dtype(value)) is not None),
          "ptr_mod_16": Expect("an integer from 0 to 15", lambda value: integer(0).test(value) and value < 16)}
DESCRIPTOR = {"base": OBJECT, "shape": _bounded_list(MAX_EXTENT), "strides": _bounded_list(MAX_EXTENT),
              "block_shape": _bounded_list(2**16, 1)}
_SCALAR = Expect("a number (a 64-bit integer), true/false, text or null", lambda value: SCALAR.test(value) and (
    not isinstance(value, int) or -MAX_INT - 1 <= value <= MAX_INT))

#: How replay checks each field it reads from a record; record_fields.FIELDS says which a record must have.
#: ``args`` entries are checked by :func:`_argument_problems`.
CHECKS = {
    "kernel": Expect("module:qualname of a Triton kernel", _kernel_name),
    "args": OBJECT,
    "constexprs": Expect("an object of constexpr values (64-bit integers, numbers, text, true/false or null)",
                         lambda value: isinstance(value, dict) and all(_SCALAR.test(v) for v in value.values())),
    "grid": _bounded_list(MAX_GRID, 0, range(1, 4)),
    "num_warps": Expect(f"a power of two from 1 to {decision_cache.MAX_WARPS}",
                        lambda value: decision_cache.power_of_two(value, decision_cache.MAX_WARPS)),
    "num_stages": _bounded(decision_cache.MAX_STAGES),
    "config": TEXT,
    "action": NAME,
    "resource": NAME,
    "required": _bounded(MAX_INT),
    "limit_hit": _bounded(MAX_INT),  # 0 where a library raised OutOfResources(0, 0, ...) itself
    "device": OBJECT,
    "id": TEXT,
    "source": TEXT,
    "limit": Expect("an object {device, emulated} of byte counts", lambda value: isinstance(value, dict) and all(
        _bounded(MAX_INT).or_null().test(value.get(k)) for k in ("device", "emulated"))),
}
REQUIRED, OPTIONAL = record_fields.required_and_optional("replay", CHECKS)


def _known_arch(value) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool) and value in {
        gpu.target_arch for gpu in gpus.GPUS}


DEVICE = {"backend": one_of("cuda", "hip"), "arch": Expect(
    "an arch of the GPUs in 'smemguard gpus' (" + ", ".join(dict.fromkeys(str(gpu.target_arch) for gpu in gpus.GPUS))
    + ")", _known_arch)}


def _tensor_problems(spec: dict, where: str) -> list[str]:
    found = untrusted.problems(spec, TENSOR, prefix=where + ".")
    if found:
        return found
    if len(spec["shape"]) != len(spec["stride"]):
        return [f"{where!r} has {len(spec['shape'])} sizes and {len(spec['stride'])} strides"]
    itemsize = _itemsize(_dtype(spec["dtype"]))
    if spec["ptr_mod_16"] % itemsize:
        return [f"{where!r}: a {printable(spec['dtype'])} tensor cannot start {spec['ptr_mod_16']} bytes past a "
                "16-byte boundary"]
    if _span(spec) * itemsize > MAX_TENSOR_BYTES:
        return [f"{where!r} spans more than {MAX_TENSOR_BYTES // 2**30} GiB"]
    return []


def _itemsize(dtype) -> int | None:
    """Bytes per element of a dtype Triton takes (None for complex and other dtypes it has no type for)."""
    import torch

    if dtype.is_complex or dtype in (torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        return None
    return torch.empty((), dtype=dtype).element_size()


def _span(spec: dict) -> int:
    """Elements from the first to the last one a tensor view reaches."""
    shape, stride = spec["shape"], spec["stride"]
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0


def _argument_problems(name: str, value) -> list[str]:
    where = f"args.{name}"
    if isinstance(value, dict) and value.get("descriptor"):
        found = untrusted.problems(value, DESCRIPTOR, prefix=where + ".")
        return found or _tensor_problems(value["base"], where + ".base")
    if isinstance(value, dict):
        return _tensor_problems(value, where)
    if isinstance(value, str):
        return [f"{where!r} is {shown(value)}: the record kept this argument as text (smemguard records objects "
                "it cannot describe that way), and replay cannot rebuild it"]
    if not SCALAR.test(value):
        return [f"{where!r} is {shown(value)}, expected a tensor {{shape, stride, dtype, ptr_mod_16}}, a TMA "
                "descriptor or a number"]
    return []


def check(record) -> list[str]:
    """One line per field of ``record`` that replay cannot use (none: it can be replayed)."""
    if not isinstance(record, dict):
        return [f"the record is {shown(record)}, expected an object"]
    found = untrusted.problems(record, REQUIRED, OPTIONAL)
    if isinstance(record.get("device"), dict):
        found += untrusted.problems(record["device"], DEVICE, prefix="device.")
    if isinstance(record.get("args"), dict):
        for name, value in record["args"].items():
            found += _argument_problems(name, value)
    return found


def import_kernel(name: str):
    """The object at ``module:qualname`` and the JIT function under it."""
    module_name, _, qualname = name.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except (Exception, SystemExit) as error:
        raise ReplayError(f"cannot import module {module_name!r} named by the record's kernel {name!r} "
                          f"({type(error).__name__}: {printable(str(error))}). Run replay where that module is "
                          "importable (same environment, PYTHONPATH).") from None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ReplayError(f"module {module_name!r} has no {qualname!r} (the record's kernel {name!r})")
    jit = introspect.jit_function(obj)
    if jit is None:
        raise ReplayError(f"{name!r} is a {type(obj).__name__}, not a Triton kernel")
    return obj, jit


def _parameter_problems(jit, record: dict) -> list[str]:
    """The record's arguments against the kernel's parameters (the kernel may have changed since)."""
    given = {*record["args"], *record["constexprs"]}
    unknown = sorted(given - set(jit.arg_names))
    missing = [param.name for param in jit.params if param.name not in given and not param.has_default]
    found = []
    if unknown:
        found.append(f"the record names {', '.join(map(shown, unknown))}, which the kernel has no parameter for")
    if missing:
        found.append(f"the record has no value for the kernel's {', '.join(missing)}")
    if found:
        found.append("the kernel's source is not the one the record was written for (source_hash "
                     f"{shown(record.get('source_hash'))}); replay it where that version is installed")
    return found


def _tensor(spec: dict, device: str, generator):
    import torch

    dtype = _dtype(spec["dtype"])
    itemsize = _itemsize(dtype)
    span = _span(spec)
    offset = spec["ptr_mod_16"] // itemsize
    base = torch.empty(span + offset + 16, dtype=dtype, device=device)
    skip = (-base.data_ptr() % 16) // itemsize  # start from a 16-byte boundary, then add the recorded offset
    if generator is None:  # compiling only: the values are never read
        pass
    elif dtype.is_floating_point:
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


def arguments(record: dict, device: str, seed: int | None = 0) -> dict:
    """Every kernel parameter by name: fresh tensors (and TMA descriptors over them) as recorded, scalars,
    constexprs. Tensors hold random values from ``seed`` (same seed, same values); None leaves them unset."""
    import torch

    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    named = {}
    for name, value in record["args"].items():
        if isinstance(value, dict):
            rebuild = _descriptor if value.get("descriptor") else _tensor
            try:
                named[name] = rebuild(value, device, generator)
            except ReplayError:
                raise
            except Exception as error:  # too large to allocate, a descriptor Triton refuses
                raise ReplayError(f"cannot rebuild argument {name!r} ({type(error).__name__}: "
                                  f"{printable(str(error).splitlines()[0] if str(error) else '')[:200]})") from None
        else:
            named[name] = value
    named.update(record["constexprs"])
    return named


def _launcher(jit, record: dict, device: str) -> Callable[[], dict]:
    grid = tuple(record["grid"])
    options = {"num_warps": record["num_warps"], "num_stages": record["num_stages"]}
    seed = None if device == COMPILING else 0

    def launch() -> dict:
        named = arguments(record, device, seed)
        jit[grid](**named, **options)
        return named

    return launch


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {printable(text.splitlines()[0][:200])}" if text else type(error).__name__


def _launch_failed(error: Exception) -> ReplayError:
    return ReplayError(f"the recorded launch fails here ({_first_line(error)}); "
                       "replay needs the Triton and kernel versions the record was written with "
                       "(its 'triton' and 'source_hash' fields)")


def _limit_line(record: dict) -> str:
    limits = record.get("limit") or {}
    emulated = f", emulated {limits['emulated']} B" if limits.get("emulated") else ""
    return f"limit {record['limit_hit']} B (device {limits.get('device')} B{emulated})"


def replay(record: dict, limit: int | None, say: Callable[[str], None]) -> int:
    """Run ``record`` again; ``say`` prints each step. Returns the exit status (0: reproduced and
    recovered, or nothing to reproduce; 1: not as recorded). ReplayError when it cannot be replayed."""
    import torch

    unmeasured = _unmeasured(record)
    if unmeasured is not None:
        say(unmeasured)
        return 1
    found = check(record)
    if found:
        raise ReplayError("cannot replay this record:\n  " + "\n  ".join(found))
    obj, jit = import_kernel(record["kernel"])
    found = _parameter_problems(jit, record)
    if found:
        raise ReplayError("cannot replay this record:\n  " + "\n  ".join(found))
    limit = limit or record["limit_hit"]
    say(f"record {printable(record.get('id', '?'))}: {record['kernel']} ({printable(record.get('source', '?'))}), "
        f"{printable(record['resource'])} {record['required']} B > {_limit_line(record)}")
    say(f"  config {printable(record['config'])}, grid {record['grid']}, action then: {printable(record['action'])}")
    if record["resource"] != "shared memory":
        say(f"  note: replay emulates shared memory only; this record is about {printable(record['resource'])}")
    if torch.cuda.is_available():
        return _replay_on_gpu(jit, record, limit, say)
    return _replay_compile_only(obj, jit, record, limit, say)


def _unmeasured(record) -> str | None:
    """Why a record of an error that gives no byte counts cannot be reproduced (a library that steps down through
    its own configs and raises ``OutOfResources(0, 0, ...)`` when none fits, as SGLang 0.5.23's DSA prefill does):
    no launch of it failed Triton's check. None for any other record."""
    if not isinstance(record, dict) or not any(type(record.get(name)) is int and record[name] == 0
                                               for name in ("required", "limit_hit")):
        return None
    kernel = record.get("kernel")
    return (f"not reproduced: {printable(kernel) if isinstance(kernel, str) else shown(kernel)}: the error gives no "
            f"byte counts (Required {shown(record.get('required'))} B, limit {shown(record.get('limit_hit'))} B): "
            "the library raised OutOfResources itself, not Triton's check of a compiled kernel, so there is no launch "
            "to run again")


def _guarded(settings: Settings, attempt: Callable[[], dict]):
    """Run ``attempt`` with smemguard installed as ``settings``; return (result or error, the new incident record).

    smemguard's own log lines are held back meanwhile: replay prints the record's contents itself.
    """
    import smemguard

    logger = logging.getLogger("smemguard")  # the package's logger: every module of smemguard logs below it
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
        if "shared" in attempt:  # the compile-time core's: each stage count it compiled, and the bytes it needs
            changes = ", ".join(f"{name}={value}" for name, value in attempt.items() if name != "shared")
            verdict = "fits" if attempt["shared"] <= incident["limit_hit"] else "too big"
            say(f"    compiled {changes}: {attempt['shared']} B, limit {incident['limit_hit']} B: {verdict}")
            continue
        verdict = attempt["error"] or ("fits" if attempt["fits"] else "too big")
        say(f"    tried {attempt.get('changes') or attempt.get('config')}: {attempt['required']} B, "
            f"limit {attempt['limit']} B: {verdict}")
    say(f"  smemguard: {incident['action']}" + (f" -> {incident['final']}" if incident.get("final") else ""))


def _replay_compile_only(obj, jit, record: dict, limit: int, say) -> int:
    from triton.runtime.errors import OutOfResources

    from ..testing import fake_gpu

    arch = record["device"]["arch"]
    if isinstance(arch, str):
        from ..preflight.compiling import hip_compile_problem

        problem = hip_compile_problem()
        if problem is not None:
            raise ReplayError(f"no GPU here, and this Triton cannot compile for {arch} without one: {problem}")
        stand_in = next(gpu.name for gpu in gpus.GPUS if gpu.target_arch == arch)
    else:
        stand_in = arch
    say(f"no GPU: compiling for {arch if isinstance(arch, str) else f'sm_{arch}'} on a stand-in device with a "
        f"{limit} B limit (nothing executes)")
    launch = _launcher(jit, record, COMPILING)
    with tempfile.TemporaryDirectory(prefix="smemguard-replay-") as scratch, fake_gpu(stand_in, max_shared=limit):
        try:
            launch()
            say("  the recorded config fits this limit: nothing to reproduce")
            reproduced = None
        except ReplayError:
            raise
        except OutOfResources as error:
            reproduced = error
            same = "same as recorded" if error.required == record["required"] else f"recorded {record['required']} B"
            say(f"  reproduced: OutOfResources {error.name}, required {error.required} B, "
                f"limit {error.limit} B ({same})")
        except Exception as error:
            raise _launch_failed(error) from None
        recovered = True
        if reproduced is not None:
            outcome, incident = _guarded(Settings(log_path=Path(scratch) / "replay.jsonl"), launch)
            _show_attempts(incident, say)
            if isinstance(outcome, Exception):
                say(f"  not recovered: the launch still fails: {_first_line(outcome)}")
                recovered = False
        if obj is not jit and hasattr(obj, "configs"):
            say(f"  {type(obj).__name__} configs, compiled for this specialization:")
            named = arguments(record, COMPILING, seed=None)
            for config in obj.configs:
                untuned = {name: value for name, value in named.items() if name not in config.kwargs}
                try:
                    kernel = jit.warmup(**untuned, **config.all_kwargs(), grid=tuple(record["grid"]))
                    verdict = f"{kernel.metadata.shared} B: {'fits' if kernel.metadata.shared <= limit else 'too big'}"
                except Exception as error:
                    verdict = f"{type(error).__name__}"
                say(f"    {config}: {verdict}")
    return 0 if reproduced is None or (recovered and reproduced.required == record["required"]) else 1


def _replay_on_gpu(jit, record: dict, limit: int, say) -> int:
    import torch
    from triton.runtime.errors import OutOfResources

    launch = _launcher(jit, record, "cuda")
    device_limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    say(f"GPU {torch.cuda.get_device_name(0)} ({device_limit} B per block); emulating {limit} B")
    reference = None
    if record["required"] <= device_limit:
        jit.device_caches.clear()
        try:
            reference = launch()
            torch.cuda.synchronize()
        except ReplayError:
            raise
        except Exception as error:
            raise _launch_failed(error) from None
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
            say(f"  not recovered: {_first_line(outcome)}")
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
