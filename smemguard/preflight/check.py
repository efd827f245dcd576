"""The check: which compiles to run (the scheduler that trusts the estimate or not) and their verdicts against each
GPU's limit, gathered in the report (:mod:`.report`)."""

from __future__ import annotations

import concurrent.futures
import math
import os
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from ..facts import gpus
from ..facts.process import triton_version
from ..kernels import introspect
from ..kernels.estimate import Estimate, estimate, stages_change_bytes
from ..kernels.parameters import PIPELINE_DEPTH, knobs_of
from .cache import ResultCache
from .compiling import Compiler, CompileRequest, PlanError, build_request, cache_key, hip_compile_problem
from .report import Report, Verdict
from .model import (
    BY_ORDER,
    CACHED,
    ERROR,
    ESTIMATED,
    FITS,
    MEASURED,
    NOT_CHECKED,
    OVERFLOWS,
    CheckedKernel,
    Specialization,
    Variant,
)

#: How many of the configs nearest the limit, per side, to consider when picking the one compiled
#: to validate the estimate (the cheapest of them: big tiles take up to a minute to compile).
VALIDATION_CANDIDATES = 4


def _compile_cost(variant: Variant) -> float:
    """Relative compile time: accumulator elements per warp drive LLVM's time (256x256 tiles on 4
    warps take a minute where 64x64 take a second)."""
    blocks = [value for _, value in variant.constexprs if isinstance(value, int) and value > 1]
    return math.prod(blocks) / max(variant.num_warps, 1) if blocks else 1.0


@dataclass
class Item:
    """One compile: kernel x config x specialization x arch, and what is known about it."""

    kernel: CheckedKernel
    variant: Variant
    spec: Specialization
    arch: int | str  # Triton's target arch: 89, "gfx942"
    request: CompileRequest | None = None
    problem: str | None = None  # could not even be set up
    interval: Estimate | None = None
    result: dict | None = None  # {"shared", "error", "seconds"}
    how: str | None = None  # MEASURED or CACHED once result is set
    submitted: bool = False
    retried: bool = False
    # The compiled config differing from this one only in num_stages, where stages change nothing
    # (:func:`.estimate.stages_change_bytes`): its bytes are this config's, without a compile.
    sibling: Item | None = None

    def agrees(self) -> bool:
        shared = self.result and self.result["shared"]
        return shared is not None and self.interval is not None and self.interval.holds(shared)


def _without_stages(item: Item) -> Variant:
    """``item``'s config with its stage count and pipeline-depth parameters (smemguard.kernels.parameters) left out."""
    depths = set(knobs_of(item.kernel.jit).with_role(PIPELINE_DEPTH))
    return replace(item.variant, num_stages=0,
                   constexprs=tuple((name, 0 if name in depths else value) for name, value in item.variant.constexprs))


@dataclass(frozen=True)
class Progress:
    done: int
    planned: int
    item: Item
    elapsed: float


