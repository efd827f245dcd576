"""What smemguard does when a guarded launch raises ``OutOfResources``.

In order, deciding with each candidate's *compiled* ``metadata.shared`` (compile only; a
kernel is never launched to find out whether it fits):

1. the same kernel with fewer ``num_stages`` (fewer ``num_warps`` for "threads"): grid and
   tiles unchanged, results bitwise identical. The replacement is stored in the JIT cache
   under the failing kernel's key, so later launches run it with no extra work;
2. for autotuned kernels, another config of the kernel's own list: the fastest the autotuner
   timed for this key, else the largest tile; its ``pre_hook`` runs, the grid is recomputed
   from it, and the autotuner's cached choice for the key is updated;
3. the fallback registered for the kernel (:func:`smemguard.register_fallback`);
4. otherwise the original ``OutOfResources`` is re-raised, with a note saying what was tried.

Tile sizes of a plain ``@triton.jit`` kernel are never changed: its grid was computed by
the caller from them. Only launches whose every layer is understood are retried (Triton's
JIT function, autotuner and heuristics, and the library layers described in
:mod:`smemguard.layers`), because each of those launches exactly one kernel and enqueues
nothing before the check fails.

A decision is taken once per failing compiled kernel (under a lock, so concurrent threads
compile the candidates once) and applied the same way on every later launch.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import logging
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from . import decisions, incidents, layers, registry
from .patches import autotuner_bench, max_shared_mem, triton_version

log = logging.getLogger("smemguard")

#: Candidate compiles allowed for one incident; compiles take seconds, and a kernel with a
#: large config list must not stall a server for minutes.
MAX_CANDIDATES = 16

#: Fitting candidates of an autotuned kernel timed against each other before choosing: the
#: tuned config with fewer stages and the fastest-timed other configs. Fewer stages keep the
#: tiles but can cost a third of the throughput (benchmarks/recovered_speed.py).
RACE = 3

STAGES_REDUCED = "stages_reduced"
WARPS_REDUCED = "warps_reduced"
CONFIG_CHANGED = "config_changed"
FALLBACK = "fallback"
RERAISED = "reraised"
OBSERVED = "observed"


@dataclass(frozen=True)
class Attempt:
    config: str
    required: int | None
    limit: int | None
    fits: bool
    error: str | None = None

    def summary(self) -> str:
        if self.error:
            return f"{self.config}: {self.error}"
        verdict = "fits" if self.fits else "too big"
        return f"{self.config}: {self.required} B ({verdict})"


@dataclass
class Launch:
    """A failed launch, resolved down to the JIT function it reached."""

    launched: Any  # what the user indexed: JIT function, autotuner, heuristics, a library's entry
    grid: Any
    args: tuple
    kwargs: dict
    jit: Any
    jit_kwargs: dict  # the kwargs ``jit.run`` received
    autotuner: Any = None  # the tuning layer (Triton's Autotuner or a library's)
    tuning_key: tuple | None = None
    config: Any = None  # the autotuner config in force
    tuner_kwargs: dict = field(default_factory=dict)  # the kwargs the autotuner layer received
    tuner: layers.Tuner | None = None  # how to read and update ``autotuner``

    def named_args(self) -> dict:
        """Every kernel parameter by name, as the kernel sees it."""
        named = {param.name: param.default for param in self.jit.params if param.has_default}
        named.update(zip(self.jit.arg_names, self.args))
        named.update((name, value) for name, value in self.jit_kwargs.items() if name in self.jit.arg_names)
        return named

    def run_config_pre_hook(self) -> None:
        if self.config is not None and self.config.pre_hook is not None:
            self.config.pre_hook({**self.named_args(), **self.config.all_kwargs()})

    def compile(self, **options):
        return self.jit.run(*self.args, grid=self.grid, warmup=True, **{**self.jit_kwargs, **options})

    def relaunch(self):
        self.run_config_pre_hook()
        return self.jit.run(*self.args, grid=self.grid, warmup=False, **self.jit_kwargs)


@dataclass(frozen=True)
class Decision:
    action: str
    attempts: tuple[Attempt, ...]
    config: Any = None  # the autotuner config chosen (CONFIG_CHANGED)
    fallback: Callable[..., Any] | None = None
    final: str | None = None  # the config that runs now
    record: str | None = None  # where the incident record went
    reason: str = ""  # why nothing else was possible (RERAISED)
    replacement: Any = None  # the compiled kernel that runs instead (STAGES_REDUCED, WARPS_REDUCED)
    options: dict | None = None  # the option change that made it ({"num_stages": 3})
    remembered: bool = False  # taken from the decision cache rather than by trying candidates
    timings: dict | None = None  # median ms of each fitting candidate timed before choosing


def resolve(launched, grid, args, kwargs, config=None) -> Launch | None:
    """Follow entry, heuristics and autotuner layers down to the JIT function, as their ``run`` would.

    ``config`` replaces the autotuner's choice. None when a layer is not understood
    (:mod:`smemguard.layers`).
    """
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.jit import JITFunction

    layer, kw = launched, dict(kwargs)
    autotuner = key = chosen = tuner = None
    tuner_kwargs: dict = {}
    while not isinstance(layer, JITFunction):
        if layers.runs_as(layer, Heuristics):
            for name, heuristic in layer.values.items():
                kw[name] = heuristic({**dict(zip(layer.arg_names, args)), **kw})
        elif autotuner is None and (tuner := layers.tuner_for(layer)) is not None:
            autotuner, tuner_kwargs = layer, dict(kw)
            key = tuner.key(layer, args, kw)
            chosen = config if config is not None else tuner.config_in_force(layer, key)
            kw = {**kw, **chosen.all_kwargs()}
        elif not layers.is_entry(layer):  # an entry passes the call on unchanged
            return None
        layer = layer.fn
    return Launch(launched, grid, args, kwargs, layer, kw, autotuner, key, chosen, tuner_kwargs, tuner)


def _current_device() -> int:
    from triton.runtime import driver

    return driver.active.get_current_device()


def _check(kernel) -> tuple[bool, int, int]:
    """Whether Triton would load ``kernel`` now: its own ``_init_handles`` checks, no launch."""
    from triton.runtime.errors import OutOfResources

    try:
        kernel._init_handles()
    except OutOfResources as error:
        return False, error.required, error.limit
    # A kernel that failed the "threads" check stays loaded, so _init_handles returns early on it.
    threads = kernel.metadata.num_warps * getattr(kernel.metadata, "warp_size", 32)
    if threads > kernel.n_max_threads:
        return False, threads, kernel.n_max_threads
    return True, kernel.metadata.shared, max_shared_mem.effective_limit(_current_device())


def describe(launch: Launch, kernel=None) -> str:
    """``BLOCK_M=128 BLOCK_N=64 num_warps=4 num_stages=3``: the constexprs and the options in force."""
    constexprs = launch.named_args()
    parts = [f"{p.name}={constexprs.get(p.name)}" for p in launch.jit.params
             if p.is_constexpr and isinstance(constexprs.get(p.name), (int, str, bool))]
    if kernel is not None:
        parts += [f"num_warps={kernel.metadata.num_warps}", f"num_stages={kernel.metadata.num_stages}"]
    return " ".join(parts)


def _try(launch: Launch, label: str, **options) -> tuple[Any, Attempt]:
    try:
        kernel = launch.compile(**options)
    except Exception as error:  # this candidate does not compile (CompilationError, PTXASError): not a fit
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        return None, Attempt(label, None, None, False, f"{type(error).__name__}: {first_line}")
    fits, required, limit = _check(kernel)
    return kernel, Attempt(describe(launch, kernel), required, limit, fits)


def _option_ladder(failing, resource: str):
    """Option-only changes, most conservative first: they keep the grid and the tiles."""
    if resource == "threads":
        warps = failing.metadata.num_warps // 2
        while warps >= 1:
            yield "num_warps", warps
            warps //= 2
    else:
        for stages in range(failing.metadata.num_stages - 1, 0, -1):
            yield "num_stages", stages


def _tile_size(config) -> int:
    blocks = [v for k, v in config.kwargs.items() if isinstance(v, int) and ("BLOCK" in k.upper() or "TILE" in k.upper())]
    return math.prod(blocks) if blocks else 0


def _candidate_configs(launch: Launch):
    """(candidate, the allowed config it derives from): the other allowed configs as they are
    first, then with fewer stages.

    Order: timed fastest by the autotuner for this key first, then untimed ones by tile size
    (largest first); configs that already failed while tuning this key are only retried with
    fewer stages.
    """
    timings = autotuner_bench.timings(launch.autotuner, launch.tuning_key) if launch.autotuner else {}
    others = [c for c in _allowed_configs(launch) if launch.config is None or c != launch.config]
    timed = sorted((c for c in others if math.isfinite(timings.get(c, math.inf))), key=timings.get)
    untimed = sorted((c for c in others if c not in timings),
                     key=lambda c: (_tile_size(c), c.num_stages, c.num_warps), reverse=True)
    failed = [c for c in others if math.isinf(timings.get(c, 0.0))]
    for config in (*timed, *untimed):
        yield config, config
    if not _takes_variants(launch):
        return
    for config in (*timed, *untimed, *failed):
        for stages in range(config.num_stages - 1, 0, -1):
            yield _variant(config, num_stages=stages), config


def _takes_variants(launch: Launch) -> bool:
    """Whether a config outside the tuner's own list can be adopted (see :class:`smemguard.layers.Tuner`)."""
    return launch.tuner is None or launch.tuner.takes_variants


