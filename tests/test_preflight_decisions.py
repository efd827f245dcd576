"""``smemguard check --decisions FILE``: the decision recovery would take for every overflowing config, which
``smemguard cache import`` stores, so that a checked launch compiles the variant that fits directly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from triton import knobs

import smemguard
from smemguard.cli import commands
from smemguard.store import decision_cache
from smemguard.kernels import tuners
from smemguard import preflight
from smemguard.patches.triton_seams import jit_compile
from smemguard.examples import attention_args, attention_fwd, attention_grid, matmul_args, matmul_kernel, tiled_grid
from smemguard.preflight import ResultCache
from smemguard.testing import fake_gpu

import preflight_fixed_kernels as fixed
from conftest import records

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")


def check_decisions(targets, gpu_names, path: Path, monkeypatch) -> int:
    """``smemguard check TARGETS --gpu GPUS --decisions PATH`` through the CLI's entry point."""
    monkeypatch.setattr(preflight, "default_cache", lambda: ResultCache(None))
    return commands.main(["check", *targets, "--gpu", gpu_names, "--decisions", str(path), "--quiet", "--jobs", "1"])


def imported(path: Path, directory: Path) -> Path:
    """``smemguard cache import PATH --dir DIRECTORY`` into a fresh cache directory."""
    assert commands.main(["cache", "import", str(path), "--dir", str(directory)]) == 0
    return directory


class Compiles:
    """Every variant Triton's JIT compiles (its own hook, called on each JIT cache miss), as (stages, warps)."""

    def __init__(self):
        self.seen = []

    def __enter__(self):
        knobs.runtime.jit_cache_hook = lambda **kw: self.seen.append(
            (kw["compile"]["num_stages"], kw["compile"]["num_warps"])) and False
        return self

    def __exit__(self, *exc):
        knobs.runtime.jit_cache_hook = None


def launch_once(install_guard, cache_dir, log, gpu_name, triton_cache, launch):
    """Install smemguard with ``cache_dir``, run ``launch()`` once on a stand-in ``gpu_name``: (what ran, the
    variants compiled, the incident records)."""
    install_guard(cache_dir=cache_dir, log_path=log)
    try:
        with fake_gpu(gpu_name, cache_dir=triton_cache) as gpu, Compiles() as compiles:
            launch()
    finally:
        smemguard.uninstall()
    ran = gpu.launches[-1]
    return (ran.num_stages, ran.num_warps, ran.shared), compiles.seen, records(log)


def tensors(size=256):
    return [torch.empty(size, size, dtype=torch.float16) for _ in range(3)]


def launch_fixed():
    a, b, c = tensors()
    matmul_kernel[tiled_grid(256, 256)](*matmul_args(a, b, c), **fixed.FIXED.all_kwargs())


def launch_tuned_elsewhere():
    a, b, c = tensors()
    args = matmul_args(a, b, c)
    fixed.tuned_elsewhere.cache.clear()
    fixed.tuned_elsewhere.cache[tuners.tuning_key(fixed.tuned_elsewhere, args, {})] = fixed.BIG
    fixed.tuned_elsewhere[tiled_grid(256, 256)](*args)


def assert_compiled_directly(ran, compiled, incidents):
    """The variant that fits compiled first and alone (fewer stages, or the stored config of the tuner, the config
    in force refused before compiling), no incident (Triton 3.5 and later; 3.4 compiles inline, so the stored
    decision applies at the first failing launch, without candidates)."""
    if jit_compile.PATCH.supported.admits(triton.__version__):
        assert incidents == [], "no OutOfResources reached smemguard: the failing variant was never compiled"
        assert compiled == [ran[:2]], "one compile: the variant that fits, nothing else"
    else:
        [record] = incidents
        assert record["remembered"] is True and len(record["attempts"]) == 1


def round_trip(tmp_path, install_guard, triton_cache, gpu_name, decisions_file, launch):
    """The launch with the imported decisions, and the same launch recovered without them."""
    directory = imported(decisions_file, tmp_path / f"imported-{gpu_name}")
    decided = launch_once(install_guard, directory, tmp_path / f"decided-{gpu_name}.jsonl", gpu_name, triton_cache,
                          launch)
    recovered = launch_once(install_guard, tmp_path / f"empty-{gpu_name}", tmp_path / f"recovered-{gpu_name}.jsonl",
                            gpu_name, triton_cache, launch)
    return decided, recovered


