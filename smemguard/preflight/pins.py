"""What each pin does on each GPU the check checks (``smemguard check``, :mod:`smemguard.facts.pins`): every config
a pin lowers is checked again as its pinned variant (the same specializations, compiles, cache and estimate as the
configs), against the limit of each GPU where the pin is the one that applies. A pinned variant that does not fit
is the pin refused there (the kernel compiles as without it), as is a pin of an option the kernel also takes as a
parameter it uses; a config that asks for as few is left as it is."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ..facts import gpus, pins
from ..kernels.parameters import OptionIsAParameter, knobs_of
from .check import check
from .report import Report
from .model import FITS, CheckedKernel, Variant

APPLIES, REFUSED, UNCHANGED = "applies", "refused", "unchanged"


@dataclasses.dataclass
class PinnedConfig:
    config: str  # the config as asked
    outcome: str  # APPLIES, REFUSED, UNCHANGED
    pinned: str | None = None  # the pinned variant's config
    shared: int | None = None  # its bytes in the worst specialization (None: estimated, or not compiled)
    why: str | None = None  # why it is refused

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PinOnGpu:
    """What one pin does to one kernel's configs on one GPU."""

    pin: pins.Pin
    kernel: str
    gpu: gpus.Gpu
    configs: list[PinnedConfig]

    def count(self, outcome: str) -> int:
        return sum(config.outcome == outcome for config in self.configs)

    def line(self) -> str:
        """One line of the text report."""
        applied = [config.shared for config in self.configs if config.outcome == APPLIES]
        refused = [config for config in self.configs if config.outcome == REFUSED]
        parts = [f"{len(applied)} of {len(self.configs)} configs pinned"
                 + (f" (at most {max(applied)} B)" if applied and None not in applied else "")]
        if refused:
            parts.append(f"refused for {len(refused)}, compiled as without the pin: {refused[0].why}"
                         + (" ..." if len(refused) > 1 else ""))
        if self.count(UNCHANGED):
            parts.append(f"{self.count(UNCHANGED)} ask for as few already")
        return (f"pin {self.pin.kernel} on {self.pin.gpu} ({self.pin.options_text()}, {self.pin.origin}): "
                f"{self.kernel.rsplit(':', 1)[-1]} on {self.gpu.name} ({self.gpu.max_shared} B): {'; '.join(parts)}")

    def to_json(self) -> dict[str, Any]:
        return {"pin": self.pin.entry(), "origin": self.pin.origin, "kernel": self.kernel, "gpu": self.gpu.name,
                "configs": [config.to_json() for config in self.configs]}


def _pinned(pin: pins.Pin, kernel: CheckedKernel, variant: Variant) -> Variant | str | None:
    """The variant ``pin`` compiles in place of ``variant``; None when it asks for as few; why not, as text."""
    changes = {option: value for option, value in pin.options().items() if value < getattr(variant, option)}
    if not changes:
        return None
    try:
        lowered = knobs_of(kernel.jit).lowered_with(changes, dict(variant.constexprs))
    except OptionIsAParameter as error:
        return str(error)
    return dataclasses.replace(variant, **changes, constexprs=tuple(
        (name, lowered.get(name, value)) for name, value in variant.constexprs))


def _matching(report: Report, kernel: CheckedKernel, declared: Sequence[pins.Pin]) -> dict[pins.Pin, list[gpus.Gpu]]:
    """The pins that apply to ``kernel``, each with the GPUs checked where it is the one that applies."""
    found: dict[pins.Pin, list[gpus.Gpu]] = {}
    for gpu in report.checked_gpus():
        pin = pins.applying(declared, kernel.jit_name, (gpu.name,), gpu.arch, gpu.max_shared)
        if pin is not None:
            found.setdefault(pin, []).append(gpu)
    return found


def check_pins(report: Report, declared: Sequence[pins.Pin], **options) -> list[PinOnGpu]:
    """What each of the ``declared`` pins does to ``report``'s kernels on its GPUs; ``options`` as :func:`check`
    takes them (jobs, cache, exact, import_timeout). Compiles only where a pin lowers some config."""
    planned = []  # (pin, kernel, gpus, [(config, pinned variant or why not)], the pinned kernel to check)
    for kernel in report.kernels:
        for pin, on in _matching(report, kernel, declared).items():
            pinned = [(variant, _pinned(pin, kernel, variant)) for variant in kernel.variants]
            variants = list(dict.fromkeys(variant for _, variant in pinned if isinstance(variant, Variant)))
            planned.append((pin, kernel, on, pinned, dataclasses.replace(kernel, variants=variants)))
    to_check = [checked for *_, checked in planned if checked.variants]
    on_gpus = list({gpu.name: gpu for _, _, on, _, _ in planned for gpu in on}.values())
    checked = check(to_check, on_gpus, **options) if to_check else None
    outcomes = []
    for pin, kernel, on, pinned, copy in planned:
        index = next((k for k, other in enumerate(to_check) if other is copy), None)
        for gpu in on:
            outcomes.append(PinOnGpu(pin, kernel.name, gpu, [
                _outcome(checked, index, copy, variant, gpu, pinned_variant) for variant, pinned_variant in pinned]))
    return outcomes


def _outcome(checked: Report | None, index: int | None, copy: CheckedKernel, variant: Variant, gpu: gpus.Gpu,
             pinned: Variant | str | None) -> PinnedConfig:
    if pinned is None:
        return PinnedConfig(variant.label(), UNCHANGED)
    if not isinstance(pinned, Variant):
        return PinnedConfig(variant.label(), REFUSED, why=pinned)
    v = copy.variants.index(pinned)
    verdicts = [checked.verdict(index, v, spec.name, gpu.name) for spec in copy.specializations]
    shared = max((verdict.shared or verdict.high or 0 for verdict in verdicts), default=0) or None
    if checked.fits_everywhere(index, v, gpu.name):
        return PinnedConfig(variant.label(), APPLIES, pinned.label(), shared)
    worst = next(verdict for verdict in verdicts if verdict.verdict != FITS)
    why = worst.error or f"{pinned.label()} needs {worst.shared or worst.low} B, over the {gpu.max_shared} B limit"
    return PinnedConfig(variant.label(), REFUSED, pinned.label(), shared, why)
