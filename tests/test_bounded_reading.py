"""Hostile input, round 3 (issue 33, items 4, 11 and 12): what `report` and `replay` read is bounded, in lines
printed, memory and time, whatever the file holds; a record of another schema is skipped and counted; a record
of huge tensors replays without a GPU in the memory of a small one."""

from __future__ import annotations

import gzip
import json
import time

from hypothesis import HealthCheck, given, settings, strategies as st

from smemguard.cli import commands, report
from smemguard.facts import untrusted

from conftest import run_python
from test_untrusted_input import RECORD, json_value, run

#: Bytes a command may add to the peak memory of the process it runs in, over any file of these tests.
MAX_GROWTH = 32 * 2**20


def test_300000_bad_lines_give_a_screenful_in_bounded_memory(tmp_path):
    """150000 lines that are not JSON and 150000 records that replay cannot use: each command names the first
    MAX_NAMED bad lines and counts the rest in one line, and neither keeps anything per line (before: 300000
    lines of stderr, ~200 B of memory per line, and replay kept every record)."""
    path = tmp_path / "i.jsonl"
    path.write_bytes((b"x\n" + json.dumps({"schema": 1, "kernel": "m:k", "action": "x"}).encode() + b"\n") * 150_000)
    result = run_python(f"""
        import contextlib, io, json, resource
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))  # a leak ends in MemoryError, not swap
        import torch  # replay's import, in the peak before the commands
        from smemguard import cli
        found = {{}}
        for command in ("report", "replay"):
            err = io.StringIO()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
                status = cli.main([command, {str(path)!r}])
            grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) * 1024
            found[command] = status, out.getvalue(), err.getvalue(), grown
        print(json.dumps(found))
    """)
    found = json.loads(result.stdout)
    status, out, err, grown = found["report"]
    lines = err.splitlines()
    assert status == 2 and len(lines) == report.MAX_NAMED + 1, err
    assert lines[0] == f"smemguard report: {path}:1: not JSON (Expecting value at column 1); line skipped"
    assert lines[-1].startswith("smemguard report: 150000 line(s) not fully used, the first 20 listed above;")
    assert out.splitlines()[1].split()[:2] == ["m:k", "?"] and " 150000 " in out, "every record counted"
    assert grown < MAX_GROWTH, f"report grew by {grown} B"
    status, out, err, grown = found["replay"]
    lines = err.splitlines()
    assert status == 2 and out == "" and lines[report.MAX_NAMED] == (
        "smemguard replay: 150000 line(s) not fully used, the first 20 listed above; not counted by --index"), err
    assert lines[report.MAX_NAMED + 1] == f"smemguard replay: {path}:300000: cannot replay this record:", \
        "the last record, with the others not kept"
    assert grown < MAX_GROWTH, f"replay grew by {grown} B"


def test_a_gzip_of_256_mib_of_blank_lines_is_read_in_seconds(tmp_path, capsys):
    """Blank lines are skipped a run at a time, and still numbered (before: 75 s for 100 MiB, one line at a time)."""
    path = tmp_path / "i.jsonl.gz"
    blank_mib = gzip.compress(b"\n" * 2**20, mtime=0)  # 1 KiB: the file is gzip members, one after the other
    path.write_bytes(blank_mib * 256 + gzip.compress(json.dumps(RECORD).encode() + b"\nx\n", mtime=0))
    started = time.monotonic()
    assert commands.main(["report", "--json", str(path)]) == 2
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert [row["count"] for row in json.loads(out)["rows"]] == [1]
    assert err.splitlines()[0] == f"smemguard report: {path}:{2**28 + 2}: not JSON (Expecting value at column 1); " \
                                  "line skipped"
    assert elapsed < 15, f"{elapsed:.1f} s"


