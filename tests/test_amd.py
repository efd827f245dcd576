"""AMD GPUs on the CPU harness: Triton's HIP backend compiles for the gfx arch, the stand-in HIP
driver launches through Triton's own JIT path, and ``_init_handles`` raises the real
``OutOfResources`` for LDS. No AMD GPU executes anything here (README, "ROCm")."""

import csv
import importlib
from pathlib import Path

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

import smemguard
from smemguard.facts import gpus
from smemguard import preflight
from smemguard.testing import fake_gpu

from conftest import records
from kernels import autotuned, config, matmul_args, matmul_kernel, tiled_grid
from test_preflight import assert_estimates_agree, results  # noqa: F401 (results is a fixture)
from test_recovery import N, aligned_and_misaligned, compiles, operands  # noqa: F401 (compiles is a fixture)

MI300X = gpus.lookup("MI300X")


@pytest.mark.parametrize("name, arch, wave", [("MI300X", "gfx942", 64), ("MI325X", "gfx942", 64),
                                              ("MI355X", "gfx950", 64), ("MI250X", "gfx90a", 64),
                                              ("MI210", "gfx90a", 64), ("RX7900XTX", "gfx1100", 32)])
def test_fake_amd_gpus_compile_for_their_arch_and_reject_what_overflows_their_lds(name, arch, wave, triton_cache):
    a, b = operands()
    c = torch.empty(N, N, dtype=torch.float16)
    with fake_gpu(name, cache_dir=triton_cache) as gpu:
        kernel = matmul_kernel[(4, 4)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=2)
        target = kernel.metadata.target
        assert (target.backend, target.arch, target.warp_size, kernel.metadata.warp_size) == ("hip", arch, wave, wave)
        assert gpu.max_shared == gpus.lookup(name).max_shared and gpu.launches[-1].shared == kernel.metadata.shared
        with pytest.raises(OutOfResources) as caught:  # 4 stages of 128x128x128 fp16 tiles: over 160 KiB everywhere
            matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_stages=4)
        assert (caught.value.limit, caught.value.name) == (gpu.max_shared, "shared memory")
        assert caught.value.required > gpu.max_shared and len(gpu.launches) == 1


def test_threads_are_counted_in_waves_of_64_on_cdna_and_32_on_rdna(triton_cache):
    a, b = operands()
    c = torch.empty(N, N, dtype=torch.float16)
    launch = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=8)
    with fake_gpu("MI300X", max_threads=256, cache_dir=triton_cache):
        with pytest.raises(OutOfResources) as caught:
            matmul_kernel[(4, 4)](*matmul_args(a, b, c), **launch)
        assert (caught.value.required, caught.value.limit, caught.value.name) == (512, 256, "threads")
    with fake_gpu("RX7900XTX", max_threads=256, cache_dir=triton_cache) as gpu:
        matmul_kernel[(4, 4)](*matmul_args(a, b, c), **launch)
        assert gpu.launches[-1].num_warps == 8


def test_autotune_trap_on_an_mi300x_recovers_with_fewer_stages(install_guard, incident_log, triton_cache):
    """Tuned on views one element off (their A tile is not pipelined through LDS: 65536 B fits),
    launched on aligned tensors of the same shape (every tile pipelined: 98304 B)."""
    aligned, misaligned = aligned_and_misaligned()
    b, c = operands()
    tuned = autotuned([config(128, 128, 64, 4), config(64, 64, 64, 4)])
    install_guard()
    with fake_gpu("MI300X", cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(N, N)](*matmul_args(misaligned, b, c))
        assert (gpu.launches[-1].shared, gpu.launches[-1].grid) == (65536, (2, 2, 1))
        kernel = tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        assert (gpu.launches[-1].num_stages, gpu.launches[-1].shared, gpu.launches[-1].grid) == (3, 65536, (2, 2, 1))
        assert kernel.metadata.target.arch == "gfx942"
    [record] = records(incident_log)
    assert record["action"] == "stages_reduced" and record["device"]["backend"] == "hip"
    assert (record["required"], record["limit_hit"], record["device"]["arch"]) == (98304, 65536, "gfx942")
    # The 3-stage variant and the other config both fit; timed equal by the stand-in GPU, fewer stages win.
    assert [(a["required"], a["fits"]) for a in record["attempts"]] == [(98304, False), (65536, True), (49152, True)]


