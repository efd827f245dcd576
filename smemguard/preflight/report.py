"""What the check found: a verdict per kernel, config, specialization and GPU, the report that holds them, and its
``--json`` document (:data:`SCHEMA`, which ``check --compare`` reads back)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._version import __version__
from ..facts import gpus
from .model import CACHED, ERROR, ESTIMATED, FITS, MEASURED, OVERFLOWS, CheckedKernel

#: Version of the ``--json`` document (see :func:`Report.to_json`).
SCHEMA = "smemguard.check/1"


@dataclass
class Verdict:
    verdict: str  # FITS, OVERFLOWS, ERROR, NOT_CHECKED
    how: str | None = None  # MEASURED, CACHED, ESTIMATED
    shared: int | None = None
    low: int | None = None
    high: int | None = None
    error: str | None = None

    def to_json(self) -> dict:
        data: dict[str, Any] = {"verdict": self.verdict, "how": self.how, "shared": self.shared}
        if self.how == ESTIMATED:
            data["estimate"] = {"low": self.low, "high": self.high}
        if self.error:
            data["error"] = self.error
        return data



@dataclass
class Report:
    kernels: list[CheckedKernel]
    gpus: list[gpus.Gpu]
    verdicts: dict[tuple[int, int, str, str], Verdict]  # (kernel index, variant index, spec name, gpu name)
    compiles: int
    cache_hits: int
    seconds: float
    exact: bool
    unchecked: dict[str, str] = field(default_factory=dict)  # GPU name -> why it could not be compiled for
    pinned: list = field(default_factory=list)  # what each pin does on each GPU (.pins.PinOnGpu)

    def verdict(self, kernel: int, variant: int, spec: str, gpu: str) -> Verdict:
        return self.verdicts[(kernel, variant, spec, gpu)]

    def checked_gpus(self) -> list[gpus.Gpu]:
        return [gpu for gpu in self.gpus if self.checked(gpu)]

    def checked(self, gpu: gpus.Gpu) -> bool:
        return gpu.name not in self.unchecked

    def fits_everywhere(self, kernel: int, variant: int, gpu: str) -> bool:
        return all(self.verdict(kernel, variant, spec.name, gpu).verdict == FITS
                   for spec in self.kernels[kernel].specializations)

    def _verdicts_of(self, kernel: int, spec: str, gpu: str) -> set[str]:
        return {self.verdict(kernel, v, spec, gpu).verdict for v in range(len(self.kernels[kernel].variants))}

    def without_fit(self, kernel: int, gpu: str) -> list[str]:
        """Specializations in which no config of the kernel fits ``gpu`` and some overflows it."""
        return [spec.name for spec in self.kernels[kernel].specializations
                if FITS not in (found := self._verdicts_of(kernel, spec.name, gpu)) and OVERFLOWS in found]

    def only_errors(self, kernel: int, gpu: str) -> list[str]:
        """Specializations in which every config of the kernel failed to compile for another reason."""
        return [spec.name for spec in self.kernels[kernel].specializations
                if self._verdicts_of(kernel, spec.name, gpu) == {ERROR}]

    @property
    def exit_status(self) -> int:
        """1: a kernel overflows some GPU whatever its config; else 2: one only failed to compile; else 0."""
        pairs = [(k, gpu.name) for k in range(len(self.kernels)) for gpu in self.checked_gpus()]
        if any(self.without_fit(k, gpu) for k, gpu in pairs):
            return 1
        return 2 if any(self.only_errors(k, gpu) for k, gpu in pairs) else 0

    def counts(self) -> dict[str, int]:
        counted = {MEASURED: 0, CACHED: 0, ESTIMATED: 0}
        for verdict in self.verdicts.values():
            if verdict.how in counted:
                counted[verdict.how] += 1
        return counted

    def to_json(self) -> dict:
        """The ``--json`` document (schema ``smemguard.check/1``)::

            {"schema": "smemguard.check/1", "smemguard": "0.1.0", "triton": "3.9.0", "exact": false,
             "exit_status": 1, "seconds": 41.2, "compiles": 52, "cache_hits": 0,
             "verdicts": {"measured": 52, "cached": 0, "estimated": 1244},
             "gpus": [{"name": "L4", "arch": "sm_89", "limit": 101376, "checked": true}, ...],
             "kernels": [{"kernel": "smemguard.examples:flaggems_matmul",
                          "jit": "smemguard.examples:matmul_kernel",
                          "specializations": [{"name": "aligned", "aligned": true, "ones": [],
                                               "unsure_strides_one": true}, ...],
                          "unit_args": ["stride_ak", "stride_bn", "stride_cn"], "unsure_unit_args": [],
                          "configs": [{"config": "BLOCK_M=128 ... num_stages=4",
                                       "constexprs": {"BLOCK_M": 128, ...}, "num_warps": 4, "num_stages": 4,
                                       "gpus": {"L4": {"fits": false,
                                                       "specializations": {"aligned": VERDICT, ...}}}}]}],
             "summary": {"L4": {"checked": true, "configs": 229, "fit": 150,
                                "kernels_without_fit": [{"kernel": "...", "specializations": ["N=1"]}]}}}

        VERDICT = {"verdict": "fits" | "overflows" | "error" | "not_checked",
                   "how": "measured" | "cached" | "estimated" | null,
                   "shared": bytes measured (null when estimated or failed),
                   "estimate": {"low": bytes, "high": bytes} (estimated only), "error": "..." (errors only)}.
        A config "fits" a GPU when it fits in every specialization. "cached" is a measurement
        made by an earlier run. "unit_args" are 1 in every specialization; "unsure_unit_args" are
        strides the source leaves unsure: 1 in the specializations with "unsure_strides_one", not
        in their "... non-unit" twins.
        """
        import triton

        kernels = []
        for k, kernel in enumerate(self.kernels):
            configs = []
            for v, variant in enumerate(kernel.variants):
                per_gpu = {}
                for gpu in self.gpus:
                    per_gpu[gpu.name] = {
                        "fits": self.fits_everywhere(k, v, gpu.name) if self.checked(gpu) else None,
                        "specializations": {spec.name: self.verdict(k, v, spec.name, gpu.name).to_json()
                                            for spec in kernel.specializations}}
                configs.append({**variant.to_json(), "gpus": per_gpu})
            kernels.append({"kernel": kernel.name, "jit": kernel.jit_name,
                            "specializations": [spec.to_json() for spec in kernel.specializations],
                            "unit_args": list(kernel.unit_args), "unsure_unit_args": list(kernel.unsure_unit_args),
                            "configs": configs})
        summary = {}
        for gpu in self.gpus:
            checked = self.checked(gpu)
            total = sum(len(kernel.variants) for kernel in self.kernels)
            fit = sum(self.fits_everywhere(k, v, gpu.name) for k, kernel in enumerate(self.kernels)
                      for v in range(len(kernel.variants))) if checked else None
            missing = [{"kernel": kernel.name, "specializations": self.without_fit(k, gpu.name)}
                       for k, kernel in enumerate(self.kernels) if checked and self.without_fit(k, gpu.name)]
            summary[gpu.name] = {"checked": checked, "configs": total, "fit": fit, "kernels_without_fit": missing}
        return {"schema": SCHEMA, "smemguard": __version__, "triton": triton.__version__, "exact": self.exact,
                "exit_status": self.exit_status, "seconds": round(self.seconds, 2), "compiles": self.compiles,
                "cache_hits": self.cache_hits, "verdicts": self.counts(),
                "gpus": [{"name": gpu.name, "arch": gpu.arch, "limit": gpu.max_shared,
                          "checked": self.checked(gpu)} for gpu in self.gpus],
                "kernels": kernels, "summary": summary, "pins": [outcome.to_json() for outcome in self.pinned]}
