"""What an entry of each table of the decision file must hold for recovery to apply it: its action, and the fields
that action reads, each checked as untrusted input (:mod:`smemguard.facts.untrusted`). The tiles and pins tables'
own rules are :mod:`.tile_entries`' and :mod:`smemguard.facts.pins`'."""

from __future__ import annotations

from typing import Any

from ..facts import pins, untrusted
from ..facts.untrusted import MAX_STAGES, NAME, OBJECT, STAGES, TEXT, WARPS, Expect, integer, one_of, shown
from . import tile_entries
from .decision import (BLOCKS_REDUCED, CONFIG_CHANGED, FALLBACK, PINNED, RERAISED, STAGES_REDUCED, TILES_REDUCED,
                       WARPS_REDUCED)

#: Bytes of shared memory (or threads) a stored variant may say it needed: far above any GPU's, below absurd.
MAX_BYTES = 2**32

#: The actions recovery stores in each table (recovery.py's names): option-only changes of one
#: compiled variant; another config, the fallback, or "nothing fits" for a launch.
ACTIONS = {"compile": (STAGES_REDUCED, WARPS_REDUCED),
           "launch": (CONFIG_CHANGED, FALLBACK, RERAISED),
           "inductor": (STAGES_REDUCED, WARPS_REDUCED, BLOCKS_REDUCED),
           "tiles": (TILES_REDUCED,),
           "pins": (PINNED,)}


_OPTIONS = Expect(f"an object of num_stages ({STAGES.what}) and num_warps ({WARPS.what})", lambda value: (
    isinstance(value, dict) and len(value) > 0
    and all((name == "num_stages" and STAGES.test(v)) or (name == "num_warps" and WARPS.test(v))
            for name, v in value.items())))
_CONFIG = {"kwargs": OBJECT, "num_warps": WARPS,
           "num_stages": Expect(f"an integer from 0 to {MAX_STAGES}", lambda value: integer(0).test(value)
                                and value <= MAX_STAGES),
           "num_ctas": Expect("an integer from 1 to 16", lambda value: integer(1).test(value) and value <= 16),
           "maxnreg": Expect("an integer from 1 to 255", lambda value: integer(1).test(value)
                             and value <= 255).or_null()}
#: Per action, what recovery reads from the entry to apply it.
_NEEDS = {STAGES_REDUCED: {"options": _OPTIONS}, WARPS_REDUCED: {"options": _OPTIONS},
          CONFIG_CHANGED: {"config": OBJECT}, FALLBACK: {"fallback": NAME},
          RERAISED: {"reason": TEXT}}


#: What the failing variant needed (absent from entries written before December 2026: such a variant is compiled
#: and fails before the entry applies).
_REQUIRED = Expect(f"an integer from 0 to {MAX_BYTES}", lambda value: integer(0).test(value) and value <= MAX_BYTES)
_OVERFLOW = {"resource": TEXT, "required": _REQUIRED}

#: What a torch.compile entry holds: the variant's config, what did not fit, and the bytes it needed.
_INDUCTOR_NEEDS = {"config": OBJECT, "resource": TEXT, "required": _REQUIRED}


#: What a wrapper's tile entry holds: its own fields (:mod:`.tile_entries`), and what did not fit.
_TILES_NEEDS = {**tile_entries.FIELDS, "resource": TEXT, "required": _REQUIRED}


def entry_problems(kind: str, entry: Any) -> list[str]:
    """Why recovery could not apply ``entry`` of table ``kind`` (empty when it can)."""
    if not isinstance(entry, dict):
        return [f"the entry is {shown(entry, 40)}, expected an object"]
    found = untrusted.problems(entry, {"action": one_of(*ACTIONS[kind])})
    if found or kind == "pins":
        return found or pins.problems(entry, stored=True)
    needs = {"inductor": _INDUCTOR_NEEDS, "tiles": _TILES_NEEDS}.get(kind) or _NEEDS[entry["action"]]
    found = untrusted.problems(entry, needs, _OVERFLOW)
    if not found and "config" in needs:
        found = untrusted.problems(entry["config"], _CONFIG, prefix="config.")
    if not found and kind == "tiles":
        found = tile_entries.problems(entry)
    return found
