"""What every benchmark here shares, so that each script says only what it measures.

- one argument parser (:func:`parser`): the script's docstring as its help, ``--json PATH`` for its results;
- one results format (:func:`write`): a JSON document ``{"meta": ..., "results": ...}`` whose ``meta``
  (:func:`meta`) names the date, the command, the commit, the machine (CPU, GPU and driver) and the versions of
  Python, smemguard, torch, Triton and any package the script names;
- a fresh process per case (:func:`fresh_process`): the case's last line of standard output is its JSON result, so
  nothing of one case (imports, Triton's in-memory caches, smemguard's decisions) reaches the next;
- the settings of a case's process (:func:`environment`): an emulated limit (``SMEMGUARD_MAX_SHARED``), its own
  decision cache and incident log, and a cold or warm Triton cache (:class:`TritonCache`).

Scripts import it as ``import harness`` (``python benchmarks/<script>.py`` puts this folder first on ``sys.path``);
the repository root goes on ``sys.path`` too, so the smemguard of this checkout is the one measured.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

#: The packages every result names the versions of (the script may add its own).
PACKAGES = ("torch", "triton")


def parser(doc: str, *, results: bool = True) -> argparse.ArgumentParser:
    """The script's command line: its docstring's first paragraph as the description, the rest as the epilog, and
    ``--json PATH`` where the script writes one results document."""
    summary, _, details = doc.strip().partition("\n\n")
    command = argparse.ArgumentParser(description=summary, epilog=details,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    if results:
        command.add_argument("--json", type=Path, metavar="PATH",
                             help="write the results here: one JSON document, {meta, results}")
    return command


def _version(package: str) -> str | None:
    module = sys.modules.get(package)
    if module is not None and isinstance(getattr(module, "__version__", None), str):
        return module.__version__
    try:
        return importlib.metadata.version(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(*packages: str) -> dict[str, str | None]:
    """Python's, this checkout's smemguard's and each package's version (None: not installed)."""
    from smemguard._version import __version__

    found = {"python": platform.python_version(), "smemguard": __version__}
    found.update({package: _version(package) for package in (*PACKAGES, *packages)})
    return found


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> dict | None:
    """The CUDA device's name and driver: from torch where the script imported it, else from nvidia-smi (no CUDA
    context is created for it); None on a machine without an NVIDIA GPU."""
    driver = name = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.split("\n")[0]
        name, driver = (part.strip() or None for part in (smi.split(",") + [""])[:2])
    except (OSError, subprocess.SubprocessError):
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return {"name": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
                "driver": driver}
    return {"name": name, "driver": driver} if name else None


def machine() -> dict:
    """Where the numbers come from: the host's CPU, its cores, its load, and the GPU (None: the CPU harness)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"platform": platform.platform(), "cpu": _cpu(), "cpus": os.cpu_count(),
            "load": round(load, 2) if load is not None else None, "gpu": _gpu()}


def _commit() -> str | None:
    """The checkout's commit, ``+changes`` when its tracked files differ from it (None: not a git checkout)."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=20).stdout.strip()
        changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+changes" if head and changed else head or None


def meta(*packages: str, **extra) -> dict:
    """What every result carries: date, command, commit, machine and versions, then the script's own ``extra``."""
    return {"date": time.strftime("%Y-%m-%d"), "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            "commit": _commit(), "machine": machine(), "versions": versions(*packages), **extra}


def write(path: Path | None, results, *packages: str, **extra) -> dict:
    """The one results document, ``{"meta": meta(...), "results": results}``, written to ``path`` (None: not
    written) and returned."""
    document = {"meta": meta(*packages, **extra), "results": results}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1, default=str) + "\n")
    return document


def headline(document: dict) -> str:
    """One line naming the machine and versions of a result, for the top of a printed table."""
    info = document["meta"]
    where = (info["machine"]["gpu"] or {}).get("name") or f"{info['machine']['cpu']} (CPU)"
    names = ", ".join(f"{name} {version}" for name, version in info["versions"].items() if version)
    return f"{info['date']} · {where} · {names}"


class TritonCache:
    """Triton's compile cache for the cases of a run: ``cold`` gives each case an empty one (every compile is paid),
    ``warm`` one shared by every case (compiled once, then loaded). Removed with the run's scratch directory."""

    def __init__(self, kind: str, scratch: Path) -> None:
        if kind not in ("cold", "warm"):
            raise ValueError(f"a Triton cache is cold or warm, not {kind!r}")
        self.kind, self.scratch, self.count = kind, Path(scratch), 0

    def next(self) -> str:
        self.count += 1
        path = self.scratch / ("triton" if self.kind == "warm" else f"triton-{self.count}")
        path.mkdir(parents=True, exist_ok=True)
        return str(path)


def environment(*, limit: str | None = None, triton_cache: str | None = None, cache_dir: str | None = None,
                log: str | None = None, mode: str | None = None, disable: str | None = None,
                base: dict | None = None) -> dict[str, str]:
    """The environment of a case's process: ``base`` (default: this one) with this checkout first on
    ``PYTHONPATH``, and each setting given: ``limit`` (``SMEMGUARD_MAX_SHARED``: bytes or a GPU name),
    ``triton_cache`` (``TRITON_CACHE_DIR``), ``cache_dir`` (``SMEMGUARD_CACHE_DIR``), ``log`` (``SMEMGUARD_LOG``),
    ``mode`` (``SMEMGUARD``), ``disable`` (``SMEMGUARD_DISABLE``)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    settings = {"SMEMGUARD_MAX_SHARED": limit, "TRITON_CACHE_DIR": triton_cache, "SMEMGUARD_CACHE_DIR": cache_dir,
                "SMEMGUARD_LOG": log, "SMEMGUARD": mode, "SMEMGUARD_DISABLE": disable}
    env.update({name: value for name, value in settings.items() if value is not None})
    return env


def fresh_process(argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 600,
                  cwd: Path = ROOT, check: bool = True):
    """Run ``python *argv`` in a fresh process and return the JSON of the last line it printed. A case that fails
    stops the benchmark with the end of its standard error, or with ``check=False`` gives ``{"error": its last
    line}`` (the other cases still run)."""
    done = subprocess.run([sys.executable, *argv], env=env or environment(), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    if not check:
        return {"error": (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]}
    raise SystemExit(f"case {argv[:3]} exited {done.returncode}:\n{done.stderr[-4000:]}")


def scratch(prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary directory for a run's caches, logs and decision stores."""
    return tempfile.TemporaryDirectory(prefix=f"smemguard-{prefix}-")
