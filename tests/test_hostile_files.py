"""Hostile input, round 2 (issue 24): FIFOs and devices, huge numbers in records and decisions, a
decision cache other users can write, and commands that must fail with one line, never hang."""

from __future__ import annotations

import json
import os

import pytest
import torch

import smemguard
from smemguard.cli import commands
from smemguard.store import decision_cache
from smemguard.kernels import registry
from smemguard.facts import settings as smemguard_settings
from smemguard.testing import fake_gpu

from conftest import run_python
from kernels import matmul_args, matmul_kernel
from test_untrusted_input import DECISIONS, RECORD


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_fifo_is_refused_at_once_never_waited_on(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    result = run_python(f"""
        import contextlib, io, json, os, signal
        from pathlib import Path
        signal.alarm(120)  # a blocking open would wait for a writer forever: the alarm ends it, failing the test
        from smemguard.cli import commands
        from smemguard.facts import settings
        from smemguard.store import decision_cache, incidents
        fifo = Path({str(fifo)!r})
        found = {{}}
        for argv in (["report", str(fifo)], ["replay", str(fifo)],
                     ["cache", "import", str(fifo), "--dir", str(fifo.parent / "cache")]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                found[argv[0]] = (commands.main(argv), err.getvalue())
        found["record written to"] = incidents.write({{"kernel": "m:k"}}, fifo)
        found["setting"] = settings.load({{"SMEMGUARD_LOG": str(fifo)}}).problems
        (fifo.parent / "served").mkdir(mode=0o700)
        os.mkfifo(fifo.parent / "served" / "decisions.json")
        found["stored"] = decision_cache.Store(fifo.parent / "served").get("compile", "case")
        print(json.dumps(found))
    """)
    found = json.loads(result.stdout)
    for command in ("report", "replay", "cache"):
        status, err = found[command]
        assert status == 2 and "FIFO" in one_line(err), (command, err)
    assert not (tmp_path / "cache").exists(), "nothing imported, nothing created"
    assert found["record written to"] is None and found["stored"] is None
    [problem] = found["setting"]
    assert problem.startswith("SMEMGUARD_LOG=") and "not a regular file" in problem


@pytest.mark.parametrize("argv", [["report", "/dev/zero"], ["replay", "/dev/zero"], ["cache", "import", "/dev/zero"]])
def test_a_device_is_refused_not_read_forever(argv, tmp_path, capsys):
    if argv[0] == "cache":
        argv = [*argv, "--dir", str(tmp_path / "cache")]
    assert commands.main(argv) == 2
    assert "a character device, not a regular file" in one_line(capsys.readouterr().err)


def test_a_decision_file_too_large_is_refused_with_one_line(tmp_path, capsys):
    huge = tmp_path / "fleet.json"
    with open(huge, "wb") as out:
        out.truncate(decision_cache.MAX_FILE + 1)
    assert commands.main(["cache", "import", str(huge), "--dir", str(tmp_path / "cache")]) == 2
    assert "larger than 8 MiB" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("value", ["/dev/full", "/dev/null"])
def test_smemguard_log_must_be_a_regular_file(value):
    settings = smemguard_settings.load({"SMEMGUARD_LOG": value})
    assert settings.log_path is None and "not a regular file" in settings.problems[0]


@pytest.mark.parametrize("name, gpu", [("4090", "RTX4090"), ("3090", "RTX3090"), ("5090", "RTX5090")])
def test_a_number_that_names_a_gpu_is_that_gpu(name, gpu):
    settings = smemguard_settings.load({"SMEMGUARD_MAX_SHARED": name})
    assert (settings.max_shared, settings.max_shared_label) == (101376, gpu) and settings.problems == ()


def test_a_byte_count_too_long_is_a_problem_line():
    [problem] = smemguard_settings.load({"SMEMGUARD_MAX_SHARED": "9" * 5000}).problems
    assert "too large" in problem


ENTRY = DECISIONS["compile"]["a" * 24]


@pytest.mark.parametrize("options", [{"num_stages": 2147483647}, {"num_stages": 10**30}, {"num_warps": 3},
                                     {"num_warps": 64}, {"num_stages": 0}])
def test_cache_import_refuses_options_recovery_could_not_have_produced(tmp_path, capsys, options):
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps({"schema": 1, "compile": {"x" * 24: {**ENTRY, "options": options}}, "launch": {}}))
    assert commands.main(["cache", "import", str(fleet), "--dir", str(tmp_path / "cache")]) == 2
    assert "'options' is" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists(), "no usable entry: nothing created"