def test_reading_stops_after_max_lines_that_are_not_blank_and_says_where(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(untrusted, "MAX_LINES", 1000)
    path = tmp_path / "i.jsonl"
    path.write_text((json.dumps(RECORD) + "\n\n") * 1500)  # a blank line after each: numbered, not counted
    assert commands.main(["report", "--json", str(path)]) == 2
    out, err = capsys.readouterr()
    assert [row["count"] for row in json.loads(out)["rows"]] == [1000]
    assert err == f"smemguard report: {path}: holds more than 1,000 lines that are not blank; reading stopped at " \
                  "line 2001; lines 1 to 2000 are read\n"


def test_a_sparse_file_of_5_gib_says_its_first_line_is_too_long(tmp_path, capsys, monkeypatch):
    """Issue 33, item 11: the 5 GiB of zeros of a sparse file are one line over the line cap, and reading stops at
    the byte cap inside it (before: "the lines before line 1 are read"). Gzipped, the cap counts what gunzip gives."""
    monkeypatch.setattr(untrusted, "MAX_LINES_BYTES", 2**30)  # 1 GiB of zeros to read, not 4, to keep it quick
    sparse = tmp_path / "sparse.jsonl"
    with open(sparse, "wb") as out:
        out.truncate(5 * 2**30)
    zipped = tmp_path / "zeros.jsonl.gz"
    zipped.write_bytes(gzip.compress(bytes(2**20), mtime=0) * 1025)
    for path, after in ((sparse, ""), (zipped, " after gunzip")):
        assert commands.main(["report", str(path)]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"smemguard report: {path}:1: longer than 16 MiB; line skipped",
            f"smemguard report: {path}: holds more than 1 GiB{after}; reading stopped there, in line 1",
            "smemguard report: 1 line(s) not fully used, listed above; the report counts the rest. Fix or delete them "
            "(a line cut short is usually from a process killed while writing it)."]


_NO_SCHEMA = object()


def _strict(value) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:  # NaN or an infinity: the line would be a bad line, not a record of another schema
        return False
    return True


other_schema = st.sampled_from([0, 2, "1", None, True, 1.0, _NO_SCHEMA]) | json_value.filter(
    lambda value: not (type(value) is int and value == 1) and _strict(value))


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schemas=st.lists(other_schema, min_size=1, max_size=4), as_json=st.booleans())
def test_records_of_another_schema_are_skipped_and_counted_in_one_line(tmp_path, schemas, as_json):
    """Issue 33, item 11: a record whose schema is not the integer 1 (0, 2, "1", null, true, 1.0, none at all, any
    JSON) is not counted; one line says how many were skipped and what the first one holds."""
    records = [{key: value for key, value in RECORD.items() if key != "schema"} for _ in schemas]
    for record, schema in zip(records, schemas):
        if schema is not _NO_SCHEMA:
            record["schema"] = schema
    path = tmp_path / "i.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in [*records, RECORD]))
    status, out, err = run(["report", str(path)] + (["--json"] if as_json else []))
    why = ("no 'schema' field (1, the schema this smemguard reads)" if schemas[0] is _NO_SCHEMA else
           f"'schema' is {untrusted.shown(schemas[0])}, expected 1, the schema this smemguard reads")
    assert status == 2 and err == (f"smemguard report: {path}: {len(schemas)} record(s) of another schema skipped; "
                                   f"the first, line 1: {untrusted.printable(why)}\n"), err
    if as_json:
        document = json.loads(out)
        assert [row["count"] for row in document["rows"]] == [1], "only the record of schema 1"
        assert [(skipped["line"], skipped["count"]) for skipped in document["other_schema"]] == [(1, len(schemas))]
    else:
        assert " 1 " in out.splitlines()[1]


def test_replay_skips_a_record_of_another_schema(tmp_path, capsys):
    path = tmp_path / "i.jsonl"
    path.write_text(json.dumps({**RECORD, "schema": 2}) + "\n")
    assert commands.main(["replay", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"smemguard replay: {path}: 1 record(s) of another schema skipped; the first, line 1: 'schema' is 2, "
        "expected 1, the schema this smemguard reads",
        f"smemguard replay: {path}: no incident record"]


def test_replay_without_a_gpu_of_three_16_gib_tensors_needs_no_memory_for_them(tmp_path):
    """Issue 33, item 12: compiling only, replay builds the tensors on the meta device (shapes, strides, dtype,
    alignment, no memory): under a 2 GiB address-space limit the record is reproduced and recovered (before: 48 GiB
    of address space reserved, and "cannot rebuild argument" under any limit below that)."""
    record = json.loads(json.dumps(RECORD))
    for name in ("a_ptr", "b_ptr", "c_ptr"):
        record["args"][name].update(shape=[2**17, 2**16], stride=[2**16, 1])  # 16 GiB of float16 each
    path = tmp_path / "i.jsonl"
    path.write_text(json.dumps(record) + "\n")
    result = run_python(f"""
        import contextlib, io, json, resource
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
        from smemguard import cli
        with contextlib.redirect_stdout(io.StringIO()) as out:
            status = cli.main(["replay", {str(path)!r}])
        print(json.dumps([status, out.getvalue(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))
    """)
    status, out, peak = json.loads(result.stdout)
    assert status == 0 and "Traceback" not in result.stderr, result.stderr
    assert "reproduced: OutOfResources shared memory, required 49152 B, limit 40000 B (same as recorded)" in out
    assert "smemguard: stages_reduced" in out
    assert peak < 2**30, f"peak RSS {peak} B"
