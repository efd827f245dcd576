"""Prometheus metrics of incidents: live series for ``/metrics``, a node_exporter textfile, and the
same series counted from incident files (``smemguard report --format prometheus``).

Every series is derived from an incident record (:func:`labels_of`, its label fields those
``smemguard.store.record_fields.FIELDS`` gives metrics), so the three agree:

* ``smemguard_incidents_total{kernel, resource, action, gpu}``: records written;
* ``smemguard_recovery_seconds{kernel}``: histogram of the records' ``recovery_ms``;
* ``smemguard_remembered_total{kernel}``: records whose decision came from memory
  (``remembered``: decided earlier, here or by another process sharing SMEMGUARD_CACHE_DIR);
* ``smemguard_info{version, triton, mode, limit}``: 1 while the guard is installed (live only:
  records do not say how the process was configured).

Labels are bounded: kernels by qualified name, GPUs by name, never shapes. All of it is cold
path: :func:`count` runs once per record (``incidents.emit``), :func:`configure` at install
and uninstall. Without prometheus_client everything here is a no-op and nothing is imported.

The live series are in prometheus_client's default registry. When ``PROMETHEUS_MULTIPROC_DIR``
was set before prometheus_client was imported (vLLM: see docs/METRICS.md), prometheus_client
writes them to files there and a ``MultiProcessCollector`` (vLLM's ``/metrics``) adds up every
process's; smemguard never reads that variable itself. ``SMEMGUARD_METRICS_FILE`` is the
alternative for a scraper that sees no process's registry: a textfile, shared by every process
of the host, updated atomically on each record under an exclusive ``flock``.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .._version import __version__
from ..facts import files, process
from . import record_fields

log = logging.getLogger(__name__)

INCIDENTS = "smemguard_incidents"
RECOVERY = "smemguard_recovery_seconds"
REMEMBERED = "smemguard_remembered"
INFO = "smemguard_info"
#: The record fields that label smemguard_incidents_total, in the declaration's order; ``device`` is labelled by its
#: GPU's name (``gpu``): a device object is no label value.
LABEL_FIELDS = record_fields.fields_read_by("metrics", record_fields.LABEL)
INCIDENT_LABELS = tuple("gpu" if name == "device" else name for name in LABEL_FIELDS)
INFO_LABELS = ("version", "triton", "mode", "limit")
#: A textfile holds a few lines per kernel; one larger than this is not smemguard's.
MAX_TEXTFILE = 8 * 2**20
#: Records kept for the textfile while its lock is busy (added at the next update that gets it); beyond, the oldest
#: are dropped (a lock held that long is no writer's: the count a scraper sees then stops, as it would anyway).
MAX_WAITING = 10_000
#: Upper bounds (s) of the recovery histogram: from candidates found in Triton's cache
#: (milliseconds) to a ladder of cold compiles and the tuner's benchmark (seconds).
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_HELP = {
    INCIDENTS: "Launches smemguard handled (one per incident record), by kernel, resource, action and GPU",
    RECOVERY: "Time from catching the error to the decision, compiles included",
    REMEMBERED: "Incidents decided from memory (SMEMGUARD_CACHE_DIR) rather than by trying candidates",
    INFO: "smemguard is installed: its version, Triton's, the mode and the emulated limit (bytes, or device)",
}



class _Exporter:
    """The process's exporter: its live series are in prometheus_client's default registry, which a process has
    one of (a series is registered once per process), and the textfile it writes; configured by the install in
    force."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entered when an import inside count() runs the post-import hook
        self.live = None  # the live series, once created; False when they cannot be (no prometheus_client, names taken)
        self.client_missing = False
        self.info_labels: tuple[str, ...] | None = None
        self.settings = None  # the installed guard's settings
        self.textfile: Path | None = None
        self.last_written: tuple | None = None  # (path, the text this process wrote there last, its Tally)
        self.waiting: list[dict] = []  # records counted while another process held the textfile's lock
        self.watching = False  # the post-import hook on prometheus_client is registered


