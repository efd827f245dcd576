"""Inductor kernels (``torch.compile``) that do not fit when Inductor loads them: the same configs with
fewer stages, or, for kernels whose grid follows their blocks, smaller blocks.

Inductor compiles every config of a kernel (``CachingAutotuner``) and loads the results when the
compiled graph is first run (``_make_launchers``); a result whose shared memory exceeds the limit is
dropped there, and when none is left the compile fails (``No valid triton configs``). :func:`recover`
takes over at that point, with the configs Inductor had compiled: for each, a variant Inductor
compiles itself (``_precompile_config``) and loads (``make_launcher``), so its caches, its static
launcher and its autotuning treat it as one of its own. In order:

1. fewer stages: the ``num_stages`` option and the kwargs through which Inductor's templates and
   mix-order reductions set their loops' depth (``tl.range(..., num_stages=NUM_STAGES)``, read as pipeline
   depth by ``kernels.parameters``; torch 2.13's own retry lowers ``NUM_STAGES`` too), each capped at the new
   depth: same tiles, same order of arithmetic, bitwise the same result. None when the kernel has no loop
   that follows them;
   fewer ``num_warps`` when it is threads that do not fit;
2. for pointwise and reduction kernels, whose launch grid Inductor computes from the config's blocks
   (``XBLOCK``, ``YBLOCK``; ``R0_BLOCK`` where the reduction loops), half the largest block, down to 1. A
   pointwise kernel computes the same elements, bitwise the same; a reduction may add in another order
   (as between the configs Inductor itself autotunes for it); a persistent reduction keeps its whole row in
   one block, which is never split.

Templates (FlexAttention, matmul) render their tiles into the source: only their stages change here.
A config that fits is never touched: recovery starts only when Inductor found none. Every candidate is
a real compile; nothing is launched. One incident record per kernel (``phase: "compile"``).

Each replacement is stored in the decision cache (table ``inductor``, keyed by Inductor's kernel name,
source hash, Triton version, GPU, limit and the config). The next process that loads the same kernel
(compiled again, or from Inductor's FX graph cache) compiles and loads the stored variant in place of
the config before Inductor loads it (:func:`load_remembered`): no load fails, no other candidate is
compiled. A stored variant is applied only if recovery could have produced it from that config here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import re
import time
from pathlib import Path

from ..facts import files, process
from ..kernels import introspect, parameters, recorded, variants
from ..kernels.launch import Attempt
from ..kernels.recorded import attempt_records
from ..store import decision_cache, incidents
from ..store.decision import AUTOTUNE_SKIPPED, BLOCKS_REDUCED, OBSERVED, RERAISED, STAGES_REDUCED, WARPS_REDUCED
from . import recall
from .candidates import MAX_CANDIDATES, fewer_warps, variant
from .steps import Steps

log = logging.getLogger(__name__)

# "out of resource: shared memory, Required: 131072, Hardware limit: 101376" (Triton) and
# "out of resource: triton_tem_fused_0 Required: 131072 Hardware limit:101376" (the static launcher).
_OVERFLOW = re.compile(r"out of resource:\s*(?P<what>[\w ]+?),?\s+Required:\s*(?P<required>\d+),?\s+"
                       r"Hardware limit:\s*(?P<limit>\d+)")
_RESOURCES = ("shared memory", "threads", "tensor memory")

#: The heuristic types (``HeuristicType`` names) whose launch grid Inductor computes from the config's
#: blocks, and the blocks each may halve.
_GRID_FOLLOWS_BLOCKS = {"POINTWISE": ("XBLOCK", "YBLOCK", "ZBLOCK"), "REDUCTION": ("XBLOCK", "YBLOCK", "R0_BLOCK"),
                        "PERSISTENT_REDUCTION": ("XBLOCK", "YBLOCK")}


@dataclasses.dataclass(frozen=True)
class Overflow:
    resource: str  # "shared memory", "threads"
    required: int
    limit: int


def overflow_of(error: BaseException) -> Overflow | None:
    """What did not fit, when ``error`` is a load failing for a resource (Triton's ``OutOfResources``,
    the static launcher's ``OutOfMemoryError``, Inductor's ``No valid triton configs`` with either)."""
    name, required, limit = (getattr(error, attribute, None) for attribute in ("name", "required", "limit"))
    if isinstance(name, str) and isinstance(required, int) and isinstance(limit, int):
        return Overflow(name, required, limit)
    match = _OVERFLOW.search(str(error)[:2000])
    if match is None:
        return None
    what = match.group("what").strip()
    return Overflow(what if what in _RESOURCES else "shared memory", int(match.group("required")),
                    int(match.group("limit")))


def kernel_name(autotuner) -> str:
    return str(autotuner.inductor_meta.get("kernel_name") or introspect.kernel_name(autotuner.fn))


def _shared(result) -> int | None:
    kernel = result.kernel
    shared = getattr(kernel, "shared", None)
    return shared if isinstance(shared, int) else getattr(getattr(kernel, "metadata", None), "shared", None)


#: The kwarg Inductor's templates and mix-order reductions take their loops' pipeline depth from
#: (``tl.range(..., num_stages=NUM_STAGES)``); Inductor's own retry (torch 2.13) lowers it with ``num_stages``.
DEPTH = "NUM_STAGES"


def depth_parameters(autotuner, config) -> list[str]:
    """The kwargs of ``config`` that set a loop's pipeline depth: those :mod:`smemguard.kernels.parameters` reads as
    pipeline depth in the kernel's source; where it cannot read the source completely, Inductor's own
    ``NUM_STAGES``, as Inductor's retry treats it. A kwarg used any other way is never lowered."""
    found = parameters.knobs_of(autotuner.fn)
    if found.complete:
        return [name for name in found.with_role(parameters.PIPELINE_DEPTH)
                if parameters.is_count(config.kwargs.get(name))]
    counted = parameters.is_count(config.kwargs.get(DEPTH))
    return [DEPTH] if counted and found.roles.get(DEPTH) != parameters.OTHER else []