def test_a_choice_tuned_on_an_mi355x_is_recovered_on_an_mi300x(install_guard, incident_log, triton_cache):
    """The tuner's choice, made on an MI355X's 160 KiB, reused on an MI300X (as FLA's config files and
    vLLM's per-GPU tuning JSON carry one from GPU to GPU): 98304 B of LDS there."""
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    tuned = autotuned([config(128, 128, 64, 4), config(32, 32, 32, 2)])
    install_guard()
    with fake_gpu("MI355X", cache_dir=triton_cache) as gpu:
        timings = iter([1.0, 2.0])
        gpu.bench_ms = lambda: next(timings)
        tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        assert gpu.launches[-1].grid == (2, 2, 1) and MI300X.max_shared < gpu.launches[-1].shared <= 163840
    with fake_gpu("MI300X", cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        assert (gpu.launches[-1].shared, gpu.launches[-1].num_stages, gpu.launches[-1].grid) == (65536, 3, (2, 2, 1))
    [record] = records(incident_log)
    assert record["action"] == "stages_reduced" and record["limit"]["device"] == MI300X.max_shared
    assert (record["required"], record["constexprs"]["BLOCK_M"], record["num_stages"]) == (98304, 128, 4)


def test_futile_stage_reduction_stops_early_and_the_fallback_runs(install_guard, incident_log, triton_cache, compiles):
    """Nothing divisible by 16 (odd sizes): gfx942 pipelines no tile through LDS, so one stage fewer
    needs the same bytes and fewer still are never compiled."""
    size = N - 1
    a, b, c = (torch.empty(size, size, dtype=torch.float16) for _ in range(3))
    calls = []
    smemguard.register_fallback(matmul_kernel, lambda a_ptr, b_ptr, c_ptr, **rest: calls.append(c_ptr))
    install_guard()
    try:
        with fake_gpu("MI300X", max_shared=30000, cache_dir=triton_cache) as gpu:
            assert matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=128,
                                         num_stages=3) is None
            assert gpu.launches == []
    finally:
        smemguard.unregister_fallback(matmul_kernel)
    assert len(calls) == 1 and calls[0] is c
    [record] = records(incident_log)
    assert record["action"] == "fallback" and record["device"]["arch"] == "gfx942"
    assert [(a["required"], a["fits"]) for a in record["attempts"]] == [(32768, False), (32768, False)]
    assert [stages for stages, _ in compiles] == [3, 2], "num_stages=1 is never compiled"


def test_candidates_keep_the_configs_amd_options(install_guard, incident_log, triton_cache):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    amd = dict(waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2)
    single = autotuned([amd_config(128, 128, 128, 2, **amd)])
    every_config_too_big = autotuned([amd_config(128, 128, 128, 3, **amd), amd_config(64, 64, 64, 4, waves_per_eu=1)])
    install_guard()
    with fake_gpu("MI300X", max_shared=40000, cache_dir=triton_cache):
        fewer_stages = single[tiled_grid(N, N)](*matmul_args(aligned, b, c))
    with fake_gpu("MI300X", max_shared=20000, cache_dir=triton_cache):
        other_config = every_config_too_big[tiled_grid(N, N)](*matmul_args(aligned, b, c))
    assert [record["action"] for record in records(incident_log)] == ["stages_reduced", "config_changed"]
    assert {name: getattr(fewer_stages.metadata, name) for name in amd} == amd
    assert fewer_stages.metadata.num_stages == 1 and fewer_stages.metadata.shared == 32768
    assert (other_config.metadata.waves_per_eu, other_config.metadata.matrix_instr_nonkdim) == (1, 0)
    assert other_config.metadata.num_stages == 2 and other_config.metadata.shared == 16384


def amd_config(block_m, block_n, block_k, num_stages, **options):
    """A config as ROCm kernels write them: AMD's compile options among the kwargs."""
    import triton

    return triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **options), num_stages=num_stages,
                         num_warps=4)


# -- smemguard check for AMD GPUs -------------------------------------------------------------------

# LDS of smemguard's example fp16 matmul measured by benchmarks/smem_sweep.py (gfx90a, gfx942, gfx950;
# Triton 3.4.0, 3.6.0, 3.9.0), the data the AMD estimate was calibrated on.
AMD_SWEEP = Path(__file__).parent / "data" / "amd_lds_sweep.csv"
MI355X = gpus.lookup("MI355X")

