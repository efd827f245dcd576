"""Pins: an operator's declaration of the launch options one kernel compiles with on one GPU.

A pin names a kernel by its ``module:name`` (a glob: ``vllm.*:fused_moe_kernel``), a GPU by name (``L4``, as
``smemguard gpus`` lists it), by arch (``sm_89``, ``gfx942``) or by per-block limit in bytes (``101376``), and
``num_stages``, ``num_warps`` or both. It is a ceiling: a compile that asks for more is compiled with the pin's
count, one that asks for as few or fewer as asked, so a pin chooses only among the variants recovery itself
could compile (fewer stages or warps: the same tiles, the same grid, the same answer). A tile is never pinned:
the caller may have computed its grid from it.

Pins come from the file ``SMEMGUARD_PINS`` names (read with the settings) and from the decision cache's ``pins``
table (``smemguard pin add``); both are untrusted input, checked here field by field, one line per problem.
The same kernel and GPU in both: the file's pin wins, since the file is the deployment's own declaration (kept
with the image or the fleet's configuration), the table a host's state. Where several pins match a kernel on a
GPU, the most specific applies: an exact name before a glob, a GPU's name before its arch before its limit, a
longer pattern before a shorter.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from . import gpus, untrusted
from .untrusted import STAGES, WARPS, Expect, shown

#: A pins file (or table) holding more is not one an operator wrote.
MAX_PINS = 1000
MAX_FILE = 2**20
MAX_PATTERN = 300
#: Per-block limits a pin may name: far above any GPU's, below absurd.
MAX_LIMIT = 2**32

OPTIONS = ("num_stages", "num_warps")
#: What a pin holds; the decision cache's entries also say what and where (``action``, ``time``, ``host``, ``pid``).
FIELDS = ("kernel", "gpu", *OPTIONS)
STORED = ("action", "time", "host", "pid")
#: Where the pins of the decision cache's table come from, for people (the file's say ``SMEMGUARD_PINS``).
CACHE_ORIGIN = "the decision cache"
#: The GPU a pin names: by name, arch or limit (the order in which a more specific one wins).
BY_NAME, BY_ARCH, BY_LIMIT = "name", "arch", "limit"

_ARCH = re.compile(r"sm_\d{2,3}|gfx[0-9a-f]{3,4}")
_GLOB = re.compile(r"[*?\[]")
WHERE_TILES_GO = ("a pin sets num_stages and num_warps only, which change no result; a tile can change the grid "
                  "its caller computed, so smaller tiles come from the kernel's own autotune configs, "
                  "smemguard.register_alternatives (a grid computed from the tile) or a wrapper declared with "
                  "smemguard.rerun_on_overflow")


@dataclass(frozen=True)
class Pin:
    kernel: str  # a module:name glob
    gpu: str  # a GPU name of the table, an arch (sm_89, gfx942) or a limit in bytes ("101376")
    num_stages: int | None = None
    num_warps: int | None = None
    origin: str = field(default="", compare=False)  # where it was declared, for people

    @property
    def key(self) -> tuple[str, str]:
        return self.kernel, self.gpu

    @property
    def table_key(self) -> str:
        """Its key in the decision cache's ``pins`` table."""
        return f"{self.kernel} on {self.gpu}"

    @property
    def gpu_kind(self) -> str:
        return BY_LIMIT if self.gpu.isdigit() else BY_ARCH if _ARCH.fullmatch(self.gpu) else BY_NAME

    def options(self) -> dict[str, int]:
        return {name: value for name in OPTIONS if (value := getattr(self, name)) is not None}

    def options_text(self) -> str:
        return " ".join(f"{name}={value}" for name, value in self.options().items())

    def text(self) -> str:
        return f"{self.kernel} on {self.gpu}: {self.options_text()}"

    def entry(self) -> dict[str, Any]:
        """The pin as a file or the decision cache holds it."""
        return {"kernel": self.kernel, "gpu": self.gpu, **self.options()}

    def matches(self, kernel: str, gpu_names: Iterable[str], arch: str, limit: int) -> bool:
        """Whether the pin applies to ``kernel`` (``module:name``) on a GPU called one of ``gpu_names`` (names of
        the table), of ``arch`` (``sm_89``, ``gfx942``) with per-block ``limit`` bytes."""
        if not fnmatch.fnmatchcase(kernel, self.kernel):
            return False
        kind = self.gpu_kind
        return (self.gpu in gpu_names if kind == BY_NAME else self.gpu == arch if kind == BY_ARCH
                else int(self.gpu) == limit)

    def specificity(self) -> tuple:
        """Sorts the most specific pin first (see the module's docstring)."""
        return (bool(_GLOB.search(self.kernel)), (BY_NAME, BY_ARCH, BY_LIMIT).index(self.gpu_kind),
                -len(self.kernel), self.kernel)