def test_a_cache_other_users_can_write_is_refused(tmp_path, capsys, caplog):
    cache = tmp_path / "cache"
    decision_cache.Store(cache).put("compile", "case", ENTRY)
    os.chmod(cache, 0o777)
    assert commands.main(["cache", "show", "--dir", str(cache)]) == 2
    assert "can be written by others" in one_line(capsys.readouterr().err)
    assert decision_cache.Store(cache).get("compile", "case") is None, "a serving process refuses it too"
    assert "refusing the decision cache" in caplog.text and "chmod go-w" in caplog.text
    os.chmod(cache, 0o700)
    os.chmod(cache / decision_cache.FILE_NAME, 0o620)
    assert commands.main(["cache", "import", str(cache / decision_cache.FILE_NAME), "--dir", str(cache)]) == 2
    assert "decisions.json can be written by its group" in one_line(capsys.readouterr().err)
    os.chmod(cache / decision_cache.FILE_NAME, 0o600)
    assert decision_cache.Store(cache).get("compile", "case") == ENTRY


def test_a_stored_stage_count_above_the_variants_own_is_ignored(tmp_path, install_guard, triton_cache, caplog):
    cache = tmp_path / "cache"
    storage = torch.empty(256 * 256 + 8, dtype=torch.float16)
    a = storage[: 256 * 256].view(256, 256)
    b, c = torch.empty(256, 256, dtype=torch.float16), torch.empty(256, 256, dtype=torch.float16)

    def launch():
        with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
            matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)
        return gpu.launches[-1]

    install_guard(cache_dir=cache)
    assert launch().num_stages == 3
    smemguard.uninstall()
    stored = json.loads((cache / decision_cache.FILE_NAME).read_text())
    [key] = stored["compile"]
    stored["compile"][key]["options"] = {"num_stages": 8}  # within the schema, above the variant's 4
    (cache / decision_cache.FILE_NAME).write_text(json.dumps(stored))
    install_guard(cache_dir=cache)
    assert launch().num_stages == 3, "recovered as if nothing were stored"
    [warning] = [r.getMessage() for r in caplog.records if "ignoring stored decision" in r.getMessage()]
    assert f"{key} (num_stages 8 is more than the 4 of the variant it replaces)" in warning


def test_report_json_stays_json_when_sums_would_overflow(tmp_path, capsys):
    path = tmp_path / "i.jsonl"
    path.write_text("\n".join(json.dumps({**RECORD, "recovery_ms": 1.7e308}) for _ in range(2)) + "\n")
    assert commands.main(["report", "--json", str(path)]) == 2
    out, err = capsys.readouterr()
    document = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert document["rows"][0]["count"] == 2
    assert "'recovery_ms' is 1.7e+308, expected a number of milliseconds from 0 to 86400000" in err


@pytest.mark.parametrize("field, value, named", [
    ("num_stages", 1000000, "'num_stages' is 1000000"), ("num_warps", 3, "'num_warps' is 3"),
    ("grid", [2**40, 1], "'grid' is"), ("device", {"backend": "cuda", "arch": 12}, "'device.arch' is 12"),
    ("device", {"backend": "cuda", "arch": 1000000000}, "'device.arch' is 1000000000"),
    ("device", {"backend": "vulkan", "arch": 89}, "'device.backend' is \"vulkan\""),
])
def test_replay_refuses_values_out_of_bounds_before_compiling(tmp_path, capsys, field, value, named):
    path = tmp_path / "i.jsonl"
    path.write_text(json.dumps({**RECORD, field: value}) + "\n")
    assert commands.main(["replay", str(path)]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["torch.complex128", "torch.qint8"])
