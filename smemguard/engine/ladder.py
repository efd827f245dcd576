"""The candidates tried for a failed launch, most conservative first, and the decision taken.

In order, deciding with each candidate's *compiled* ``metadata.shared`` (compile only; a
kernel is never launched to find out whether it fits):

1. the same kernel with fewer ``num_stages`` (fewer ``num_warps`` for "threads"): grid and
   tiles unchanged, results bitwise identical. Counts are skipped that the measured bytes per
   stage show cannot fit, and a stage fewer that needs exactly as many bytes ends this rung:
   the bytes are not the pipeline's (misaligned loads on gfx942 or sm_80 keep one buffer
   whatever ``num_stages`` says), so fewer stages still would only cost compiles. Before sm_80,
   where Triton runs no software pipeliner, stages change no byte: this rung, and the fewer-stage
   variants of rung 2, are skipped without a compile;
2. for tuned kernels, another config of the kernel's own list: the fastest the tuner timed
   for this key, else the largest tile; for a plain JIT function launched with a grid
   function, the alternatives registered for it whose parameters that function reads (one that
   ignores them holds the caller's tiles, as a tuple does). When several fit, up to :data:`RACE` are
   timed with the tuner's own benchmark and the fastest wins. A candidate keeps the config's
   other options (AMD's ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``): they change the
   code and its speed, never whether it fits (README, "What changes LDS on AMD").
   The candidates still wanted are compiled together (:func:`smemguard.kernels.launch.try_compile_all`);
3. the fallback registered for the kernel (:func:`smemguard.register_fallback`);
4. otherwise nothing: the original error is re-raised (:mod:`smemguard.engine.recovery`).

Where the failing launch's measured bytes lie inside the calibrated envelope of a matmul with
its tiles (:func:`smemguard.kernels.estimate.envelope`), the estimate steers both rungs: a candidate
whose one stage of tiles alone is :data:`~smemguard.kernels.estimate.ESTIMATE_MARGIN` over the limit is
not compiled, and a measurement that is exactly S stages of tiles gives the stage count that fits
at once. Only a compile says that a candidate fits.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import re
import time
from dataclasses import dataclass

from ..kernels import estimate, introspect, parameters, registry
from ..kernels.launch import Attempt, Launch, describe, try_compile, try_compile_all, with_config
from ..store.decision import CONFIG_CHANGED, FALLBACK, RERAISED, STAGES_REDUCED, WARPS_REDUCED, Decision
from . import reasons
from .candidates import MAX_CANDIDATES, FewerStages, fewer_warps, variant

log = logging.getLogger(__name__)

#: Fitting candidates of a tuned kernel timed against each other before choosing: the
#: tuned config with fewer stages and the fastest-timed other configs. Fewer stages keep the
#: tiles but can cost a third of the throughput (benchmarks/recovered_speed.py).
RACE = 3

#: Batches of candidates compiled only to find rivals for a candidate that already fits: racing is
#: worth one concurrent batch, not a search through every config that overflows.
RACE_BATCHES = 1


def _is_tile(name: str, value) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)
            and ("BLOCK" in name.upper() or "TILE" in name.upper()))


def _tile_size(config) -> int:
    blocks = [v for k, v in config.kwargs.items() if _is_tile(k, v)]
    return math.prod(blocks) if blocks else 0


@dataclass
class _Measured:
    """What the compiles of one incident showed, so that candidates that cannot fit are not compiled."""

    limit: int
    overflowing: list = dataclasses.field(default_factory=list)  # (constexprs, num_stages) measured too big
    skipped: list = dataclasses.field(default_factory=list)  # config texts not compiled, and why
    stages_inert: str = ""  # why fewer stages were given up: they did not lower the bytes, or cannot
    # False where num_stages changes no byte: no software pipeliner before sm_80, or no loop of the kernel
    # follows the option or a pipeline-depth parameter (smemguard.kernels.parameters).
    stages_matter: bool = True
    pinned: str = ""  # the tuner's pruner keeps a single config: which, and whose pruner
    # The arch and operand types of the failing launch, when its measured bytes lie inside the calibrated envelope.
    estimated: tuple | None = None
    compile_ms: float = 0.0
    timings: dict = dataclasses.field(default_factory=dict)  # {config: median ms} the tuner measured for this key

    @classmethod
    def of(cls, launch: Launch, failing, error, timings: dict) -> "_Measured":
        measured = cls(error.limit, [(_constexprs(launch), failing.metadata.num_stages)], timings=timings)
        arch = getattr(getattr(failing.metadata, "target", None), "arch", None)
        futile = parameters.knobs_of(launch.jit).stages_futile()
        if arch is not None and not estimate.stages_change_bytes(arch, None):
            futile = "Triton pipelines nothing before sm_80, stages change no byte"
        if futile:
            measured.stages_matter, measured.stages_inert = False, futile
        signature = getattr(getattr(failing, "src", None), "signature", None) or {}
        pointer_types = [match.group(1) for ty in signature.values()
                         if isinstance(ty, str) and (match := _OPERAND_TYPE.match(ty))]
        own = estimate.envelope(arch, _constexprs(launch), pointer_types, failing.metadata.num_stages,
                                failing.metadata.num_warps)
        # Trusted for this kernel only when its own measurement is what a calibrated matmul's would be, and
        # its loops' depth is the option's (the calibration's).
        if (own is not None and error.required is not None and own.holds(error.required)
                and not parameters.knobs_of(launch.jit).writes_depth()):
            measured.estimated = (arch, pointer_types)
        return measured

    def too_big(self, constexprs: dict, stages: int, warps: int) -> int | None:
        """The calibrated lower bound of a candidate when it is :data:`estimate.ESTIMATE_MARGIN` above
        the limit: it certainly overflows, so it is not compiled."""
        bounds = self._envelope(constexprs, stages, warps)
        return bounds.low if bounds is not None and bounds.decides(self.limit) == estimate.OVERFLOWS else None

    def stage_bytes(self, constexprs: dict, stages: int, warps: int, required: int) -> int | None:
        """The bytes of one pipeline stage, when ``required`` is exactly what ``stages`` stages of
        the tiles need (every stage buffered, or one in registers): a line that the stage ladder
        can follow before it has measured two counts."""
        bounds = self._envelope(constexprs, stages, warps)
        if bounds is None:
            return None
        return bounds.low if required in (stages * bounds.low, (stages - 1) * bounds.low) else None

    def _envelope(self, constexprs: dict, stages: int, warps: int):
        """The calibrated envelope of a candidate, where the failing launch showed the model holds."""
        if self.estimated is None:
            return None
        arch, pointer_types = self.estimated
        return estimate.envelope(arch, constexprs, pointer_types, stages, warps)

    def dominated(self, constexprs: dict, stages: int) -> tuple | None:
        """A measured overflow this candidate cannot need less than: every tile at least as large,
        as many stages or more, every other constexpr the same (then it needs at least as much
        shared memory: the buffers only grow with tiles and stages); any stages where they do not matter."""
        for measured, measured_stages in self.overflowing:
            if (stages < measured_stages and self.stages_matter) or measured.keys() != constexprs.keys():
                continue
            if all((value >= measured[name]) if _is_tile(name, value) and _is_tile(name, measured[name])
                   else value == measured[name] for name, value in constexprs.items()):
                return measured, measured_stages
        return None


def _option_attempts(launch: Launch, failing, error, measured: _Measured, budget: int):
    """Fewer stages (fewer warps for "threads"), most conservative first: same grid, same tiles.

    Yields (option, value, kernel, attempt) for each compile. Stage counts are not all compiled:
    the bytes two measured counts differ by give the bytes of one stage, and the ladder goes
    straight to the largest count that this predicts to fit, then checks it by compiling. When
    fewer stages did not lower the bytes at all, the ladder stops: no smaller count will fit.
    """
    if error.name == "threads":
        for warps in itertools.islice(fewer_warps(failing.metadata.num_warps), max(budget, 0)):
            yield ("num_warps", warps, *try_compile(launch, f"num_warps={warps}", num_warps=warps))
        return
    # A pipeline-depth parameter deeper than the option is the depth its loops run at (it is lowered with the option).
    last_stages = max(failing.metadata.num_stages, parameters.knobs_of(launch.jit).depth(launch.named_args()))
    last_bytes = error.required
    counts = "1" if last_stages == 2 else f"1 to {last_stages - 1}"
    if not measured.stages_matter and last_stages > 1:
        measured.skipped.append(f"num_stages={counts}: {measured.stages_inert}")
        return
    bound = measured.too_big(_constexprs(launch), 1, failing.metadata.num_warps)
    if bound is not None and last_stages > 1:
        measured.skipped.append(f"num_stages={counts}: at least {bound} B, "
                                "one stage of its tiles (calibrated estimate)")
        return
    first = last_stages - 1
    per_stage = measured.stage_bytes(_constexprs(launch), last_stages, failing.metadata.num_warps, last_bytes)
    if per_stage and first >= 1:
        first = max(1, min(first, last_stages - math.ceil((last_bytes - measured.limit) / per_stage)))
    search = FewerStages(last_stages, last_bytes, measured.limit, first=first)
    for stages in search:
        if budget <= 0:
            return
        budget -= 1
        kernel, attempt = try_compile(launch, f"num_stages={stages}", num_stages=stages)
        yield "num_stages", stages, kernel, attempt
        if attempt.fits:
            return
        if attempt.required is not None:
            measured.overflowing.append((_constexprs(launch), stages))
        search.measured(stages, attempt.required)
    if search.inert:
        (before, before_bytes), (after, after_bytes) = search.inert
        measured.stages_inert = (f"fewer stages did not lower the shared memory ({before_bytes} B at "
                                 f"{before} stages, {after_bytes} B at {after})")
        fixed = parameters.knobs_of(launch.jit).fixed_text()
        if fixed:
            measured.stages_inert += f"; loops that set their own num_stages: {fixed}"


def _launch_as_config(launch: Launch, failing):
    """The failing launch of a plain JIT function, as a config (its constexprs and options)."""
    import triton

    return triton.Config(_constexprs(launch), num_warps=failing.metadata.num_warps,
                         num_stages=failing.metadata.num_stages)


def _constexprs(launch: Launch) -> dict:
    named = launch.named_args()
    return {name: named.get(name) for name in sorted(launch.constexpr_names())}


#: The element type of a pointer (``*fp16``) or of a TMA descriptor (``tensordesc<fp16[64, 64]>``) argument.
_OPERAND_TYPE = re.compile(r"^(?:\*|tensordesc<)(\w+)")


def _stage_elements(config) -> int | None:
    """BLOCK_M*BLOCK_K + BLOCK_K*BLOCK_N: the elements one pipeline stage of a matmul-like config holds."""
    tiles = estimate.matmul_tiles(config.kwargs)
    return tiles[0] * tiles[2] + tiles[2] * tiles[1] if tiles is not None else None


def _order(configs: list, reference, limit: int) -> list:
    """Candidates most likely to fit first, and among those the biggest (the fastest, usually).

    The bytes of a matmul-like config are predicted in proportion to the failing launch's
    measured bytes (``reference``: (config, bytes)), by stages times the elements of one stage.
    Only an order: whether a candidate fits is still decided by compiling it. Those predicted
    to overflow come smallest first, so that one measured overflow rules out (see
    :meth:`_Measured.dominated`) everything at least as big. Configs the prediction cannot read
    keep the order by tile size, largest first, after them.
    """
    reference_config, reference_bytes = reference
    units = _stage_elements(reference_config)

    def predicted(config) -> float | None:
        elements = _stage_elements(config)
        if units is None or elements is None:
            return None
        return reference_bytes * (elements * config.num_stages) / (units * max(reference_config.num_stages, 1))

    def rank(config):
        bytes_ = predicted(config)
        if bytes_ is None:
            return (2, -_tile_size(config), -config.num_stages, -config.num_warps)
        return (0, -bytes_) if bytes_ <= limit else (1, bytes_)

    return sorted(configs, key=rank)


def _candidate_configs(launch: Launch, reference, measured: _Measured):
    """(candidate, the allowed config it derives from): the other allowed configs as they are
    first, then with fewer stages (where stages change the bytes).

    Order: timed fastest by the tuner for this key first, then untimed ones most likely to fit
    first (:func:`_order`); configs that already failed while tuning this key are only retried
    with fewer stages. A tuner whose pruner keeps a single config is noted in ``measured.skipped``:
    only that config's fewer stages remain.
    """
    limit, stages_matter = measured.limit, measured.stages_matter
    timings = measured.timings
    allowed = allowed_configs(launch)
    if launch.tuner is not None and len(allowed) == 1 < len(launch.tuner.configs):
        measured.pinned = (f"the tuner's pruner {introspect.callable_name(launch.tuner.early_config_prune)} pins "
                           f"{introspect.config_text(allowed[0])}")
        measured.skipped.append(f"the other {len(launch.tuner.configs) - 1} configs: {measured.pinned}")
    others = [c for c in allowed if launch.config is None or c != launch.config]
    timed = sorted((c for c in others if math.isfinite(timings.get(c, math.inf))), key=timings.get)
    untimed = _order([c for c in others if c not in timings], reference, limit)
    failed = [c for c in others if math.isinf(timings.get(c, 0.0))]
    for config in (*timed, *untimed):
        yield config, config
    if not takes_variants(launch) or not stages_matter:
        return
    variants = [(option_variant(launch, config, num_stages=stages), config) for config in (*timed, *untimed, *failed)
                for stages in range(_stage_count(launch, config) - 1, 0, -1)]
    order = {id(candidate): index for index, candidate in enumerate(_order([v for v, _ in variants], reference, limit))}
    yield from sorted(variants, key=lambda pair: order[id(pair[0])])


def takes_variants(launch: Launch) -> bool:
    """Whether a config outside the tuner's own list can be adopted (see :class:`smemguard.kernels.tuners.Tuner`)."""
    return launch.tuner_kind is None or launch.tuner_kind.takes_variants


