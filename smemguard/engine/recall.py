"""Applying a decision stored in the decision cache (:mod:`smemguard.store.decision_cache`) to a failing launch
(what the cache says of a compile Triton is about to run is :func:`smemguard.engine.compile_fit.remembered_compile`'s,
with the same checks).

An entry is untrusted input, even from a trusted directory (another version, a hand edit, a bug):
before it is applied it is checked against what recovery could have produced for this very
launch: a stage count and a warp count no larger than those of the variant it replaces, warps a
power of two within the device's thread limit, a config of the kernel's own list (or a
fewer-stage variant of one). An entry that fails is ignored with one warning, and the launch is
recovered as if nothing were stored.
"""

from __future__ import annotations

import logging

from ..facts import process
from ..kernels import introspect, registry, variants
from ..kernels.launch import try_compile, with_config
from ..store import decision_cache
from ..store.decision import CONFIG_CHANGED, FALLBACK, RERAISED, Decision
from . import candidates, compile_fit, ladder

log = logging.getLogger(__name__)

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
        why = compile_fit.options_problem(entry["options"], metadata.num_stages, metadata.num_warps,
                              getattr(metadata, "warp_size", 32))
        if why is not None:
            compile_fit.ignored(key, why)
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
            compile_fit.ignored(key, "its config is not one of the kernel's own that this launch allows")
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