def _fewer_stages(config, stages: int, depth: list[str]):
    """``config`` pipelined at most ``stages`` deep: the option and each depth kwarg, capped."""
    return variant(config, {name: min(config.kwargs[name], stages) for name in depth},
                    num_stages=min(config.num_stages, stages))


def _candidates(autotuner, config, overflow: Overflow):
    """(action, candidate) for one config Inductor compiled, most conservative first."""
    if overflow.resource == "threads":
        for warps in fewer_warps(config.num_warps):
            yield WARPS_REDUCED, variant(config, num_warps=warps)
        return
    depth = depth_parameters(autotuner, config)
    futile = parameters.knobs_of(autotuner.fn).stages_futile()
    deepest = max([config.num_stages, *(config.kwargs[name] for name in depth)])
    for stages in range(deepest - 1, 0, -1) if futile is None else ():
        yield STAGES_REDUCED, _fewer_stages(config, stages, depth)
    blocks = _GRID_FOLLOWS_BLOCKS.get(getattr(autotuner.heuristic_type, "name", ""), ())
    current = {name: config.kwargs[name] for name in blocks if isinstance(config.kwargs.get(name), int)}
    while current and max(current.values()) > 1:
        largest = max(current, key=current.get)
        current[largest] //= 2
        yield BLOCKS_REDUCED, variant(config, dict(current))