def _variant(config, **options):
    """``config`` with other options (``num_stages=2``), leaving the original untouched."""
    variant = copy.copy(config)
    for option, value in options.items():
        setattr(variant, option, value)
    return variant


def _allowed_configs(launch: Launch) -> list:
    """The configs this launch may switch to.

    For an autotuner: its configs that its own ``early_config_prune`` keeps (a pruner may
    encode constraints of the kernel, such as a split that must divide K). For a plain JIT
    function: the alternatives registered for it, and only when the grid is a callable of the
    meta-parameters (a tuple grid was computed by the caller from the tiles it launched).
    """
    tuner = launch.autotuner
    if tuner is None:
        return list(registry.alternatives_for(launch.jit)) if callable(launch.grid) else []
    if len(tuner.configs) < 2:
        return []
    prune = getattr(tuner, "early_config_prune", None)
    if prune is None:
        return list(tuner.configs)
    named = dict(zip(tuner.arg_names, launch.args))
    return list(prune(tuner.configs, named, **launch.tuner_kwargs, grid=launch.grid, warmup=False))


def with_config(launch: Launch, config) -> Launch:
    """``launch`` with ``config`` in force: through the autotuner, or by keyword on a plain JIT function."""
    if launch.autotuner is not None:
        return resolve(launch.launched, launch.grid, launch.args, launch.kwargs, config=config)
    # Every parameter by name: a constexpr passed positionally cannot also be passed by keyword.
    options = {k: v for k, v in launch.jit_kwargs.items() if k not in launch.jit.arg_names}
    kwargs = {**launch.named_args(), **options, **config.all_kwargs()}
    return Launch(launch.launched, launch.grid, (), kwargs, launch.jit, kwargs, config=config)