class _Group:
    """The items of one kernel, specialization and arch: the estimate is trusted or not per group."""

    def __init__(self, items: list[Item], limits: list[int]) -> None:
        self.items = items
        self.limits = limits
        self.trusted = True
        self.tried: set[int] = set()
        # Configs that differ only in num_stages, where stages change nothing: once two of one family
        # (the cheapest, at its fewest and most stages) have compiled to the same bytes, each family
        # needs one compile. Any two of a family that differ end the sharing: everything compiles.
        # Stages change nothing before sm_80, nor in a kernel none of whose loops follows them (kernels.parameters).
        families: dict[Variant, list[Item]] = {}
        for item in items:
            if item.request is not None and item.problem is None and (
                    not stages_change_bytes(item.arch, item.interval) or knobs_of(item.kernel.jit).stages_futile()):
                families.setdefault(_without_stages(item), []).append(item)
        self.families = {key: members for key, members in families.items() if len(members) > 1}
        self.stages_inert: bool | None = None if self.families else False
        self.proof: list[Item] = []

    def undecided(self) -> list[Item]:
        """Items neither measured, nor sharing a measured sibling's bytes, nor decided by the estimate at
        every limit: after planning settles, they are compiled."""
        self._share_stages()
        return [item for item in self.unknown() if not item.submitted and (
            item.interval is None or any(item.interval.decides(limit) is None for limit in self.limits))]

    def unknown(self) -> list[Item]:
        return [item for item in self.items if item.result is None and item.problem is None and item.sibling is None]

    def to_compile(self) -> list[Item]:
        """Items to compile now: ambiguous ones, validation samples, or all when the model failed; one
        per family of stage variants where stages change nothing."""
        self._share_stages()
        return self._one_per_family(self._wanted())

    def _share_stages(self) -> None:
        measured = {key: {item.result["shared"] for item in members if item.result is not None}
                    for key, members in self.families.items()}
        if any(len(values) > 1 for values in measured.values()) or (
                self.proof and all(item.result is not None for item in self.proof)
                and None in {item.result["shared"] for item in self.proof}):
            self.stages_inert = False
            for item in self.items:
                item.sibling = None
            return
        if self.stages_inert is None and self.proof and all(item.result is not None for item in self.proof):
            self.stages_inert = True
        if not self.stages_inert:
            return
        for members in self.families.values():
            source = next((item for item in members if item.result is not None and item.result["shared"] is not None),
                          None)
            for item in members:
                if source is not None and item.result is None and not item.submitted:
                    item.sibling = source

    def _one_per_family(self, wanted: list[Item]) -> list[Item]:
        """``wanted`` less the stage variants whose family has a compile under way or done (they wait
        for its bytes), plus the two compiles that show whether stages change the bytes here."""
        if self.stages_inert is False:
            return wanted
        family_of = {id(item): key for key, members in self.families.items() for item in members}
        if self.stages_inert is None and not self.proof and any(id(item) in family_of for item in wanted):
            cheapest = min(self.families.values(), key=lambda members: _compile_cost(members[0].variant))
            by_stages = sorted(cheapest, key=lambda item: item.variant.num_stages)
            self.proof = [by_stages[0], by_stages[-1]]
        chosen, started = [item for item in self.proof if not item.submitted and item.result is None], set()
        for item in sorted(wanted, key=lambda item: item.variant.num_stages):
            key = family_of.get(id(item))
            if key is not None:
                if key in started or any(_bytes_coming(other) for other in self.families[key] if other is not item):
                    continue
                started.add(key)
            chosen.append(item)
        return list({id(item): item for item in chosen}.values())

    def _wanted(self) -> list[Item]:
        """Ambiguous items and validation samples, or all unknown ones when the model failed."""
        if any(item.result is not None and item.result["shared"] is not None and item.interval is not None
               and not item.agrees() for item in self.items):
            self.trusted = False
        unknown = [item for item in self.unknown() if not item.submitted]
        if not self.trusted:
            return unknown
        chosen = [item for item in unknown
                  if item.interval is None or any(item.interval.decides(limit) is None for limit in self.limits)]
        for limit in self.limits:
            for side in (FITS, OVERFLOWS):
                on_side = [item for item in self.items if item.interval is not None
                           and item.interval.decides(limit) == side]
                for regime in dict.fromkeys(item.interval.regime for item in on_side):
                    chosen += self._sample([item for item in on_side if item.interval.regime == regime], limit)
                    if not self.trusted:  # _sample changes no item: the unknown ones are as above
                        return unknown
        return list({id(item): item for item in chosen}.values())

    def _sample(self, on_side: list[Item], limit: int) -> list[Item]:
        """The cheapest of the configs nearest ``limit`` among ``on_side`` (one side of the limit, one
        code path), unless one of them already agrees with the model or is being compiled to find out."""
        if any(item.agrees() or (id(item) in self.tried and item.result is None) for item in on_side):
            return []
        untried = [item for item in sorted(on_side, key=lambda item: item.interval.distance(limit))
                   if id(item) not in self.tried][:VALIDATION_CANDIDATES]
        if not untried:
            return []
        if sum(id(item) in self.tried for item in on_side) >= VALIDATION_CANDIDATES:
            self.trusted = False  # the configs near the limit do not compile: no evidence for the model
            return []
        sample = min(untried, key=lambda item: _compile_cost(item.variant))
        self.tried.add(id(sample))
        return [sample]