def test_replay_names_a_dtype_triton_has_no_type_for(tmp_path, capsys, dtype):
    record = json.loads(json.dumps(RECORD))
    record["args"]["a_ptr"]["dtype"] = dtype
    path = tmp_path / "i.jsonl"
    path.write_text(json.dumps(record) + "\n")
    assert commands.main(["replay", str(path)]) == 2
    assert f"'args.a_ptr.dtype' is \"{dtype}\", expected a torch dtype" in capsys.readouterr().err


def test_replay_of_a_tensor_spanning_more_than_16_gib_is_refused(tmp_path, capsys):
    record = json.loads(json.dumps(RECORD))
    record["args"]["a_ptr"].update(shape=[2**20, 2**20], stride=[2**20, 1])
    path = tmp_path / "i.jsonl"
    path.write_text(json.dumps(record) + "\n")
    assert commands.main(["replay", str(path)]) == 2
    assert "'args.a_ptr' spans more than 16 GiB" in capsys.readouterr().err


def test_check_refuses_what_it_cannot_check_with_exit_2(tmp_path, capsys):
    quits = tmp_path / "quits.py"
    quits.write_text("import sys\nsys.exit(3)\n")
    assert commands.main(["check", str(quits), "--gpu", "L4"]) == 2
    assert "could not be imported: SystemExit: 3" in capsys.readouterr().err
    assert commands.main(["check", str(tmp_path), "--gpu", "L4"]) == 2
    assert "a directory, not a kernel file" in capsys.readouterr().err
    os.mkfifo(tmp_path / "kernels.py")
    assert commands.main(["check", str(tmp_path / "kernels.py"), "--gpu", "L4"]) == 2
    assert "not a regular file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        commands.main(["check", "--examples", "--gpu", "L4", "--jobs", "-3"])
    assert usage.value.code == 2 and "expected a positive number of processes" in capsys.readouterr().err


def test_check_of_a_kernel_that_fails_for_another_reason_is_not_an_overflow(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SMEMGUARD_CACHE_DIR", str(tmp_path / "a-file"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "a-file").write_text("not a directory")
    smemguard_settings.current.cache_clear()
    try:
        status = commands.main(["check", "smemguard.examples:attention_fwd", "--meta",
                           "BLOCK_M=64,BLOCK_N=48,num_warps=4,num_stages=2", "--gpu", "L4", "--quiet"])
    finally:
        smemguard_settings.current.cache_clear()
    out = capsys.readouterr().out
    assert status == 2 and "NO FITTING CONFIG" not in out
    assert "NOT CHECKED: smemguard.examples:attention_fwd" in out and "arange's range must be a power of 2" in out
    assert not (tmp_path / "xdg").exists(), "a bad SMEMGUARD_CACHE_DIR is not replaced by the default cache"


def test_registering_something_that_is_not_a_kernel_says_so():
    with pytest.raises(ValueError, match="not a 'module:qualname'"):
        registry.register_fallback("notakernel", print)
    with pytest.raises(TypeError, match="must be a Triton kernel"):
        registry.register_alternatives(42, [])
    with pytest.raises(TypeError, match="a list of triton.Config objects, not NoneType"):
        registry.register_alternatives(matmul_kernel, None)
    assert registry.fallback_for("notakernel") is None and registry.alternatives_for(matmul_kernel) == ()


def test_replay_compiles_an_amd_record_without_a_gpu(tmp_path, capsys):
    path = tmp_path / "i.jsonl"
    path.write_text(json.dumps({**RECORD, "device": {"backend": "hip", "arch": "gfx942", "name": None}}) + "\n")
    status = commands.main(["replay", str(path)])
    out = capsys.readouterr().out
    assert "no GPU: compiling for gfx942 on a stand-in device with a 40000 B limit" in out
    assert "reproduced: OutOfResources shared memory" in out and status in (0, 1), out


@pytest.mark.parametrize("target_exists", [True, False], ids=["link to a file", "dangling link"])
def test_smemguard_log_never_writes_through_a_symbolic_link(tmp_path, install_guard, caplog, triton_cache,
                                                            target_exists):
    """Issue 33: a SMEMGUARD_LOG that is a symbolic link gets one warning; the file it points at is neither
    appended to nor created, and the launch is recovered all the same."""
    target = tmp_path / "someone-elses.txt"
    if target_exists:
        target.write_text("theirs\n")
    link = tmp_path / "incidents.jsonl"
    link.symlink_to(target)
    install_guard(log_path=link)
    a, b, c = (torch.empty(256, 256, dtype=torch.float16) for _ in range(3))
    with caplog.at_level("WARNING", logger="smemguard"), \
            fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
        matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)
    assert gpu.launches[-1].num_stages == 3, "recovered"
    assert (target.read_text() == "theirs\n") if target_exists else not target.exists()
    [line] = [r.getMessage() for r in caplog.records if "cannot write incident records" in r.getMessage()]
    assert "is a symbolic link" in line


