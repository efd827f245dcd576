import json
import os
import subprocess
import sys
import tempfile
import warnings

import pytest

from smemguard.cli import commands
from smemguard.facts import gpus, settings

from conftest import ROOT, records


def _one_gpu_per_target_and_limit(besides: tuple[str, ...]) -> list[str]:
    """Every GPU of the table compiles and fails exactly like the first one of its (arch, limit);
    those of ``besides`` have tests of their own."""
    covered = {(gpus.lookup(name).arch, gpus.lookup(name).max_shared) for name in besides}
    seen = {}
    for gpu in gpus.GPUS:
        seen.setdefault((gpu.arch, gpu.max_shared), gpu.name)
    return [name for key, name in seen.items() if key not in covered]


@pytest.fixture
def clean_tmp(tmp_path, monkeypatch):
    """tempfile's directory, empty, for this test: what the command leaves there is left over."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


def test_demo_shows_the_overflow_and_the_recovery(capsys, clean_tmp):
    assert commands.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "1. autotune a 512x512 fp16 matmul over 2 configs on misaligned views\n" in out
    assert "OutOfResources: shared memory, Required: 131072, Hardware limit: 101376" in out
    assert "-> ran with 4 stages, 98304 B, grid (4, 4, 1)" in out
    assert "action       stages_reduced" in out
    assert "attempts     BLOCK_M=128 BLOCK_N=128 BLOCK_K=64 num_warps=4 num_stages=5: 131072 B\n" in out
    assert "\n               num_stages=4: 98304 B\n" in out, "later attempts name what they changed"
    assert "incidents.jsonl, named above: a temporary file, removed as the demo ends" in out, "said while it is there"
    assert list(clean_tmp.iterdir()) == [], "the demo leaves nothing behind"


def test_demo_shows_the_autotune_trap_on_an_amd_gpu(capsys, clean_tmp):
    assert commands.main(["demo", "--gpu", "MI300X"]) == 0
    out = capsys.readouterr().out
    assert "a stand-in MI300X (gfx942, 65536 B of LDS (shared memory) per workgroup)" in out
    assert "1. autotune a 512x512 fp16 matmul over 2 configs on misaligned views\n" in out
    assert "-> winner 128x128x64, 4 stages, 65536 B" in out
    assert "OutOfResources: shared memory, Required: 98304, Hardware limit: 65536" in out
    assert "-> ran with 3 stages, 65536 B, grid (4, 4, 1)" in out and "4. again" in out
    assert "action       stages_reduced" in out
    assert "final        BLOCK_M=128 BLOCK_N=128 BLOCK_K=64 num_warps=4 num_stages=3\n" in out
    assert list(clean_tmp.iterdir()) == []


#: Where tuning on misaligned views hides nothing, the winner comes from a bigger GPU.
TUNED_ELSEWHERE = {"V100": "A100", "T4": "A100", "MI350X": "H100", "RX7900XTX": "H100", "MI100": "H100",
                   "RX7700S": "H100", "StrixHalo": "H100", "RX9070": "H100"}


@pytest.mark.parametrize("gpu", _one_gpu_per_target_and_limit(besides=("L4", "MI300X")))
def test_demo_overflows_and_recovers_on_every_gpu(capsys, gpu):
    """T4 and V100 have no asynchronous copies (a config tuned on an A100 overflows them); gfx950 and
    gfx1100 pipeline misaligned loads too (one tuned on an H100 does); the others multi-buffer aligned
    loads only (the autotune trap)."""
    assert commands.main(["demo", "--gpu", gpu]) == 0
    out = capsys.readouterr().out
    limit = gpus.lookup(gpu).max_shared
    assert f"Hardware limit: {limit}" in out and "-> ran with" in out
    # The T4 and the V100 keep one stage whatever: another config of the list fits.
    action = "config_changed" if gpu in ("V100", "T4") else "stages_reduced"
    assert f"action       {action}" in out
    if gpu in TUNED_ELSEWHERE:
        assert f"on a stand-in {TUNED_ELSEWHERE[gpu]} (tuned elsewhere)" in out
    else:
        assert "on misaligned views\n" in out


def test_demo_rejects_a_gpu_it_does_not_know(capsys):
    assert commands.main(["demo", "--gpu", "MI999"]) == 2
    err = capsys.readouterr().err
    assert "'MI999' is not a GPU from 'smemguard gpus'" in err and "MI300X" in err


def test_demo_says_why_it_cannot_compile_for_an_amd_gpu_here(capsys, monkeypatch):
    reason = "Triton 3.4.0 links AMD code objects with an external ld.lld"
    monkeypatch.setattr("smemguard.preflight.compiling.hip_compile_problem", lambda: reason)
    assert commands.main(["demo", "--gpu", "MI300X"]) == 2
    assert f"smemguard demo: cannot compile for the MI300X (gfx942) here: {reason}" in capsys.readouterr().err


def test_demo_appends_its_record_to_smemguard_log(tmp_path, monkeypatch, capsys, clean_tmp):
    log = tmp_path / "incidents.jsonl"
    log.write_text('{"kept": "as it was"}\n')
    monkeypatch.setenv("SMEMGUARD_LOG", str(log))
    monkeypatch.setenv("SMEMGUARD_MAX_SHARED", "T4")
    assert commands.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert f"incident record ({log}):" in out and "(SMEMGUARD_MAX_SHARED does not apply here" in out
    kept, record = records(log)
    assert kept == {"kept": "as it was"} and record["action"] == "stages_reduced"
    assert list(clean_tmp.iterdir()) == []


@pytest.mark.parametrize("mode, after", [("observe", "observe mode records the incident and changes nothing"),
                                         ("off", "smemguard is off, nothing installed")])
def test_demo_honours_smemguard_mode(monkeypatch, capsys, mode, after):
    monkeypatch.setenv("SMEMGUARD", mode)
    assert commands.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert f"3. the same launch with smemguard installed (SMEMGUARD={mode})" in out
    assert f"-> OutOfResources again: {after}" in out and "4. again" not in out
    assert ("action       observed" in out) == (mode == "observe")


def test_gpus_table_and_json(capsys):
    assert commands.main(["gpus"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["GPU", "aliases", "arch", "bytes/block", "bytes/SM", "tensor", "memory", "(columns)"]
    assert any(line.split() == ["L4", "-", "sm_89", "101376", "102400", "-"] for line in lines)
    assert commands.main(["gpus", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert {"name": "T4", "aliases": [], "arch": "sm_75", "max_shared": 65536, "shared_per_sm": 65536,
            "tensor_memory": None, "compile_problem": None} in table


def test_help_teaches_the_commands_settings_and_exit_statuses(capsys):
    assert commands.main([]) == 2
    out = capsys.readouterr().out
    for text in ("demo", "gpus", "VLLM_PLUGINS=smemguard", "SMEMGUARD_MAX_SHARED", "examples:", "exit status",
                 "2 bad input"):
        assert text in out
    for command in ("demo", "gpus", "report", "replay", "cache", "check"):
        with pytest.raises(SystemExit):
            commands.main([command, "--help"])
        assert "xit status" in capsys.readouterr().out, command


def test_every_command_reports_bad_settings_as_install_does(monkeypatch, capsys):
    monkeypatch.setenv("SMEMGUARD", "bogus")
    monkeypatch.setenv("SMEMGUARD_CACHEDIR", "/tmp")
    assert commands.main(["gpus"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("GPU")
    assert err.splitlines() == [
        "smemguard: SMEMGUARD='bogus' ignored: unknown mode; accepted: on | off | observe | strict. Using the default.",
        "smemguard: SMEMGUARD_CACHEDIR is not a smemguard setting (did you mean SMEMGUARD_CACHE_DIR?); known: "
        "SMEMGUARD, SMEMGUARD_MAX_SHARED, SMEMGUARD_LOG, SMEMGUARD_CACHE_DIR, SMEMGUARD_METRICS_FILE, "
        "SMEMGUARD_DISABLE, SMEMGUARD_EMULATE_PROPERTIES, SMEMGUARD_PINS."]


def test_an_unknown_patch_in_smemguard_disable_is_reported_like_an_unknown_setting(monkeypatch, capsys, caplog):
    monkeypatch.setenv("SMEMGUARD_DISABLE", "kernel_warmup, kernel_warmpu")
    assert commands.main(["gpus"]) == 0
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("smemguard: SMEMGUARD_DISABLE: kernel_warmpu is not a smemguard patch (did you mean "
                           "kernel_warmup?); known: max_shared_mem, ")


def test_strict_mode_stops_every_command_on_a_bad_setting(monkeypatch, capsys):
    monkeypatch.setenv("SMEMGUARD", "strict")
    monkeypatch.setenv("SMEMGUARD_MAX_SHARED", "a lot")
    assert commands.main(["gpus"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[-1] == "smemguard: SMEMGUARD=strict: stopping on the settings problem(s) above"


def test_the_cli_hides_torchs_numpy_warning_and_nothing_else(tmp_path):
    """torch warns at import without NumPy; the filter is the CLI's own and ends with the command."""
    filters = list(warnings.filters)
    assert commands.main(["gpus"]) == 0
    assert warnings.filters == filters
    record = tmp_path / "i.jsonl"
    record.write_text(json.dumps({"schema": 1, "kernel": "m:k", "action": "x",
                                  "args": {"a": {"shape": [1], "stride": [1], "dtype": "torch.float16",
                                                 "ptr_mod_16": 1}}}) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMEMGUARD")}
    result = subprocess.run([sys.executable, "-m", "smemguard.cli", "replay", str(record)], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "torch.float16 tensor cannot start 1 bytes past a 16-byte boundary" in result.stderr, "torch was imported"
    assert "NumPy" not in result.stderr and "Traceback" not in result.stderr


def test_cache_import_without_a_file_shows_the_cache_commands_usage(capsys):
    """Issue 33: the usage of `smemguard cache`, not the top level's, and exit status 2."""
    with pytest.raises(SystemExit) as exit_:
        commands.main(["cache", "import"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: smemguard cache") and "cache import needs a FILE" in err


def test_help_names_every_setting(capsys):
    with pytest.raises(SystemExit):
        commands.main(["--help"])
    out = capsys.readouterr().out
    assert [name for name in settings.KNOWN if name not in out] == []


@pytest.mark.parametrize("argv", [["cache", "show"], ["cache", "show", "--json"], ["report"], ["report", "--json"],
                                  ["gpus"], ["versions"]])
def test_every_command_ends_quietly_with_0_when_its_reader_leaves(tmp_path, argv):
    """Issue 45: ``cache show | head -1`` said "Broken pipe" and exited 2 (its own handling of file errors took the
    pipe's for one); one mechanism ends every command so, and nothing is said at exit either."""
    from smemguard.store import decision_cache
    from test_untrusted_input import DECISIONS, RECORD

    [entry] = list(DECISIONS["compile"].values())[:1]
    data = {**decision_cache.empty(), "compile": {f"{n:024x}": entry for n in range(3000)}}
    (tmp_path / "cache").mkdir(mode=0o700)
    (tmp_path / "cache" / decision_cache.FILE_NAME).write_text(json.dumps(data))
    (tmp_path / "incidents.jsonl").write_text("\n".join(json.dumps({**RECORD, "kernel": f"m:k{n}"})
                                                        for n in range(3000)) + "\n")
    where = ["--dir", str(tmp_path / "cache")] if argv[0] == "cache" else \
        [str(tmp_path / "incidents.jsonl")] if argv[0] == "report" else []
    command = " ".join([sys.executable, "-m", "smemguard.cli", *argv, *where])
    done = subprocess.run(["bash", "-c", f"set -o pipefail; {command} | head -1"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert len(done.stdout.splitlines()) == 1
    closed = subprocess.run(["bash", "-c", f"{command} >&-"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (closed.returncode, closed.stderr) == (0, ""), "a closed stdout: nothing to write to, nothing said"


def test_cache_dir_expands_a_tilde_the_shell_left(tmp_path, monkeypatch, capsys):
    """Issue 45: ``cache import F --dir=~/x`` made a directory named ``~`` (the shell expands a ~ only at the start
    of a word); an unknown ``~user`` is one line."""
    from smemguard.store import decision_cache
    from test_untrusted_input import DECISIONS

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fleet.json").write_text(json.dumps(DECISIONS))
    assert commands.main(["cache", "import", "fleet.json", "--dir=~/x"]) == 0
    assert (tmp_path / "home" / "x" / decision_cache.FILE_NAME).exists() and not (tmp_path / "~").exists()
    assert f"into {tmp_path / 'home' / 'x' / decision_cache.FILE_NAME}" in capsys.readouterr().out
    assert commands.main(["cache", "show", "--dir=~no-such-user-here/x"]) == 2
    assert capsys.readouterr().err == ("smemguard cache show: --dir ~no-such-user-here/x: no such user's home "
                                       "directory\n")


def test_check_refuses_an_unknown_dtype_with_one_line(capsys):
    """Issue 45: ``--dtype bogus`` failed every config of every kernel with a KeyError."""
    assert commands.main(["check", "--examples", "--gpu", "L4", "--dtype", "bogus", "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("smemguard check: --dtype bogus: not an element type; accepted: fp8e4nv, "
                                 "fp8e5, fp8e4b15, fp8e4b8, fp8e5b16, i8, u8, fp16, bf16, i16, u16, fp32, i32, u32, "
                                 "fp64, i64, u64\n")


@pytest.mark.parametrize("argv", [["report", "A"], ["cache", "import", "A"], ["check", "A", "--gpu", "L4"],
                                  ["check", "--examples", "--gpu", "A"], ["check", "--examples", "--gpu", "L4",
                                                                          "--timeout", "A"], ["demo", "--gpu", "A"],
                                  ["replay", "x", "--limit", "A"], ["run", "--", "A"]])
def test_a_100_kb_argument_is_never_echoed_whole(argv):
    """Issue 45: each of these echoed a 100 KB argument whole in its line (run: a name too long to execute, 126)."""
    argv = [("x" * 100_000 if arg == "A" else arg) for arg in argv]
    done = subprocess.run([sys.executable, "-m", "smemguard.cli", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    [line] = done.stderr.splitlines()
    assert done.returncode == (126 if argv[0] == "run" else 2) and len(line) < 400 and "(100000 characters)" in line