class _Trial:
    """One recovery of one kernel: the candidates compiled so far, against the compile budget, and its record."""

    def __init__(self, autotuner, limit: int, *, settings, steps: Steps, started: float):
        self.autotuner, self.limit = autotuner, limit
        self.settings, self.steps, self.started = settings, steps, started
        self.attempts: list[Attempt] = []
        self.compile_ms = 0.0

    def load(self, candidate, with_launcher: bool = True):
        """(compile result, its launcher) when ``candidate`` compiles and loads here, else None; with
        ``with_launcher=False`` only compiled and measured (Inductor loads it), the launcher None."""
        started = time.perf_counter()
        text = introspect.config_text(candidate)
        try:
            result = self.autotuner._precompile_config(candidate)
        except Exception as error:  # a candidate that does not compile is not a fit
            self._note(Attempt(text, None, self.limit, False, introspect.error_summary(error, width=200)), started)
            return None
        shared = _shared(result)
        if shared is not None and shared > self.limit:  # known too big: loading it would only raise
            self._note(Attempt(text, shared, self.limit, False), started)
            return None
        if not with_launcher:
            self._note(Attempt(text, shared, self.limit, True), started)
            return result, None
        try:
            launcher = result.make_launcher()
        except Exception as error:
            overflow = overflow_of(error)
            if overflow is None:
                raise
            self._note(Attempt(text, overflow.required, overflow.limit, False), started)
            return None
        self._note(Attempt(text, shared, self.limit, True), started)
        return result, launcher

    def _note(self, attempt: Attempt, started: float) -> None:
        elapsed = round((time.perf_counter() - started) * 1000, 3)
        self.compile_ms += elapsed
        self.attempts.append(dataclasses.replace(attempt, compile_ms=elapsed))

    def record(self, overflow: Overflow, failing: list, chosen: list, *, configs: list = (), remembered: bool = False,
               timed: process.TimedChoice | None = None) -> None:
        """The record of this recovery: ``failing`` the configs that did not fit (an Attempt each), ``chosen`` the
        (action, candidate) loaded in their place, ``remembered`` when the decision cache's variants were loaded;
        ``timed``: the choice max-autotune was timing, whose failure to fit is ``autotune_skipped`` (Inductor times it
        as failed and chooses another), never a re-raise."""
        autotuner, settings, steps = self.autotuner, self.settings, self.steps
        unfit = AUTOTUNE_SKIPPED if timed is not None else OBSERVED if settings.observe_only else RERAISED
        action = chosen[0][0] if chosen else unfit
        final = " | ".join(introspect.config_text(candidate) for _, candidate in chosen) or None
        name = kernel_name(autotuner)
        device = _device(autotuner)
        config = failing[0].config if failing else None
        reason = None if chosen else _why_not(autotuner, name, settings) if timed is None else (
            "no stage count of its configs fits; Inductor's max-autotune times this choice as failed and chooses "
            "among the others")
        described, generated = {}, {}
        with steps.skippable("describe the compile"):
            described, generated = _described(autotuner, configs[0]) if configs else ({}, {})
        incident = incidents.Incident(
            kernel=name, launched_as="CachingAutotuner", phase="autotune" if timed else "compile", action=action,
            final=final,
            resource=overflow.resource, required=overflow.required, limit_hit=overflow.limit, started=self.started,
            device=device, internal_steps=steps.failed, reason=reason,
            attempts=attempt_records([*failing[:1], *self.attempts]), compiles=len(self.attempts),
            remembered=remembered, extras={
                **described,
                "inductor": {"kernel_name": name, "heuristic_type": getattr(autotuner.heuristic_type, "name", None),
                             "source_hash": introspect.source_hash(autotuner.fn), **generated},
                "config": config, "compile_ms": round(self.compile_ms, 3)})
        verdict = f"{'remembered: ' if remembered else ''}loads {final}" if chosen else reason
        record = incident.record()
        incidents.emit(record, settings.log_path, ("inductor", name, device, config),
                       "smemguard: %s (torch.compile): %s %s > %s B with %s; %s after %d compiles in %.0f ms", name,
                       overflow.resource, overflow.required, overflow.limit, config, verdict,
                       len(self.attempts), record["recovery_ms"])


def _with_live_function(autotuner) -> None:
    """A kernel compiled in one of Inductor's compile workers, or loaded from its FX graph cache, has lost its
    function (``prepare_for_pickle``: no source globals, no hash lock) and cannot be compiled again or read;
    Inductor reloads it (``_reload_kernel``) before it compiles in the parent itself, and so does recovery."""
    if getattr(autotuner.fn, "fn", True) is not None:
        return
    ensure = getattr(autotuner, "_ensure_kernel_loaded", None)  # torch 2.13; earlier ones reload inline
    if callable(ensure):
        ensure()
    elif callable(getattr(autotuner, "_reload_kernel", None)):
        autotuner.fn = autotuner._reload_kernel().fn


