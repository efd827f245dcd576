"""What the check checks: kernels, their configs and the specializations they are compiled in,
and the words its verdicts are made of."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..kernels import introspect
from ..kernels.estimate import (  # noqa: F401  (re-exported: the estimate decides in the check's own words)
    ELEMENT_BYTES,
    FITS,
    OVERFLOWS,
)
from ..kernels.recorded import describe_arg

ALIGNED = "aligned"
MISALIGNED = "misaligned"
#: Readings of the strides the source leaves unsure (see :mod:`.source`): the last of each tensor's
#: strides in argument order is 1 (the plain specializations), the one on the tile's last axis is 1
#: (named "<specialization> by-layout"), none of them is 1 ("<specialization> non-unit").
BY_ORDER = "by-order"
BY_LAYOUT = "by-layout"
NON_UNIT = "non-unit"

ERROR = "error"
NOT_CHECKED = "not_checked"

MEASURED = "measured"
CACHED = "cached"
ESTIMATED = "estimated"


#: Integer types Triton's launcher marks as divisible by 16 and turns into a constant when 1.
INT_TYPES = ("i32", "i64", "u32", "u64")
#: The type of an argument every launch passes as ``None`` (an optional tensor left out): Triton compiles it as a
#: constant, and heuristics see ``None``.
NONE = "none"


class TargetError(ValueError):
    """A check that cannot start: unknown GPU, unimportable target, malformed option."""


@dataclass(frozen=True)
class Specialization:
    name: str
    aligned: bool
    ones: tuple[str, ...] = ()  # integer arguments equal to 1 in this specialization
    # For a kernel with unsure strides: the reading (BY_ORDER, BY_LAYOUT, NON_UNIT) and the strides it takes as 1.
    unit_guess: str | None = None
    guessed_ones: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"name": self.name, "aligned": self.aligned, "ones": list(self.ones), "unit_guess": self.unit_guess,
                "guessed_ones": list(self.guessed_ones)}


@dataclass(frozen=True)
class Variant:
    """One config: constexpr values and compile options."""

    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int = 4
    num_stages: int = 3
    num_ctas: int = 1
    maxnreg: int | None = None

    @classmethod
    def of(cls, config) -> "Variant":
        """From a ``triton.Config`` or a dict of constexprs plus ``num_warps``/``num_stages``/..."""
        if isinstance(config, Variant):
            return config
        if isinstance(config, dict):
            meta = dict(config)
            options = {key: meta.pop(key) for key in ("num_warps", "num_stages", "num_ctas", "maxnreg") if key in meta}
            return cls(tuple(meta.items()), **options)
        return cls(tuple(config.kwargs.items()), config.num_warps or 4,
                   config.num_stages if config.num_stages is not None else 3,
                   getattr(config, "num_ctas", 1) or 1, getattr(config, "maxnreg", None))

    def label(self) -> str:
        parts = [f"{name}={value}" for name, value in (*self.constexprs, *self.options().items())]
        return " ".join(parts)

    def options(self) -> dict:
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.num_ctas != 1:
            options["num_ctas"] = self.num_ctas
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options

    def to_json(self) -> dict:
        """The config as the ``--json`` document lists it."""
        constexprs = {name: describe_arg(value) for name, value in self.constexprs}
        return {"config": self.label(), "constexprs": constexprs, "num_warps": self.num_warps,
                "num_stages": self.num_stages}


@dataclass
class CheckedKernel:
    """A kernel as the check sees it: its JIT function, configs, argument types and specializations."""

    name: str  # how the user can name it: "module:attr"
    jit: Any
    variants: list[Variant]
    types: dict[str, str]  # non-constexpr parameter -> Triton type ("*fp16", "i32", "fp32")
    constants: dict[str, Any]  # constexprs no config sets
    unit_args: tuple[str, ...]  # integer arguments that are 1 in every launch
    specializations: list[Specialization]
    heuristics: list[dict] = field(default_factory=list)  # values of triton.heuristics layers
    locator: tuple[str, str, str | None] | None = None  # (module, attribute, file) for worker processes
    # Innermost strides the source leaves unsure; each specialization says which it takes as 1 (guessed_ones).
    unsure_unit_args: tuple[str, ...] = ()
    launched: Any = None  # what a launch indexes: the autotuner, heuristics or JIT function found

    @property
    def jit_name(self) -> str:
        return introspect.kernel_name(self.jit)
