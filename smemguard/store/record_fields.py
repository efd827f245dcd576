"""The incident record's fields, declared once: who writes each (every record, or one source) and how each
reader takes it (``smemguard report``, ``smemguard replay``, the Prometheus series). What each field means is
docs/INCIDENTS.md's tables; tests/test_incident_declaration.py keeps them, the writers and the readers equal to
this declaration."""

from __future__ import annotations

import dataclasses

SCHEMA = 1
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"  # the records' "time"; `smemguard report` parses it back


#: Who writes a field: every record (some only while a patch is unverified), every record of a Triton kernel (not
#: DeepGEMM's), or one source.
EVERY = "every record"
WHILE_UNVERIFIED = "every record, while some patch runs above the newest release it was checked against"
TRITON = "every record of a Triton kernel"
LAUNCH = "the launch guard"
DESCRIBED_LAUNCH = "the launch behind it (kernels.recorded.launch_fields): the launch guard's and a warm-up's, the " \
    "compile-time core's and a pin's where a launch caused the compile, a wrapper's that chose its tiles again"
DESCRIBED_COMPILE = "what a compile was given (kernels.recorded.compile_fields): the compile-time core's, a pin's " \
    "and Inductor's load recovery's"
COMPILE = "the compile-time core"
INDUCTOR = "Inductor's load recovery"
FLEX = "FlexAttention's configs"
DECLARED_WRAPPER = "a wrapper declared with rerun_on_overflow (a library's or a pack's)"
DEEPGEMM = "the DeepGEMM patch"

#: How a reader takes a field. NEEDED: a record without it, or with a wrong one, is refused; READ: used when present,
#: left out when wrong; LABEL: labels smemguard_incidents_total; SHOWN: only printed, or read from the record replay's
#: own run just wrote, so it needs no check.
NEEDED, READ, LABEL, SHOWN = "needed", "read", "label", "shown"


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of the incident record: who writes it, and how ``smemguard report``, ``smemguard replay`` and the
    Prometheus series (:mod:`smemguard.store.metrics`) take it (None: not at all)."""

    name: str
    written_by: tuple[str, ...]
    report: str | None = None
    replay: str | None = None
    metrics: str | None = None


#: The order is the labels' order in smemguard_incidents_total (kernel, resource, action, then device's gpu).
FIELDS = (
    Field("schema", (EVERY,)),
    Field("id", (EVERY,), replay=READ),
    Field("time", (EVERY,), report=READ),
    Field("pid", (EVERY,)),
    Field("host", (EVERY,)),
    Field("rank", (EVERY,)),
    Field("kernel", (EVERY,), report=NEEDED, replay=NEEDED, metrics=LABEL),
    Field("verified", (WHILE_UNVERIFIED,)),
    Field("unverified", (WHILE_UNVERIFIED,)),
    Field("launched_as", (EVERY,), replay=READ),
    Field("phase", (EVERY,)),
    Field("resource", (EVERY,), report=READ, replay=NEEDED, metrics=LABEL),
    Field("required", (EVERY,), replay=NEEDED),
    Field("limit_hit", (EVERY,), replay=NEEDED),
    Field("action", (EVERY,), report=NEEDED, replay=NEEDED, metrics=LABEL),
    Field("final", (EVERY,), replay=READ),
    Field("reason", (EVERY,)),
    Field("attempts", (EVERY,), replay=SHOWN),
    Field("compiles", (EVERY,)),
    Field("remembered", (EVERY,), metrics=READ),
    Field("internal_errors", (EVERY,)),
    Field("internal_steps", (EVERY,)),
    Field("recovery_ms", (EVERY,), report=READ, metrics=READ),
    Field("triton", (TRITON,)),
    Field("device", (TRITON,), report=READ, replay=NEEDED, metrics=LABEL),
    Field("limit", (TRITON,), replay=READ),
    Field("source", (DESCRIBED_LAUNCH, DESCRIBED_COMPILE), replay=READ),
    Field("source_hash", (DESCRIBED_LAUNCH, DESCRIBED_COMPILE), replay=SHOWN),
    Field("num_warps", (DESCRIBED_LAUNCH, DESCRIBED_COMPILE), replay=NEEDED),
    Field("num_stages", (DESCRIBED_LAUNCH, DESCRIBED_COMPILE), replay=NEEDED),
    Field("constexprs", (DESCRIBED_LAUNCH, DESCRIBED_COMPILE), replay=NEEDED),
    Field("config", (DESCRIBED_LAUNCH, DESCRIBED_COMPILE, INDUCTOR, FLEX, DECLARED_WRAPPER),
          replay=NEEDED),
    Field("grid", (DESCRIBED_LAUNCH,), replay=READ),
    Field("args", (DESCRIBED_LAUNCH, DEEPGEMM), report=READ, replay=READ),
    Field("signature", (DESCRIBED_COMPILE,), replay=READ),
    Field("specialization", (DESCRIBED_LAUNCH, DESCRIBED_COMPILE), replay=READ),
    Field("autotune_key", (DESCRIBED_LAUNCH,)),
    Field("compile_ms", (LAUNCH, INDUCTOR)),
    Field("skipped", (LAUNCH,)),
    Field("timings_ms", (LAUNCH,)),
    Field("inductor", (INDUCTOR,), replay=READ),
    Field("head_dim", (FLEX,)),
    Field("dtype", (FLEX,)),
    Field("shape_class", (DECLARED_WRAPPER,)),
    Field("choice", (DECLARED_WRAPPER,)),
    Field("slots", (DEEPGEMM,)),
    Field("variant", (DEEPGEMM,)),
    Field("deep_gemm", (DEEPGEMM,)),
    Field("error", (DEEPGEMM,)),
)


def fields_read_by(reader: str, *uses: str) -> tuple[str, ...]:
    """The names of the fields ``reader`` (``"report"``, ``"replay"`` or ``"metrics"``) takes as one of ``uses``,
    in :data:`FIELDS`' order."""
    return tuple(field.name for field in FIELDS if getattr(field, reader) in uses)


def required_and_optional(reader: str, checks: dict) -> tuple[dict, dict]:
    """A reader's own checks, by field, split as :data:`FIELDS` says: the fields a record must have (NEEDED) and
    those checked when present (READ), each in ``checks``' order. A check of a field the declaration does not give
    the reader, or a field it gives without a check, is a ValueError at import: no reader has fields of its own."""
    needed, declared = fields_read_by(reader, NEEDED), set(fields_read_by(reader, NEEDED, READ))
    if set(checks) != declared:
        raise ValueError(f"smemguard {reader} checks {sorted(set(checks) - declared)} beyond the fields "
                         f"record_fields.FIELDS gives it, and lacks checks of {sorted(declared - set(checks))}")
    return ({name: check for name, check in checks.items() if name in needed},
            {name: check for name, check in checks.items() if name not in needed})