def _device(autotuner) -> int:
    """The device the kernel loads on. torch 2.14's compile on one rank leaves it None (rank-agnostic): it loads
    on the current device of the rank that runs it, as Inductor's own ``_resolve_load_device`` reads it."""
    device = autotuner.triton_meta.get("device")
    index = getattr(device, "index", device)  # Inductor's DeviceProperties, or an index
    return process.current_device() if index is None else index


def _case(autotuner, config, device: int) -> dict:
    """What identifies one config of one Inductor kernel on this GPU's arch and limit to other processes."""
    return {"kernel": kernel_name(autotuner), "source_hash": introspect.source_hash(autotuner.fn),
            **variants.on_device(device), "config": introspect.config_fields(config)}


def _remember(autotuner, overflow: Overflow, replaced: list, store) -> None:
    device = _device(autotuner)
    for config, action, candidate in replaced:
        case = _case(autotuner, config, device)
        store.put("inductor", decision_cache.case_id(case), decision_cache.new_entry(
            case, action=action, final=introspect.config_text(candidate), from_config=introspect.config_text(config),
            gpu=variants.gpu_label(device), resource=overflow.resource, required=overflow.required,
            config=introspect.config_fields(candidate)))


def _stored_variant(autotuner, config, entry: dict):
    """The candidate of ``config`` that ``entry`` names, if recovery could have produced it here; else None."""
    overflow = Overflow(entry["resource"], entry.get("required", 0), 0)
    for action, candidate in itertools.islice(_candidates(autotuner, config, overflow), MAX_CANDIDATES):
        if action == entry["action"] and introspect.config_fields(candidate) == entry["config"]:
            return candidate
    return None


def load_remembered(autotuner, settings) -> None:
    """Before Inductor loads ``autotuner``'s compile results: each one whose config has a stored variant
    is replaced by that variant, compiled through Inductor; Inductor then loads it as its own. Nothing
    is done in observe mode, without a decision cache, or when the cache holds no torch.compile entry
    (one stat of the file: the cost of a healthy kernel load)."""
    store = decision_cache.store(settings.cache_dir)
    if settings.observe_only or store is None or autotuner.launchers or not store.holds("inductor"):
        return
    from torch._dynamo.device_interface import DeviceGuard

    started, device, steps = time.perf_counter(), _device(autotuner), Steps(kernel_name(autotuner))
    trial = _Trial(autotuner, process.effective_limit(device), settings=settings, steps=steps, started=started)
    replaced, overflow = [], None
    with DeviceGuard(autotuner.get_device_interface(), device):
        for index, result in enumerate(list(autotuner.compile_results)):
            key = decision_cache.case_id(_case(autotuner, result.config, device))
            found = recall.stored_entry(settings.cache_dir, ("inductor",), key)
            entry = found[1] if found is not None else None
            if entry is not None:
                with steps.required("reload the kernel's function"):
                    _with_live_function(autotuner)
            candidate = entry and _stored_variant(autotuner, result.config, entry)
            if entry is not None and candidate is None:
                recall.ignored(key, f"not a variant recovery could produce from {introspect.config_text(result.config)}"
                               " here")
            if candidate is None:
                continue
            found = trial.load(candidate, with_launcher=False)
            if found is not None:
                autotuner.compile_results[index] = found[0]
                replaced.append((result.config, entry["action"], candidate))
                overflow = overflow or Overflow(entry["resource"], entry.get("required", 0), trial.limit)
    if replaced:
        trial.record(overflow, [Attempt(introspect.config_text(config), overflow.required, overflow.limit, False)
                                for config, _, _ in replaced],
                     [(action, candidate) for _, action, candidate in replaced],
                     configs=[config for config, _, _ in replaced], remembered=True)


