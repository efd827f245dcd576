"""``smemguard run -- CMD``: real processes, started the way users start them."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from smemguard.cli import run
from smemguard.facts import settings

from conftest import TESTS, records


#: The line smemguard/bootstrap/sitecustomize.py writes when it cannot install (importing it here would install).
NOT_INSTALLED = "smemguard run: smemguard is not installed in this process"


def smemguard_run(*command, env=None, cli_ignores_pythonpath=False, **popen):
    """Start ``smemguard run -- COMMAND`` (this interpreter's smemguard) with ``env`` over a clean environment."""
    environ = {key: value for key, value in os.environ.items() if not key.startswith(("SMEMGUARD", "PYTHON"))}
    environ.update(env or {})
    # -E: the command's PYTHONPATH may name a broken smemguard that the command line itself must not import.
    cli = [sys.executable, *(["-E"] if cli_ignores_pythonpath else []), "-m", "smemguard.cli", "run", "--"]
    return subprocess.Popen([*cli, *map(str, command)], env=environ, text=True, **popen)


def finished(process, stdin=None, timeout=600):
    out, err = process.communicate(stdin, timeout=timeout)
    return process.returncode, out, err


def script(tmp_path, code: str, name="script.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


PIPES = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

SPAWNING = """
    import multiprocessing
    import os
    import subprocess
    import sys

    import smemguard  # nothing below calls install(): `smemguard run` did, in each process


    def recover_a_launch(triton_cache):
        import torch
        from kernels import matmul_args, matmul_kernel
        from smemguard.testing import fake_gpu

        a, b, c = (torch.randn(128, 128, dtype=torch.float16) for _ in range(3))
        with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache):  # 4 stages need more than 40000 B
            compiled = matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)
        print("spawn child", os.getpid(), smemguard.is_installed(), compiled.metadata.num_stages, flush=True)


    def report(how):
        import triton  # noqa: F401

        print(how, "child", os.getpid(), smemguard.is_installed(), flush=True)


    if __name__ == "__main__":
        import triton  # noqa: F401

        print("parent", os.getpid(), smemguard.is_installed(), flush=True)
        children = [multiprocessing.get_context("spawn").Process(target=recover_a_launch, args=(sys.argv[1],)),
                    multiprocessing.get_context("forkserver").Process(target=report, args=("forkserver",))]
        for child in children:
            child.start()
            child.join()
        subprocess.run([sys.executable, "-c", "import os, smemguard, triton; "
                        "print('subprocess child', os.getpid(), smemguard.is_installed(), flush=True)"], check=True)
        sys.exit(max(child.exitcode for child in children))
"""


def test_the_program_and_the_python_processes_it_starts_are_guarded(tmp_path, triton_cache):
    log = tmp_path / "incidents.jsonl"
    program = script(tmp_path, SPAWNING)
    process = smemguard_run(sys.executable, program, triton_cache, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PYTHONPATH": str(TESTS), "SMEMGUARD_LOG": str(log), "SMEMGUARD_CACHE_DIR": "off"})
    status, out, err = finished(process)
    assert status == 0, err
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert lines["parent"] == [str(process.pid), "True"], "exec'd: the program has smemguard run's process id"
    spawned_pid, installed, stages = lines["spawn"][1:]
    assert (installed, stages) == ("True", "3"), "the spawned child recovered its launch with fewer stages"
    assert lines["forkserver"][2] == "True" and lines["subprocess"][2] == "True"
    assert len({lines[name][1] for name in ("spawn", "forkserver", "subprocess")} | {str(process.pid)}) == 4
    [record] = records(log)
    assert (record["pid"], record["action"], record["final"].endswith("num_stages=3")) == (
        int(spawned_pid), "stages_reduced", True)
    [warning] = [line for line in err.splitlines() if line.startswith("smemguard")]
    assert warning.startswith("smemguard: smemguard.examples:matmul_kernel: shared memory 49152 > 40000 B")
    assert "compiled with num_stages=3 (32768 B) before it loaded" in warning and f"#{record['id']}" in warning
    assert record["phase"] == "compile", "the compile-time core fitted it: the launch never raised"


def test_the_program_keeps_its_input_output_exit_status_and_signals(tmp_path):
    program = script(tmp_path, """
        import os, sys
        print("pid", os.getpid(), flush=True)
        line = sys.stdin.readline()
        if line == "wait\\n":
            sys.stdin.readline()  # until killed
        print(line.strip()[::-1])
        print("to stderr", file=sys.stderr)
        sys.exit(7)
    """)
    process = smemguard_run(sys.executable, program, **PIPES)
    assert finished(process, "hello\n") == (7, f"pid {process.pid}\nolleh\n", "to stderr\n")

    process = smemguard_run(sys.executable, program, **PIPES)
    assert process.stdout.readline() == f"pid {process.pid}\n"
    process.stdin.write("wait\n")
    process.stdin.flush()
    process.send_signal(signal.SIGTERM)  # reaches the program itself: nothing stands in between
    assert finished(process)[0] == -signal.SIGTERM


def test_a_process_is_guarded_from_its_triton_import_on_and_pays_nothing_before(tmp_path):
    """smemguard is imported at Triton's import, not at start-up: a process that never imports Triton (a tool,
    a data loader) pays nothing for it; one that does is guarded before its next line."""
    program = script(tmp_path, """
        import sys
        # importlib.abc pulls importlib.resources and pathlib in: most of the 39 ms the bootstrap added (issue 45)
        before = any(name in sys.modules for name in ("smemguard", "wrapt", "importlib.abc", "importlib.resources"))
        import triton
        import smemguard
        from smemguard.patches.triton_seams import kernel_interface
        print(before, smemguard.is_installed(), kernel_interface.PATCH.is_patched())
    """)
    status, out, err = finished(smemguard_run(sys.executable, program, **PIPES))
    assert (status, err) == (0, "")
    assert out == "False True True\n"


BROKEN_PACKAGE = "raise RuntimeError('broken on purpose')\n"


@pytest.mark.parametrize("case", ["broken import", "strict and a bad setting", "a bad setting"])
def test_a_failed_install_is_one_line_and_the_program_runs(tmp_path, case):
    env = {}
    if case == "broken import":  # a smemguard that the program's interpreter finds first, and that raises
        (tmp_path / "broken" / "smemguard").mkdir(parents=True)
        (tmp_path / "broken" / "smemguard" / "__init__.py").write_text(BROKEN_PACKAGE)
        env["PYTHONPATH"] = str(tmp_path / "broken")
    else:
        env.update(SMEMGUARD_MAX_SHARED="4O96", SMEMGUARD="strict" if case.startswith("strict") else "on")
    program = script(tmp_path, """
        import sys
        import triton  # noqa: F401
        guard = sys.modules.get("smemguard")
        print(sys.stdin.read().upper(), guard is not None and guard.is_installed())
        sys.exit(3)
    """)
    process = smemguard_run(sys.executable, program, env=env, cli_ignores_pythonpath=True, **PIPES)
    status, out, err = finished(process, "hello")
    [line] = err.splitlines()
    if case == "a bad setting":  # install() warns and keeps the default: the program is guarded
        assert (status, out) == (3, "HELLO True\n")
        assert line.startswith("smemguard: SMEMGUARD_MAX_SHARED='4O96' ignored: neither a byte count nor a known GPU")
    else:
        assert (status, out) == (3, "HELLO False\n")
        assert line.startswith(NOT_INSTALLED) and line.endswith(f"{sys.executable} runs unguarded")
        assert ("RuntimeError: broken on purpose" if case == "broken import" else
                "SettingsError: smemguard: SMEMGUARD_MAX_SHARED='4O96' ignored") in line


def test_an_existing_pythonpath_and_sitecustomize_are_kept(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    script(user, "import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n", "sitecustomize.py")
    script(user, "WHERE = 'user folder'\n", "userlib.py")
    program = script(tmp_path, """
        import os, sitecustomize, triton, userlib, smemguard
        print(os.environ.get("USER_SITECUSTOMIZE"), userlib.WHERE, sitecustomize.__file__, smemguard.is_installed())
    """)
    process = smemguard_run(sys.executable, program, env={"PYTHONPATH": str(user)}, **PIPES)
    status, out, err = finished(process)
    assert (status, err) == (0, "")
    assert out == f"ran user folder {user / 'sitecustomize.py'} True\n", "the user's sitecustomize ran, after ours"


def test_a_failing_user_sitecustomize_is_reported_by_python_as_without_smemguard(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    script(user, "raise RuntimeError('the user sitecustomize is broken')\n", "sitecustomize.py")
    program = script(tmp_path, "import triton, smemguard\nprint(smemguard.is_installed())\n")
    # -E: `smemguard run` is a Python program too, where the user's sitecustomize would run (and fail) first.
    process = smemguard_run(sys.executable, program, env={"PYTHONPATH": str(user)}, cli_ignores_pythonpath=True,
                            **PIPES)
    status, out, err = finished(process)
    assert (status, out) == (0, "True\n"), "the program runs, guarded"
    assert err.splitlines() == ["Error in sitecustomize; set PYTHONVERBOSE for traceback:",
                                "RuntimeError: the user sitecustomize is broken"], "Python's own report, unchanged"


@pytest.mark.parametrize("flags, guarded", [
    (["-m", "mymodule"], "True"),  # python -m, with PYTHONSAFEPATH: PYTHONPATH still counts
    (["-I", "mymodule.py"], "False"),  # isolated mode ignores PYTHONPATH: not reached (the README says so)
])
def test_python_dash_m_and_isolated_mode(tmp_path, flags, guarded):
    script(tmp_path, "import triton, smemguard\nprint(smemguard.is_installed())\n", "mymodule.py")
    process = smemguard_run(sys.executable, *flags, env={"PYTHONPATH": str(tmp_path), "PYTHONSAFEPATH": "1"},
                            cwd=tmp_path, **PIPES)
    assert finished(process) == (0, f"{guarded}\n", "")


def test_off_runs_the_command_unchanged(tmp_path):
    program = script(tmp_path, "import os, sys\nprint(os.environ.get('PYTHONPATH'), 'smemguard' in sys.modules)\n")
    process = smemguard_run(sys.executable, program, env={"SMEMGUARD": "off", "PYTHONPATH": "/somewhere"}, **PIPES)
    assert finished(process) == (0, "/somewhere False\n", "")


def test_bootstrap_goes_first_on_pythonpath_once():
    first = run.environment({"PYTHONPATH": os.pathsep.join(["/a", "/b"])})
    assert first["PYTHONPATH"] == os.pathsep.join([str(run.BOOTSTRAP), "/a", "/b"])
    again = run.environment(first)  # smemguard run -- smemguard run -- ...
    assert again["PYTHONPATH"] == first["PYTHONPATH"]
    assert run.environment({})["PYTHONPATH"] == str(run.BOOTSTRAP)
    assert sorted(path.name for path in run.BOOTSTRAP.iterdir() if path.suffix == ".py") == ["sitecustomize.py"]


@pytest.mark.parametrize("argv, status, line", [
    ([], 2, "smemguard run: no command given"),
    (["--"], 2, "smemguard run: no command given"),
    (["-x", "python"], 2, "smemguard run: unknown option -x; put the command after --"),
    (["--", "no-such-command-here", "x"], 127, "smemguard run: no-such-command-here: command not found"),
    (["--", ""], 127, "smemguard run: '': command not found"),  # issue 45: was a traceback
    (["--", os.devnull], 126, f"smemguard run: {os.devnull}: Permission denied"),
])
def test_a_command_that_cannot_start_is_one_line(argv, status, line):
    done = subprocess.run([sys.executable, "-m", "smemguard.cli", "run", *argv], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout, done.stderr.splitlines()[-1]) == (status, "", line)
    assert len(done.stderr.splitlines()) == (2 if status == 2 else 1), "usage, then the problem"


def test_help_teaches_with_examples(capsys):
    from smemguard.cli import commands

    with pytest.raises(SystemExit) as exit_status:
        commands.main(["run", "--help"])
    text = capsys.readouterr().out
    assert exit_status.value.code == 0
    for taught in ("usage: smemguard run [-h] -- CMD [ARGS...]", "smemguard run -- python train.py",
                   "python -m sglang.launch_server", "-I (isolated)", "SMEMGUARD=off runs CMD unchanged",
                   "127 CMD not found"):
        assert taught in text
    with pytest.raises(SystemExit):
        commands.main(["--help"])
    assert "run -- python train.py" in capsys.readouterr().out


def test_empty_pythonpath_entries_still_mean_the_current_directory():
    """An empty ``PYTHONPATH`` entry is the current directory to Python: ``run`` keeps it (issue 33), and adds
    none where the user had no ``PYTHONPATH``."""
    from smemguard.cli import run

    bootstrap = str(run.BOOTSTRAP)
    assert run.environment({"PYTHONPATH": ":/lib"})["PYTHONPATH"] == os.pathsep.join([bootstrap, "", "/lib"])
    assert run.environment({"PYTHONPATH": f"{bootstrap}:/lib:"})["PYTHONPATH"] == os.pathsep.join(
        [bootstrap, "/lib", ""]), "run inside run: the bootstrap once, the user's entries as they were"
    assert run.environment({})["PYTHONPATH"] == bootstrap
    assert run.environment({"PYTHONPATH": ""})["PYTHONPATH"] == bootstrap


def test_a_script_importing_from_the_working_directory_works_under_run(tmp_path):
    (tmp_path / "neighbour.py").write_text("VALUE = 42\n")
    program = script(tmp_path, "import neighbour\nprint(neighbour.VALUE)\n")
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "prog.py").write_text(program.read_text())
    process = smemguard_run(sys.executable, str(other / "prog.py"), env={"PYTHONPATH": ":"}, cwd=tmp_path, **PIPES)
    status, out, err = finished(process)
    assert (status, out.strip()) == (0, "42"), err


def test_relative_paths_are_made_absolute_once_for_every_process(tmp_path):
    """Issue 45: a relative SMEMGUARD_LOG or SMEMGUARD_CACHE_DIR resolved in each process's working directory, so a
    child started elsewhere wrote a second log and cache. ``run`` makes them absolute against its own directory; a
    value that names no path is passed on as it is."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    child = script(tmp_path, """
        import json, os, subprocess, sys
        from smemguard.facts import settings
        seen = subprocess.run([sys.executable, "-c", "from smemguard.facts import settings; s = settings.load(); "
                               "print(s.log_path, s.cache_dir, s.metrics_file)"], cwd=sys.argv[1],
                              capture_output=True, text=True).stdout.split()
        print(json.dumps([os.environ["SMEMGUARD_LOG"], os.environ["SMEMGUARD_CACHE_DIR"], seen]))
    """)
    env = {"SMEMGUARD_LOG": "incidents.jsonl", "SMEMGUARD_CACHE_DIR": "cache", "SMEMGUARD_METRICS_FILE": "m.prom",
           "PYTHONPATH": str(TESTS.parent)}
    status, out, err = finished(smemguard_run(sys.executable, child, elsewhere, env=env, cwd=here, **PIPES))
    assert status == 0, err
    log, cache, seen = json.loads(out)
    assert (log, cache) == (str(here / "incidents.jsonl"), str(here / "cache"))
    assert seen == [str(here / "incidents.jsonl"), str(here / "cache"), str(here / "m.prom")], "the same files"
    environ = {"SMEMGUARD_CACHE_DIR": "off", "SMEMGUARD_LOG": "~no-such-user-here/x.jsonl"}
    assert settings.with_absolute_paths(environ) == environ


def test_warnings_smemguard_causes_are_left_unsaid_and_the_programs_own_are_not(tmp_path, triton_cache):
    """Issue 45: Triton 3.9 warned of its fp-fusion default because smemguard's recovery asked for the options'
    names, in a program that named fusion in its launch; that warning is left unsaid, the program's own stay."""
    program = script(tmp_path, """
        import sys, warnings
        import torch
        from kernels import matmul_args, matmul_kernel
        from smemguard.testing import fake_gpu

        a, b, c = (torch.empty(256, 256, dtype=torch.float16) for _ in range(3))
        with fake_gpu("L4", max_shared=40000, cache_dir=sys.argv[1]):
            compiled = matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4,
                                             enable_fp_fusion=True)
        warnings.warn("the program's own warning")
        print(compiled.metadata.num_stages)
    """)
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]), "SMEMGUARD_CACHE_DIR": "off"}
    status, out, err = finished(smemguard_run(sys.executable, program, triton_cache, env=env, **PIPES))
    assert (status, out.split()) == (0, ["3"]), err
    assert "UserWarning: the program's own warning" in err and "TRITON_DEFAULT_FP_FUSION" not in err, err
