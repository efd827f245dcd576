"""smemguard report / replay / cache: the morning after."""

import gzip
import json
import os

import pytest
import torch

from smemguard.cli import commands
from smemguard.store import decision_cache
from smemguard.testing import fake_gpu

from kernels import matmul_args, matmul_kernel


@pytest.fixture(scope="module")
def real_record(tmp_path_factory, triton_cache):
    """One incident record of a launch written by smemguard itself on the CPU harness (sm_89, 40000 B): the
    launch guard's, with the compile-time core left off (which would fit the kernel before any launch)."""
    import smemguard
    from smemguard.facts.settings import Settings

    log = tmp_path_factory.mktemp("record") / "incidents.jsonl"
    smemguard.install(Settings(log_path=log, disabled=("triton_compile",)))
    try:
        storage = torch.empty(256 * 256 + 8, dtype=torch.float16)
        a = storage[: 256 * 256].view(256, 256)
        b, c = torch.empty(256, 256, dtype=torch.float16), torch.empty(256, 256, dtype=torch.float16)
        with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache):
            matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)
    finally:
        smemguard.uninstall()
    return json.loads(log.read_text().splitlines()[0])


def write(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as out:
        out.write("\n".join(lines) + "\n")
    return path


def variant(record, **changes):
    return {**record, **changes}


def test_report_over_mixed_partly_corrupt_files(tmp_path, real_record, capsys):
    other_shape = variant(real_record, args={**real_record["args"], "a_ptr": {**real_record["args"]["a_ptr"],
                                                                             "shape": [512, 256]}},
                          time="2026-11-30T03:10:00+0000", recovery_ms=500.0)
    rank0 = write(tmp_path / "rank0.jsonl", [variant(real_record, time="2026-11-30T03:00:00+0000"), other_shape],
                  extra_lines=["{truncated", '["not", "a", "record"]'])
    rank1 = write(tmp_path / "rank1.jsonl.gz", [variant(real_record, time="2026-11-30T04:00:00+0000",
                                                        action="fallback"),
                                                variant(real_record, kernel="other:kernel", resource="threads")])
    assert commands.main(["report", str(rank0), str(rank1)]) == 2, "some input was bad: the table counts the rest"
    out, err = capsys.readouterr()
    header, first, second, _, shapes, *listed = out.splitlines()
    assert header.split()[:5] == ["kernel", "resource", "GPU", "count", "shapes"]
    assert shapes.startswith("shapes") and listed[:3] == [
        "  smemguard.examples:matmul_kernel on cuda:89:", "    a_ptr[256, 256] b_ptr[256, 256] c_ptr[256, 256]  x2",
        "    a_ptr[512, 256] b_ptr[256, 256] c_ptr[256, 256]  x1"], "each incident's shapes, the most seen first"
    assert first.split()[:3] == ["smemguard.examples:matmul_kernel", "shared", "memory"]
    assert "cuda:89" in first and " 3 " in first and "stages_reduced 2, fallback 1" in first
    assert "2026-11-30T03:00:00+0000" in first and "2026-11-30T04:00:00+0000" in first
    assert second.startswith("other:kernel")
    assert f"{rank0}:3: not JSON" in err and f"{rank0}:4: not an incident record" in err
    assert "2 line(s) not fully used" in err and "Traceback" not in err


def test_report_json_and_filters(tmp_path, real_record, capsys):
    path = write(tmp_path / "i.jsonl", [variant(real_record, time="2026-11-29T10:00:00+0000"),
                                         variant(real_record, time="2026-11-30T10:00:00+0000"),
                                         variant(real_record, kernel="other:kernel")])
    assert commands.main(["report", str(path), "--json", "--kernel", "matmul", "--since", "2026-11-30"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["malformed"] == []
    [row] = out["rows"]
    assert set(row) == {"kernel", "resource", "gpu", "count", "distinct_shapes", "shapes", "actions", "first_seen",
                        "last_seen", "recovery_ms"}
    assert row["shapes"] == [{"args": {"a_ptr": [256, 256], "b_ptr": [256, 256], "c_ptr": [256, 256]}, "count": 1}]
    assert (row["count"], row["distinct_shapes"], row["actions"]) == (1, 1, {"stages_reduced": 1})
    assert commands.main(["report", str(path), "--since", "yesterday"]) == 2
    assert "expected a date" in capsys.readouterr().err


def test_replay_on_cpu_reproduces_the_recorded_bytes(tmp_path, real_record, capsys):
    path = write(tmp_path / "i.jsonl", [real_record])
    assert commands.main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no GPU: compiling for sm_89 on a stand-in device with a 40000 B limit" in out
    assert "reproduced: OutOfResources shared memory, required 49152 B, limit 40000 B (same as recorded)" in out
    assert "tried num_stages=3: 32768 B, limit 40000 B: fits" in out
    assert "smemguard: stages_reduced" in out


def test_replay_against_another_gpu_limit(tmp_path, real_record, capsys):
    path = write(tmp_path / "i.jsonl", [real_record])
    assert commands.main(["replay", str(path), "--limit", "16000"]) == 1, "not recovered: exit 1, as --help says"
    out = capsys.readouterr().out
    assert "limit 16000 B: too big" in out and "smemguard: reraised" in out and "not recovered" in out


def test_replay_of_an_unimportable_kernel_names_the_module(tmp_path, real_record, capsys):
    path = write(tmp_path / "i.jsonl", [variant(real_record, kernel="vllm_private.ops:fused_kernel")])
    assert commands.main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cannot import module 'vllm_private.ops'" in err and "vllm_private.ops:fused_kernel" in err


def test_replay_index_out_of_range(tmp_path, real_record, capsys):
    path = write(tmp_path / "i.jsonl", [real_record])
    assert commands.main(["replay", str(path), "--index", "5"]) == 2
    assert "out of range; it holds 1 records" in capsys.readouterr().err


def test_cache_show_export_import_clear(tmp_path, capsys):
    here, there = tmp_path / "here", tmp_path / "there"
    decision_cache.Store(here).put("compile", "case", {"kernel": "m:k", "gpu": "NVIDIA L4", "limit": 101376,
                                                  "from_config": "BLOCK_M=128 num_stages=5",
                                                  "action": "stages_reduced", "final": "num_stages=4",
                                                  "options": {"num_stages": 4}})
    assert commands.main(["cache", "show", "--dir", str(here)]) == 0
    out = capsys.readouterr().out
    assert "m:k on NVIDIA L4 (limit 101376 B): BLOCK_M=128 num_stages=5 -> stages_reduced num_stages=4" in out
    assert out.startswith(f"1 decision in {here}"), "one decision, not '1 decisions' (issue 45)"
    exported = tmp_path / "fleet.json"
    assert commands.main(["cache", "export", str(exported), "--dir", str(here)]) == 0
    assert commands.main(["cache", "import", str(exported), "--dir", str(there)]) == 0
    out = capsys.readouterr().out
    assert "exported 1 decision from" in out and "imported 1 decision into" in out
    assert decision_cache.Store(there).get("compile", "case")["action"] == "stages_reduced"
    assert commands.main(["cache", "clear", "--dir", str(there)]) == 0
    assert capsys.readouterr().out.startswith("forgot 1 decision in")
    assert decision_cache.Store(there).get("compile", "case") is None
    (tmp_path / "junk.json").write_text("[]")
    assert commands.main(["cache", "import", str(tmp_path / "junk.json"), "--dir", str(there)]) == 2
    assert "not a smemguard decision file (not a JSON object but [])" in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("resource", None), ("time", 5), ("recovery_ms", "fast"), ("device", "x"),
                                          ("args", {"a_ptr": {"shape": "wide"}})])
def test_report_counts_a_record_with_a_wrong_field_without_that_field(tmp_path, real_record, capsys, field, value):
    path = write(tmp_path / "i.jsonl", [variant(real_record, **{field: value}), real_record])
    assert commands.main(["report", str(path)]) == 2
    [line, summary] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"smemguard report: {path}:1: {field!r} is ") and line.endswith("; counted without it")
    assert summary.startswith("smemguard report: 1 line(s) not fully used")
    assert commands.main(["report", str(path), "--json"]) == 2
    assert sum(row["count"] for row in json.loads(capsys.readouterr().out)["rows"]) == 2, "both records counted"


