"""The compile-time core at ``triton.compile``: a kernel that does not fit is compiled again with fewer stages
before anything loads it, for any caller (Triton's real compiles for a stand-in L4, Triton's own load check)."""

import contextlib
import json

import pytest
import torch
import triton
import triton.language as tl
from triton.compiler import compiler

import smemguard
from smemguard.facts import process
from smemguard.patches.triton_seams import triton_compile
from smemguard.facts.settings import Settings
from smemguard.testing import fake_gpu, load_check_failures as load_checks

from conftest import records
from kernels import autotuned, config, matmul_args, matmul_kernel


def operands():
    return [torch.empty(256, 256, dtype=torch.float16) for _ in range(3)]


def five_stages(kernel=matmul_kernel):
    """131072 B at 5 stages on sm_89, 98304 at 4: an L4's 101376 B takes 4."""
    kernel[(4, 4)](*matmul_args(*operands()), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5)


def test_the_first_launch_of_a_plain_kernel_never_raises(install_guard, incident_log, tmp_path, triton_cache):
    install_guard(core=True, cache_dir=tmp_path / "decisions")
    with load_checks() as raised, fake_gpu("L4", cache_dir=triton_cache) as gpu:
        five_stages()
    assert raised == [], "no OutOfResources at Triton's load check: the kernel that loaded fits"
    assert [(launch.num_stages, launch.shared) for launch in gpu.launches] == [(4, 98304)]
    [record] = records(incident_log)
    assert (record["phase"], record["launched_as"], record["action"]) == ("compile", "triton.compile",
                                                                          "stages_reduced")
    assert (record["required"], record["limit_hit"], record["final"]) == (131072, 101376, "num_stages=4")
    assert record["compiles"] == 1 and record["attempts"][-1] == {"num_stages": 4, "shared": 98304}
    stored = json.loads((tmp_path / "decisions" / "decisions.json").read_text())["compile"]
    [entry] = stored.values()
    assert entry["options"] == {"num_stages": 4} and entry["kernel"] == "smemguard.examples:matmul_kernel"


def test_the_next_process_compiles_the_fitting_variant_first(incident_log, tmp_path, triton_cache):
    """The decision stored by the core is keyed as the JIT's compile-time patch reads it: a new install (a
    new process's view of the store) compiles 4 stages, no incident; on Triton 3.4 (no ``_do_compile``) the
    core applies it after one compile, remembered."""
    settings = Settings(log_path=incident_log, cache_dir=tmp_path / "decisions")  # the core on, as by default
    for _ in range(2):
        assert smemguard.install(settings)
        try:
            with load_checks() as raised, fake_gpu("L4", cache_dir=triton_cache) as gpu:
                five_stages()
        finally:
            smemguard.uninstall()
        assert raised == [] and gpu.launches[-1].num_stages == 4
    first, *again = records(incident_log)
    assert first["remembered"] is False
    if process.triton_release() >= (3, 5):
        assert again == [], "the JIT compiled the stored variant: nothing overflowed"
    else:
        assert [(r["remembered"], r["compiles"]) for r in again] == [(True, 1)]


def test_the_engines_own_compiles_are_compiled_as_asked(incident_log, tmp_path, triton_cache):
    """While the engine compiles (the ladder's candidates, warm-up and torch.compile recoveries: ``Engine.compiling``)
    neither the core nor a remembered decision changes what Triton compiles, so the engine measures what it asked
    for; before and after, anyone's compile of the same variant gets the 4 stages that fit (``run(warmup=True)``:
    the JIT's compile, as the engine's own candidates call it)."""
    settings = Settings(log_path=incident_log, cache_dir=tmp_path / "decisions")  # the core on, as by default
    stages = {}
    for who in ("first", "the engine", "the next"):
        kernel = triton.jit(matmul_kernel.fn)  # a JIT cache of its own: each compiles
        assert smemguard.install(settings)
        try:
            with fake_gpu("L4", cache_dir=triton_cache), \
                    (process.engine_compiling.scope() if who == "the engine" else contextlib.nullcontext()):
                compiled = kernel.run(*matmul_args(*operands()), grid=(1,), warmup=True, BLOCK_M=128, BLOCK_N=128,
                                      BLOCK_K=64, num_stages=5)
        finally:
            smemguard.uninstall()
        stages[who] = compiled.metadata.num_stages
    assert stages == {"first": 4, "the engine": 5, "the next": 4}
    assert [record["phase"] for record in records(incident_log)][:1] == ["compile"]


