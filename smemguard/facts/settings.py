"""Every environment variable smemguard reads, parsed once into a frozen :class:`Settings`.

This is the only module that reads ``os.environ``. A malformed value never stops the
process: it becomes one problem line (naming the variable, the bad value and what is
accepted), the setting keeps its default, and :func:`smemguard.install` logs the line
(or raises :class:`SettingsError` in ``strict`` mode).
"""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from . import files, gpus, pins, untrusted

#: ``on`` (default): recover from shared-memory overflows. ``off``: install nothing.
#: ``observe``: write incident records and log, change nothing. ``strict``: like ``on``,
#: but a misconfiguration (bad variable, unsupported Triton, failed patch) raises at install.
MODE = "SMEMGUARD"
MODES = ("on", "off", "observe", "strict")

#: Emulated per-block shared-memory limit: bytes (``101376``) or a GPU name (``L20``).
#: Triton then enforces min(device limit, this), so a big GPU fails like a small one.
MAX_SHARED = "SMEMGUARD_MAX_SHARED"

#: Path of the JSON-lines incident file. Unset: incidents are only logged.
LOG = "SMEMGUARD_LOG"

#: Where persisted decisions live; ``off`` disables persistence.
#: Default: ``$XDG_CACHE_HOME/smemguard`` (``~/.cache/smemguard``).
CACHE_DIR = "SMEMGUARD_CACHE_DIR"

#: Path of a Prometheus textfile (``*.prom``, for node_exporter's textfile collector) that every
#: process of the host adds its incidents to. Unset: metrics live in the process only.
METRICS_FILE = "SMEMGUARD_METRICS_FILE"

#: Patch modules to leave off, comma-separated, by the names ``smemguard.patches.NAMES`` lists
#: (``kernel_warmup,flaggems``): for an operator who suspects one patch. The rest still apply.
DISABLE = "SMEMGUARD_DISABLE"

#: ``0`` (or off, false, no): under ``SMEMGUARD_MAX_SHARED``, torch's device properties stay the device's own.
#: Default on: they report the emulated GPU (``patches/torch_seams/torch_device_properties``), as vLLM's own
#: shared-memory
#: query does (``patches/contrib/vllm_shared_memory``), so that libraries sizing themselves from them choose what they
#: would choose there.
EMULATE_PROPERTIES = "SMEMGUARD_EMULATE_PROPERTIES"

#: Path of a JSON file of pins: the options a kernel compiles with on a GPU (:mod:`smemguard.facts.pins`), merged
#: over those ``smemguard pin add`` keeps in the decision cache. Unset: the cache's pins only.
PINS = "SMEMGUARD_PINS"

KNOWN = (MODE, MAX_SHARED, LOG, CACHE_DIR, METRICS_FILE, DISABLE, EMULATE_PROPERTIES, PINS)


class SettingsError(ValueError):
    """A malformed smemguard setting, raised only in ``strict`` mode."""


@dataclass(frozen=True)
class Settings:
    mode: str = "on"
    max_shared: int | None = None  # emulated limit in bytes; None: the device's own
    max_shared_label: str | None = None  # how the user named it: "L20", "101376"
    log_path: Path | None = None
    cache_dir: Path | None = None
    problems: tuple[str, ...] = ()  # one line each, ready to log
    metrics_file: Path | None = None
    disabled: tuple[str, ...] = ()  # patch modules named in SMEMGUARD_DISABLE (unknown names are reported at install)
    emulate_properties: bool = True  # SMEMGUARD_EMULATE_PROPERTIES: what the device reports follows the emulation
    pins: tuple[pins.Pin, ...] = ()  # the pins of the SMEMGUARD_PINS file
    pins_file: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def observe_only(self) -> bool:
        return self.mode == "observe"

    def ignored(self, var: str) -> bool:
        """Whether the value of ``var`` was rejected (and replaced by the default): its line is in ``problems``."""
        return self.problem_of(var) is not None

    def problem_of(self, var: str) -> str | None:
        """The problem line of ``var``'s rejected value, or None."""
        return next((problem for problem in self.problems if problem.startswith(f"{var}=")), None)

    @property
    def emulated_gpu(self) -> gpus.Gpu | None:
        """The GPU ``SMEMGUARD_MAX_SHARED`` names (``L4``), None for a byte count or none."""
        label = self.max_shared_label
        return None if self.max_shared is None or label is None or label.isdigit() else gpus.lookup(label)

    def describe_limit(self) -> str:
        if self.max_shared is None:
            return "shared-memory limit from the device"
        return f"shared-memory limit emulated at {self.max_shared} B ({MAX_SHARED}={self.max_shared_label})"