def option_variant(launch: Launch, config, **options):
    """:func:`variant`, with the parameters that follow ``options`` lowered as :meth:`Launch.compile` does."""
    changed = variant(config, **options)
    try:
        following = parameters.knobs_of(launch.jit).lowered_with(options, config.kwargs)
    except parameters.OptionIsAParameter:  # compiling it says so
        following = {}
    if following:
        changed.kwargs = {**config.kwargs, **following}
    return changed


def _stage_count(launch: Launch, config) -> int:
    """The deepest pipeline ``config`` asks for: its option, or a pipeline-depth parameter it sets deeper."""
    return max(config.num_stages or 0, parameters.knobs_of(launch.jit).depth(config.kwargs))


def allowed_configs(launch: Launch) -> list:
    """The configs this launch may switch to.

    For a tuner: its configs that its own ``early_config_prune`` keeps (a pruner may encode
    constraints of the kernel, such as a split that must divide K). For a plain JIT function:
    the alternatives registered for it that its grid follows (:meth:`Launch.alternatives`: a tuple
    grid, or a function that ignores the meta-parameters, was computed from the tiles it launched).
    """
    tuner = launch.tuner
    if tuner is None:
        return launch.alternatives()
    if len(tuner.configs) < 2:
        return []
    prune = getattr(tuner, "early_config_prune", None)
    if prune is None:
        return list(tuner.configs)
    named = dict(zip(tuner.arg_names, launch.args))
    return list(prune(tuner.configs, named, **launch.tuner_kwargs, grid=launch.grid, warmup=False))