def test_an_autotuner_times_each_config_as_the_kernel_that_will_run(install_guard, incident_log, triton_cache):
    """Inside ``Autotuner._bench`` the core fits as anywhere: the 5-stage config is timed as its 4-stage variant
    (cached under its own key), nothing raises, and whichever config wins launches exactly what was timed."""
    too_big, fits = config(128, 128, 64, 5), config(64, 64, 64, 2)
    kernel = autotuned([too_big, fits])
    install_guard(core=True)
    with load_checks() as raised, fake_gpu("L4", cache_dir=triton_cache) as gpu:
        gpu.bench_ms = iter([1.0, 2.0] * 100).__next__  # the too-big config's variant times fastest
        kernel[lambda meta: (4, 4)](*matmul_args(*operands()))
    assert raised == [], "no OutOfResources, not even inside the benchmark"
    measured = smemguard.guard.installed_engine().notes.timings(kernel, next(iter(kernel.cache)))
    timings = {str(cfg): ms for cfg, ms in measured.items()}
    assert set(timings) == {str(too_big), str(fits)} and float("inf") not in timings.values()
    assert (gpu.launches[-1].num_stages, gpu.launches[-1].shared) == (4, 98304), "the timed variant runs"
    [record] = records(incident_log)
    assert record["phase"] == "autotune" and record["final"] == "num_stages=4"
    assert record["config"] == "BLOCK_M=128 BLOCK_N=128 BLOCK_K=64 num_warps=4 num_stages=5", "the config timed"
    assert record["grid"] == [4, 4] and record["args"]["a_ptr"]["shape"] == [256, 256]


def test_the_next_process_times_the_stored_variant_and_chooses_as_the_first(incident_log, tmp_path, triton_cache):
    """The autotuner of a process that shares the decision cache times the too-big config as the stored variant
    that fits (compiled directly at 4 stages), as the core timed it in the first: the same choice, the same
    kernel, no incident (it was refused in that benchmark before, so the next process chose the other config)."""
    settings = Settings(log_path=incident_log, cache_dir=tmp_path / "decisions")  # the core on, as by default
    launched, compiled, block_m = [], [], (matmul_kernel.arg_names.index("BLOCK_M"),)
    for _ in range(2):
        kernel = autotuned([config(128, 128, 64, 5), config(64, 64, 64, 2)])
        assert smemguard.install(settings)
        try:
            with fake_gpu("L4", cache_dir=triton_cache) as gpu:
                gpu.bench_ms = iter([1.0, 2.0] * 100).__next__  # the too-big config's variant times fastest
                compiled.append([])
                triton.knobs.runtime.jit_cache_hook = lambda **kw: compiled[-1].append(
                    (kw["compile"]["constants"].get(block_m), kw["compile"]["num_stages"])) and False
                kernel[lambda meta: (4, 4)](*matmul_args(*operands()))
            notes = smemguard.guard.installed_engine().notes
        finally:
            triton.knobs.runtime.jit_cache_hook = None
            smemguard.uninstall()
        launched.append((gpu.launches[-1].num_stages, gpu.launches[-1].shared))
        assert float("inf") not in notes.timings(kernel, next(iter(kernel.cache))).values()
    assert launched == [(4, 98304), (4, 98304)], "the same config, the same variant"
    if process.triton_release() >= (3, 5):
        assert compiled[1] == [(128, 4), (64, 2)], "the stored variant compiled directly"
        assert [record["remembered"] for record in records(incident_log)] == [False], "nothing overflowed"


def test_a_cross_compile_is_left_as_compiled(install_guard, incident_log, triton_cache):
    """A compile for another arch is not for this device: no limit applies to it here."""
    install_guard(core=True)
    with fake_gpu("L4", cache_dir=triton_cache):
        compiled = matmul_kernel.warmup(*matmul_args(*operands()), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                        num_stages=2, grid=(1,))
        other = triton.compile(compiled.src, target=triton.backends.compiler.GPUTarget("cuda", 80, 32),
                               options={"num_stages": 5})
    assert other.metadata.num_stages == 5 and other.metadata.shared > 101376
    assert records(incident_log) == []


@triton.jit
def _no_loop(x_ptr, BLOCK: tl.constexpr):
    """Holds a BLOCK x BLOCK fp32 tile in shared memory through a transpose, with no loop to pipeline."""
    offsets = tl.arange(0, BLOCK)
    tile = tl.load(x_ptr + offsets[:, None] * BLOCK + offsets[None, :])
    tl.store(x_ptr + offsets[:, None] * BLOCK + offsets[None, :], tl.trans(tile))