def _bytes_coming(item: Item) -> bool:
    """Whether ``item`` has measured bytes or is being compiled."""
    return item.result["shared"] is not None if item.result is not None else item.submitted




def check(kernels: list[CheckedKernel], gpu_list: Sequence[gpus.Gpu], *, exact: bool = False, jobs: int | None = None,
          cache: ResultCache | None = None, progress: Callable[[Progress], None] | None = None,
          import_timeout: float | None = None) -> Report:
    """Verdicts for every kernel x config x specialization x GPU (see :mod:`smemguard.preflight`). Each compiler
    process imports the kernels' modules again, each import within ``import_timeout`` seconds (None: unbounded);
    raises :class:`TargetError` when one fails there."""
    started = time.perf_counter()
    cache = cache or ResultCache(None)
    jobs = max(1, jobs or os.cpu_count() or 1)
    amd_problem = hip_compile_problem() if any(gpu.backend == "hip" for gpu in gpu_list) else None
    problems = {gpu.name: gpus.compile_problem(gpu.arch, triton_version()) or (amd_problem if gpu.backend == "hip"
                                                                                else None) for gpu in gpu_list}
    unchecked = {name: problem for name, problem in problems.items() if problem}
    groups, items = _plan(kernels, _limits_by_arch(gpu_list, unchecked), cache, exact)
    cache_hits = sum(item.how == CACHED for item in items.values())
    compiler = Compiler(jobs, import_timeout)
    try:
        compiles = _compile_until_decided(groups, compiler, cache, exact, progress, started)
    finally:
        compiler.close()
    return Report(list(kernels), list(gpu_list), _verdicts(kernels, gpu_list, items, unchecked), compiles, cache_hits,
                  time.perf_counter() - started, exact, unchecked)


def _limits_by_arch(gpu_list: Sequence[gpus.Gpu], unchecked: dict[str, str]) -> dict[int | str, list[int]]:
    """The distinct shared-memory limits of the checked GPUs, per Triton target arch: one compile per
    arch serves every GPU of it."""
    limits: dict[int | str, list[int]] = {}
    for gpu in gpu_list:
        if gpu.name not in unchecked:
            limits[gpu.target_arch] = sorted({*limits.get(gpu.target_arch, ()), gpu.max_shared})
    return limits


def _plan(kernels: list[CheckedKernel], limits: dict[int | str, list[int]], cache: ResultCache,
          exact: bool) -> tuple[list[_Group], dict[tuple[int, int, str, int | str], Item]]:
    """Every compile's item, keyed by (kernel, variant, specialization name, arch), and their groups."""
    groups: list[_Group] = []
    items: dict[tuple[int, int, str, int | str], Item] = {}
    for k, kernel in enumerate(kernels):
        for spec in kernel.specializations:
            for arch, arch_limits in limits.items():
                group_items = []
                for v, variant in enumerate(kernel.variants):
                    item = _planned_item(kernel, variant, spec, arch, cache, exact)
                    items[(k, v, spec.name, arch)] = item
                    group_items.append(item)
                groups.append(_Group(group_items, arch_limits))
    return groups, items


def _planned_item(kernel: CheckedKernel, variant: Variant, spec: Specialization, arch: int | str,
                  cache: ResultCache, exact: bool) -> Item:
    """The item with its compile request, its cached result if any, and its estimate where one is sound."""
    item = Item(kernel, variant, spec, arch)
    try:
        item.request = build_request(kernel, variant, spec, arch)
        item.request.key = cache_key(kernel.jit, item.request)
    except PlanError as error:
        item.problem = str(error)
    except Exception as error:  # the compiler's front end rejected the signature
        item.problem = introspect.error_summary(error)
    if item.request is not None and item.problem is None:
        item.result = cache.get(item.request.key)
        if item.result is not None:
            item.how = CACHED
        # The calibration launches had unit inner strides, as *x.stride() passes them for
        # contiguous tensors; other strides change what can be pipelined. Nor is the stage
        # count the option's where the kernel writes its loops' depth itself.
        if not exact and spec.unit_guess in (None, BY_ORDER) \
                and not knobs_of(kernel.jit).writes_depth():
            item.interval = estimate(item.request, spec)
    return item