def _jit_keys_of(launch: Launch, failing):
    """The JIT cache keys whose kernel is a compile of ``failing``.

    Matching by compile hash, not identity: threads that missed the JIT cache together each
    compiled (and stored) their own copy of the failing kernel.
    """
    kernel_cache = launch.jit.device_caches[_current_device()][0]
    return (key for key, kernel in list(kernel_cache.items()) if kernel.hash == failing.hash)


def _replace_in_jit_cache(launch: Launch, failing, replacement) -> None:
    """Put ``replacement`` under every key whose kernel is a compile of ``failing``."""
    kernel_cache = launch.jit.device_caches[_current_device()][0]
    for key in list(_jit_keys_of(launch, failing)):
        kernel_cache[key] = replacement


def _decide(launch: Launch, failing, error) -> Decision:
    attempts = [Attempt(describe(launch, failing), error.required, error.limit, False)]
    budget = MAX_CANDIDATES
    fitting: list[Decision] = []  # candidates that fit, most preferred first

    for option, value in _option_ladder(failing, error.name):
        if budget == 0:
            break
        budget -= 1
        kernel, attempt = _try(launch, f"{option}={value}", **{option: value})
        attempts.append(attempt)
        if attempt.fits:
            action = WARPS_REDUCED if option == "num_warps" else STAGES_REDUCED
            fitting.append(Decision(action, (), final=attempt.config, replacement=kernel, options={option: value}))
            break

    racing = _can_race(launch)
    wanted = RACE if racing else 1
    fitted_bases: list = []  # a config that fits needs no fewer-stage variant
    for config, base in _candidate_configs(launch) if len(fitting) < wanted else ():
        if budget == 0 or len(fitting) >= wanted:
            break
        if any(base is fitted for fitted in fitted_bases):
            continue
        budget -= 1
        candidate = with_config(launch, config)
        # A TMA pre_hook sets descriptor block shapes, which are part of the compiled signature.
        candidate.run_config_pre_hook()
        kernel, attempt = _try(candidate, str(config))
        attempts.append(attempt)
        if attempt.fits:
            fitted_bases.append(base)
            fitting.append(Decision(CONFIG_CHANGED, (), config=config, final=attempt.config))

    if fitting:
        chosen, timings = _fastest(launch, fitting) if racing and len(fitting) > 1 else (fitting[0], None)
        if chosen.action == CONFIG_CHANGED:
            _adopt(launch, chosen.config)
        return dataclasses.replace(chosen, attempts=tuple(attempts), timings=timings)

    fallback = registry.fallback_for(launch.jit)
    if fallback is not None:
        return Decision(FALLBACK, tuple(attempts), fallback=fallback, final=f"fallback {_name(fallback)}")
    return Decision(RERAISED, tuple(attempts), reason=_why_nothing_fits(launch, budget))