# Around the MI300X's 65536 B and the MI355X's 163840 B, both sides, both code paths of each arch.
AROUND_AMD = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
              dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=2),
              dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
              dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2),
              dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=2),
              dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)]


def test_check_for_mi300x_and_mi355x_estimates_only_what_compiles_confirm(results, tmp_path):
    kernels = preflight.discover(["smemguard.examples:flaggems_matmul"], overrides={"configs": AROUND_AMD})
    estimated = preflight.check(kernels, [MI300X, MI355X], jobs=2, cache=preflight.ResultCache(tmp_path / "cold"))
    exact = preflight.check(kernels, [MI300X, MI355X], exact=True, jobs=2, cache=results)
    assert {verdict.verdict for verdict in exact.verdicts.values()} == {preflight.FITS, preflight.OVERFLOWS}
    assert {verdict.how for verdict in estimated.verdicts.values()} == {preflight.MEASURED, preflight.ESTIMATED}
    assert estimated.compiles < exact.compiles == len(AROUND_AMD) * 2 * 2
    assert_estimates_agree(estimated, exact)
    # 128x128x64 at 3 stages needs (3-1) x 32768 B on gfx942: exactly the limit, never estimated.
    assert estimated.verdict(0, 0, "aligned", "MI300X").how == preflight.MEASURED
    assert exact.verdict(0, 0, "aligned", "MI300X").shared == 65536 and exact.exit_status == 0
    summary = preflight.format_summary(estimated)
    assert "MI300X (gfx942, 65536 B): configs that fit: flaggems_matmul" in summary
    assert "MI355X (gfx950, 163840 B): configs that fit: flaggems_matmul" in summary


def test_the_amd_estimate_holds_every_config_the_sweep_measured_with_this_triton():
    rows = [row for row in csv.DictReader(AMD_SWEEP.open())
            if row["triton"] == triton.__version__ and row["kernel"] == "matmul_kernel" and row["shared"]]
    if not rows:
        pytest.skip(f"benchmarks/smem_sweep.py --vendor amd has no measurements with Triton {triton.__version__}")
    kernels = {dtype: preflight.discover(["smemguard.examples:matmul_kernel"], overrides={
        "dtype": dtype, "ones": [["N"]], "configs": [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)]})[0]
        for dtype in {row["dtype"] for row in rows}}
    outside, compiled = [], []
    for row in rows:
        kernel = kernels[row["dtype"]]
        options = {name: int(row[name]) for name in ("waves_per_eu", "matrix_instr_nonkdim", "kpack") if row[name]}
        variant = preflight.Variant.of(dict(BLOCK_M=int(row["BM"]), BLOCK_N=int(row["BN"]), BLOCK_K=int(row["BK"]),
                                            num_warps=int(row["num_warps"]), num_stages=int(row["num_stages"]),
                                            **options))
        spec = next(spec for spec in kernel.specializations if spec.name == row["spec"])
        interval = preflight.estimate(preflight.build_request(kernel, variant, spec, row["arch"]), spec)
        if interval is None:
            compiled.append((row["dtype"], row["spec"]))
        elif not interval.holds(int(row["shared"])):
            outside.append((row, interval))
    assert len(rows) >= 280 and outside == []
    assert all(dtype == "fp32" or spec == "N=1" for dtype, spec in compiled), "outside the calibrated domain only"


def test_amd_gpus_this_triton_cannot_compile_for_are_listed_as_not_checked(monkeypatch, results):
    check_module = importlib.import_module("smemguard.preflight.check")
    reason = "Triton 3.4.0 links AMD code objects with an external ld.lld"
    monkeypatch.setattr(check_module, "hip_compile_problem", lambda: reason)
    kernels = preflight.discover(["smemguard.examples:flaggems_matmul"], overrides={"configs": AROUND_AMD[3:4]})
    report = preflight.check(kernels, [gpus.lookup("L4"), MI300X], jobs=1, cache=results)
    assert report.compiles == 2 and report.unchecked == {"MI300X": reason}
    assert {report.verdict(0, 0, spec, "MI300X").verdict for spec in ("aligned", "misaligned")} == {
        preflight.NOT_CHECKED}
    assert f"MI300X (gfx942): not checked: {reason}" in preflight.format_summary(report)
    assert report.to_json()["summary"]["MI300X"]["checked"] is False and report.exit_status == 0