_exporter = _Exporter()


def labels_of(record: dict) -> dict[str, str]:
    """The labels of ``smemguard_incidents_total`` for one record (the others take its ``kernel``)."""
    labels = {name: str(record.get(name, "?")) for name in LABEL_FIELDS if name != "device"}
    device = record.get("device")
    if isinstance(device, dict):
        labels["gpu"] = device.get("name") or f"{device.get('backend', '?')}:{device.get('arch', '?')}"
    else:  # the DeepGEMM patch's records name no device
        labels["gpu"] = "unknown"
    return labels


def _recovery_seconds(record: dict) -> float | None:
    value = record.get("recovery_ms")
    return value / 1000 if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


@dataclass
class Tally:
    """The incident series as plain numbers: what records add up to, printable in exposition format."""

    incidents: Counter = field(default_factory=Counter)  # (kernel, resource, action, gpu) -> records
    remembered: Counter = field(default_factory=Counter)  # kernel -> records
    recovery: dict = field(default_factory=dict)  # kernel -> ([records per bucket, +Inf last], sum of seconds)

    @classmethod
    def of(cls, records: Iterable[dict]) -> "Tally":
        tally = cls()
        for record in records:
            tally.add(record)
        return tally

    def add(self, record: dict) -> None:
        labels = labels_of(record)
        self.incidents[tuple(labels[name] for name in INCIDENT_LABELS)] += 1
        if record.get("remembered") is True:
            self.remembered[labels["kernel"]] += 1
        seconds = _recovery_seconds(record)
        if seconds is not None:
            counts, total = self.recovery.get(labels["kernel"], ([0] * (len(BUCKETS) + 1), 0.0))
            counts[next((i for i, bound in enumerate(BUCKETS) if seconds <= bound), len(BUCKETS))] += 1
            self.recovery[labels["kernel"]] = (counts, total + seconds)

    @classmethod
    def parse(cls, text: str) -> "Tally":
        """The series of a file this module wrote; ValueError for anything else."""
        from prometheus_client.parser import text_string_to_metric_families

        tally, cumulative = cls(), {}
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    labels = sample.labels
                    if not (math.isfinite(sample.value) and sample.value >= 0):  # counts and seconds: never so
                        raise ValueError(f"{sample.name} is {sample.value:g}, not a count smemguard wrote")
                    if sample.name == INCIDENTS + "_total":
                        tally.incidents[tuple(labels[name] for name in INCIDENT_LABELS)] += sample.value
                    elif sample.name == REMEMBERED + "_total":
                        tally.remembered[labels["kernel"]] += sample.value
                    elif sample.name == RECOVERY + "_bucket":
                        cumulative.setdefault(labels["kernel"], {})[float(labels["le"])] = sample.value
                    elif sample.name == RECOVERY + "_sum":
                        tally.recovery[labels["kernel"]] = ([], sample.value)
                    elif not sample.name.endswith(("_created", "_count")):
                        raise ValueError(f"a series smemguard does not write: {sample.name}")
        except KeyError as missing:
            raise ValueError(f"a smemguard series without the label {missing}") from None
        if set(cumulative) != set(tally.recovery):
            raise ValueError("a histogram without its buckets or its sum")
        bounds = [*BUCKETS, float("inf")]
        for kernel, (_, total) in tally.recovery.items():
            buckets = cumulative.get(kernel, {})
            if sorted(buckets) != bounds:
                raise ValueError(f"histogram buckets {sorted(buckets)} for {kernel}, not {bounds}")
            running = [buckets[bound] for bound in bounds]
            tally.recovery[kernel] = ([int(n - before) for n, before in zip(running, [0, *running])], total)
        return tally

    def families(self) -> list:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        incidents = CounterMetricFamily(INCIDENTS, _HELP[INCIDENTS], labels=INCIDENT_LABELS)
        for labels, count in sorted(self.incidents.items()):
            incidents.add_metric(labels, count)
        recovery = HistogramMetricFamily(RECOVERY, _HELP[RECOVERY], labels=("kernel",))
        for kernel, (counts, total) in sorted(self.recovery.items()):
            running = [sum(counts[: i + 1]) for i in range(len(counts))]
            recovery.add_metric([kernel], list(zip([str(b) for b in BUCKETS] + ["+Inf"], running)), total)
        remembered = CounterMetricFamily(REMEMBERED, _HELP[REMEMBERED], labels=("kernel",))
        for kernel, count in sorted(self.remembered.items()):
            remembered.add_metric([kernel], count)
        return [incidents, recovery, remembered]

    def exposition(self) -> str:
        """The series in Prometheus' text format (what node_exporter's textfile collector reads)."""
        from prometheus_client import CollectorRegistry, generate_latest

        # Metric families are plain numbers: unlike metric objects, they never write to
        # PROMETHEUS_MULTIPROC_DIR, so printing a report cannot add to a server's /metrics.
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(self.families()))
        return generate_latest(registry).decode()