#: A setting's value is shown up to this many characters in its problem line: a deep path fits whole (CI's
#: temporary paths pass 80), a 130 KB value is cut.
SHOWN_VALUE = 400


#: How a problem line ends where the process goes on with the default (a cache command does not: it says so).
USING_THE_DEFAULT = " Using the default."


def _shown(value: str) -> str:
    """``value`` on one line (repr escapes control characters), cut: a 130 KB setting is not echoed whole."""
    text = repr(value)
    return text if len(text) <= SHOWN_VALUE else f"{text[:SHOWN_VALUE - 4]}...' ({len(value)} characters)"


def _problem(var: str, value: str, why: str, accepted: str) -> str:
    return f"{var}={_shown(value)} ignored: {why}; accepted: {accepted}.{USING_THE_DEFAULT}"


def _parse_mode(value: str | None, problems: list[str]) -> str:
    if value is None or value.strip() == "":
        return "on"
    mode = value.strip().lower()
    if mode in MODES:
        return mode
    problems.append(_problem(MODE, value, "unknown mode", " | ".join(MODES)))
    return "on"


def _limits_accepted() -> str:
    return f"a byte count such as 101376, or a GPU name: {', '.join(gpus.names())}"


def parse_max_shared(text: str) -> tuple[int, str]:
    """``"101376"`` or a GPU name (``"L20"``) -> (bytes, label); ValueError saying what is accepted."""
    text = text.strip()
    accepted = _limits_accepted()
    gpu = gpus.lookup(text)
    if gpu is not None:  # "4090" is the RTX 4090, as in 'smemguard gpus' and 'check --gpu', not 4090 bytes
        return gpu.max_shared, gpu.name
    if text.isascii() and text.isdigit() and len(text) <= 12 and int(text) > 0:
        return int(text), text
    ascii_digits = text.isascii() and text.lstrip("-").isdigit()
    why = ("not ASCII digits" if text.lstrip("-").isdigit() and not text.isascii() else
           "must be positive" if ascii_digits and len(text) <= 12 else
           "too large" if ascii_digits else "neither a byte count nor a known GPU")
    raise ValueError(f"{why}; accepted: {accepted}")


def _parse_max_shared(value: str | None, problems: list[str]) -> tuple[int | None, str | None]:
    if value is None or value.strip() == "":
        return None, None
    try:
        limit, label = parse_max_shared(value)
    except ValueError as error:
        problems.append(f"{MAX_SHARED}={_shown(value)} ignored: {error}.{USING_THE_DEFAULT}")
        return None, None
    smallest = min(gpus.GPUS, key=lambda gpu: gpu.max_shared)
    if limit < smallest.max_shared:  # no GPU is that small: every kernel using shared memory would fail (KiB meant?)
        problems.append(_problem(MAX_SHARED, value, f"below the smallest GPU's limit ({smallest.name}: "
                                 f"{smallest.max_shared} B; the value is bytes)", _limits_accepted()))
        return None, None
    return limit, label


_YES, _NO = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def _parse_switch(var: str, value: str | None, problems: list[str]) -> bool:
    """An on/off setting, on by default."""
    if value is None or value.strip() == "" or value.strip().lower() in _YES:
        return True
    if value.strip().lower() in _NO:
        return False
    problems.append(_problem(var, value, "neither on nor off", " | ".join(_YES + _NO)))
    return True


def _unwritable_reason(path: Path) -> str | None:
    """Why ``path`` (a file or directory to be created on first use) cannot be written, or None."""
    if path.exists():
        return None if os.access(path, os.W_OK) else "not writable"
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK):
        return f"{ancestor} is not writable"
    return None