def test_a_held_decisions_lock_is_waited_on_for_a_bounded_time(tmp_path, monkeypatch, capsys, caplog):
    """Issue 33: a ``decisions.lock`` another process holds for ever stops neither ``cache import`` (one line, exit
    2, nothing written) nor a serving process (one warning, the decision kept in memory)."""
    import fcntl
    import time

    from smemguard.facts import files

    monkeypatch.setattr(files, "LOCK_WAIT_S", 0.3)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    source = tmp_path / "decisions.json"
    source.write_text(json.dumps(decision_cache.empty()))
    with open(cache / decision_cache.LOCK_NAME, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        entry = DECISIONS["compile"]
        data = {**decision_cache.empty(), "compile": entry}
        source.write_text(json.dumps(data))
        assert commands.main(["cache", "import", str(source), "--dir", str(cache)]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert "decisions.lock has been held by another process for over 0.3 s" in line
        assert not (cache / decision_cache.FILE_NAME).exists(), "nothing written"
        store = decision_cache.Store(cache)
        key, value = next(iter(entry.items()))
        with caplog.at_level("WARNING", logger="smemguard"):
            assert store.put("compile", key, value) is value
        assert time.monotonic() - started < 5, "bounded, never for ever"
    [warning] = [r.getMessage() for r in caplog.records]
    assert "refusing the decision cache" in warning and "decisions stay in this process" in warning


@pytest.mark.parametrize("text, why", [
    ('{"schema": 1, "compile": {}, "launch": {}, "inductor": {}, "x": NaN}', "NaN is not a JSON number"),
    ('{"schema": 1, "compile": {}, "launch": {}, "inductor": {}, "x": -Infinity}', "-Infinity is not a JSON number"),
    ('{"schema": 1, "compile": {}, "compile": {}, "launch": {}, "inductor": {}}', 'the key "compile" appears twice'),
    ('{"schema": true, "compile": {}, "launch": {}, "inductor": {}}', "schema true, expected 1"),
    ('{"schema": 1.0, "compile": {}, "launch": {}, "inductor": {}}', "schema 1.0, expected 1"),
], ids=["NaN", "Infinity", "duplicate key", "schema true", "schema 1.0"])
def test_decision_files_are_strict_json_of_schema_1(tmp_path, capsys, text, why):
    """Issue 33: what strict parsers reject (NaN, Infinity, a key twice) and a schema that only equals 1 in Python
    are refused with one line; nothing is imported."""
    source = tmp_path / "decisions.json"
    source.write_text(text)
    assert commands.main(["cache", "import", str(source), "--dir", str(tmp_path / "cache")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert why in line and "nothing imported" in line
    assert not (tmp_path / "cache" / decision_cache.FILE_NAME).exists()


def test_a_link_named_as_decisions_lock_is_never_followed(tmp_path, capsys, caplog):
    """Issue 45: opening a link named as ``decisions.lock`` would create its target (as root: an empty file
    anywhere). A serving process gets one warning and keeps the decision in memory; ``cache import`` one line."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    (cache / decision_cache.LOCK_NAME).symlink_to(target)
    key, value = next(iter(DECISIONS["compile"].items()))
    with caplog.at_level("WARNING", logger="smemguard"):
        assert decision_cache.Store(cache).put("compile", key, value) is value
    [warning] = [r.getMessage() for r in caplog.records]
    assert "decisions.lock is a symbolic link" in warning and "decisions stay in this process" in warning
    source = tmp_path / "fleet.json"
    source.write_text(json.dumps(DECISIONS))
    assert commands.main(["cache", "import", str(source), "--dir", str(cache)]) == 2
    assert "decisions.lock is a symbolic link" in one_line(capsys.readouterr().err)
    assert not target.exists() and not (cache / decision_cache.FILE_NAME).exists()


def test_a_record_cut_short_by_a_full_disk_is_taken_back(tmp_path):
    """Issue 45: a real short write (the kernel's, under RLIMIT_FSIZE: writes up to the limit, then fails, as a disk
    that fills does; SIGXFSZ ignored so that the write fails instead of the process) leaves no fragment: the next
    record, of any process, is whole."""
    log = tmp_path / "incidents.jsonl"
    earlier = json.dumps({"id": "earlier"}) + "\n"
    log.write_text(earlier)
    result = run_python(f"""
        import resource, signal
        from pathlib import Path
        from smemguard.store import incidents
        log = Path({str(log)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (log.stat().st_size + 100, resource.RLIM_INFINITY))
        print(incidents.write({{"kernel": "m:k", "pad": "x" * 100_000}}, log))
    """)
    assert result.stdout.split() == ["None"], "not written, and not announced as written"
    assert "cannot write incident records to" in one_line(result.stderr) and "taken back" in result.stderr
    assert log.read_text() == earlier, "the part written was taken back"
    from smemguard.store import incidents

    assert incidents.write({"kernel": "m:next"}, log) is not None
    assert [json.loads(line).get("kernel") for line in log.read_text().splitlines()] == [None, "m:next"]


def test_a_record_after_a_fragment_starts_a_line_of_its_own(tmp_path):
    """Issue 45: a fragment another writer left (killed mid-write, or an older smemguard on a full disk) ends where
    the next record starts a new line: that record is read whole."""
    from smemguard.store import incidents

    log = tmp_path / "incidents.jsonl"
    log.write_text('{"id": "earlier"}\n{"kernel": "m:cut', encoding="utf-8")
    where = incidents.write({"kernel": "m:whole"}, log)
    lines = log.read_text().splitlines()
    assert lines[:2] == ['{"id": "earlier"}', '{"kernel": "m:cut'] and len(lines) == 3
    assert where.endswith("#" + json.loads(lines[2])["id"]) and json.loads(lines[2])["kernel"] == "m:whole"


def test_a_lock_held_too_long_once_leaves_the_decision_cache_on(tmp_path, monkeypatch, caplog):
    """Issue 45: one wait for ``decisions.lock`` that runs out keeps the decision in memory (one warning) but does
    not switch the cache off: while the lock stays held, a miss only tries it (no second wait); once it is free, the
    next miss reads what other processes stored meanwhile, and a new decision is stored."""
    import fcntl
    import time

    from smemguard.facts import files

    monkeypatch.setattr(files, "LOCK_WAIT_S", 0.3)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    first, later, own = ({**ENTRY, "final": name} for name in ("first", "later", "own"))
    store = decision_cache.Store(cache)
    with open(cache / decision_cache.LOCK_NAME, "w") as held, caplog.at_level("WARNING", logger="smemguard"):
        fcntl.flock(held, fcntl.LOCK_EX)
        assert store.put("compile", "first", first) is first
        started = time.monotonic()
        assert store.put("compile", "own", own) is own and store.get("compile", "later") is None
        assert time.monotonic() - started < 0.25, "while it stays held, a miss tries the lock, never waits again"
    run_python(f"""
        from pathlib import Path
        from smemguard.store import decision_cache
        decision_cache.Store(Path({str(cache)!r})).put("compile", "later", {later!r})
    """)
    assert store.get("compile", "later") == later, "read once the lock is free"
    assert store.put("compile", "own again", own) is own
    assert set(json.loads((cache / decision_cache.FILE_NAME).read_text())["compile"]) == {"later", "own again"}
    [warning] = [r.getMessage() for r in caplog.records]
    assert "decisions.lock has been held by another process for over 0.3 s" in warning
