"""Applying a decision the decision cache holds (:mod:`smemguard.store.decision_cache`): the one place every path reads
a stored entry and checks it against what is about to run. The launch guard's failing launch (:func:`recall`,
:func:`switch`), a compile Triton is about to run (:func:`remembered_compile`, at the JIT's compile), the compile-time
core's stage count (:func:`stored_stages`), Inductor's load (its variants, :mod:`.inductor`) and a declared wrapper's
tiles (:mod:`.wrapper_outcomes`) all look their entry up with :func:`stored_entry` and say why one does not apply
with :func:`ignored`.

An entry is untrusted input, even from a trusted directory (another version, a hand edit, a bug): the store checks
its fields when it reads the file (:mod:`smemguard.store.entry_rules`), and before it is applied it is checked here
against what recovery could have produced for this very kernel: a stage count and a warp count no larger than those
of the variant it replaces, warps a power of two within the device's thread limit (:func:`options_problem`), a config
of the kernel's own list (or a fewer-stage variant of one), tiles a halving of the wrapper's own. An entry that fails
is ignored with one warning, and the kernel is recovered as if nothing were stored.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable

from ..facts import process
from ..kernels import introspect, registry, variants
from ..kernels.launch import try_compile, with_config
from ..store import decision_cache, incidents
from ..store.decision import CONFIG_CHANGED, FALLBACK, RERAISED, SHARED, Decision
from . import candidates, ladder

log = logging.getLogger(__name__)

#: Threads per block no GPU exceeds.
MAX_THREADS = 1024


def options_problem(options: dict, stages: int, warps: int, warp_size: int) -> str | None:
    """Why stored ``options`` cannot replace a variant compiled with ``stages`` and ``warps``, or None."""
    most_warps = min(warps, MAX_THREADS // warp_size)
    if options.get("num_stages", stages) > stages:
        return f"num_stages {options['num_stages']} is more than the {stages} of the variant it replaces"
    if not decision_cache.power_of_two(options.get("num_warps", warps), most_warps):
        return f"num_warps {options['num_warps']} is not a power of two from 1 to {most_warps}"
    return None


def ignored(key: str, why: str) -> None:
    process.warn_once(log, ("ignored decision", key), "smemguard: ignoring stored decision %s (%s): recovering as if "
                      "nothing were stored", key, why)


def stored_entry(directory: Path | None, tables: tuple[str, ...], key: str | Callable[[], str]
                 ) -> tuple[str, dict] | None:
    """(table, entry) the decision cache in ``directory`` holds for ``key``, from the first of ``tables`` that has
    one; None when none does, or there is no decision cache. One stat of the file when it holds none of ``tables``
    (what a healthy compile or load pays): a ``key`` to compute (a callable) is computed only past it."""
    store = decision_cache.store(directory)
    if store is None or not any(store.holds(table) for table in tables):
        return None
    key = key() if callable(key) else key
    return next(((table, entry) for table in tables if (entry := store.get(table, key)) is not None), None)


def switch(launch, key: str, entry: dict) -> Decision | None:
    """The stored config switch applied to ``launch`` (its config compiled and checked: one compile), or None
    when it does not apply to this launch."""
    return _from_entry(launch, None, "launch", key, entry)


def _config_from_entry(launch, entry: dict):
    """The tuner config described by ``entry`` (one of its own, or a fewer-stage variant), or None."""
    for config in ladder.allowed_configs(launch):
        fields = introspect.config_fields(config)
        same_but_stages = all(entry.get(name) == value for name, value in fields.items() if name != "num_stages")
        if same_but_stages and config.num_stages >= entry["num_stages"]:
            if config.num_stages == entry["num_stages"]:
                return config
            return candidates.variant(config, num_stages=entry["num_stages"]) if ladder.takes_variants(launch) else None
    return None


def _from_entry(launch, failing, kind: str, key: str, entry: dict):
    """Apply a stored decision to this launch: one compile to confirm it fits, no other candidate."""
    if kind == "compile":
        metadata = failing.metadata
        why = options_problem(entry["options"], metadata.num_stages, metadata.num_warps,
                              getattr(metadata, "warp_size", 32))
        if why is not None:
            ignored(key, why)
            return None
        kernel, attempt = try_compile(launch, "remembered", **entry["options"])
        if attempt.fits:
            return Decision(entry["action"], (attempt,), final=attempt.config, replacement=kernel,
                            options=dict(entry["options"]), remembered=True)
        return None
    action = entry["action"]
    if action == CONFIG_CHANGED:
        config = _config_from_entry(launch, entry["config"])
        if config is None:
            ignored(key, "its config is not one of the kernel's own that this launch allows")
            return None
        _, attempt = try_compile(with_config(launch, config), introspect.config_text(config))
        if attempt.fits:
            ladder.adopt(launch, config)
            return Decision(CONFIG_CHANGED, (attempt,), config=config, final=attempt.config, remembered=True)
        return None
    fallback = registry.fallback_for(launch.jit)
    if action == FALLBACK and fallback is not None and introspect.callable_name(fallback) == entry["fallback"]:
        return Decision(FALLBACK, (), fallback=fallback, final=f"fallback {entry['fallback']}", remembered=True)
    if action == RERAISED and fallback is None and not launch.alternatives():  # what the note said to register
        return Decision(RERAISED, (), reason=entry["reason"], remembered=True)  # yields, as a stored fallback does
    return None


def recall(launch, failing, cases: dict, store: decision_cache.Store):
    """The decision stored for one of ``cases`` (:func:`decisions.cases_for`), applied to ``launch``; None
    when there is none that applies."""
    for name, case in cases.items():
        table, key = TABLES[name], decision_cache.case_id(case)
        entry = store.get(table, key)
        if entry is not None:
            decision = _from_entry(launch, failing, table, key, entry)
            if decision is not None:
                return decision
    return None


def remember(launch, failing, error, decision, cases: dict, store: decision_cache.Store):
    """Store ``decision`` about ``error``; if another process stored this case first, apply theirs instead."""
    case = cases[case_name(decision)]
    table, entry = entry_of(decision, case, variants.gpu_label(process.current_device()), error)
    key = decision_cache.case_id(case)
    standing = store.put(table, key, entry)
    if standing is entry:
        return decision
    theirs = _from_entry(launch, failing, table, key, standing)
    return theirs if theirs is not None else decision


#: The table each case of :func:`smemguard.kernels.variants.cases_for` is stored in.
TABLES = {"compile": "compile", "config": "launch", "launch": "launch"}


def case_name(decision) -> str:
    """Which case of :func:`smemguard.kernels.variants.cases_for` stores ``decision``."""
    if decision.options is not None:
        return "compile"
    return "config" if decision.action == CONFIG_CHANGED else "launch"


def entry_of(decision, case: dict, gpu: str, error) -> tuple[str, dict]:
    """(the table, the entry) that stores ``decision`` for ``case``, decided on ``gpu``
    (:func:`smemguard.kernels.variants.gpu_label`) about ``error``."""
    own: dict = {}
    if decision.options is not None:
        own["options"] = decision.options
    else:
        if decision.config is not None:
            own["config"] = introspect.config_fields(decision.config)
        if decision.fallback is not None:
            own["fallback"] = introspect.callable_name(decision.fallback)
        own["reason"] = decision.reason
    return TABLES[case_name(decision)], decision_cache.new_entry(
        case, action=decision.action, final=decision.final, from_config=decision.attempts[0].config, gpu=gpu,
        resource=error.name, required=error.required, **own)


# -- a compile Triton is about to run


def remembered_compile(jit, source, device: int, options, directory: Path | None, *, launching: bool) -> dict | None:
    """What the decision cache says of the variant Triton is about to compile from ``source`` (its
    ``ASTSource``) with ``options`` (Triton's parsed options; compile-time patch).

    Option overrides to compile instead (fewer stages or warps), None when nothing applies: inside the autotuner's
    benchmark too, which times each config as the kernel that will run, as the core fits it there (the first
    process timed the fitting variant; refusing it in the next would make its autotuner choose otherwise). Raises
    the ``OutOfResources`` the variant would raise at its launch, without compiling it, where the
    variant is stored as overflowing at any stage count and compiling it gains nothing: inside the autotuner's
    benchmark (which must see it fail, and does) and, when ``launching``, for a variant whose tuner
    switches to another config (:func:`smemguard.engine.recall.switch` applies it at the launch guard). Never while
    :data:`compiling_as_asked`.
    """
    if compiling_as_asked:
        return None
    key_of = functools.cache(lambda: decision_cache.case_id(  # hashed only where the cache holds such entries
        variants.device_case(jit, variants.variant_id(source, options.__dict__), device)))
    found = stored_entry(directory, ("compile", "launch"), key_of)
    if found is None:
        return None
    (table, entry), key = found, key_of()
    benchmarking = bool(process.benchmarking)
    if table == "compile":
        why = options_problem(entry["options"], options.num_stages, options.num_warps,
                              getattr(options, "warp_size", 32))
        if why is not None:
            ignored(key, why)
            return None
        return dict(entry["options"])
    if (benchmarking or (launching and entry["action"] == CONFIG_CHANGED)) and entry.get("resource") == SHARED\
            and isinstance(entry.get("required"), int):
        raise _refused(key, entry)
    return None


#: Set while every variant is compiled as asked, none refused before compiling
#: (:func:`smemguard.engine.recovery.handle`).
compiling_as_asked = process.ThreadFlag()


@functools.cache
def _refusal_type() -> type:
    """Triton's ``OutOfResources`` (what callers catch) for a variant refused before compiling, naming the stored
    entry that refused it. Made at first use: smemguard imports Triton only once it handles something."""
    from triton.runtime.errors import OutOfResources

    class RefusedBeforeCompiling(OutOfResources):
        def __init__(self, key: str, entry: dict):
            super().__init__(entry["required"], entry["limit"], SHARED)
            self.stored = (key, entry)

        def __reduce__(self):  # pickled (a tuner sent to a worker), it is Triton's own error: nothing of ours to find
            return OutOfResources, (self.required, self.limit, self.name)

    return RefusedBeforeCompiling


def _refused(key: str, entry: dict):
    """Triton's own error for a variant that needs ``entry["required"]`` bytes, refused for ``entry``."""
    error = _refusal_type()(key, entry)
    incidents.add_note(error, f"smemguard: refused before compiling: the decision cache ({decision_cache.FILE_NAME}, "
                       f"entry {key}, decided on {entry.get('gpu', '?')}) says this variant needs {entry['required']} "
                       f"B here; compiling it would raise this error at its launch")
    return error


def stored(error) -> tuple[str, dict] | None:
    """(key, entry) when ``error`` was raised by :func:`remembered_compile` for a config switch, else None."""
    return error.stored if isinstance(error, _refusal_type()) else None


def stored_stages(directory: Path | None, key: str, stages: int, kernel) -> int | None:
    """The stage count the ``compile`` table holds for the compiled ``kernel`` (``key``: its case) that the
    compile-time core may apply: fewer stages only (warps are the launch guard's to lower); else None."""
    found = stored_entry(directory, ("compile",), key)
    if found is None:
        return None
    options = found[1]["options"]
    why = options_problem(options, stages, kernel.metadata.num_warps, getattr(kernel.metadata, "warp_size", 32))
    if why is not None or "num_warps" in options:
        return None
    return options.get("num_stages")
