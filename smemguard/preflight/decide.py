"""Decisions from the check (``smemguard check --decisions FILE``): for every config the check found
overflowing a GPU, the decision recovery would take there, in the file ``smemguard cache import`` reads.

Nothing here decides anything itself. Each overflowing (kernel, config, specialization, GPU) is
launched as the check compiled it, on a stand-in of that GPU (:func:`smemguard.testing.fake_gpu`):
arguments whose alignment, sizes divisible by 16 and arguments equal to 1 are the specialization's,
the config in force through the kernel's own autotuner (or passed to a plain JIT function). Triton
compiles it for the GPU's arch and its own check rejects it; recovery's ladder
(:func:`smemguard.engine.ladder.decide`) compiles candidates as at run time, and the decision is keyed as
recovery keys it (:func:`smemguard.kernels.variants.cases_for`: by what was compiled, not by how the launch
spelled it). A host that imports the file compiles a fewer-stage (or fewer-warp) variant directly,
and switches a tuner from the config to the stored one at its first launch without compiling the config
or trying others.

Written: fewer stages or warps, and another config of the kernel's list (for any tuning key whose
config in force is this one; recall checks that the launch allows it). Not written: the fallback and
"nothing fits", which hold for one tuning key (the report names the kernels with no fitting config).
The stand-in times every candidate alike: where recovery would race fitting candidates with the
tuner's benchmark, the file holds the one it prefers untimed (the first that fits).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..engine import ladder, recall
from ..facts import gpus
from ..kernels import introspect, tuners, variants
from ..kernels.launch import overflow, resolve
from ..store import decision_cache
from ..store.decision import CONFIG_CHANGED, FALLBACK, OPTION_ONLY
from .report import Report
from .compiling import HEURISTIC_SIZE, build_request, torch_dtype
from .model import INT_TYPES, OVERFLOWS, CheckedKernel, Specialization, Variant

#: Integers Triton types i64 (at least 2**31) as a launch passes them, divisible by 16 or not.
_I64 = {True: 2**32, False: 2**32 + 1}


class NotDecided(Exception):
    """Why one overflowing config gets no entry (said in the notes)."""


@dataclass
class Decisions:
    """The decision file for a report, and one line per overflow it holds no entry for."""

    data: dict = field(default_factory=decision_cache.empty)
    notes: list[str] = field(default_factory=list)
    decided: int = 0  # overflowing (kernel, config, specialization, GPU) with an entry (shared ones counted each)

    @property
    def entries(self) -> int:
        return sum(len(self.data[table]) for table in decision_cache.KINDS)


@dataclass
class Decided:
    """Progress of :func:`decide`: one overflowing config decided (or not) on one GPU."""

    done: int
    planned: int
    gpu: str
    kernel: str
    config: str
    spec: str
    outcome: str  # the decision's final config, or why there is none
    seconds: float
    elapsed: float


def decide(report: Report, triton_cache: Path | None = None,
           progress: Callable[[Decided], None] | None = None) -> Decisions:
    """The decisions for every overflow ``report`` found, one stand-in GPU at a time. GPUs of one arch
    and limit share their entries (the keys are the same); ``triton_cache`` keeps the stand-in's
    compiles for the next run (a fresh temporary directory when None); ``progress`` hears of each."""
    found = Decisions()
    plans, done = [], set()
    for gpu in report.checked_gpus():
        if (gpu.target_arch, gpu.max_shared) in done:
            continue
        done.add((gpu.target_arch, gpu.max_shared))
        overflowing = [(k, v, spec) for k, kernel in enumerate(report.kernels) for v in range(len(kernel.variants))
                       for spec in kernel.specializations
                       if report.verdict(k, v, spec.name, gpu.name).verdict == OVERFLOWS]
        if overflowing:
            plans.append((gpu, overflowing))
    counter = _Counter(sum(len(overflowing) for _, overflowing in plans), progress)
    for gpu, overflowing in plans:
        try:
            _decide_on(gpu, overflowing, report, found, triton_cache, counter)
        except Exception as error:  # the stand-in GPU itself could not be set up
            found.notes.append(f"the {len(overflowing)} overflowing configs on {gpu.name}: not decided "
                               f"({introspect.error_summary(error)})")
    return found


@dataclass
class _Counter:
    planned: int
    progress: Callable[[Decided], None] | None
    done: int = 0
    started: float = field(default_factory=time.perf_counter)

    def tell(self, gpu: gpus.Gpu, kernel: CheckedKernel, variant: Variant, spec: Specialization, outcome: str,
             since: float) -> None:
        self.done += 1
        if self.progress is not None:
            now = time.perf_counter()
            self.progress(Decided(self.done, self.planned, gpu.name, kernel.name, variant.label(), spec.name, outcome,
                                  now - since, now - self.started))


def _decide_on(gpu: gpus.Gpu, overflowing: list, report: Report, found: Decisions, triton_cache: Path | None,
               counter: _Counter) -> None:
    from ..testing import fake_gpu

    with fake_gpu(gpu.name, cache_dir=str(triton_cache) if triton_cache else None):
        for k, v, spec in overflowing:
            kernel, variant = report.kernels[k], report.kernels[k].variants[v]
            since = time.perf_counter()
            try:
                measured = report.verdict(k, v, spec.name, gpu.name).shared
                table, key, entry = _decide_one(kernel, variant, spec, gpu, measured)
            except NotDecided as why:
                found.notes.append(f"{kernel.name} {variant.label()} [{spec.name}] on {gpu.name}: {why}")
                counter.tell(gpu, kernel, variant, spec, "no decision", since)
                continue
            except Exception as error:  # the stand-in launch itself failed: say so, decide the others
                found.notes.append(f"{kernel.name} {variant.label()} [{spec.name}] on {gpu.name}: not decided "
                                   f"({introspect.error_summary(error)})")
                counter.tell(gpu, kernel, variant, spec, "not decided", since)
                continue
            found.data[table].setdefault(key, entry)
            found.decided += 1
            counter.tell(gpu, kernel, variant, spec,
                         f"{entry['action']} ({introspect.changes(entry['from_config'], entry['final'])})", since)


def _decide_one(kernel: CheckedKernel, variant: Variant, spec: Specialization, gpu: gpus.Gpu, measured: int | None):
    """(table, key, entry) of the decision recovery takes for ``variant`` launched in ``spec`` on ``gpu``
    (where the check compiled it to ``measured`` bytes; None when it estimated them)."""
    args, kwargs, config = stand_in_launch(kernel, variant, spec, gpu)
    launch = resolve(kernel.launched, stand_in_grid, args, kwargs, config=config)
    if launch is None:
        raise NotDecided(f"recovery does not retry a launch through {type(kernel.launched).__qualname__}")
    failing = launch.compile()
    if measured is not None and failing.metadata.shared != measured:  # the stand-ins specialized otherwise
        raise NotDecided(f"the stand-in launch compiled {failing.metadata.shared} B where the check measured "
                         f"{measured} B; not decided (please report it)")
    error = overflow(failing)
    if error is None:
        raise NotDecided(f"fits when launched ({failing.metadata.shared} B): nothing to decide")
    with _tuner_choices_kept(launch):
        decision = ladder.decide(launch, failing, error)
    if decision.action not in (*OPTION_ONLY, CONFIG_CHANGED):
        what = "run the registered fallback" if decision.action == FALLBACK else f"re-raise ({decision.reason})"
        raise NotDecided(f"recovery would {what} here; that holds for one tuning key only, so it is not written")
    case = variants.cases_for(launch, failing)[recall.case_name(decision)]
    table, entry = recall.entry_of(decision, case, f"{gpu.name} (smemguard check)", error)
    return table, decision_cache.case_id(case), entry


def stand_in_grid(meta) -> tuple:
    """The stand-in launch's grid: one program (nothing runs on a stand-in GPU), a callable of the
    meta-parameters as a launch that lets its tiles change passes, reading them all
    (:meth:`smemguard.kernels.launch.Launch.grid_reads`: its registered alternatives may run)."""
    meta.keys()
    return (1, 1, 1)


def stand_in_launch(kernel: CheckedKernel, variant: Variant, spec: Specialization, gpu: gpus.Gpu) -> tuple:
    """(args, kwargs, config) that launch ``kernel`` as the check compiled ``variant`` in ``spec`` for ``gpu``:
    stand-in arguments of the specialization, and the config to put in force through the kernel's autotuner
    (None for a kernel launched without one: then ``kwargs`` holds the variant's constexprs and options)."""
    request = build_request(kernel, variant, spec, gpu.target_arch)
    args = tuple(_stand_in(request.signature[p.name], request.constants.get(p.name), p.name in request.divisible)
                 for p in kernel.jit.params if not p.is_constexpr)
    kwargs = dict(kernel.constants)
    config = _tuner_config(kernel, variant)
    if config is None:
        kwargs.update({**dict(variant.constexprs), **variant.options()})
    return args, kwargs, config


def _tuner_config(kernel: CheckedKernel, variant: Variant):
    """The ``triton.Config`` that puts ``variant`` in force through the kernel's autotuner (its own
    object where the list has it), or None for a kernel launched without one."""
    tuner = next((layer for layer in introspect.chain(kernel.launched) if tuners.tuner_for(layer)), None)
    if tuner is None:
        return None
    for config in tuner.configs:
        if Variant.of(config) == variant:
            return config
    import triton

    return triton.Config(dict(variant.constexprs), num_warps=variant.num_warps, num_stages=variant.num_stages,
                         num_ctas=variant.num_ctas, maxnreg=variant.maxnreg)


def _stand_in(ty: str, constant, divisible: bool):
    """An argument a launch specializes as ``ty`` (or as the constant 1), 16-divisible or not."""
    if ty == "constexpr":
        return constant
    if ty.startswith("*"):
        import torch

        tensor = torch.empty(64, dtype=torch_dtype(ty[1:]))
        return tensor if divisible else tensor[1:]  # one element on: no longer 16-byte aligned
    if ty == "i32":
        return HEURISTIC_SIZE[divisible]
    if ty == "i64":
        return _I64[divisible]
    if ty == "fp32":
        return 1.5
    if ty == "i1":
        return True
    raise NotDecided(f"no stand-in for an argument of type {ty} (a launch passes {', '.join(INT_TYPES[:2])}, fp32, "
                     "i1 and pointers)")


@contextlib.contextmanager
def _tuner_choices_kept(launch) -> Iterator[None]:
    """The ladder adopts what it chose in the tuner's cache; the check leaves the user's tuner as it was."""
    cache = getattr(launch.tuner, "cache", None)
    saved = dict(cache) if isinstance(cache, dict) else None
    try:
        yield
    finally:
        if saved is not None:
            cache.clear()
            cache.update(saved)