def test_report_skips_a_record_whose_kernel_is_not_a_name(tmp_path, real_record, capsys):
    path = write(tmp_path / "i.jsonl", [variant(real_record, kernel=42), real_record])
    assert commands.main(["report", str(path)]) == 2
    out, err = capsys.readouterr()
    assert " 1 " in out.splitlines()[1], "the other record is counted"
    assert f"{path}:1: not an incident record: 'kernel' is 42, expected non-empty text; line skipped" in err


def test_report_of_a_missing_file_is_bad_input(tmp_path, capsys):
    assert commands.main(["report", str(tmp_path / "nowhere.jsonl")]) == 2
    out, err = capsys.readouterr()
    assert out == "no incident records\n"
    assert err == f"smemguard report: {tmp_path / 'nowhere.jsonl'}: no such file\n"


@pytest.mark.parametrize("field", ["args", "grid", "config", "constexprs", "device", "num_stages"])
def test_replay_names_a_missing_field(tmp_path, real_record, capsys, field):
    record = {name: value for name, value in real_record.items() if name != field}
    path = write(tmp_path / "i.jsonl", [record])
    assert commands.main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: cannot replay this record:\n  no {field!r} field (" in err
    assert "fix: replay another record" in err


@pytest.mark.parametrize("field, value, problem", [
    ("args", {"a_ptr": "<object at 0x7f>"},
     "'args.a_ptr' is \"<object at 0x7f>\": the record kept this argument as text"),
    ("grid", "<lambda>", "'grid' is \"<lambda>\", expected a list of 1 to 3 integers from 0 to 2147483647"),
    ("device", {"backend": "cuda"}, "no 'device.arch' field"),
    ("num_stages", "4", "'num_stages' is \"4\", expected an integer from 0 to 32"),
    ("kernel", "not a kernel", "'kernel' is \"not a kernel\", expected module:qualname of a Triton kernel"),
])
def test_replay_names_a_field_of_the_wrong_type(tmp_path, real_record, capsys, field, value, problem):
    path = write(tmp_path / "i.jsonl", [variant(real_record, **{field: value})])
    assert commands.main(["replay", str(path)]) == 2
    assert problem in capsys.readouterr().err


def test_replay_names_parameters_the_kernel_does_not_have(tmp_path, real_record, capsys):
    args = {**real_record["args"], "stride_zz": 1}
    del args["M"]
    path = write(tmp_path / "i.jsonl", [variant(real_record, args=args)])
    assert commands.main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert "the record names \"stride_zz\", which the kernel has no parameter for" in err
    assert "the record has no value for the kernel's M" in err


def test_replay_of_a_missing_file_is_bad_input(tmp_path, capsys):
    assert commands.main(["replay", str(tmp_path / "nowhere.jsonl")]) == 2
    assert capsys.readouterr().err == f"smemguard replay: {tmp_path / 'nowhere.jsonl'}: no such file\n"


DECISION = {"kernel": "m:k", "gpu": "NVIDIA L4", "limit": 101376, "from_config": "BLOCK_M=128 num_stages=5",
            "action": "stages_reduced", "final": "num_stages=4", "options": {"num_stages": 4}}


def test_cache_import_skips_entries_that_are_not_decisions_and_show_still_reads(tmp_path, capsys):
    incoming = tmp_path / "fleet.json"
    incoming.write_text(json.dumps({"schema": 1, "compile": {"good": DECISION, "bad": "not a decision"},
                                    "launch": {"odd": {**DECISION, "action": "config_changed"}}}))
    assert commands.main(["cache", "import", str(incoming), "--dir", str(tmp_path / "cache")]) == 2
    out, err = capsys.readouterr()
    assert "imported 1 decision into" in out
    assert f'{incoming}: compile entry "bad": the entry is "not a decision", expected an object; not imported' in err
    assert f'{incoming}: launch entry "odd": \'action\' is "config_changed"' not in err, "a launch table may hold it"
    assert f'{incoming}: launch entry "odd": no \'config\' field' in err
    assert commands.main(["cache", "show", "--dir", str(tmp_path / "cache")]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[1] == "  m:k on NVIDIA L4 (limit 101376 B): BLOCK_M=128 num_stages=5 -> stages_reduced " \
                                  "num_stages=4" and err == ""


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root (CI runs as root)")
def test_a_decision_file_of_another_users_in_ones_own_directory_is_to_be_moved_away(tmp_path, capsys):
    """The fix line once said "use a directory of your own" of the user's own directory."""
    decision_cache.Store(tmp_path).put("compile", "case", DECISION)
    os.chown(tmp_path / "decisions.json", 65534, -1)
    assert commands.main(["cache", "show", "--dir", str(tmp_path)]) == 2
    assert "decisions.json belongs to another user (uid 65534); fix: move it away (smemguard starts a new one), or " \
        "chown it to uid 0; nothing was changed" in capsys.readouterr().err
    os.chown(tmp_path, 65534, -1)  # the directory another user's too: nothing of it is the user's to move
    assert commands.main(["cache", "show", "--dir", str(tmp_path)]) == 2
    assert f"{tmp_path} belongs to another user (uid 65534); fix: use a directory of your own" in \
        capsys.readouterr().err


def test_cache_show_leaves_out_the_fields_an_entry_lacks(tmp_path, capsys):
    """An entry with only what a decision needs once printed "None on None (limit None B)"."""
    bare = {"action": "stages_reduced", "options": {"num_stages": 4}}
    decision_cache.Store(tmp_path).put("compile", "bare", bare)
    decision_cache.Store(tmp_path).put("compile", "named", {**bare, "kernel": "m:k", "final": "num_stages=4"})
    assert commands.main(["cache", "show", "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["  a kernel: -> stages_reduced",
                                                        "  m:k: -> stages_reduced num_stages=4"]


def test_a_bad_cache_dir_setting_is_refused_and_the_default_cache_kept(tmp_path, monkeypatch, capsys):
    """SMEMGUARD_CACHE_DIR=/etc/hostname once made 'cache clear' empty the default cache without a word."""
    default = tmp_path / "xdg" / "smemguard"
    decision_cache.Store(default).put("compile", "case", DECISION)
    kept = (default / "decisions.json").read_bytes()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    hostname = tmp_path / "hostname"
    hostname.write_text("box\n")
    monkeypatch.setenv("SMEMGUARD_CACHE_DIR", str(hostname))
    exported = tmp_path / "out.json"
    for action in (["clear"], ["show"], ["export", str(exported)], ["import", str(default / "decisions.json")]):
        assert commands.main(["cache", *action]) == 2, action
        [refusal] = capsys.readouterr().err.splitlines()  # one line: no "Using the default" before a refusal
        assert refusal.startswith(f"smemguard cache {action[0]}: SMEMGUARD_CACHE_DIR='{hostname}' ignored: is a file")
        assert refusal.endswith("Nothing was touched: a cache command never uses the default cache in its place; "
                                "fix the setting, or pass --dir DIR") and "Using the default" not in refusal
    assert (default / "decisions.json").read_bytes() == kept and hostname.read_text() == "box\n"
    assert not exported.exists()


def test_cache_commands_change_nothing_in_a_file_that_is_not_theirs(tmp_path, capsys):
    foreign = tmp_path / "decisions.json"
    foreign.write_text('{"my": "own data"}')
    for action in (["clear"], ["show"], ["import", str(foreign)]):
        assert commands.main(["cache", *action, "--dir", str(tmp_path)]) == 2
        assert "is not a smemguard decision file (schema null, expected 1); nothing" in capsys.readouterr().err
    assert foreign.read_text() == '{"my": "own data"}' and sorted(p.name for p in tmp_path.iterdir()) == \
        ["decisions.json"]
    assert commands.main(["cache", "clear", "--dir", str(tmp_path / "new")]) == 0
    assert "nothing to forget" in capsys.readouterr().out and not (tmp_path / "new").exists()
    assert commands.main(["cache", "show", "--dir", str(foreign)]) == 2
    assert "is a file, not a cache directory" in capsys.readouterr().err