@pytest.mark.parametrize("gpu_name", ["L4", "MI300X"])
def test_a_checked_fixed_config_compiles_the_fitting_variant_directly(tmp_path, monkeypatch, install_guard,
                                                                     triton_cache, gpu_name):
    path = tmp_path / "decisions.json"
    # Exit 1: its one config overflows; the decisions say what recovery does about it.
    assert check_decisions(["preflight_fixed_kernels:matmul_kernel"], gpu_name, path, monkeypatch) == 1
    stored = json.loads(path.read_text())
    assert stored["launch"] == {} and stored["compile"], "fewer stages fit: compile decisions"
    (ran, compiled, incidents), (ran_recovered, compiled_recovered, recovered) = round_trip(
        tmp_path, install_guard, triton_cache, gpu_name, path, launch_fixed)
    assert_compiled_directly(ran, compiled, incidents)
    [record] = recovered
    assert record["action"] == "stages_reduced" and len(compiled_recovered) > 1
    assert ran == ran_recovered, "the variant recovery chooses without the file"


@pytest.mark.slow
def test_a_config_tuned_elsewhere_switches_on_a_t4_without_trying_candidates(tmp_path, monkeypatch, install_guard,
                                                                           triton_cache):
    path = tmp_path / "decisions.json"
    assert check_decisions(["preflight_fixed_kernels:tuned_elsewhere"], "T4", path, monkeypatch) == 0
    stored = json.loads(path.read_text())
    [entry] = {json.dumps(e["config"], sort_keys=True): e for e in stored["launch"].values()}.values()
    assert entry["action"] == "config_changed" and "tuning_key" not in entry, "keyed by the config, any tuning key"
    (ran, compiled, incidents), (ran_recovered, compiled_recovered, recovered) = round_trip(
        tmp_path, install_guard, triton_cache, "T4", path, launch_tuned_elsewhere)
    assert ran == ran_recovered, "the config recovery chooses without the file"
    # The config in force is refused before compiling; the tuner switches to the stored config at the launch.
    assert_compiled_directly(ran, compiled, incidents)
    [record_recovered] = recovered
    assert record_recovered["remembered"] is False and len(compiled_recovered) > len(compiled) == 1


def config_of(entry: dict, configs: list):
    """The config of ``configs`` an entry was decided for (its ``from_config``: NAME=VALUE ... num_stages=S)."""
    fields = dict(part.split("=") for part in entry["from_config"].split())
    return next(config for config in configs if all(fields[name] == str(value) for name, value in
                                                    {**config.kwargs, "num_warps": config.num_warps,
                                                     "num_stages": config.num_stages}.items()))


@pytest.mark.parametrize("gpu_name", ["L4", *(pytest.param(name, marks=pytest.mark.slow) for name in ("T4", "MI300X"))])
def test_the_example_attention_round_trip(tmp_path, monkeypatch, install_guard, triton_cache, gpu_name):
    """The example flash-attention forward, its config in force tuned elsewhere: the first config the check wrote a
    decision for, launched as the check compiled it (contiguous, aligned tensors)."""
    path = tmp_path / "decisions.json"
    assert check_decisions(["smemguard.examples:attention_fwd"], gpu_name, path, monkeypatch) in (0, 1)
    stored = json.loads(path.read_text())
    entry = next(entry for table in ("compile", "launch") for entry in stored[table].values())
    overflowing = config_of(entry, attention_fwd.configs)
    q, k, v, o = (torch.empty(4, 1024, 128, dtype=torch.float16) for _ in range(4))

    def launch():
        args = attention_args(q, k, v, o, 0.1)
        attention_fwd.cache.clear()
        attention_fwd.cache[tuners.tuning_key(attention_fwd, args, {"HEAD_DIM": 128})] = overflowing
        attention_fwd[attention_grid(1024, 4)](*args, HEAD_DIM=128)

    (ran, compiled, incidents), (ran_recovered, _, recovered) = round_trip(
        tmp_path, install_guard, triton_cache, gpu_name, path, launch)
    assert ran == ran_recovered and recovered, "the variant recovery chooses without the file"
    assert_compiled_directly(ran, compiled, incidents)


