"""The incident record is declared once (store.record_fields.FIELDS): its writers, its readers (report, replay, the
metrics) and docs/INCIDENTS.md all name the same fields, so a field added to one of them alone fails here."""

import ast
import re
from pathlib import Path

import pytest

import smemguard
from smemguard.facts.install import Notes
from smemguard.store import incidents, metrics
from smemguard.cli import rebuild, replay, report
from smemguard.store import record_fields
from smemguard.store.record_fields import FIELDS, LABEL, NEEDED, READ, SHOWN

PACKAGE = Path(smemguard.__file__).parent
DOCS = PACKAGE.parent / "docs" / "INCIDENTS.md"
DECLARED = {field.name for field in FIELDS}
READERS = {"report": (report,), "replay": (replay, rebuild), "metrics": (metrics,)}
#: Where each source builds its own fields (``extras``), or the function whose returned dict they are.
SOURCES = {
    record_fields.LAUNCH: "engine/records.py",
    record_fields.DESCRIBED_LAUNCH: ("kernels/recorded.py", "launch_fields"),
    record_fields.DESCRIBED_COMPILE: ("kernels/recorded.py", "compile_fields"),
    record_fields.COMPILE: "engine/compile_fit.py",
    record_fields.INDUCTOR: "engine/inductor.py",
    record_fields.FLEX: "engine/flex.py",
    record_fields.DECLARED_WRAPPER: "engine/wrapper_outcomes.py",
    record_fields.DEEPGEMM: "engine/deepgemm.py",
}
COMMON = (record_fields.EVERY, record_fields.WHILE_UNVERIFIED, record_fields.TRITON)


def documented_fields() -> list[str]:
    """The fields named in the first column of docs/INCIDENTS.md's field tables."""
    names, in_table = [], False
    for line in DOCS.read_text().splitlines():
        if re.fullmatch(r"\|\s*field\s*\|\s*meaning\s*\|", line.strip()):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("|---"):
            names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def declared_for(reader: str) -> set[str]:
    return set(record_fields.fields_read_by(reader, NEEDED, READ, LABEL, SHOWN))


def _is_a_record(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("record", "incident")) or (
        isinstance(node, ast.Attribute) and node.attr == "fields")


def fields_read_in(modules) -> set[str]:
    """The field names the modules' code reads from a record by name: ``record["x"]``, ``record.get("x")``."""
    found = set()
    for node in (node for module in modules for node in ast.walk(ast.parse(Path(module.__file__).read_text()))):
        if isinstance(node, ast.Subscript):
            target, key = node.value, node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            target, key = node.func.value, node.args[0] if node.args else None
        else:
            continue
        if _is_a_record(target) and isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.add(key.value)
    return found


def extras_written_in(source) -> set[str]:
    """The keys of the dict literals a module passes as a record's ``extras``, assigns to ``extras`` or adds to it;
    for (path, function), those of the dict literals the function returns."""
    path, function = source if isinstance(source, tuple) else (source, None)
    tree = ast.parse((PACKAGE / path).read_text())
    if function is not None:
        [definition] = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == function]
        return {key.value for node in ast.walk(definition) if isinstance(node, ast.Return)
                and isinstance(node.value, ast.Dict) for key in node.value.keys if isinstance(key, ast.Constant)}
    dicts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras":
            dicts.append(node.value)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(target, ast.Name) and target.id == "extras" for target in targets):
                dicts.append(node.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "extras"):
            dicts += node.args
    return {key.value for found in dicts if isinstance(found, ast.Dict) for key in found.keys
            if isinstance(key, ast.Constant)}


def test_each_field_is_declared_once_with_known_writers_and_uses():
    assert len(DECLARED) == len(FIELDS)
    for field in FIELDS:
        assert field.written_by and set(field.written_by) <= {*COMMON, *SOURCES}, field
        assert {field.report, field.replay, field.metrics} <= {None, NEEDED, READ, LABEL, SHOWN}, field


def test_the_docs_tables_name_exactly_the_declared_fields():
    documented = documented_fields()
    assert set(documented) - DECLARED == set(), "documented in docs/INCIDENTS.md, not declared in FIELDS"
    assert DECLARED - set(documented) == set(), "declared in FIELDS, missing from docs/INCIDENTS.md's tables"


@pytest.mark.parametrize("reader", ["report", "replay"])
def test_a_readers_checks_are_of_the_fields_declared_for_it(reader):
    module = READERS[reader][0]
    assert set(module.REQUIRED) == set(record_fields.fields_read_by(reader, NEEDED))
    assert set(module.OPTIONAL) == set(record_fields.fields_read_by(reader, READ))
    assert list(module.CHECKS) == [*module.REQUIRED, *module.OPTIONAL]  # the order problems are listed in


@pytest.mark.parametrize("reader", ["report", "replay"])
def test_a_check_beyond_the_declaration_or_a_declared_field_unchecked_is_refused(reader):
    checks = READERS[reader][0].CHECKS
    with pytest.raises(ValueError, match="beyond the fields"):
        record_fields.required_and_optional(reader, {**checks, "not_declared": checks["kernel"]})
    with pytest.raises(ValueError, match=r"lacks checks of \['kernel'\]"):
        record_fields.required_and_optional(reader, {name: check for name, check in checks.items() if name != "kernel"})


def test_the_metrics_labels_are_the_fields_declared_as_labels_in_the_series_order():
    assert metrics.LABEL_FIELDS == record_fields.fields_read_by("metrics", LABEL) == ("kernel", "resource", "action",
                                                                                  "device")
    assert metrics.INCIDENT_LABELS == ("kernel", "resource", "action", "gpu")


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_reader_reads_by_name_only_the_fields_declared_for_it(reader):
    modules = READERS[reader]
    read = fields_read_in(modules) | set(getattr(modules[0], "LABEL_FIELDS", ()))
    assert read == declared_for(reader)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_source_writes_the_fields_declared_as_its_own(source):
    declared = {field.name for field in FIELDS if source in field.written_by}
    assert extras_written_in(SOURCES[source]) == declared


@pytest.mark.parametrize("device", [None, 0], ids=["deepgemm", "triton"])
@pytest.mark.parametrize("unverified", [[], ["kernel_interface (triton 9.9.0)"]], ids=["verified", "unverified"])
def test_every_record_carries_the_common_fields_declared(monkeypatch, device, unverified):
    notes = Notes()
    if unverified:
        notes.note_patch("kernel_interface", "triton", "9.9.0", verified=False)
    monkeypatch.setattr(incidents.process, "notes", lambda: notes)
    monkeypatch.setattr(incidents.process, "triton_version", lambda: "9.9.0")
    monkeypatch.setattr(incidents.process, "device_description", lambda index: {"index": index})
    monkeypatch.setattr(incidents.process, "device_limit", lambda index: 101376)
    record = incidents.Incident(kernel="m:k", launched_as="JITFunction", phase="launch", action="reraised",
                                final=None, resource="shared memory", required=1, limit_hit=1, started=0.0,
                                device=device).record()
    incidents.write(record, None)
    common = (record_fields.EVERY, *([record_fields.TRITON] if device is not None else []),
              *([record_fields.WHILE_UNVERIFIED] if unverified else []))
    assert set(record) == {field.name for field in FIELDS if set(field.written_by) & set(common)}
