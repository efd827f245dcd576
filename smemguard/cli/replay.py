"""``smemguard replay``: rebuild the launch or compile behind an incident record from the record alone and run it
again, then what smemguard did about it.

The kernel is imported by the record's ``module:qualname``. A record of a launch (``args`` and ``grid``: every path
records them where a launch caused the incident) gets tensors with the recorded shapes, strides, dtypes and 16-byte
alignment, filled with random values, and the failing config (constexprs, ``num_warps``, ``num_stages``) is
launched directly on the JIT function with the recorded grid. A record of a compile no launch caused (a warm-up's
placeholders, Inductor's precompile, ``smemguard check``) has Triton's ``signature`` and ``specialization``
instead: stand-ins Triton specializes the same way are compiled, and replay says that no tensors were recorded.

* With a GPU and a launch record: the recorded limit is emulated; the original ``OutOfResources`` is reproduced
  (``SMEMGUARD=observe``), then smemguard recovers the launch, and the recovered output is compared with the
  original config run without emulation, where this GPU can hold it.
* Otherwise: the launch is compiled for the recorded arch on a stand-in device with the recorded limit
  (:func:`smemguard.testing.fake_gpu`), printing the required bytes of the recorded config and of every candidate
  smemguard tries.

A decision that changed tiles (another config of a tuner, registered alternatives, a wrapper's smaller tiles) is
replayed as decided: the config the record names as ``final`` is compiled where the failing one was, and must fit.
A re-raised record replays as recorded when smemguard still cannot recover it.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections import deque
from pathlib import Path
from typing import Callable

from ..facts import gpus, process, untrusted
from ..facts.settings import Settings
from ..facts.untrusted import NAME, OBJECT, TEXT, Expect, one_of, printable, shown
from ..store import decision_cache, record_fields
from ..store.decision import PINNED
from . import rebuild
from .rebuild import COMPILING, MAX_GRID, MAX_INT, ReplayError, bounded, bounded_list
from .report import Problems, Record, read


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


#: How replay checks each field it reads from a record; record_fields.FIELDS says which a record must have.
#: ``args`` entries are checked by :func:`rebuild.argument_problems`.
CHECKS = {
    "kernel": Expect("module:qualname of a Triton kernel, or Inductor's name of one", rebuild.kernel_name),
    "num_warps": Expect(f"a power of two from 1 to {decision_cache.MAX_WARPS}",
                        lambda value: decision_cache.power_of_two(value, decision_cache.MAX_WARPS)),
    "num_stages": bounded(decision_cache.MAX_STAGES),
    "constexprs": Expect("an object of constexpr values (64-bit integers, numbers, text, true/false or null)",
                         lambda value: isinstance(value, dict) and all(rebuild.SCALAR_VALUE.test(v)
                                                                        for v in value.values())),
    "config": TEXT,
    "action": NAME,
    "resource": NAME,
    "required": bounded(MAX_INT),
    "limit_hit": bounded(MAX_INT),  # 0 where a library raised OutOfResources(0, 0, ...) itself
    "device": OBJECT,
    "id": TEXT,
    "launched_as": TEXT,
    "final": TEXT.or_null(),
    "limit": Expect("an object {device, emulated} of byte counts", lambda value: isinstance(value, dict) and all(
        bounded(MAX_INT).or_null().test(value.get(k)) for k in ("device", "emulated"))),
    "source": TEXT,
    "inductor": Expect("an object {kernel_name, heuristic_type, source_hash, source_file, source_sha256}",
                       lambda value: isinstance(value, dict) and all(
                           isinstance(value[k], str) and len(value[k]) <= 4096
                           for k in ("source_file", "source_sha256") if k in value)),
    "grid": bounded_list(MAX_GRID, 0, range(1, 4)),
    "args": OBJECT,
    "signature": Expect("an object of Triton types by parameter name", lambda value: isinstance(value, dict) and all(
        isinstance(kind, str) and len(kind) <= 64 for kind in value.values())),
    "specialization": Expect("an object of \"div16\", \"==1\" or \"\" by parameter name", lambda value: (
        isinstance(value, dict) and all(spec in rebuild.SPECIALIZATIONS for spec in value.values()))),
}
REQUIRED, OPTIONAL = record_fields.required_and_optional("replay", CHECKS)


def _known_arch(value) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool) and value in {
        gpu.target_arch for gpu in gpus.GPUS}


DEVICE = {"backend": one_of("cuda", "hip"), "arch": Expect(
    "an arch of the GPUs in 'smemguard gpus' (" + ", ".join(dict.fromkeys(str(gpu.target_arch) for gpu in gpus.GPUS))
    + ")", _known_arch)}

#: Why a record of each source has neither the launch (``args``, ``grid``) nor the compile (``signature``) behind
#: it, by its ``launched_as``; a record of any other source lacks them only if damaged.
NO_LAUNCH = {
    "torch.compile": "FlexAttention's tiles were chosen before Inductor rendered the kernel: no kernel was compiled "
                     "for it; run the compiled program again under the recorded limit (SMEMGUARD_MAX_SHARED)",
    "CachingAutotuner": "a torch.compile kernel: Inductor compiled and loaded it itself, with no launch, and this "
                        "record keeps no signature of its compile; run the compiled program again under the recorded "
                        "limit (SMEMGUARD_MAX_SHARED)",
}


def check(record) -> list[str]:
    """One line per field of ``record`` that replay cannot use (none: it can be replayed)."""
    if not isinstance(record, dict):
        return [f"the record is {shown(record)}, expected an object"]
    found = untrusted.problems(record, REQUIRED, OPTIONAL)
    if isinstance(record.get("device"), dict):
        found += untrusted.problems(record["device"], DEVICE, prefix="device.")
    arguments = [line for name, value in record["args"].items() for line in rebuild.argument_problems(name, value)] \
        if isinstance(record.get("args"), dict) else []
    if found or arguments and "signature" not in record:
        return found + arguments
    if _launched(record):
        return []
    if "signature" in record and "specialization" in record:
        return rebuild.specialization_problems(record)
    why = NO_LAUNCH.get(record.get("launched_as")) or ("a record names the launch behind it (args and grid) or, "
                                                       "where no launch caused it, the compile (signature and "
                                                       "specialization): this one is damaged")
    missing = [name for name in ("args", "grid") if name not in record] or ["signature", "specialization"]
    return [f"no {name!r} field ({CHECKS[name].what}); {why}" for name in missing]


def _launched(record: dict) -> bool:
    """Whether the record holds a launch replay can rebuild (its tensors, scalars and grid), not only the compile
    (a warm-up's placeholders are kept as text: its signature replays instead)."""
    if "args" not in record or "grid" not in record:
        return False
    rebuildable = not any(rebuild.argument_problems(name, value) for name, value in record["args"].items())
    return rebuildable or "signature" not in record


def replay(record: dict, limit: int | None, say: Callable[[str], None]) -> int:
    """Run ``record`` again; ``say`` prints each step. Returns the exit status (0: reproduced and
    smemguard did as recorded, or nothing to reproduce; 1: not as recorded). ReplayError when it cannot be
    replayed."""
    import torch

    unmeasured = _unmeasured(record)
    if unmeasured is not None:
        say(unmeasured)
        return 1
    found = check(record)
    if found:
        raise ReplayError("cannot replay this record:\n  " + "\n  ".join(found))
    obj, jit = rebuild.import_kernel(record)
    launched = _launched(record)
    recorded = record["args"] if launched else rebuild.stand_ins(record)
    found = rebuild.parameter_problems(jit, record, {*recorded, *record["constexprs"]})
    if found:
        raise ReplayError("cannot replay this record:\n  " + "\n  ".join(found))
    limit = limit or record["limit_hit"]
    say(f"record {printable(record.get('id', '?'))}: {record['kernel']} ({printable(record.get('source', '?'))}), "
        f"{printable(record['resource'])} {record['required']} B {'of' if record['action'] == PINNED else '>'} "
        f"{_limit_line(record)}")
    grid = record["grid"] if launched else [1]
    say(f"  config {printable(record['config'])}, grid {grid if launched else '(none recorded)'}, action then: "
        f"{printable(record['action'])}")
    if not launched:
        say("  no tensors were recorded (a compile no launch caused): compiling the recorded variant from its "
            "signature and specialization")
    if record["resource"] != "shared memory":
        say(f"  note: replay emulates shared memory only; this record is about {printable(record['resource'])}")
    launch = _launcher(jit, record, recorded, grid)
    if record["action"] == PINNED:
        return _replay_pinned(record, launch, limit, say)
    if torch.cuda.is_available() and launched:
        return _replay_on_gpu(jit, record, launch, limit, say)
    return _replay_compile_only(obj, jit, record, launch, limit, say)


def _launcher(jit, record: dict, recorded: dict, grid: list) -> Callable[..., dict]:
    """A launch of the recorded config (or of it with ``changes``, the settings a decision chose) on ``device``."""

    def launch(device: str, changes: dict | None = None) -> dict:
        settings = {**record["constexprs"], "num_warps": record["num_warps"], "num_stages": record["num_stages"],
                    **(changes or {})}
        named = rebuild.arguments(recorded, {}, device, None if device == COMPILING else 0)
        jit[tuple(grid)](**named, **settings)
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


#: The decisions that chose other tiles or another config: replayed by compiling the config they chose.
CHOSE_A_CONFIG = ("config_changed", "tiles_reduced")
#: The records of what fits at no stage count: replayed as recorded when smemguard still cannot fit it.
NOTHING_FITTED = ("reraised", "autotune_skipped")


def _recovery_as_recorded(record: dict, launch, limit: int, scratch: str, say) -> bool:
    """What smemguard does with the reproduced failure, and whether it is what the record says it did: the config a
    decision chose fits (compiled, nothing launched), or smemguard recovers the launch again (a stage or warp
    count, a fallback), or it still cannot, for a record of a re-raise."""
    from triton.runtime.errors import OutOfResources

    chosen = rebuild.chosen_settings(record.get("final"))
    if record["action"] in CHOSE_A_CONFIG and chosen:
        try:
            launch(COMPILING, chosen)
        except OutOfResources as error:
            say(f"  the chosen config {printable(record['final'])} needs {error.required} B: still too big")
            return False
        except Exception as error:
            say(f"  the chosen config {printable(record['final'])} does not compile here: {_first_line(error)}")
            return False
        say(f"  the chosen config {printable(record['final'])} fits {limit} B: recovered as recorded")
        return True
    outcome, incident = _guarded(Settings(log_path=Path(scratch) / "replay.jsonl"), lambda: launch(COMPILING))
    _show_attempts(incident, say)
    if not isinstance(outcome, Exception):
        return True
    if record["action"] in NOTHING_FITTED:
        say(f"  still not recovered, as recorded: {_first_line(outcome)}")
        return True
    say(f"  not recovered: the launch still fails: {_first_line(outcome)}")
    return False


def _replay_pinned(record: dict, launch, limit: int, say) -> int:
    """A pin's record (nothing failed): the config the pin chose compiled again for the recorded arch, on a stand-in
    (nothing executes); 0 when it fits with the bytes recorded, 1 when not (the pin would be refused there)."""
    from triton.runtime.errors import OutOfResources

    from ..testing import fake_gpu

    arch = record["device"]["arch"]
    say(f"  a pin chose this compile, nothing failed: compiling the config it chose ({printable(record['final'])}) "
        f"for {arch if isinstance(arch, str) else f'sm_{arch}'} under {limit} B")
    with fake_gpu(_stand_in(arch), max_shared=limit) as gpu:
        try:
            launch(COMPILING, rebuild.chosen_settings(record["final"]))
        except OutOfResources as error:
            say(f"  it needs {error.required} B, over {limit} B: the pin would be refused here")
            return 1
        except Exception as error:
            raise _launch_failed(error) from None
    shared = gpu.launches[-1].shared
    same = "as recorded" if shared == record["required"] else f"recorded {record['required']} B"
    say(f"  it needs {shared} B and fits {limit} B ({same})")
    return 0 if shared == record["required"] else 1


def _stand_in(arch):
    """What :func:`smemguard.testing.fake_gpu` stands in for to compile for the recorded ``arch``."""
    problem = gpus.compile_problem(arch, process.triton_version())
    if problem is not None:
        raise ReplayError(f"cannot compile the record here: {problem}")
    if not isinstance(arch, str):
        return arch
    from ..preflight.compiling import hip_compile_problem

    problem = hip_compile_problem()
    if problem is not None:
        raise ReplayError(f"no GPU here, and this Triton cannot compile for {arch} without one: {problem}")
    return next(gpu.name for gpu in gpus.GPUS if gpu.target_arch == arch)


def _replay_compile_only(obj, jit, record: dict, launch, limit: int, say) -> int:
    from triton.runtime.errors import OutOfResources

    from ..testing import fake_gpu

    arch = record["device"]["arch"]
    stand_in = _stand_in(arch)
    import torch

    say(f"{'no tensors' if torch.cuda.is_available() else 'no GPU'}: compiling for "
        f"{arch if isinstance(arch, str) else f'sm_{arch}'} on a stand-in device with a {limit} B limit "
        "(nothing executes)")
    with tempfile.TemporaryDirectory(prefix="smemguard-replay-") as scratch, fake_gpu(stand_in, max_shared=limit):
        try:
            launch(COMPILING)
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
        recovered = reproduced is None or _recovery_as_recorded(record, launch, limit, scratch, say)
        if obj is not jit and hasattr(obj, "configs"):
            _show_configs(obj, jit, record, limit, say)
    return 0 if reproduced is None or (recovered and reproduced.required == record["required"]) else 1


def _show_configs(tuner, jit, record: dict, limit: int, say) -> None:
    """The bytes of each of ``tuner``'s configs at the recorded specialization."""
    say(f"  {type(tuner).__name__} configs, compiled for this specialization:")
    recorded = record["args"] if _launched(record) else rebuild.stand_ins(record)
    named = rebuild.arguments(recorded, record["constexprs"], COMPILING, seed=None)
    grid = tuple(record["grid"]) if _launched(record) else (1,)
    for config in tuner.configs:
        untuned = {name: value for name, value in named.items() if name not in config.kwargs}
        try:
            kernel = jit.warmup(**untuned, **config.all_kwargs(), grid=grid)
            verdict = f"{kernel.metadata.shared} B: {'fits' if kernel.metadata.shared <= limit else 'too big'}"
        except Exception as error:
            verdict = f"{type(error).__name__}"
        say(f"    {config}: {verdict}")


def _replay_on_gpu(jit, record: dict, launch, limit: int, say) -> int:
    import torch
    from triton.runtime.errors import OutOfResources

    device = process.own_device_properties(0)
    device_limit = device.shared_memory_per_block_optin
    say(f"GPU {device.name} ({device_limit} B per block); emulating {limit} B")
    reference = None
    if record["required"] <= device_limit:
        jit.device_caches.clear()
        try:
            reference = launch("cuda")
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
                                       log_path=log_path), lambda: launch("cuda"))
        if not isinstance(outcome, OutOfResources):
            say(f"  not reproduced: the recorded config ran under {limit} B")
            return 1
        say(f"  reproduced: OutOfResources {outcome.name}, required {outcome.required} B, limit {outcome.limit} B")
        if record["action"] in CHOSE_A_CONFIG:  # its tiles changed, and with them the grid its caller computed
            from ..testing import fake_gpu

            with fake_gpu(_stand_in(record["device"]["arch"]), max_shared=limit):
                return 0 if _recovery_as_recorded(record, launch, limit, scratch, say) else 1
        jit.device_caches.clear()
        outcome, incident = _guarded(Settings(max_shared=limit, max_shared_label=str(limit), log_path=log_path),
                                     lambda: launch("cuda"))
        _show_attempts(incident, say)
        if isinstance(outcome, Exception):
            if record["action"] in NOTHING_FITTED:
                say(f"  still not recovered, as recorded: {_first_line(outcome)}")
                return 0
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