def recover(engine, autotuner, error: BaseException, configs: list) -> bool:
    """Load a fitting variant of each of ``configs`` (what Inductor compiled for ``autotuner``) after
    ``error`` said none fits: True when at least one loads (``autotuner`` then holds their compile results
    and launchers, as after ``_make_launchers``), False when ``error`` stands (its record is written)."""
    from torch._dynamo.device_interface import DeviceGuard

    settings = engine.settings
    started = time.perf_counter()
    overflow = overflow_of(error)
    device = _device(autotuner)
    steps = Steps(kernel_name(autotuner))
    if not settings.observe_only:
        with steps.required("reload the kernel's function"):
            _with_live_function(autotuner)
    limit = process.effective_limit(device) if overflow.resource == "shared memory" else overflow.limit
    trial = _Trial(autotuner, limit, settings=settings, steps=steps, started=started)
    failing = [Attempt(introspect.config_text(config), overflow.required, overflow.limit, False) for config in configs]
    loaded, replaced = [], []
    if not settings.observe_only:
        with DeviceGuard(autotuner.get_device_interface(), device):
            for config in configs:
                for action, candidate in _candidates(autotuner, config, overflow):
                    if len(trial.attempts) >= MAX_CANDIDATES:
                        break
                    found = trial.load(candidate)
                    if found is not None:
                        loaded.append(found)
                        replaced.append((config, action, candidate))
                        break
    if loaded:
        autotuner.compile_results = [result for result, _ in loaded]
        autotuner.launchers = [launcher for _, launcher in loaded]
        store = None
        with steps.skippable("open the decision cache"):
            store = decision_cache.store(settings.cache_dir)
        if store is not None:
            with steps.skippable("store the decisions"):
                _remember(autotuner, overflow, replaced, store)
    chosen = [(action, candidate) for _, action, candidate in replaced]
    timed = process.benchmarking.value
    if not isinstance(timed, process.TimedChoice):
        trial.record(overflow, failing, chosen, configs=configs)
    elif engine.memory.first("autotune", (kernel_name(autotuner), device, limit, timed.shape_class, bool(chosen))):
        # A choice max-autotune is timing: once per kernel and shape class, and nothing that fits is not a failure.
        trial.record(overflow, failing, chosen, configs=configs, timed=timed)
    return bool(loaded)


def _described(autotuner, config) -> tuple[dict, dict]:
    """(what Inductor's compile of ``config`` was given, as the compile-time core's records keep it; the generated
    module that holds the kernel, ``{source_file, source_sha256}``), from which ``smemguard replay`` compiles the
    same variant while Inductor's cache still holds that file."""
    from triton.compiler.compiler import ASTSource

    meta = autotuner._create_compile_meta(config)  # as Inductor's _precompile_config builds the compile
    source = ASTSource(autotuner.fn, meta["signature"], meta["constants"], meta["configs"][0])
    path = autotuner.fn.fn.__code__.co_filename
    digest = hashlib.sha256(files.read_bytes(Path(path), GENERATED_SOURCE_LIMIT)).hexdigest()
    return (recorded.compile_fields(source, config.num_warps, config.num_stages),
            {"source_file": path, "source_sha256": digest})


#: A generated kernel module larger than this is not hashed for the record (Inductor's are kilobytes).
GENERATED_SOURCE_LIMIT = 4 * 2**20


def _why_not(autotuner, name: str, settings) -> str:
    if settings.observe_only:
        return "observed only (SMEMGUARD=observe)"
    kind = getattr(autotuner.heuristic_type, "name", "")
    if kind == "TEMPLATE" and "flex_attention" in name:
        # Not moved to eager by smemguard: the forward ran already, and eager's memory is quadratic
        # (docs/BENCHMARKS.md, "FlexAttention with head size 256 in fp32 under a T4").
        return ("no stage count of its configs fits, at the tiles smemguard's FlexAttention configs offered before "
                "rendering; to run it here, leave this attention out of the compiled graph (torch.compiler.disable: "
                "torch's eager FlexAttention, exact, its memory quadratic in the sequence length) or run it in "
                "fp16/bf16")
    if kind == "TEMPLATE":
        return ("no stage count of its configs fits, and a template's tiles are in its source (smaller tiles must be "
                "chosen before Inductor renders it)")
    return f"no stage count{' or smaller block' if kind in _GRID_FOLLOWS_BLOCKS else ''} of its configs fits"