class _Families:
    def __init__(self, families):
        self._families = families

    def collect(self):
        return self._families


def _client():
    """prometheus_client, or None when it is not installed (then its import is not tried again)."""
    if _exporter.client_missing:
        return None
    try:
        import prometheus_client
    except ImportError:
        _exporter.client_missing = True
        return None
    return prometheus_client


class _Live:
    """The live series in prometheus_client's default registry (files in PROMETHEUS_MULTIPROC_DIR when set)."""

    def __init__(self, client):
        self.incidents = client.Counter(INCIDENTS, _HELP[INCIDENTS], INCIDENT_LABELS)
        self.recovery = client.Histogram(RECOVERY, _HELP[RECOVERY], ("kernel",), buckets=BUCKETS)
        self.remembered = client.Counter(REMEMBERED, _HELP[REMEMBERED], ("kernel",))
        # livemax: one series per configuration across processes, without a pid label.
        self.info = client.Gauge(INFO, _HELP[INFO], INFO_LABELS, multiprocess_mode="livemax")

    def add(self, record: dict) -> None:
        labels = labels_of(record)
        self.incidents.labels(**labels).inc()
        if record.get("remembered") is True:
            self.remembered.labels(labels["kernel"]).inc()
        seconds = _recovery_seconds(record)
        if seconds is not None:
            self.recovery.labels(labels["kernel"]).observe(seconds)


def _live_series():
    """The live series, created on first use; None without prometheus_client (caller holds ``_exporter.lock``)."""
    if _exporter.live is None:
        client = _client()
        if client is None:
            _exporter.live = False
        if _exporter.live is not None:  # False, or created by the post-import hook that importing the client ran
            return _exporter.live or None
        try:
            _exporter.live = _Live(client)
        except ValueError as error:  # a name already registered by someone else
            _exporter.live = False
            process.warn_once(log, ("metrics", "registry"), "smemguard: no Prometheus metrics in this process: %s",
                              error)
    return _exporter.live or None


def configure(settings) -> None:
    """At install (``settings``) and uninstall (None): ``smemguard_info`` and the textfile's path. Never raises.

    smemguard never imports prometheus_client first (before an incident): prometheus_client picks
    its multiprocess mode at import, from ``PROMETHEUS_MULTIPROC_DIR``, which a host may set after
    installing the guard. ``smemguard_info`` appears when the host imports it (at once if it has).
    """
    try:
        with _exporter.lock:
            _exporter.settings = settings
            _exporter.textfile = settings.metrics_file if settings is not None else None
            if _exporter.textfile is not None and importlib.util.find_spec("prometheus_client") is None:
                process.warn_once(log, ("metrics", "client"),
                                  "smemguard: SMEMGUARD_METRICS_FILE=%s needs prometheus_client, which is not "
                                  "installed; no metrics are written. Fix: pip install 'smemguard[metrics]'",
                                  _exporter.textfile)
            if _exporter.watching or settings is None:
                if "prometheus_client" in sys.modules:
                    _publish_info()
                return
            _exporter.watching = True
        import wrapt  # hooks cannot be removed: this one publishes whatever the settings are then

        wrapt.register_post_import_hook(_publish_info, "prometheus_client")
    except Exception:  # metrics are never the reason smemguard does not install
        process.warn_once(log, ("metrics", "configure"), "smemguard: could not set up its Prometheus metrics",
                          exc_info=True)