def decide(launch: Launch, failing, error, timings: dict | None = None) -> Decision:
    """Try the candidates for ``launch`` (whose compiled kernel ``failing`` raised ``error``); ``timings``: what its
    tuner measured for this key ({config: median ms}), the fastest of them tried first."""
    attempts = [Attempt(describe(launch, failing), error.required, error.limit, False)]
    budget = MAX_CANDIDATES
    fitting: list[Decision] = []  # candidates that fit, most preferred first
    measured = _Measured.of(launch, failing, error, timings or {})

    for option, value, kernel, attempt in _option_attempts(launch, failing, error, measured, budget):
        budget -= 1
        measured.compile_ms += attempt.compile_ms or 0.0
        attempts.append(attempt)
        if attempt.fits:
            action = WARPS_REDUCED if option == "num_warps" else STAGES_REDUCED
            fitting.append(Decision(action, (), final=attempt.config, replacement=kernel, options={option: value}))

    racing = _can_race(launch)
    wanted = RACE if racing else 1
    fitted_bases: list = []  # a config that fits needs no fewer-stage variant
    reference = (launch.config if launch.config is not None else _launch_as_config(launch, failing), error.required)
    candidates = (list(_candidate_configs(launch, reference, measured))
                  if len(fitting) < wanted else [])
    raced_batches = 0  # batches compiled only to find more candidates to race, once one fits
    while budget > 0 and len(fitting) < wanted and raced_batches < RACE_BATCHES:
        # As many as are still wanted, compiled together: the ones predicted to fit usually do.
        batch = _next_batch(launch, candidates, fitted_bases, measured, min(wanted - len(fitting), budget))
        if not batch:
            break
        raced_batches += bool(fitting)
        budget -= len(batch)
        compiled = _try_configs([(config, candidate) for config, _, candidate in batch], attempts, measured)
        for (config, base, _), attempt in zip(batch, compiled):
            # The order only predicts: a variant that fits may leave a stage to spare. Climb while its own
            # bytes per stage say the next count of the same config may fit too (more stages: usually faster).
            while (attempt.fits and config is not base and config.num_stages + 1 < _stage_count(launch, base)
                   and budget > 0 and _may_take_a_stage_more(attempt, config.num_stages)):
                budget -= 1
                more = option_variant(launch, base, num_stages=config.num_stages + 1)
                if not _try_configs([(more, with_config(launch, more))], attempts, measured)[0].fits:
                    break
                config, attempt = more, attempts[-1]
            if attempt.fits:
                fitted_bases.append(base)
                fitting.append(Decision(CONFIG_CHANGED, (), config=config, final=attempt.config))

    skipped, compile_ms = tuple(measured.skipped), round(measured.compile_ms, 3)
    if fitting:
        chosen, timings = _fastest(launch, fitting) if racing and len(fitting) > 1 else (fitting[0], None)
        if chosen.action == CONFIG_CHANGED:
            adopt(launch, chosen.config)
        return dataclasses.replace(chosen, attempts=tuple(attempts), timings=timings, skipped=skipped,
                                   compile_ms=compile_ms)

    fallback = registry.fallback_for(launch.jit)
    if fallback is not None:
        return Decision(FALLBACK, tuple(attempts), fallback=fallback,
                        final=f"fallback {introspect.callable_name(fallback)}", skipped=skipped, compile_ms=compile_ms)
    reason = "; ".join(filter(None, (measured.stages_inert, measured.pinned,
                                     reasons.why_nothing_fits(launch, budget, attempts))))
    return Decision(RERAISED, tuple(attempts), reason=reason, skipped=skipped, compile_ms=compile_ms)