def _capturing() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:
        return True  # when in doubt, launch nothing extra


def _can_race(launch: Launch) -> bool:
    """Candidates of an autotuned kernel can be timed with its own benchmark, except during graph capture."""
    return launch.autotuner is not None and len(launch.autotuner.configs) > 1 and not _capturing()


def _fastest(launch: Launch, fitting: list[Decision]) -> tuple[Decision, dict | None]:
    """The fitting candidate the autotuner's own benchmark times fastest, and every timing.

    ``Autotuner._bench`` is what the autotuner uses to tune: it runs the kernel's
    reset_to_zero / restore_value hooks, so kernels that accumulate into their outputs are
    timed safely. Ties keep the preferred order (fewer stages of the tuned config first).
    """
    tuner = launch.autotuner
    timings: dict[str, float] = {}
    best, best_ms = fitting[0], math.inf
    tuner.nargs = dict(zip(tuner.arg_names, launch.args))
    try:
        for decision in fitting:
            config = decision.config if decision.config is not None else _variant(launch.config, **decision.options)
            median = tuner._bench(*launch.args, config=config, grid=launch.grid, warmup=False,
                                  **launch.tuner_kwargs)[0]
            timings[decision.final] = median
            if median < best_ms:
                best, best_ms = decision, median
    except Exception:
        log.debug("smemguard: timing the candidates failed; keeping the preferred one", exc_info=True)
        return fitting[0], timings or None
    finally:
        tuner.nargs = None
    return best, timings


def _adopt(launch: Launch, config) -> None:
    """Make later launches of an autotuned kernel use ``config`` directly."""
    if launch.autotuner is not None:
        launch.tuner.adopt(launch.autotuner, launch.tuning_key, config)


def _why_nothing_fits(launch: Launch, budget: int) -> str:
    advice = "register a fallback with smemguard.register_fallback"
    if budget == 0:
        return f"stopped after {MAX_CANDIDATES} candidate compiles; {advice}"
    if launch.autotuner is not None:
        return f"no config of the autotuner fits; {advice}"
    if registry.alternatives_for(launch.jit) and not callable(launch.grid):
        return (f"alternatives are registered, but the grid is a tuple computed by the caller, so the tiles it "
                f"was computed for are kept; pass the grid as a function of the meta-parameters, or {advice}")
    if registry.alternatives_for(launch.jit):
        return f"none of the registered alternatives fits; {advice}"
    return ("tile sizes of a plain @triton.jit kernel are never changed (its grid may be computed from them); "
            f"register alternatives with smemguard.register_alternatives, or {advice}")


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


# launched object -> {(compile hash of the failing kernel, device, limit, tuning key, fallback): case}.
# Keyed by what was compiled, not by the kernel object: concurrent first launches each
# compile their own copy. Entries go with the kernel object they belong to.
_cases: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_cases_guard = threading.Lock()


@dataclass
class _Case:
    lock: threading.RLock = field(default_factory=threading.RLock)
    decision: Decision | None = None


def _case_for(launch: Launch, failing) -> _Case:
    device = _current_device()
    key = (failing.hash, device, max_shared_mem.effective_limit(device), launch.tuning_key,
           registry.fallback_for(launch.jit))
    with _cases_guard:
        return _cases.setdefault(launch.launched, {}).setdefault(key, _Case())