def _publish_info(_module=None) -> None:
    """``smemguard_info`` 1 for the installed guard's settings, none when not installed. Never raises."""
    from ..facts import process

    try:
        with _exporter.lock:
            live = _live_series()
            if live is None:
                return
            published, settings = _exporter.info_labels, _exporter.settings
            if published is not None:
                live.info.labels(*published).set(0)  # in PROMETHEUS_MULTIPROC_DIR, a removed series keeps its value
                live.info.remove(*published)
                _exporter.info_labels = None
            if settings is not None:
                limit = str(settings.max_shared) if settings.max_shared is not None else "device"
                _exporter.info_labels = (__version__, process.triton_version(), settings.mode, limit)
                live.info.labels(*_exporter.info_labels).set(1)
    except Exception:
        process.warn_once(log, ("metrics", "info"), "smemguard: could not publish smemguard_info", exc_info=True)


def count(record: dict) -> None:
    """Add one incident record to the live series and to SMEMGUARD_METRICS_FILE. Never raises."""
    try:
        with _exporter.lock:
            live = _live_series()
            if live is not None:
                live.add(record)
            if _exporter.textfile is not None and _client() is not None:
                _update_textfile(_exporter.textfile, record)
    except Exception:
        process.warn_once(log, ("metrics", "count"), "smemguard: could not count an incident in its Prometheus metrics",
                          exc_info=True)


def _update_textfile(path: Path, record: dict) -> None:
    """Add ``record`` to the textfile: read, add and replace it atomically under an exclusive lock
    (``.<name>.lock`` beside it, :mod:`smemguard.facts.files`), so a reader never sees half a file and
    concurrent writers of the host lose no count. A lock another process holds too long (:class:`files.Busy`): the
    record waits for the next update that gets it (one line). Unwritable: one warning, then the file is left alone."""
    if process.warned(("metrics", str(path))):
        return
    try:
        files.make_directory(path.parent)
        with files.exclusive(path.parent / f".{path.name}.lock"):
            tally = _read_textfile(path)
            _exporter.last_written = None
            for waited in (*_exporter.waiting, record):
                tally.add(waited)
            text = tally.exposition()
            files.replace(path, text, mode=0o644)  # node_exporter usually runs as another user
            _exporter.waiting, _exporter.last_written = [], (path, text, tally)
    except files.Busy as error:
        _exporter.waiting = [*_exporter.waiting, record][-MAX_WAITING:]
        process.warn_once(log, ("metrics busy", str(path)), "smemguard: %s; the incident is counted there at the "
                          "next update that gets the lock (%d waiting)", error, len(_exporter.waiting))
    except OSError as error:
        process.warn_once(log, ("metrics", str(path)),
                          "smemguard: cannot write metrics to %s (%s); it is left as it is. Fix: point "
                          "SMEMGUARD_METRICS_FILE at a writable file.", path, error.strerror or error)


def _read_textfile(path: Path) -> Tally:
    """The textfile's series; one that is not smemguard's is moved aside (nothing lost) and started anew.
    Parsing is most of an update's cost: the text this process wrote last is not parsed again."""
    try:
        text = files.read_bytes(path, MAX_TEXTFILE, follow_links=False).decode("utf-8")
        if _exporter.last_written is not None and _exporter.last_written[:2] == (path, text):
            return _exporter.last_written[2]
        return Tally.parse(text)
    except FileNotFoundError:
        return Tally()
    except (ValueError, files.Refused) as error:  # UnicodeDecodeError too; too large, a link, not a regular file
        aside = files.move_aside(path)
        log.warning("smemguard: %s is not a metrics file smemguard wrote (%s); moved it to %s and started anew",
                    path, error, aside)
        return Tally()
