"""What recovery decided for one failing launch: the :class:`Decision` and its actions.

A small module of its own because the ladder (which takes decisions), the store (which keeps them
across processes), the incident records (which describe them) and recovery (which applies them)
all read it, and none of them should have to import another's machinery to do so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

STAGES_REDUCED = "stages_reduced"
WARPS_REDUCED = "warps_reduced"
CONFIG_CHANGED = "config_changed"
FALLBACK = "fallback"
RERAISED = "reraised"
OBSERVED = "observed"
#: torch.compile kernels (:mod:`smemguard.engine.inductor`): smaller blocks of a kernel whose grid follows them.
BLOCKS_REDUCED = "blocks_reduced"
#: Smaller tiles chosen where the tiles are chosen: FlexAttention configs before Inductor renders them
#: (:mod:`smemguard.patches.torch_seams.inductor_flex_configs`), a declared wrapper's tiles
#: (:mod:`smemguard.engine.wrapper_tiles`;
#: records written before 2026-12-03 spell it ``tile_reduced``).
TILES_REDUCED = "tiles_reduced"

#: A config (or Inductor choice) an autotuner was timing that fits at no stage count: the autotuner counts it as
#: failed and chooses another, so nothing the caller asked for failed (recorded once per kernel and shape class).
AUTOTUNE_SKIPPED = "autotune_skipped"

#: An operator's pin (:mod:`smemguard.facts.pins`) chose the options a kernel compiled with: a decision taken before
#: deployment, recorded once per kernel, GPU and pin, never a failure.
PINNED = "pinned"

#: The resource every overflow smemguard handles is named with (Triton's ``OutOfResources.name``).
SHARED = "shared memory"

#: Actions applied by putting the replacement into Triton's JIT cache: same tiles, other options.
OPTION_ONLY = (STAGES_REDUCED, WARPS_REDUCED)


@dataclass(frozen=True)
class Decision:
    action: str
    attempts: tuple  # smemguard.kernels.launch.Attempt, the failing launch first
    config: Any = None  # the tuner config chosen (CONFIG_CHANGED)
    fallback: Callable[..., Any] | None = None
    final: str | None = None  # the config that runs now
    record: str | None = None  # where the incident record went
    reason: str = ""  # why nothing else was possible (RERAISED)
    replacement: Any = None  # the compiled kernel that runs instead (STAGES_REDUCED, WARPS_REDUCED)
    options: dict | None = None  # the option change that made it ({"num_stages": 3})
    remembered: bool = False  # taken from the decision cache rather than by trying candidates
    timings: dict | None = None  # median ms of each fitting candidate timed before choosing
    skipped: tuple[str, ...] = ()  # candidates not compiled: measurements or the estimate showed they cannot fit
    compile_ms: float = 0.0  # wall-clock time spent compiling candidates (concurrent compiles counted once)
    internal_steps: tuple[str, ...] = ()  # smemguard's own steps that failed while handling it (its bugs)
