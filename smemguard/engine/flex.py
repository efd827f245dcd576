"""FlexAttention tiles that can fit, chosen before Inductor renders its templates (the seam:
:mod:`smemguard.patches.torch_seams.inductor_flex_configs`, which says why there).

Each config Inductor's table returns is bounded from below by what one stage of its tiles holds in shared
memory: the query and one key/value tile for the forward, ``(BLOCK_M + BLOCK_N) x D`` elements, and the four tiles
of the backward, ``(BLOCK_M1 + BLOCK_N1 + BLOCK_M2 + BLOCK_N2) x D``, with D the head dimension rounded up to a
power of two as Inductor pads it (measured: docs/MEASURED.md). A config whose bound reaches the limit cannot fit at
any stage count: it is replaced, before rendering, by the same config with every block above 16 halved together
(powers of two: the backward's ``BLOCK_N1 % BLOCK_M1`` and ``BLOCK_M2 % BLOCK_N2`` still hold), the largest whose
bound fits; its stages and warps stay, and the load recovery lowers the stages if they still do not fit. A config
that may fit is never touched. Smaller FlexAttention blocks give results within FlexAttention's own tolerances,
not bitwise the same (the softmax adds in another order). One warning and one incident record (``action:
"tiles_reduced"``, ``phase: "compile"``) per (pass, head dim, dtype, device, limit, config) and install.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..facts import process
from ..store import incidents
from ..store.decision import TILES_REDUCED

#: The backward's four blocks and the forward's two, as Inductor's config dataclasses name them.
_BLOCKS = {"forward": ("block_m", "block_n"), "backward": ("block_m1", "block_n1", "block_m2", "block_n2")}
SMALLEST_BLOCK = 16  # tl.dot's smallest
#: The engine's memory table of the configs replaced in this install.
TABLE = "inductor_flex_configs"


def _element_bytes(dtype) -> int:
    return getattr(dtype, "itemsize", 2)


def one_stage_bytes(kind: str, config, head_dim: int, dtype) -> int:
    """What one stage of ``config``'s tiles holds at least, in bytes (see the module's docstring)."""
    padded = 1 << max(int(head_dim) - 1, 0).bit_length()
    return sum(getattr(config, block) for block in _BLOCKS[kind]) * padded * _element_bytes(dtype)


def _halved(kind: str, config):
    """Every block above the smallest halved (powers of two: the backward's divisibilities still hold)."""
    return dataclasses.replace(config, **{block: getattr(config, block) // 2 for block in _BLOCKS[kind]
                                          if getattr(config, block) > SMALLEST_BLOCK})


def fitting(kind: str, config, head_dim: int, dtype, limit: int):
    """``config``, or the largest halving of its blocks whose one stage can fit ``limit``; None when even
    the smallest blocks cannot. A bound equal to the limit cannot fit: the kernel needs the bound and more
    (the backward at exactly it), and Inductor's static launcher refuses ``shared >= limit`` (measured:
    docs/MEASURED.md, smemguard/patches/inductor_flex_configs.py)."""
    while one_stage_bytes(kind, config, head_dim, dtype) >= limit:
        if max(getattr(config, block) for block in _BLOCKS[kind]) <= SMALLEST_BLOCK:
            return None
        config = _halved(kind, config)
    return config


@dataclasses.dataclass(frozen=True)
class _Offer:
    """The configs Inductor's heuristics offer one pass for a head dim and dtype, on a device and its limit."""

    kind: str  # "forward" or "backward"
    head_dim: int
    dtype: Any
    device: int
    limit: int
    started: float


def offer_fitting(engine, kind: str, configs: list, head_dim: int, dtype, started: float, steps) -> list:
    """``configs`` with each that cannot fit at any stage count replaced by the largest halving that can."""
    device = process.current_device()
    limit = process.effective_limit(device)
    offer = _Offer(kind, head_dim, dtype, device, limit, started)
    offered = []
    for config in configs:
        replacement = config
        if dataclasses.is_dataclass(config):
            replacement = None
            with steps.skippable("fit the config"):
                replacement = fitting(kind, config, head_dim, dtype, limit)
        if replacement is None or replacement == config:
            offered.append(config)
            continue
        offered.append(replacement)
        _report(engine, offer, config, replacement, steps)
    return offered


def _report(engine, offer: _Offer, config, replacement, steps) -> None:
    """The record of ``replacement`` offered in place of ``config``, once per install."""
    kind, head_dim, dtype, device, limit = offer.kind, offer.head_dim, offer.dtype, offer.device, offer.limit
    key = (kind, head_dim, str(dtype), device, limit, str(config))
    with engine.memory.lock:  # one record per (pass, head dim, dtype, device, limit, config) and install
        decided = engine.memory.table(TABLE)
        if key in decided:
            return
        decided[key] = replacement
    bound = one_stage_bytes(kind, config, head_dim, dtype)
    kernel = f"flex_attention_{kind}"
    incident = incidents.Incident(
        kernel=kernel, launched_as="torch.compile", phase="compile", action=TILES_REDUCED, final=str(replacement),
        resource="shared memory", required=bound, limit_hit=limit, started=offer.started, device=device,
        internal_steps=steps.failed, reason=f"at least {bound} B at one stage of its tiles",
        extras={"head_dim": head_dim, "dtype": str(dtype), "config": str(config)})
    incidents.report(incident, engine.settings.log_path, ("flex", kind, head_dim, str(dtype), device, limit),
                   "smemguard: FlexAttention %s (head dim %d, %s): Inductor's %s needs at least %d B at one stage, "
                   "over %d B; offering %s instead", kind, head_dim, dtype, config, bound, limit, replacement)
