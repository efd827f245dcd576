"""The candidates tried for a failed launch, most conservative first, and the decision taken.

In order, deciding with each candidate's *compiled* ``metadata.shared`` (compile only; a
kernel is never launched to find out whether it fits):

1. the same kernel with fewer ``num_stages`` (fewer ``num_warps`` for "threads"): grid and
   tiles unchanged, results bitwise identical. A stage fewer that needs exactly as many bytes
   ends this rung: the bytes are not the pipeline's (misaligned loads on gfx942 or sm_80 keep
   one buffer whatever ``num_stages`` says), so fewer stages still would only cost compiles;
2. for tuned kernels, another config of the kernel's own list: the fastest the tuner timed
   for this key, else the largest tile; for a plain JIT function launched with a grid
   function, the alternatives registered for it. When several fit, up to :data:`RACE` are
   timed with the tuner's own benchmark and the fastest wins. A candidate keeps the config's
   other options (AMD's ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``): they change the
   code and its speed, never whether it fits (``waves_per_eu`` and ``kpack`` change no byte of
   LDS, ``matrix_instr_nonkdim`` under 1 KiB of gfx950's padding: ``benchmarks/amd_lds_sweep.py``);
3. the fallback registered for the kernel (:func:`smemguard.register_fallback`);
4. otherwise nothing: the original error is re-raised (:mod:`smemguard.recovery`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

from . import introspect, registry, runtime
from .launch import Attempt, Launch, describe, try_compile, with_config

log = logging.getLogger(__name__)

#: Candidate compiles allowed for one incident; compiles take seconds, and a kernel with a
#: large config list must not stall a server for minutes.
MAX_CANDIDATES = 16

#: Fitting candidates of a tuned kernel timed against each other before choosing: the
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
class Decision:
    action: str
    attempts: tuple[Attempt, ...]
    config: Any = None  # the tuner config chosen (CONFIG_CHANGED)
    fallback: Callable[..., Any] | None = None
    final: str | None = None  # the config that runs now
    record: str | None = None  # where the incident record went
    reason: str = ""  # why nothing else was possible (RERAISED)
    replacement: Any = None  # the compiled kernel that runs instead (STAGES_REDUCED, WARPS_REDUCED)
    options: dict | None = None  # the option change that made it ({"num_stages": 3})
    remembered: bool = False  # taken from the decision cache rather than by trying candidates
    timings: dict | None = None  # median ms of each fitting candidate timed before choosing


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


def _stages_futile(option: str, before: int | None, attempt: Attempt) -> bool:
    """Whether a stage fewer left the bytes exactly as they were: fewer still will not help."""
    return option == "num_stages" and attempt.required is not None and attempt.required == before


def _tile_size(config) -> int:
    blocks = [v for k, v in config.kwargs.items() if isinstance(v, int) and ("BLOCK" in k.upper() or "TILE" in k.upper())]
    return math.prod(blocks) if blocks else 0


def _candidate_configs(launch: Launch):
    """(candidate, the allowed config it derives from): the other allowed configs as they are
    first, then with fewer stages.

    Order: timed fastest by the tuner for this key first, then untimed ones by tile size
    (largest first); configs that already failed while tuning this key are only retried with
    fewer stages.
    """
    timings = runtime.timings(launch.tuner, launch.tuning_key) if launch.tuner is not None else {}
    others = [c for c in allowed_configs(launch) if launch.config is None or c != launch.config]
    timed = sorted((c for c in others if math.isfinite(timings.get(c, math.inf))), key=timings.get)
    untimed = sorted((c for c in others if c not in timings),
                     key=lambda c: (_tile_size(c), c.num_stages, c.num_warps), reverse=True)
    failed = [c for c in others if math.isinf(timings.get(c, 0.0))]
    for config in (*timed, *untimed):
        yield config, config
    if not takes_variants(launch):
        return
    for config in (*timed, *untimed, *failed):
        for stages in range(config.num_stages - 1, 0, -1):
            yield variant(config, num_stages=stages), config


def takes_variants(launch: Launch) -> bool:
    """Whether a config outside the tuner's own list can be adopted (see :class:`smemguard.layers.Tuner`)."""
    return launch.tuner_kind is None or launch.tuner_kind.takes_variants


def variant(config, **options):
    """``config`` with other options (``num_stages=2``), leaving the original untouched."""
    changed = copy.copy(config)
    for option, value in options.items():
        setattr(changed, option, value)
    return changed


def allowed_configs(launch: Launch) -> list:
    """The configs this launch may switch to.

    For a tuner: its configs that its own ``early_config_prune`` keeps (a pruner may encode
    constraints of the kernel, such as a split that must divide K). For a plain JIT function:
    the alternatives registered for it, and only when the grid is a callable of the
    meta-parameters (a tuple grid was computed by the caller from the tiles it launched).
    """
    tuner = launch.tuner
    if tuner is None:
        return list(registry.alternatives_for(launch.jit)) if callable(launch.grid) else []
    if len(tuner.configs) < 2:
        return []
    prune = getattr(tuner, "early_config_prune", None)
    if prune is None:
        return list(tuner.configs)
    named = dict(zip(tuner.arg_names, launch.args))
    return list(prune(tuner.configs, named, **launch.tuner_kwargs, grid=launch.grid, warmup=False))