def test_what_stages_cannot_fix_is_left_to_the_launch_guard(install_guard, incident_log, triton_cache):
    """No loop to pipeline: the core compiles nothing more, and the launch guard says why nothing fits."""
    install_guard(core=True)
    with fake_gpu("L4", max_shared=4096, cache_dir=triton_cache), pytest.raises(triton.runtime.errors.OutOfResources):
        _no_loop[(1,)](torch.empty(64, 64), BLOCK=64)
    [record] = records(incident_log)
    assert record["phase"] == "launch" and record["action"] == "reraised"


def test_smemguards_own_search_is_seen_by_the_threads_it_compiles_on():
    """The ladder compiles candidates on a pool of threads: the core must stand aside in all of them (it would
    hide what each candidate needs), not only in the thread that handles the failure."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(bool, process.engine_compiling).result() is False
        with process.engine_compiling.scope():
            assert pool.submit(bool, process.engine_compiling).result() is True
        assert pool.submit(bool, process.engine_compiling).result() is False


def test_observe_mode_leaves_every_binding_of_triton_compile_untouched(install_guard):
    bindings = (triton.compile, triton.compiler.compile, compiler.compile)
    install_guard(core=True, mode="observe")
    assert not triton_compile.PATCH.is_patched()
    assert (triton.compile, triton.compiler.compile, compiler.compile) == bindings


def test_an_inductor_template_loads_at_the_stages_that_fit_without_a_failing_load(install_guard, incident_log,
                                                                                 monkeypatch, triton_cache):
    """Inductor compiles with ``triton.compile`` in ``_precompile_config``: the core fits the template there, so its
    load (``_make_launchers``) meets no ``OutOfResources`` and the load-time recovery has nothing to do."""
    pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    from inductor_kernels import inductor_gpu, template_matmul

    kernel = template_matmul("L4", num_stages=5)
    install_guard(core=True)
    with load_checks() as raised, inductor_gpu(monkeypatch, "L4", cache_dir=triton_cache):
        kernel.precompile()
    assert raised == []
    [result] = kernel.compile_results
    assert (result.kernel.metadata.num_stages, result.kernel.metadata.shared) == (4, 98304)
    [record] = records(incident_log)
    assert (record["phase"], record["launched_as"], record["final"]) == ("compile", "triton.compile", "num_stages=4")


def test_every_torch_patch_applies_when_inductor_is_imported_as_torch_compile_imports_it():
    """In a fresh process: install, then import what ``torch.compile`` imports; every torch.compile patch of this
    torch's release is on (unverified above the newest checked, never stepping aside)."""
    pytest.importorskip("torch._inductor")
    from conftest import run_python

    result = run_python("""
        import triton, smemguard
        from smemguard.facts.settings import Settings
        smemguard.install(Settings(max_shared=101376))
        import torch._inductor.compile_fx, torch._inductor.kernel.flex.flex_attention  # what torch.compile loads
        from smemguard.patches.torch_seams import inductor_cache_key, inductor_flex_configs, inductor_launchers
        from smemguard.patches.torch_seams import inductor_static_launcher
        print([m.PATCH.is_patched() for m in (inductor_launchers, inductor_static_launcher, inductor_flex_configs,
                                        inductor_cache_key)])
    """)
    assert result.stdout.split("\n")[-2] == "[True, True, True, True]", result.stderr


def test_the_core_fits_an_amd_kernel_before_its_load_and_keeps_its_options(install_guard, incident_log,
                                                                           triton_cache):
    """Triton's HIP backend on the CPU harness (no AMD GPU runs anything): 4 stages of 128x128x64 fp16 tiles need
    98304 B of an MI300X's 65536 B of LDS; the core compiles 3 (65536 B), the AMD options the caller gave kept."""
    amd = dict(waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2)
    install_guard(core=True)
    with load_checks() as raised, fake_gpu("MI300X", cache_dir=triton_cache) as gpu:
        kernel = matmul_kernel[(2, 2)](*matmul_args(*operands()), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                       num_stages=4, **amd)
    assert raised == [], "no OutOfResources at Triton's load check on the HIP backend either"
    assert [(launch.num_stages, launch.shared) for launch in gpu.launches] == [(3, 65536)]
    assert kernel.metadata.target.arch == "gfx942" and {name: getattr(kernel.metadata, name) for name in amd} == amd
    [record] = records(incident_log)
    assert (record["phase"], record["action"], record["final"]) == ("compile", "stages_reduced", "num_stages=3")
    assert (record["required"], record["limit_hit"], record["device"]["backend"]) == (98304, 65536, "hip")