def test_deciding_shows_progress_unless_quiet(tmp_path, monkeypatch, capsys):
    """Each decision is a stand-in launch and recovery's ladder (seconds each): a line per config on stderr."""
    monkeypatch.setattr(preflight, "default_cache", lambda: ResultCache(None))
    path = tmp_path / "decisions.json"
    assert commands.main(["check", "preflight_fixed_kernels:matmul_kernel", "--gpu", "L4", "--decisions", str(path),
                     "--jobs", "1"]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("smemguard check: deciding [")]
    assert lines and "L4 matmul_kernel" in lines[-1] and "stages_reduced (num_stages=" in lines[-1], lines
    assert lines[-1].startswith(f"smemguard check: deciding [{len(lines)}/{len(lines)}]")


@pytest.mark.parametrize("make, problem", [
    (lambda tmp: tmp, "is a directory"),
    (lambda tmp: (os.mkfifo(tmp / "pipe"), tmp / "pipe")[1], "not a regular file"),
    (lambda tmp: tmp / "missing" / "decisions.json", "does not exist"),
    (lambda tmp: ((tmp / "ro").mkdir(mode=0o500), tmp / "ro" / "decisions.json")[1], "cannot be written"),
])
def test_a_bad_decisions_path_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys, make, problem):
    if problem == "cannot be written" and os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    target = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.setenv("SMEMGUARD_CACHE_DIR", str(tmp_path / "cache"))
    assert commands.main(["check", "smemguard.examples:flaggems_matmul", "--gpu", "L4", "--decisions",
                          str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and problem in err[0] and "--decisions" in err[0], err
    assert sorted(tmp_path.rglob("*")) == before, "nothing written, not even the check's cache"


def test_rerunning_replaces_only_the_file(tmp_path, monkeypatch):
    path = tmp_path / "decisions.json"
    path.write_text("an older file")
    for _ in range(2):
        assert check_decisions(["smemguard.examples:matmul_persistent_kernel"], "L4", path, monkeypatch) == 0
        assert json.loads(path.read_text()) == decision_cache.empty(), "every config fits an L4: no entry"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["decisions.json"], "no temporary file left beside it"


def test_check_help_teaches_the_decisions_flag(capsys):
    with pytest.raises(SystemExit):
        commands.build_parser().parse_args(["check", "--help"])
    text = capsys.readouterr().out
    assert "--decisions l4-t4.json" in text and "smemguard cache import l4-t4.json" in text


# -- Targets as a deploy gate reads them (issue 33) ----------------------------------------------------------

DOT_KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def dot_tile(a_ptr, b_ptr, c_ptr, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm, rn, rk = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * BLOCK_N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * BLOCK_N + rn[None, :], acc.to(tl.float16))


#: 196608 B at 4 stages on sm_89: over an L4's 101376 B; 3 stages fit.
CONFIG = triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128), num_stages=4, num_warps=4)
SMEMGUARD_PREFLIGHT = {"dot_tile": {"dtype": "fp16", "configs": [CONFIG]}}
'''


def test_a_submodule_exiting_at_import_neither_passes_the_gate_nor_hides_the_rest(tmp_path):
    """``check PACKAGE`` where one module calls ``sys.exit(0)`` at import and another holds a kernel that overflows
    the L4: that module is skipped with one line, the kernel is checked, exit status 1 (no fitting config)."""
    package = tmp_path / "gatepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a_exits.py").write_text("import sys\nsys.exit(0)\n")
    (package / "b_kernels.py").write_text(DOT_KERNELS)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SMEMGUARD")},
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(commands.__file__).parents[1])])}
    done = subprocess.run([sys.executable, "-m", "smemguard.cli", "check", "gatepkg", "--gpu", "L4", "--quiet",
                           "--jobs", "1"], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "smemguard check: skipping gatepkg.a_exits: it calls sys.exit(0) at import" in done.stderr
    assert "NO FITTING CONFIG: gatepkg.b_kernels:dot_tile" in done.stdout


def test_decisions_checked_from_a_file_apply_where_the_file_is_imported(tmp_path, monkeypatch, install_guard,
                                                                       triton_cache):
    """``check FILE.py --decisions`` keys the decisions to the module the file is at run time (its stem), so a
    program importing it compiles the fitting variant first."""
    source = tmp_path / "kernels_here" / "dot_kernels.py"
    source.parent.mkdir()
    source.write_text(DOT_KERNELS)
    monkeypatch.syspath_prepend(str(source.parent))
    path = tmp_path / "decisions.json"
    assert check_decisions([str(source)], "L4", path, monkeypatch) == 1
    assert {entry["kernel"] for entry in json.loads(path.read_text())["compile"].values()} == {"dot_kernels:dot_tile"}
    import dot_kernels

    def launch():
        a, b, c = (torch.empty(128, 256, dtype=torch.float16), torch.empty(256, 128, dtype=torch.float16),
                   torch.empty(128, 128, dtype=torch.float16))
        dot_kernels.dot_tile[(1,)](a, b, c, 256, **dot_kernels.CONFIG.all_kwargs())

    ran, compiled, incidents = launch_once(install_guard, imported(path, tmp_path / "imported"),
                                           tmp_path / "decided.jsonl", "L4", triton_cache, launch)
    assert ran[0] < 4
    assert_compiled_directly(ran, compiled, incidents)


@pytest.mark.parametrize("named", ["the kernel file", "a module it imported"])
def test_decisions_never_replace_a_file_the_check_read(tmp_path, monkeypatch, capsys, named):
    """Issue 45: ``check kern.py --decisions kern.py`` replaced the kernel source it had just checked with JSON.
    A file the check read (a target, a module imported) is refused with one line, before anything compiles."""
    package = tmp_path / "readpkg"
    package.mkdir()
    (package / "__init__.py").write_text("# the package\n")
    (package / "kern_read.py").write_text(DOT_KERNELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = package / ("kern_read.py" if named == "the kernel file" else "__init__.py")
    before = path.read_text()
    target = str(package / "kern_read.py") if named == "the kernel file" else "readpkg.kern_read"
    assert check_decisions([target], "L4", path, monkeypatch) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == (f"smemguard check: --decisions {path} is {path}, a file this check read (a kernel's source, a "
                    "module it imported): name another file; nothing checked")
    assert path.read_text() == before


def test_decisions_into_the_live_decision_file_are_merged_under_its_lock(tmp_path, monkeypatch, capsys):
    """Issue 45: ``--decisions $SMEMGUARD_CACHE_DIR/decisions.json`` replaced the host's live file whole, outside its
    lock (its decisions lost, mode 644) and then said to import the file into itself. It is merged into as 'cache
    import' merges: what was there stays, the file stays its owner's, and the line says so."""
    from smemguard.facts import settings
    from test_untrusted_input import DECISIONS

    cache = tmp_path / "cache"
    [(key, earlier)] = list(DECISIONS["compile"].items())[:1]
    decision_cache.Store(cache).put("compile", key, earlier)
    monkeypatch.setenv("SMEMGUARD_CACHE_DIR", str(cache))
    settings.current.cache_clear()
    try:
        assert check_decisions(["smemguard.examples:matmul_kernel", "--meta", "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,"
                                "num_warps=4,num_stages=5"], "L4", cache / decision_cache.FILE_NAME, monkeypatch) == 1
    finally:
        settings.current.cache_clear()
    stored = json.loads((cache / decision_cache.FILE_NAME).read_text())
    assert stored["compile"][key] == earlier and len(stored["compile"]) > 1, "merged: nothing that was there lost"
    assert oct((cache / decision_cache.FILE_NAME).stat().st_mode & 0o777) == oct(0o600)
    [line] = [line for line in capsys.readouterr().err.splitlines() if "decisions" in line]
    assert len(stored["compile"]) + len(stored["launch"]) == 2
    assert line == (f"smemguard check: added 1 decision to this host's decision cache "
                    f"{cache / decision_cache.FILE_NAME} (0 already there, kept as they were) for 1 overflowing config "
                    "(0 without one)")
    assert "cache import" not in line