def decide(launch: Launch, failing, error) -> Decision:
    """Try the candidates for ``launch`` (whose compiled kernel ``failing`` raised ``error``)."""
    attempts = [Attempt(describe(launch, failing), error.required, error.limit, False)]
    budget = MAX_CANDIDATES
    fitting: list[Decision] = []  # candidates that fit, most preferred first

    required = error.required
    for option, value in _option_ladder(failing, error.name):
        if budget == 0:
            break
        budget -= 1
        kernel, attempt = try_compile(launch, f"{option}={value}", **{option: value})
        attempts.append(attempt)
        if attempt.fits:
            action = WARPS_REDUCED if option == "num_warps" else STAGES_REDUCED
            fitting.append(Decision(action, (), final=attempt.config, replacement=kernel, options={option: value}))
            break
        if _stages_futile(option, required, attempt):
            break
        required = attempt.required

    racing = _can_race(launch)
    wanted = RACE if racing else 1
    done_bases: list = []  # a config that fits, or whose stages do not change its bytes, needs no fewer-stage variant
    required_by_base: dict[int, int | None] = {}
    for config, base in _candidate_configs(launch) if len(fitting) < wanted else ():
        if budget == 0 or len(fitting) >= wanted:
            break
        if any(base is done for done in done_bases):
            continue
        budget -= 1
        candidate = with_config(launch, config)
        # A TMA pre_hook sets descriptor block shapes, which are part of the compiled signature.
        candidate.run_config_pre_hook()
        kernel, attempt = try_compile(candidate, introspect.config_text(config))
        attempts.append(attempt)
        if attempt.fits:
            done_bases.append(base)
            fitting.append(Decision(CONFIG_CHANGED, (), config=config, final=attempt.config))
        elif config is not base and _stages_futile("num_stages", required_by_base.get(id(base)), attempt):
            done_bases.append(base)
        required_by_base[id(base)] = attempt.required

    if fitting:
        chosen, timings = _fastest(launch, fitting) if racing and len(fitting) > 1 else (fitting[0], None)
        if chosen.action == CONFIG_CHANGED:
            adopt(launch, chosen.config)
        return dataclasses.replace(chosen, attempts=tuple(attempts), timings=timings)

    fallback = registry.fallback_for(launch.jit)
    if fallback is not None:
        return Decision(FALLBACK, tuple(attempts), fallback=fallback,
                        final=f"fallback {introspect.callable_name(fallback)}")
    return Decision(RERAISED, tuple(attempts), reason=_why_nothing_fits(launch, budget))


def _capturing() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:
        return True  # when in doubt, launch nothing extra


def _can_race(launch: Launch) -> bool:
    """Candidates of a tuned kernel can be timed with its own benchmark, except during graph capture."""
    return launch.tuner is not None and len(launch.tuner.configs) > 1 and not _capturing()


def _fastest(launch: Launch, fitting: list[Decision]) -> tuple[Decision, dict | None]:
    """The fitting candidate the tuner's own benchmark times fastest, and every timing.

    ``Autotuner._bench`` is what the autotuner uses to tune: it runs the kernel's
    reset_to_zero / restore_value hooks, so kernels that accumulate into their outputs are
    timed safely. Ties keep the preferred order (fewer stages of the tuned config first).
    """
    tuner = launch.tuner
    timings: dict[str, float] = {}
    best, best_ms = fitting[0], math.inf
    tuner.nargs = dict(zip(tuner.arg_names, launch.args))
    try:
        for decision in fitting:
            config = decision.config if decision.config is not None else variant(launch.config, **decision.options)
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


def adopt(launch: Launch, config) -> None:
    """Make later launches of a tuned kernel use ``config`` directly."""
    if launch.tuner is not None:
        launch.tuner_kind.adopt(launch.tuner, launch.tuning_key, config)


def _why_nothing_fits(launch: Launch, budget: int) -> str:
    advice = "register a fallback with smemguard.register_fallback"
    if budget == 0:
        return f"stopped after {MAX_CANDIDATES} candidate compiles; {advice}"
    if launch.tuner is not None:
        return f"no config of the autotuner fits; {advice}"
    if registry.alternatives_for(launch.jit) and not callable(launch.grid):
        return (f"alternatives are registered, but the grid is a tuple computed by the caller, so the tiles it "
                f"was computed for are kept; pass the grid as a function of the meta-parameters, or {advice}")
    if registry.alternatives_for(launch.jit):
        return f"none of the registered alternatives fits; {advice}"
    return ("tile sizes of a plain @triton.jit kernel are never changed (its grid may be computed from them); "
            f"register alternatives with smemguard.register_alternatives, or {advice}")
