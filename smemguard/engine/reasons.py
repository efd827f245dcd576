"""Why the ladder (:mod:`.ladder`) found nothing to run for a launch that has no fallback: the reason its record
and the re-raised error's note give, naming who chose the tiles, what the best candidate still needs, and the calls
that would let it run here."""

from __future__ import annotations

from ..kernels import introspect, parameters, registry
from ..kernels.launch import Launch
from .candidates import MAX_CANDIDATES


def why_nothing_fits(launch: Launch, budget: int, attempts: list) -> str:
    """The reason a launch whose candidates all failed is re-raised (its record's, its note's), once the fallback
    too is absent: what stopped the ladder, and what would let the launch run here."""
    advice = "register a fallback with smemguard.register_fallback"
    if budget == 0:
        return f"stopped after {MAX_CANDIDATES} candidate compiles; {advice}"
    if launch.tuner is not None:
        return f"no config of the autotuner fits; {advice}"
    if registry.alternatives_for(launch.jit) and not launch.alternatives():
        misses = sorted(set().union(*map(launch.grid_misses, registry.alternatives_for(launch.jit))))
        reads = launch.grid_reads()
        grid = ("the grid is a tuple computed by the caller" if not callable(launch.grid) else "the grid function "
                "reads none of their parameters from its meta-parameters (it holds the caller's tiles, as a tuple)"
                if not any(reads & config.kwargs.keys() for config in registry.alternatives_for(launch.jit)) else
                f"the grid function does not read {', '.join(misses)} from its meta-parameters, which the kernel's "
                "program ids step over (it holds the caller's)")
        return (f"alternatives are registered, but {grid}, so the tiles it was computed for are kept; pass the grid "
                f"as a function of the meta-parameters (meta['BLOCK_M']), or {advice}")
    if registry.alternatives_for(launch.jit):
        return f"none of the registered alternatives fits; {advice}"
    return _tiles_chosen_by_the_caller(launch, attempts)


def _tiles_chosen_by_the_caller(launch: Launch, attempts: list) -> str:
    """Why a plain kernel's launch is re-raised, naming who chose its tiles, what the best candidate still needs
    and the exact calls that would let it run here (the class smemguard leaves to the caller)."""
    module, _, qualname = introspect.kernel_name(launch.jit).partition(":")
    named, constexprs = launch.named_args(), launch.constexpr_names()
    chosen = constexprs & set(parameters.knobs_of(launch.jit).shapes) or constexprs  # the tiles, not strides
    tiles = ", ".join(f"{param.name}={named[param.name]}" for param in launch.jit.params if param.name in chosen
                      and isinstance(named.get(param.name), int) and not isinstance(named.get(param.name), bool))
    needed = [attempt.required for attempt in attempts if attempt.required]
    least = f"; the least any candidate needs is {min(needed)} B over {attempts[0].limit} B" if needed else ""
    site = introspect.launching_site()
    by = f" by {site}" if site else ""
    signature = ", ".join(param.name for param in launch.jit.params)
    grid = ("its grid is a function of the meta-parameters, so smemguard.register_alternatives"
            f"({module}.{qualname}, [triton.Config({{...smaller tiles...}})]) would be tried"
            if launch.grid_reads() & chosen else "the grid is a tuple the caller computed from them, so only the "
            "caller can choose smaller ones" if not callable(launch.grid) else "its grid function reads none of them "
            "from its meta-parameters (it holds the caller's tiles, as a tuple), so only the caller can choose "
            "smaller ones")
    return (f"tile sizes of a plain @triton.jit kernel are never changed: {tiles or 'its constexprs'} were chosen"
            f"{by}{least}; {grid}; or smemguard.register_fallback({module}.{qualname}, fn) with "
            f"fn({signature}) computing the same result in torch")