def gpu_of(value: Any) -> str | None:
    """The GPU ``value`` names, as a pin keeps it (a GPU's name of the table, an arch, a limit's digits), or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or len(value) > 100:
        return None
    text = value.strip()
    known = gpus.lookup(text) if text else None
    if known is not None:
        return known.name
    if _ARCH.fullmatch(text.lower()):
        return text.lower()
    return str(int(text)) if text.isascii() and text.isdigit() and 0 < int(text) <= MAX_LIMIT else None


KERNEL = Expect(f"a kernel's module:name, a glob allowed (vllm.*:fused_moe_kernel), at most {MAX_PATTERN} characters",
                lambda value: isinstance(value, str) and 0 < len(value) <= MAX_PATTERN and value.isprintable()
                and ":" in value.strip(":") and value == value.strip())
GPU = Expect(f"a GPU of 'smemguard gpus' (L4), an arch (sm_89, gfx942) or a per-block limit from 1 to {MAX_LIMIT} "
             "bytes (101376)", lambda value: gpu_of(value) is not None)


def problems(entry: Any, stored: bool = False) -> list[str]:
    """Why ``entry`` (an object of a pins file, or of the decision cache's table when ``stored``) is no pin."""
    if not isinstance(entry, dict):
        return [f"{shown(entry, 40)} is no pin: expected an object with kernel, gpu, num_stages and/or num_warps"]
    allowed = (*FIELDS, *STORED) if stored else FIELDS
    tiles = [name for name in entry if name not in allowed]
    if tiles:
        return [f"{shown(tiles[0], 40)} cannot be pinned: {WHERE_TILES_GO}"]
    found = untrusted.problems(entry, {"kernel": KERNEL, "gpu": GPU}, {"num_stages": STAGES, "num_warps": WARPS})
    if not any(name in entry for name in OPTIONS):
        found.append("neither num_stages nor num_warps: a pin sets one of them, or both")
    return found


def key_problems(key: str, entry: dict) -> list[str]:
    """Why ``key`` is not the key of the decision cache's pin ``entry`` (one kernel and GPU, one entry)."""
    own = of(entry, "").table_key
    return [] if key == own else [f"its key is not {shown(own, 60)}, the kernel and GPU it pins"]


def of(entry: dict, origin: str) -> Pin:
    """The pin of an ``entry`` :func:`problems` found nothing wrong with."""
    return Pin(entry["kernel"], gpu_of(entry["gpu"]), entry.get("num_stages"), entry.get("num_warps"), origin)


def parse(document: Any, origin: str) -> tuple[tuple[Pin, ...], list[str]]:
    """The pins of a pins file's JSON value (``{"pins": [{...}, ...]}``, as ``smemguard pin list --json`` prints
    it), and one line per pin left out."""
    if not isinstance(document, dict) or not isinstance(document.get("pins"), list):
        return (), [f"{shown(document, 40)} holds no pins: expected {{\"pins\": [{{\"kernel\": \"module:name\", "
                    "\"gpu\": \"L4\", \"num_stages\": 2}, ...]}"]
    entries = document["pins"]
    if len(entries) > MAX_PINS:
        return (), [f"{len(entries)} pins, more than the {MAX_PINS} a pins file may hold"]
    pins: dict[tuple[str, str], Pin] = {}
    left_out = []
    for number, entry in enumerate(entries, 1):
        found = problems(entry)
        pin = of(entry, origin) if not found else None
        if pin is not None and pin.key in pins:
            found = [f"the same kernel and GPU as pin {list(pins).index(pin.key) + 1}"]
        if found:
            left_out.append(f"pin {number}: {'; '.join(found)}")
        else:
            pins[pin.key] = pin
    return tuple(pins.values()), left_out


def in_force(declared: Iterable[Pin], stored: Iterable[Pin]) -> tuple[Pin, ...]:
    """The pins that apply: the ``declared`` ones (the file's), and the ``stored`` ones (the decision cache's) whose
    kernel and GPU the file does not pin."""
    declared = tuple(declared)
    keys = {pin.key for pin in declared}
    return (*declared, *(pin for pin in stored if pin.key not in keys))


def applying(pins: Iterable[Pin], kernel: str, gpu_names: Iterable[str], arch: str, limit: int) -> Pin | None:
    """The most specific of ``pins`` that matches ``kernel`` on the GPU (see :meth:`Pin.matches`), or None."""
    names = tuple(gpu_names)
    matching = [pin for pin in pins if pin.matches(kernel, names, arch, limit)]
    return min(matching, key=Pin.specificity) if matching else None
