"""``smemguard check`` runs the target's code: what it says about that, how long an import may take, what the
target prints (never on stdout), and the --meta and --jobs values it refuses or lowers (issue 33, items 7-8)."""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from smemguard.cli import commands, check

from conftest import ROOT, run_python

COPY_KERNEL = """
    import triton
    import triton.language as tl

    @triton.jit
    def copy(X, Out, n, BLOCK: tl.constexpr = 64):
        cols = tl.arange(0, BLOCK)
        tl.store(Out + cols, tl.load(X + cols, mask=cols < n), mask=cols < n)
"""

#: What a target does at import only in a compile worker (the check's own process imported it fine).
IN_WORKER_ONLY = "import multiprocessing\nif multiprocessing.parent_process() is not None:\n"

several_cpus = pytest.mark.skipif(check.usable_cpus() < 2, reason="compile workers need --jobs 2, 2 CPUs")


def check_process(argv, cwd, timeout=120, env=None) -> tuple[subprocess.CompletedProcess, float]:
    """``smemguard check ARGV`` in a process of its own (an import that never ends, or ends the process, must not
    take pytest's along), with ``env`` over the environment; the result and its seconds."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SMEMGUARD")},
           "PYTHONPATH": os.pathsep.join([str(cwd), str(ROOT)]), **(env or {})}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "smemguard.cli", "check", *argv], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)
    return done, time.monotonic() - started


def test_help_says_the_check_runs_the_target_and_how_to_run_it_safely(capsys):
    with pytest.raises(SystemExit):
        commands.build_parser().parse_args(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for expected in ("The check runs the target's code: it imports TARGET",
                     "in this process, and again in each compiler process (--jobs)",
                     "for code you do not trust, run the check where that code can do no harm",
                     "container or sandbox", "docker run --rm --network none",
                     "longer than --timeout (default 300 s", "exit status 2 and one line naming the module",
                     "Whatever the target prints goes to stderr: stdout holds the report alone",
                     "--timeout SECONDS", "num_stages (0 to 32", "32 warps on NVIDIA, 16 on CDNA",
                     "any other name is refused", "more is lowered to that"):
        assert expected in text, expected


def test_an_endless_loop_at_import_stops_the_check_at_the_timeout_naming_the_module(tmp_path):
    """A package whose second module never finishes importing: one line names that module, exit status 2, nothing
    on stdout, after about --timeout (not skipped as a failing module is: its kernels would pass unchecked)."""
    package = tmp_path / "loop_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a_kernels.py").write_text(textwrap.dedent(COPY_KERNEL))
    (package / "b_waits.py").write_text("while True:\n    pass\n")
    done, seconds = check_process(["loop_pkg", "--gpu", "L4", "--json", "--timeout", "1"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "smemguard check: 'loop_pkg.b_waits' did not finish importing in 1 s (--timeout): an endless loop at "
        "import, or a wait for something that never comes; nothing checked"]
    assert done.stdout == "" and seconds < 30


def test_an_import_that_swallows_the_interruption_is_stopped_all_the_same(tmp_path):
    (tmp_path / "stubborn.py").write_text("import time\nwhile True:\n    try:\n        time.sleep(60)\n"
                                          "    except BaseException:\n        pass\n")
    done, seconds = check_process(["stubborn.py", "--gpu", "L4", "--timeout", "1"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "smemguard check: 'stubborn.py' did not finish importing in 1 s (--timeout): an endless loop at import, or "
        "a wait for something that never comes; nothing checked"]
    assert seconds < 30, "stopped one --timeout after the interruption did nothing"


def test_a_slow_import_says_so_before_the_timeout(tmp_path):
    (tmp_path / "slow_kernels.py").write_text("import time\ntime.sleep(1.5)\n" + textwrap.dedent(COPY_KERNEL))
    done = run_python(f"""
        import os, sys
        from smemguard import cli
        from smemguard.preflight import discovery
        discovery.SLOW_IMPORT = 0.5
        os.chdir({str(tmp_path)!r})
        sys.exit(cli.main(["check", "slow_kernels.py", "--gpu", "L4", "--quiet", "--jobs", "1", "--timeout", "60"]))
    """)
    assert "smemguard check: still importing 'slow_kernels.py' after 0.5 s (stopped at 60 s: --timeout)" in done.stderr
    assert "configs that fit: copy 1/1" in done.stdout


@several_cpus
def test_what_the_target_prints_goes_to_stderr_and_the_json_parses(tmp_path):
    """Prints at import, here and in a compile worker, through print, the file descriptor, sys.__stdout__ and a
    shell: all on stderr; stdout is the JSON document alone."""
    (tmp_path / "noisy_kernels.py").write_text(textwrap.dedent("""
        import multiprocessing, os, sys
        where = "a compile worker" if multiprocessing.parent_process() is not None else "the main process"
        print(f"print in {where}")
        os.write(1, f"fd 1 in {where}\\n".encode())
        sys.__stdout__.write(f"sys.__stdout__ in {where}\\n")
        os.system(f"echo shell in {where}")
    """) + textwrap.dedent(COPY_KERNEL))
    done, _ = check_process(["noisy_kernels.py", "--gpu", "L4", "--json", "--quiet", "--jobs", "2", "--no-cache"],
                            tmp_path)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["compiles"] == 2 and document["kernels"][0]["kernel"] == "noisy_kernels.py:copy"
    for where in ("the main process", "a compile worker"):
        for how in ("print", "fd 1", "sys.__stdout__", "shell"):
            assert f"{how} in {where}" in done.stderr, (how, where)


@several_cpus
@pytest.mark.parametrize("import_in_worker, line", [
    ("    while True:\n        pass\n",
     "did not finish importing in 2 s (--timeout) in a compile worker, although this process imported it: does "
     "its import wait for something this process holds? (--jobs 1 compiles without workers); no report"),
    ("    raise SystemExit(0)\n",
     "could not be imported in a compile worker, although this process imported it: SystemExit: 0 (--jobs 1 "
     "compiles without workers); no report")], ids=["hangs", "exits"])
def test_a_compile_worker_that_cannot_import_the_target_stops_the_check(tmp_path, import_in_worker, line):
    (tmp_path / "worker_kernels.py").write_text(IN_WORKER_ONLY + import_in_worker + textwrap.dedent(COPY_KERNEL))
    done, seconds = check_process(["worker_kernels.py", "--gpu", "L4", "--quiet", "--jobs", "2", "--no-cache",
                                   "--timeout", "2"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"smemguard check: '{(tmp_path / 'worker_kernels.py').resolve()}' {line}"]
    assert done.stdout == "" and seconds < 60


def test_meta_options_no_launch_takes_are_refused_with_one_line(tmp_path, capsys):
    """num_warps and num_stages outside a decision file's bounds (1024 threads a block; 32 stages) are refused
    before the target is imported; a name that is no constexpr nor option once its kernel is known."""
    (tmp_path / "meta_target_kernels.py").write_text(textwrap.dedent(COPY_KERNEL))
    target = str(tmp_path / "meta_target_kernels.py")

    def refused(meta, gpus="L4"):
        assert commands.main(["check", target, "--gpu", gpus, "--meta", meta, "--no-cache", "--jobs", "1"]) == 2, meta
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    started = time.monotonic()
    assert refused("BLOCK=64,num_stages=100000") == (
        "smemguard check: --meta 'BLOCK=64,num_stages=100000': num_stages=100000: expected an integer from 0 to 32; "
        "compile time grows with the stages: 512 take minutes")
    assert time.monotonic() - started < 5, "refused, not compiled"
    assert refused("num_warps=1024").endswith(
        "num_warps=1024: expected a power of two from 1 to 32 (warps of 32 threads: a block has 1024 at most)")
    assert "num_warps=3: expected a power of two" in refused("num_warps=3")
    assert "num_warps='many': expected a power of two" in refused("num_warps=many")
    assert refused("num_warps=32", gpus="L4,MI300X").endswith(
        "num_warps=32 is 2048 threads a block on MI300X (64 a warp), over the 1024 a block can have: at most "
        "num_warps=16 there")
    assert "num_stages=2.5: expected an integer from 0 to 32" in refused("num_stages=2.5")
    assert "num_ctas=0: expected an integer from 1 to 16" in refused("num_ctas=0")
    assert "maxnreg=256: expected an integer from 1 to 255" in refused("maxnreg=256")
    assert "meta_target_kernels" not in sys.modules, "refused before the target's code ran"

    assert refused("BLOCK=64,bogus=1") == (
        "smemguard check: --meta bogus=1: no constexpr of meta_target_kernels.py:copy, nor an option; its "
        "constexprs: BLOCK; options: num_warps, num_stages, num_ctas, maxnreg")
    assert "for AMD GPUs Triton's HIP options (waves_per_eu" in refused("BLOCK=64,bogus=1", gpus="MI300X")
    # on NVIDIA an AMD option is what a launch there refuses too
    assert "--meta waves_per_eu=2: no constexpr" in refused("BLOCK=64,waves_per_eu=2")


def test_meta_options_at_their_bounds_are_checked(tmp_path, capsys):
    (tmp_path / "bounds_kernels.py").write_text(textwrap.dedent(COPY_KERNEL))
    target = str(tmp_path / "bounds_kernels.py")
    # num_stages=0 (accepted: AMD configs use it) compiles on Triton 3.5 and later; 3.4's AMD stream pipeliner
    # fails on it (a Triton bug, CI stage 4), so the AMD bound is checked at 1 stage.
    for gpu, meta in (("H100", "BLOCK=64,num_warps=32,num_stages=32"),
                      ("MI300X", "BLOCK=64,num_warps=16,num_stages=1,waves_per_eu=2")):
        argv = ["check", target, "--gpu", gpu, "--meta", meta, "--no-cache", "--jobs", "1", "--json", "--quiet"]
        assert commands.main(argv) == 0, capsys.readouterr().err
        [config] = json.loads(capsys.readouterr().out)["kernels"][0]["configs"]
        assert f"num_warps={config['num_warps']}" in meta and f"num_stages={config['num_stages']}" in meta
        assert {spec["verdict"] for spec in config["gpus"][gpu]["specializations"].values()} == {"fits"}


def test_jobs_beyond_the_usable_cpus_are_lowered_with_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "jobs_kernels.py").write_text(textwrap.dedent(COPY_KERNEL))
    monkeypatch.setattr(check, "usable_cpus", lambda: 1)
    assert commands.main(["check", str(tmp_path / "jobs_kernels.py"), "--gpu", "L4", "--jobs", "100000",
                     "--no-cache"]) == 0
    err = capsys.readouterr().err
    assert ("smemguard check: --jobs 100000 lowered to 1, the CPUs this process can use: more processes compile no "
            "faster, and each holds about 150 MB") in err
    assert "compiling with 1 processes" in err


@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan", "1e12", "soon"])
def test_a_timeout_that_bounds_nothing_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as usage:
        commands.main(["check", "--examples", "--gpu", "L4", "--timeout", value])
    assert usage.value.code == 2
    assert f"expected seconds, more than 0 and at most 86400, not {value!r}" in capsys.readouterr().err


def test_a_helper_its_kernels_call_is_not_warned_about_but_an_uncalled_kernel_is(tmp_path):
    """``check --examples --quiet`` once warned about smemguard's own ``_matmul_tile``, which both matmul kernels
    call: a helper is compiled in its callers. A kernel nothing calls, whose constexprs have no default, is still
    named."""
    (tmp_path / "helpers.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def _store_tile(Out, cols, n, BLOCK: tl.constexpr):
            tl.store(Out + cols, cols, mask=cols < n)

        @triton.jit
        def fill(Out, n, BLOCK: tl.constexpr = 64):
            _store_tile(Out, tl.arange(0, BLOCK), n, BLOCK)

        @triton.jit
        def alone(Out, n, BLOCK: tl.constexpr):
            tl.store(Out + tl.arange(0, BLOCK), 0)
    """))
    done, _ = check_process(["helpers", "--gpu", "L4", "--quiet"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["smemguard check: skipping helpers:alone: a plain @triton.jit kernel whose "
                                        "constexprs have no default (name it as module:kernel with --meta to check "
                                        "it)"]


def test_check_creates_the_cache_directories_it_needs_for_their_owner_only(tmp_path):
    """Issue 45: the default cache and each parent it lacks (``~/.cache`` itself on a new host) are made with mode
    700, as README says of the cache, not the umask's 755."""
    (tmp_path / "kernels.py").write_text(textwrap.dedent(COPY_KERNEL))
    home_cache = tmp_path / "home" / ".cache"
    done, _ = check_process(["kernels.py:copy", "--gpu", "L4", "--quiet", "--jobs", "1"], tmp_path,
                            env={"XDG_CACHE_HOME": str(home_cache)})
    assert done.returncode == 0, done.stderr
    made = [home_cache.parent, home_cache, home_cache / "smemguard", home_cache / "smemguard" / "preflight"]
    assert [oct(path.stat().st_mode & 0o777) for path in made] == [oct(0o700)] * 4


def test_check_does_not_trust_results_cached_where_others_can_write(tmp_path):
    """Issue 45: results rewritten to ``{"shared": 1}`` in a cache directory others can write turned "163840 OVER"
    (exit 1) into "fits" (exit 0): a deploy gate passed. The decision file's rule applies: one line, and every
    config is compiled (nothing read from there, nothing written)."""
    cache = tmp_path / "cache"
    argv = ["smemguard.examples:attention_fwd", "--meta", "BLOCK_M=128,BLOCK_N=128,num_warps=8,num_stages=3",
            "--gpu", "L4", "--quiet", "--jobs", "1"]
    env = {"SMEMGUARD_CACHE_DIR": str(cache)}
    done, _ = check_process(argv, tmp_path, env=env)
    assert done.returncode == 1 and "163840 OVER" in done.stdout, done.stderr
    results = list((cache / "preflight").glob("*/*.json"))
    assert results
    for result in results:
        result.write_text(json.dumps({"shared": 1, "error": None}))
    os.chmod(cache, 0o777)
    done, _ = check_process(argv, tmp_path, env=env)
    assert done.returncode == 1 and "163840 OVER" in done.stdout, done.stdout
    [line] = done.stderr.splitlines()
    assert line == (f"smemguard check: not using cached results: {cache} can be written by others (mode 777); fix: "
                    f"chmod go-w {cache}; every config is compiled, and only SMEMGUARD_PINS's pins are shown")
    assert all(json.loads(result.read_text())["shared"] == 1 for result in results), "nothing written there"
    os.chmod(cache, 0o700)
    os.chmod(results[0], 0o666)
    done, _ = check_process([*argv, "--json"], tmp_path, env=env)
    assert done.returncode == 1 and json.loads(done.stdout)["verdicts"]["measured"] >= 1, "a writable result: compiled"


@several_cpus
@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_to_the_check_ends_its_compile_workers(tmp_path, ending):
    """Issue 45: SIGTERM or SIGHUP to the check's own pid left its compile workers running for 10 minutes and more,
    holding its stdout and stderr, so a caller reading them hung. They end with the check, which ends as the
    signal says."""
    workers = tmp_path / "workers"
    workers.mkdir()
    (tmp_path / "busy_kernels.py").write_text(IN_WORKER_ONLY + f"    import os, pathlib, time\n"
                                              f"    pathlib.Path({str(workers)!r}, str(os.getpid())).touch()\n"
                                              "    time.sleep(600)\n" + textwrap.dedent(COPY_KERNEL))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SMEMGUARD")},
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    started = subprocess.Popen([sys.executable, "-m", "smemguard.cli", "check", "busy_kernels.py", "--gpu", "L4",
                                "--quiet", "--jobs", "2", "--no-cache", "--timeout", "900"], env=env, cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(workers.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(workers.iterdir()), "a compile worker started"
        started.send_signal(ending)
        out, err = started.communicate(timeout=60)  # the pipes end once no process holds them
        assert started.returncode == -ending and out == ""
    finally:
        for pid in (int(path.name) for path in workers.iterdir()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        started.kill()


@several_cpus
@pytest.mark.skipif(importlib.util.find_spec("numpy") is not None, reason="torch warns of NumPy only without it")
def test_the_check_and_its_compile_workers_leave_torchs_numpy_warning_unsaid(tmp_path):
    """Issue 45: the check imports the target (here and in each compile worker) on its own account, and torch
    warned in each that NumPy is missing, which no check uses."""
    (tmp_path / "torch_kernels.py").write_text("import torch\n" + textwrap.dedent(COPY_KERNEL))
    done, _ = check_process(["torch_kernels.py", "--gpu", "L4", "--quiet", "--jobs", "2", "--no-cache"], tmp_path)
    assert done.returncode == 0 and "NumPy" not in done.stderr, done.stderr