def _readable_path(value: str) -> tuple[Path | None, str | None]:
    """The path ``value`` names (``~`` expanded), or None and why it names none."""
    if not value.strip().isprintable():  # a newline would let a setting forge log lines wherever the path is shown
        return None, "it holds a control character (a newline, a tab, an escape)"
    try:
        return Path(value.strip()).expanduser(), None
    except RuntimeError:  # ~user, and no such user
        return None, "no such user's home directory"


def _checked_path(value: str, directory: bool) -> tuple[Path | None, str | None]:
    """The path ``value`` names (``~`` expanded), and why it cannot be written as a file (or as a
    directory), None when it can. Never raises: every reason is a problem line."""
    path, reason = _readable_path(value)
    if path is None:
        return None, reason
    try:
        if path.is_file() if directory else path.is_dir():
            return path, "is a file" if directory else "is a directory"
        if directory and path.is_dir():  # read-only too: its decisions apply, new ones stay in the process
            return path, None
        if not directory and path.exists() and not path.is_file():  # a FIFO would block the first incident
            return path, "not a regular file"
        return path, _unwritable_reason(path)
    except OSError as error:  # a name too long for the file system
        return path, error.strerror or str(error)


def _parse_log(value: str | None, problems: list[str]) -> Path | None:
    if value is None or value.strip() == "":
        return None
    path, reason = _checked_path(value, directory=False)
    if reason:
        problems.append(_problem(LOG, value, reason, "a writable file path, e.g. /var/log/smemguard/incidents.jsonl")
                        + " Incidents go to the log only.")
        return None
    return path


def _parse_metrics_file(value: str | None, problems: list[str]) -> Path | None:
    if value is None or value.strip() == "":
        return None
    path, reason = _checked_path(value, directory=False)
    accepted = "a writable file path ending in .prom, e.g. /var/lib/node_exporter/textfile/smemguard.prom"
    if reason is None and path.suffix != ".prom":
        reason = "node_exporter's textfile collector reads only *.prom files"
    if reason:
        problems.append(_problem(METRICS_FILE, value, reason, accepted) + " Metrics stay in the process.")
        return None
    return path


def _default_cache_dir(environ: Mapping[str, str]) -> Path:
    home = environ.get("HOME") or os.path.expanduser("~")
    base = environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return Path(base) / "smemguard"


def _parse_cache_dir(value: str | None, environ: Mapping[str, str], problems: list[str]) -> Path | None:
    if value is not None and value.strip().lower() == "off":
        return None
    default = _default_cache_dir(environ)
    if value is None or value.strip() == "":
        return default
    path, reason = _checked_path(value, directory=True)
    if reason:
        problems.append(_problem(CACHE_DIR, value, reason, f"a writable directory, or off (default {default})"))
        return default
    return path


PINS_ACCEPTED = ('a readable JSON file of pins, e.g. {"pins": [{"kernel": "my.kernels:matmul", "gpu": "L4", '
                 '"num_stages": 2}]} (smemguard pin --help)')


def _parse_pins(value: str | None, problems: list[str]) -> tuple[Path | None, tuple[pins.Pin, ...]]:
    """The pins of the file ``value`` names; a file that cannot be read or holds no pins is one problem line, and
    so are the pins it holds that are left out (the others apply)."""
    if value is None or value.strip() == "":
        return None, ()
    path, reason = _readable_path(value)
    found: tuple[pins.Pin, ...] = ()
    left_out: list[str] = []
    if path is not None:
        try:
            files.check_trusted(path)  # it chooses what compiles, as the decision cache does
            document, reason = untrusted.loads(files.read_bytes(path, pins.MAX_FILE).decode("utf-8"))
            if reason is None:
                found, left_out = pins.parse(document, PINS)
                more = f" (and {len(left_out) - 1} more pins)" if len(left_out) > 1 else ""
                reason = left_out[0] + more if left_out and not found else None
        except UnicodeDecodeError as error:
            reason = f"not UTF-8 text (byte {error.start})"
        except OSError as error:  # missing, unreadable, a FIFO, too large, writable by others
            reason = str(error) if isinstance(error, files.Refused) else error.strerror or str(error)
    if reason is not None:
        problems.append(_problem(PINS, value, reason, PINS_ACCEPTED) + " No pin of it applies.")
        return path, ()
    if left_out:
        more = f" (and {len(left_out) - 1} more pins)" if len(left_out) > 1 else ""
        problems.append(f"{PINS}={_shown(value)}: {left_out[0]}{more}: left out; its {len(found)} other pins apply.")
    return path, found