def forget() -> None:
    """Drop every remembered decision (``uninstall`` does); kernels already replaced in Triton's
    JIT cache stay replaced, since they compute the same results."""
    with _cases_guard:
        _cases.clear()


def _apply(decision: Decision, launch: Launch, failing, error):
    if decision.action in (STAGES_REDUCED, WARPS_REDUCED):
        _replace_in_jit_cache(launch, failing, decision.replacement)
        return launch.relaunch()
    if decision.action == CONFIG_CHANGED:
        return with_config(launch, decision.config).relaunch()
    if decision.action == FALLBACK:
        try:
            decision.fallback(**launch.named_args())
        except Exception as fallback_error:
            _add_note(error, f"smemguard: the registered fallback {_name(decision.fallback)} raised "
                      f"{type(fallback_error).__name__}: {fallback_error}")
            raise error from fallback_error
        return None
    _add_note(error, lambda: _explain(launch, decision, error))
    raise error


def _add_note(error: BaseException, note: str | Callable[[], str]) -> None:
    """Attach ``note`` (or the text it builds) to the user's error; never raises: the error must reach them as it is."""
    try:
        text = note() if callable(note) else note
        if hasattr(error, "add_note"):
            error.add_note(text)
        else:  # Python 3.10: same attribute, shown by tools that know PEP 678
            error.__notes__ = [*getattr(error, "__notes__", []), text]
    except Exception:
        log.debug("smemguard: could not add a note to %s", type(error).__name__, exc_info=True)


def handle(launched, grid, args, kwargs, error, settings):
    """Recover the launch ``launched[grid](*args, **kwargs)`` that raised ``error``, or re-raise it.

    Internal failures are logged and end in re-raising ``error`` itself, never another one.
    """
    started = time.perf_counter()
    try:
        launch = resolve(launched, grid, args, kwargs)
        failing = launch.compile() if launch is not None else None
    except Exception:
        log.debug("smemguard: could not resolve the failed launch; re-raising", exc_info=True)
        raise error
    if launch is None:
        decision = _record(None, launched, None, error, Decision(RERAISED, (), reason=(
            f"{type(launched).__name__} is not a Triton JIT function, autotuner or heuristics: it may launch more "
            "than one kernel, so it is not retried")), started, settings)
        _add_note(error, lambda: f"smemguard did not retry {registry.kernel_name(launched)}: {decision.reason}"
                  + (f"; incident record: {decision.record}" if decision.record else ""))
        raise error

    if settings.observe_only:
        _record(launch, launched, failing, error, Decision(OBSERVED, ()), started, settings)
        raise error

    if _check(failing)[0]:  # another thread already put a kernel that fits in its place
        return launch.relaunch()

    case = _case_for(launch, failing)
    with case.lock:
        if case.decision is None:
            try:
                # Described before candidates are tried: their pre_hooks rewrite TMA descriptors' block shapes.
                described = _described_args(launch)
                shared = decisions.store(settings.cache_dir)
                cases = _shared_cases(launch, failing) if shared else None
                decision = _recall(launch, cases, shared) if cases else None
                if decision is None:
                    decision = _decide(launch, failing, error)
                    if cases:
                        decision = _remember(launch, decision, cases, shared)
            except Exception:
                log.warning("smemguard: internal error while recovering %s; re-raising the original error",
                            registry.kernel_name(launch.jit), exc_info=True)
                raise error
            case.decision = _record(launch, launched, failing, error, decision, started, settings, described)
    return _apply(case.decision, launch, failing, error)


# Decisions shared with other processes through smemguard.decisions. A case is identified by
# what was compiled and where: kernel, source, Triton, GPU model, enforced limit, JIT key.


@functools.lru_cache(maxsize=None)
def _gpu_name(device: int) -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(device) if torch.cuda.is_available() else None
    except Exception:
        log.debug("no device name", exc_info=True)
        return None


def source_hash(jit) -> str:
    return hashlib.sha256(jit.src.encode()).hexdigest()[:16]


def _compile_case(jit, jit_key: str, device: int) -> dict:
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return {"kernel": registry.kernel_name(jit), "source_hash": source_hash(jit), "triton": triton_version(),
            "gpu": _gpu_name(device) or f"{target.backend}:{target.arch}", "arch": target.arch,
            "limit": max_shared_mem.effective_limit(device), "jit_key": jit_key}