def _next_batch(launch: Launch, candidates: list, fitted_bases: list, measured: _Measured, size: int) -> list:
    """Take from ``candidates`` the next ``size`` (config, base, launch with that config) worth compiling:
    not a variant of a config that fits, nor of one already in the batch (it may fit yet), not at least
    as big as a measured overflow, not certainly too big by the calibrated estimate."""
    batch: list = []
    index = 0
    while index < len(candidates) and len(batch) < size:
        config, base = candidates[index]
        if any(base is chosen for _, chosen, _ in batch):
            index += 1
            continue
        del candidates[index]
        if any(base is fitted for fitted in fitted_bases):
            continue
        candidate = with_config(launch, config)
        constexprs = _constexprs(candidate)
        if measured.dominated(constexprs, config.num_stages) is not None:
            measured.skipped.append(f"{introspect.config_text(config)}: at least as big as a config measured too big")
        elif (bound := measured.too_big(constexprs, config.num_stages, config.num_warps)) is not None:
            measured.skipped.append(f"{introspect.config_text(config)}: at least {bound} B, one stage of its tiles "
                                    "(calibrated estimate)")
        else:
            batch.append((config, base, candidate))
    return batch


def _may_take_a_stage_more(attempt: Attempt, stages: int) -> bool:
    """Whether ``stages + 1`` of a config measured at ``attempt`` may still fit. The steepest growth
    seen is (S-1) buffered stages (one stage in registers, sm_80/89): S/(S-1) times the bytes; from
    one stage nothing is known (with one stage in registers, two need no more)."""
    return stages == 1 or attempt.required * stages <= attempt.limit * (stages - 1)


def _try_configs(candidates: list, attempts: list, measured: _Measured) -> list[Attempt]:
    """Compile each (tuner config or alternative, the launch with it) of ``candidates``, concurrently
    where Triton allows it; note what each showed."""
    started = time.perf_counter()
    compiled = try_compile_all([(candidate, introspect.config_text(config)) for config, candidate in candidates])
    measured.compile_ms += (time.perf_counter() - started) * 1000
    for (config, candidate), (_, attempt) in zip(candidates, compiled):
        attempts.append(attempt)
        if not attempt.fits and attempt.required is not None:
            measured.overflowing.append((_constexprs(candidate), config.num_stages))
    return [attempt for _, attempt in compiled]


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
            config = (decision.config if decision.config is not None
                      else option_variant(launch, launch.config, **decision.options))
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