#: More names than there are patches is a malformed value, not a list to check name by name.
MAX_DISABLED = 64


def _parse_disable(value: str | None, problems: list[str]) -> tuple[str, ...]:
    given = [name.strip()[:100] for name in (value or "").split(",", MAX_DISABLED) if name.strip()]
    if len(given) >= MAX_DISABLED:
        problems.append(_problem(DISABLE, (value or "")[:80] + "...", f"more than {MAX_DISABLED - 1} names",
                                 "patch module names, comma-separated"))
        return ()
    return tuple(dict.fromkeys(given))


def _unknown(names, known, what: str) -> list[str]:
    """One line per name of ``names`` not in ``known``, with the closest known name when there is one."""
    lines = []
    for name in names:
        if name not in known:
            guess = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            hint = f" (did you mean {guess[0]}?)" if guess else ""
            lines.append(f"{name} is not {what}{hint}; known: {', '.join(known)}.")
    return lines


def unknown_patches(settings: Settings, known: tuple[str, ...]) -> list[str]:
    """Problem lines for names in SMEMGUARD_DISABLE that are not patch modules (``known``)."""
    return [f"{DISABLE}: {line}" for line in _unknown(settings.disabled, known, "a smemguard patch")]


#: Unknown SMEMGUARD_ variables named one line each, at most; the rest are counted in one more line.
MAX_UNKNOWN_NAMED = 10


def _unknown_variables(environ: Mapping[str, str]) -> list[str]:
    unknown = sorted(name for name in environ if name.startswith("SMEMGUARD_") and name not in KNOWN)
    lines = _unknown([name[:100] for name in unknown[:MAX_UNKNOWN_NAMED]], KNOWN, "a smemguard setting")
    if len(unknown) > MAX_UNKNOWN_NAMED:
        lines.append(f"{len(unknown) - MAX_UNKNOWN_NAMED} more SMEMGUARD_ variables are no smemguard setting either "
                     f"(known: {', '.join(KNOWN)}).")
    return lines


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """Parse the settings from ``environ`` (default: the process environment). Never raises."""
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    mode = _parse_mode(environ.get(MODE), problems)
    max_shared, label = _parse_max_shared(environ.get(MAX_SHARED), problems)
    log_path = _parse_log(environ.get(LOG), problems)
    cache_dir = _parse_cache_dir(environ.get(CACHE_DIR), environ, problems)
    metrics_file = _parse_metrics_file(environ.get(METRICS_FILE), problems)
    disabled = _parse_disable(environ.get(DISABLE), problems)
    emulate_properties = _parse_switch(EMULATE_PROPERTIES, environ.get(EMULATE_PROPERTIES), problems)
    pins_file, pinned = _parse_pins(environ.get(PINS), problems)
    problems.extend(_unknown_variables(environ))
    return Settings(mode, max_shared, label, log_path, cache_dir, tuple(problems), metrics_file=metrics_file,
                    disabled=disabled, emulate_properties=emulate_properties, pins=pinned, pins_file=pins_file)


def with_absolute_paths(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the settings that name a path (a relative one is relative to each process's working
    directory) made absolute against this process's, ``~`` expanded: ``smemguard run`` passes them on so, and a
    child started in another directory writes the same log, cache and metrics, and reads the same pins. A value
    that names no path (off, empty, an unknown ``~user``, a control character) is passed on as it is: each process
    reports it."""
    made = {}
    for var in (LOG, CACHE_DIR, METRICS_FILE, PINS):
        value = environ.get(var, "").strip()
        expanded = os.path.expanduser(value)
        if value and value.isprintable() and not expanded.startswith("~") and not (var == CACHE_DIR and
                                                                                    value.lower() == "off"):
            made[var] = os.path.abspath(expanded)
    return {**environ, **made}


@functools.lru_cache(maxsize=1)
def current() -> Settings:
    """The process's settings, read from the environment on first use only."""
    return load()