def _shared_cases(launch: Launch, failing) -> dict | None:
    """{"compile": case, "launch": case} identifying this failure to other processes; None when
    the failing kernel is not in the JIT cache (nothing to key it by)."""
    jit_key = next(_jit_keys_of(launch, failing), None)
    if jit_key is None:
        return None
    compile_case = _compile_case(launch.jit, jit_key, _current_device())
    return {"compile": compile_case, "launch": {**compile_case, "tuning_key": repr(launch.tuning_key)}}


def remembered_options(jit, jit_key: str, device: int, settings) -> dict | None:
    """Option overrides remembered for the variant Triton is about to compile (compile-time patch)."""
    shared = decisions.store(settings.cache_dir)
    if shared is None:
        return None
    entry = shared.get("compile", decisions.case_id(_compile_case(jit, jit_key, device)))
    return dict(entry["options"]) if entry else None


def _config_entry(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def _config_from_entry(launch: Launch, entry: dict):
    """The autotuner config described by ``entry`` (one of its own, or a fewer-stage variant), or None."""
    for config in _allowed_configs(launch):
        if (dict(config.kwargs) == entry["kwargs"] and config.num_warps == entry["num_warps"]
                and getattr(config, "num_ctas", 1) == entry["num_ctas"]
                and getattr(config, "maxnreg", None) == entry["maxnreg"] and config.num_stages >= entry["num_stages"]):
            if config.num_stages == entry["num_stages"]:
                return config
            return _variant(config, num_stages=entry["num_stages"]) if _takes_variants(launch) else None
    return None


def _from_entry(launch: Launch, kind: str, entry: dict) -> Decision | None:
    """Apply a stored decision to this launch: one compile to confirm it fits, no other candidate."""
    if kind == "compile":
        kernel, attempt = _try(launch, "remembered", **entry["options"])
        if attempt.fits:
            return Decision(entry["action"], (attempt,), final=attempt.config, replacement=kernel,
                            options=dict(entry["options"]), remembered=True)
        return None
    action = entry["action"]
    if action == CONFIG_CHANGED:
        config = _config_from_entry(launch, entry["config"])
        if config is None:
            return None
        candidate = with_config(launch, config)
        candidate.run_config_pre_hook()
        _, attempt = _try(candidate, str(config))
        if attempt.fits:
            _adopt(launch, config)
            return Decision(CONFIG_CHANGED, (attempt,), config=config, final=attempt.config, remembered=True)
        return None
    fallback = registry.fallback_for(launch.jit)
    if action == FALLBACK and fallback is not None and _name(fallback) == entry["fallback"]:
        return Decision(FALLBACK, (), fallback=fallback, final=f"fallback {entry['fallback']}", remembered=True)
    if action == RERAISED and fallback is None:
        return Decision(RERAISED, (), reason=entry["reason"], remembered=True)
    return None


def _recall(launch: Launch, cases: dict, shared) -> Decision | None:
    for kind, case in cases.items():
        entry = shared.get(kind, decisions.case_id(case))
        if entry is not None:
            decision = _from_entry(launch, kind, entry)
            if decision is not None:
                return decision
    return None


def _remember(launch: Launch, decision: Decision, cases: dict, shared) -> Decision:
    """Store ``decision``; if another process stored this case first, apply theirs instead."""
    entry: dict[str, Any] = {"action": decision.action, "final": decision.final, "time": time.time(),
                             "host": incidents.host(), "pid": os.getpid(), "from_config": decision.attempts[0].config}
    kind = "compile" if decision.options is not None else "launch"
    case = cases[kind]
    if decision.options is not None:
        entry["options"] = decision.options
    else:
        if decision.config is not None:
            entry["config"] = _config_entry(decision.config)
        if decision.fallback is not None:
            entry["fallback"] = _name(decision.fallback)
        entry["reason"] = decision.reason
    entry.update(case)
    standing = shared.put(kind, decisions.case_id(case), entry)
    if standing is entry:
        return decision
    theirs = _from_entry(launch, kind, standing)
    return theirs if theirs is not None else decision


def _device_record(device: int) -> dict:
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return {"name": _gpu_name(device), "backend": target.backend, "arch": target.arch, "index": device}


def _described_args(launch: Launch) -> dict:
    """The kernel's non-constexpr arguments as the incident record keeps them."""
    constexpr_names = {p.name for p in launch.jit.params if p.is_constexpr}
    return {k: incidents.describe_arg(v) for k, v in launch.named_args().items() if k not in constexpr_names}


def _record(launch, launched, failing, error, decision: Decision, started: float, settings,
            described: dict | None = None) -> Decision:
    """Write the incident record and the one-line warning; return the decision with its location.

    ``described``: the arguments as :func:`_described_args` saw them at the failure, if taken then.
    Never raises: a record that cannot be built or written leaves the decision as it is.
    """
    try:
        return _write_record(launch, launched, failing, error, decision, started, settings, described)
    except Exception:
        log.warning("smemguard: could not write the incident record for %s", type(launched).__name__,
                    exc_info=True)
        return decision


def _write_record(launch, launched, failing, error, decision: Decision, started: float, settings,
                  described: dict | None) -> Decision:
    elapsed_ms = round((time.perf_counter() - started) * 1000, 3)
    device = _current_device()
    kernel = registry.kernel_name(launch.jit if launch is not None else launched)
    record: dict[str, Any] = {
        **incidents.new_record(kernel),
        "launched_as": type(launched).__name__,
        "triton": triton_version(),
        "device": _device_record(device),
        "limit": {"device": max_shared_mem.device_limit(device), "emulated": max_shared_mem.emulated_limit()},
        "resource": error.name,
        "required": error.required,
        "limit_hit": error.limit,
        "action": decision.action,
        "final": decision.final,
        "reason": decision.reason or None,
        "attempts": [vars(a) for a in decision.attempts],
        "remembered": decision.remembered,
        "timings_ms": decision.timings,
        "recovery_ms": elapsed_ms,
    }
    if launch is not None:
        code = launch.jit.fn.__code__
        named = launch.named_args()
        constexpr_names = {p.name for p in launch.jit.params if p.is_constexpr}
        record.update({
            "source": f"{code.co_filename}:{code.co_firstlineno}",
            "source_hash": source_hash(launch.jit),
            "constexprs": {k: incidents.describe_arg(v) for k, v in named.items() if k in constexpr_names},
            "num_warps": failing.metadata.num_warps,
            "num_stages": failing.metadata.num_stages,
            "config": describe(launch, failing),
            "grid": incidents.evaluate_grid(launch.grid, named),
            "args": described if described is not None else _described_args(launch),
            "specialization": incidents.specialization(launch.jit, named),
            "autotune_key": list(launch.tuning_key) if launch.tuning_key is not None else None,
        })
    where = incidents.write(record, settings.log_path)
    incidents.warn_once(
        (kernel, device, record.get("config")),
        "smemguard: %s: %s %s > %s B with %s; %s after %d tries in %.0f ms%s",
        kernel, error.name, error.required, error.limit, record.get("config") or "?",
        _action_text(decision), max(len(decision.attempts) - 1, 0), elapsed_ms,
        f"; record {where}" if where else "")
    log.debug("smemguard incident: %s", record)
    return dataclasses.replace(decision, record=where)


def _action_text(decision: Decision) -> str:
    return ("remembered: " if decision.remembered else "") + {
        STAGES_REDUCED: f"recovered with {decision.final}",
        WARPS_REDUCED: f"recovered with {decision.final}",
        CONFIG_CHANGED: f"switched to config {decision.final}",
        FALLBACK: f"ran {decision.final}",
        OBSERVED: "observed only (SMEMGUARD=observe)",
        RERAISED: "re-raised: " + decision.reason,
    }[decision.action]


def _explain(launch: Launch, decision: Decision, error) -> str:
    named = launch.named_args()
    code = launch.jit.fn.__code__
    tensors = ", ".join(f"{k}: {v['dtype']}{v['shape']} stride {v['stride']}" for k, v in
                        ((k, incidents.describe_arg(v)) for k, v in named.items()) if isinstance(v, dict) and "dtype" in v)
    lines = [
        f"smemguard could not recover {registry.kernel_name(launch.jit)} ({code.co_filename}:{code.co_firstlineno}):",
        f"  {error.name}: required {error.required}, limit {error.limit}",
        f"  tensors: {tensors or 'none'}",
        "  tried: " + ("; ".join(a.summary() for a in decision.attempts) or "nothing"),
        f"  {decision.reason}",
    ]
    if decision.remembered:
        lines.append("  (decided earlier and kept in SMEMGUARD_CACHE_DIR; 'smemguard cache clear' forgets it)")
    if decision.record:
        lines.append(f"  incident record: {decision.record}")
    return "\n".join(lines)