def _compile_until_decided(groups: list[_Group], compiler: Compiler, cache: ResultCache, exact: bool,
                           progress: Callable[[Progress], None] | None, started: float) -> int:
    """Compiles what the groups ask for, batch after batch as results change their plans, until
    nothing is left to compile; returns how many compiles finished."""
    compiles = 0
    in_flight: dict[concurrent.futures.Future, Item] = {}
    planned = 0
    while True:
        batch = [item for group in groups for item in (group.unknown() if exact else group.to_compile())
                 if not item.submitted]
        if not batch and not in_flight:
            # Planning found nothing to compile, yet may have left items to the bytes of a stage
            # variant already known (a warm cache): those it now shares; what no rule decides compiles.
            batch = [item for group in groups for item in group.undecided()]
        # Longest first: the pool finishes together instead of waiting on one late big tile.
        for item in sorted(batch, key=lambda item: -_compile_cost(item.variant)):
            item.submitted = True
            planned += 1
            in_flight[compiler.submit(item.kernel.jit, item.request)] = item
        if not in_flight:
            return compiles
        finished, _ = concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in finished:
            item = in_flight.pop(future)
            if not _take_result(item, future, compiler, cache, in_flight):
                continue
            compiles += 1
            if progress is not None:
                progress(Progress(compiles, planned, item, time.perf_counter() - started))


def _take_result(item: Item, future: concurrent.futures.Future, compiler: Compiler, cache: ResultCache,
                 in_flight: dict[concurrent.futures.Future, Item]) -> bool:
    """Sets ``item``'s measured result from its finished compile and caches it; False when the compile
    was resubmitted instead (into ``in_flight``)."""
    try:
        item.result = future.result()
    except BrokenProcessPool as error:  # a compiler process died (crash, out of memory)
        if not item.retried:  # maybe a neighbour's compile took it down: once more, in a fresh pool
            item.retried = True
            in_flight[compiler.submit(item.kernel.jit, item.request)] = item
            return False
        item.result = {"shared": None,
                       "error": f"compiler process failed: {introspect.error_summary(error)}",
                       "seconds": 0.0}
    else:
        cache.put(item.request.key, {**item.result, "kernel": item.kernel.jit_name,
                                     "config": item.variant.label(), "specialization": item.spec.name,
                                     "arch": item.arch})
    item.how = MEASURED
    return True


def _verdicts(kernels: list[CheckedKernel], gpu_list: Sequence[gpus.Gpu],
              items: dict[tuple[int, int, str, int | str], Item],
              unchecked: dict[str, str]) -> dict[tuple[int, int, str, str], Verdict]:
    verdicts = {}
    for k, kernel in enumerate(kernels):
        for v in range(len(kernel.variants)):
            for spec in kernel.specializations:
                for gpu in gpu_list:
                    if gpu.name in unchecked:
                        verdict = Verdict(NOT_CHECKED, error=unchecked[gpu.name])
                    else:
                        verdict = _verdict(items[(k, v, spec.name, gpu.target_arch)], gpu.max_shared)
                    verdicts[(k, v, spec.name, gpu.name)] = verdict
    return verdicts


def _verdict(item: Item, limit: int) -> Verdict:
    if item.problem is not None:
        return Verdict(ERROR, error=item.problem)
    if item.result is None and item.sibling is not None:
        shared = item.sibling.result["shared"]
        return Verdict(FITS if shared <= limit else OVERFLOWS, ESTIMATED, low=shared, high=shared)
    if item.result is not None:
        shared = item.result["shared"]
        if shared is None:
            return Verdict(ERROR, item.how, error=item.result["error"])
        return Verdict(FITS if shared <= limit else OVERFLOWS, item.how, shared)
    assert item.interval is not None, "an item without a result was decided by the estimate"
    decided = item.interval.decides(limit)
    assert decided is not None
    return Verdict(decided, ESTIMATED, low=item.interval.low, high=item.interval.high)
