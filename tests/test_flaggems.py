"""FlagGems' Hopper matmul through its own LibEntry and LibTuner, on the CPU harness (Triton's real compile for sm_90).

Needs FlagGems (``pip install --no-deps flag-gems==5.0.2 sqlalchemy pyyaml``; CI stage "flaggems").
FlagGems asks torch for the current CUDA device and its count; on this machine its device
layer is replaced by what it would say on a one-GPU machine. Everything else is FlagGems'
and Triton's own: ``general_mm``, the descriptors, ``LibEntry``'s cache, ``LibTuner``'s SQLite
database and its pre_hook, the compile, and ``OutOfResources`` from ``_init_handles``.
"""

import contextlib
import importlib.util
import os
import sys
import types

import pytest
import torch

import smemguard
from smemguard.kernels import tuners, registry
from smemguard.cli import replay
from smemguard.patches.contrib import flaggems
from smemguard.testing import fake_gpu

from conftest import records, run_python

pytestmark = [pytest.mark.flaggems, pytest.mark.usefixtures("records_name_their_launch")]

HOPPER_MM = "hopper.ops.mm"  # FlagGems imports its arch package as "hopper", with its folder on sys.path
L20_ON_HOPPER = dict(gpu=90, max_shared=101376)  # an H200 emulating an L20's limit
FLAGGEMS_ENV = {"GEMS_VENDOR": "nvidia"}  # FlagGems finds its vendor with nvidia-smi otherwise


@pytest.fixture(scope="module")
def flag_gems_modules(tmp_path_factory):
    """FlagGems' libentry module and its Hopper matmul module, loaded as FlagGems loads it on a Hopper GPU."""
    if importlib.util.find_spec("flag_gems") is None:
        pytest.skip("FlagGems is not installed (CI stage 'flaggems' installs it)")
    # FlagGems' tuning database, one per process (its table classes live on one global SQLAlchemy base):
    # each test below uses its own shapes, hence its own keys. Without a URL FlagGems names the
    # database after the CUDA device it cannot find here. FlagGems reads both variables at import only.
    with pytest.MonkeyPatch.context() as environment:
        database = f"sqlite:///{tmp_path_factory.mktemp('flaggems')}/tuned.db"
        for name, value in {**FLAGGEMS_ENV, "FLAGGEMS_DB_URL": database}.items():
            environment.setenv(name, value)
        import flag_gems

        path = os.path.join(os.path.dirname(flag_gems.__file__), "runtime", "backend", "_nvidia", "hopper", "ops",
                            "mm.py")
        spec = importlib.util.spec_from_file_location(HOPPER_MM, path)
        hopper = importlib.util.module_from_spec(spec)
        sys.modules[HOPPER_MM] = hopper
        spec.loader.exec_module(hopper)
    one_gpu = types.SimpleNamespace(current_device=lambda: 0, device=lambda device: contextlib.nullcontext())
    libentry = sys.modules["flag_gems.utils.libentry"]
    libentry.torch_device_fn = hopper.torch_device_fn = one_gpu
    yield libentry, hopper
    del sys.modules[HOPPER_MM]


def _configs(kernel, *wanted):
    """Configs of FlagGems' own list (with their pre_hook), by (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)."""
    own = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages, c.num_warps): c
           for c in kernel.fn.configs}
    return [own[shape] for shape in wanted]


@pytest.fixture
def hopper_mm(flag_gems_modules, monkeypatch):
    """The Hopper matmul with an empty LibEntry cache.

    Its config list is cut to four of its own 216 (tuning all of them takes minutes here): one
    that overflows an L20 only at 4 stages, one that overflows 64 KiB at any stage count, one that
    fits an L20, one that fits 64 KiB.
    """
    _, hopper = flag_gems_modules
    kernel = hopper.mm_kernel_general_host_tma
    tuner = kernel.fn
    monkeypatch.setattr(tuner, "configs", _configs(kernel, (128, 128, 64, 4, 8), (256, 128, 128, 2, 8),
                                                   (128, 64, 64, 3, 4), (64, 64, 64, 3, 4)))
    monkeypatch.setattr(kernel, "kernel_cache", ({},))  # FlagGems sizes it by the GPUs it found: none here
    return hopper


def _operands(M=256, N=256, K=512, dtype=torch.float16):
    torch.manual_seed(0)
    return torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype), torch.full((M, N), float("nan"), dtype=dtype)


def _tuned_elsewhere(hopper, a, b, config):
    """File ``config`` in the tuning database for this shape, as a bigger GPU's tuning run would have."""
    tuner = hopper.mm_kernel_general_host_tma.fn
    (M, K), N = a.shape, b.shape[1]
    key = tuner.get_key({"M": M, "N": N, "K": K, "stride_am": a.stride(0), "stride_bk": b.stride(0),
                         "dtype": str(a.dtype).split(".")[-1]})
    tuner.cache[key] = config
    return key


def test_flaggems_layers_are_described_and_the_matmuls_get_the_cublas_fallback(install_guard, flag_gems_modules):
    _, hopper = flag_gems_modules
    install_guard()
    kernel = hopper.mm_kernel_general_host_tma
    assert tuners.is_entry(kernel) and tuners.tuner_for(kernel.fn).name == "flag_gems.LibTuner"
    assert registry.fallback_for(kernel) is flaggems._host_tma_mm_fallback
    assert registry.fallback_for(sys.modules["flag_gems.ops.mm"].mm_kernel_general) is flaggems._mm_fallback


def test_a_config_tuned_on_a_bigger_gpu_runs_with_fewer_stages_and_libentry_keeps_it(install_guard, incident_log,
                                                                                    triton_cache, hopper_mm):
    install_guard()
    kernel = hopper_mm.mm_kernel_general_host_tma
    a, b, c = _operands()
    key = _tuned_elsewhere(hopper_mm, a, b, kernel.fn.configs[0])  # 128x128x64, 4 stages: 131104 B on sm_90
    with fake_gpu(**L20_ON_HOPPER, cache_dir=triton_cache) as gpu:
        hopper_mm.general_mm(a, b, c, *a.shape[:1], b.shape[1], a.shape[1])
        recovered = gpu.launches[-1]
        hopper_mm.general_mm(a, b, c, *a.shape[:1], b.shape[1], a.shape[1])
    (record,) = records(incident_log)
    assert (record["action"], record["launched_as"], record["required"]) == ("stages_reduced", "LibEntry", 131104)
    assert record["autotune_key"] == list(key), "the incident names LibTuner's own key"
    assert record["args"]["a_desc"]["block_shape"] == [128, 64], "as the tuned config's pre_hook had set them"
    assert recovered.num_stages == 3 and recovered.shared <= 101376
    assert gpu.launches[-1] == recovered, "the second call found the replacement through LibTuner"
    assert all(launch.shared <= 101376 for launch in gpu.launches), "timing the candidates launched only fits"
    ((cached_kernel, *_),) = kernel.kernel_cache[0].values()
    assert cached_kernel.metadata.num_stages == 3, "LibEntry cached the replacement: later calls launch it directly"
    assert kernel.fn.cache.get(key).num_stages == 4, "same tiles: LibTuner's choice stays, Triton's cache serves it"

    smemguard.uninstall()  # replay installs its own guard
    said = []
    assert replay.replay(record, None, said.append) == 0
    assert any("reproduced: OutOfResources shared memory, required 131104 B" in line for line in said), said
    assert any("stages_reduced" in line and "num_stages=3" in line for line in said), said


def test_when_no_stage_count_fits_libtuner_switches_config_and_files_it_in_its_database(
        install_guard, incident_log, triton_cache, hopper_mm, flag_gems_modules):
    libentry, _ = flag_gems_modules
    install_guard()
    kernel = hopper_mm.mm_kernel_general_host_tma
    a, b, c = _operands(M=512)
    key = _tuned_elsewhere(hopper_mm, a, b, kernel.fn.configs[1])  # 256x128x128: too big at any stage count
    with fake_gpu(90, max_shared=65536, cache_dir=triton_cache) as gpu:  # an H200 emulating a 64 KiB GPU
        hopper_mm.general_mm(a, b, c, *a.shape[:1], b.shape[1], a.shape[1])
    (record,) = records(incident_log)
    assert record["action"] == "config_changed"
    # One stage of 256x128x128 fp16 tiles through TMA descriptors is 98304 B: its fewer stages are not compiled.
    assert record["skipped"][0] == "num_stages=1: at least 98304 B, one stage of its tiles (calibrated estimate)"
    adopted = kernel.fn.cache.get(key)
    assert adopted.all_kwargs() == kernel.fn.configs[3].all_kwargs(), \
        "the one of LibTuner's own configs that fits, never a variant it could not find the pre_hook for"
    assert record["final"].startswith(f"BLOCK_M={adopted.kwargs['BLOCK_M']} BLOCK_N={adopted.kwargs['BLOCK_N']} ")
    assert gpu.launches[-1].shared <= 65536 and gpu.launches[-1].num_stages == adopted.num_stages
    # Another process opening FlagGems' database finds the config that fits under LibTuner's key.
    reopened = libentry.SQLPersistantModel(libentry.libcache.db_url)
    assert reopened.get_config(kernel.fn.config_table_name, key).all_kwargs() == adopted.all_kwargs()


@pytest.mark.parametrize("max_shared, shape", [(16384, (64, 32, 64)), (24576, (64, 32, 128))],
                         ids=["nothing-fits", "only-a-fewer-stage-variant-of-another-config-fits"])
def test_when_no_config_of_its_own_fits_the_product_comes_from_torch_not_from_flaggems(
        install_guard, incident_log, triton_cache, hopper_mm, max_shared, shape):
    """At 24576 B only 64x64x64 with 1 stage fits: LibTuner could not find the pre_hook of that variant."""
    install_guard()
    M, N, K = shape
    a, b, c = _operands(M, N, K)
    tuned = hopper_mm.mm_kernel_general_host_tma.fn.configs[0]
    key = _tuned_elsewhere(hopper_mm, a, b, tuned)
    with fake_gpu(90, max_shared=max_shared, cache_dir=triton_cache) as gpu:
        hopper_mm.general_mm(a, b, c, M, N, K)
    assert gpu.launches == []
    (record,) = records(incident_log)
    assert record["action"] == "fallback" and "_host_tma_mm_fallback" in record["final"]
    assert torch.equal(c, a @ b), "the fallback wrote the product into FlagGems' output"
    assert hopper_mm.mm_kernel_general_host_tma.fn.cache.get(key).all_kwargs() == tuned.all_kwargs()


@pytest.mark.parametrize("max_shared, M", [(101376, 96), (4096, 80)], ids=["recovered", "fallback"])
def test_the_pointer_matmul_for_misaligned_shapes_recovers_through_the_same_layers(
        install_guard, incident_log, triton_cache, flag_gems_modules, monkeypatch, max_shared, M):
    """N % 8 != 0 is not TMA-compatible: FlagGems runs ``mm_kernel_general``, keyed on exact sizes."""
    _, hopper = flag_gems_modules
    kernel = hopper.mm_kernel_general
    monkeypatch.setattr(kernel.fn, "configs", _configs(kernel, (128, 256, 64, 4, 8), (128, 128, 64, 3, 8),
                                                       (64, 64, 64, 4, 4)))
    monkeypatch.setattr(kernel, "kernel_cache", ({},))
    install_guard()
    N, K = 100, 256
    a, b, c = _operands(M, N, K)
    key = kernel.fn.get_key({"A": a, "B": b, "C": c, "M": M, "N": N, "K": K, "stride_am": K, "stride_bk": N})
    kernel.fn.cache[key] = kernel.fn.configs[0]  # 128x256x64, 4 stages: tuned on a bigger GPU
    with fake_gpu(90, max_shared=max_shared, cache_dir=triton_cache) as gpu:
        hopper_result = hopper.general_mm(a, b, c, M, N, K)
    (record,) = records(incident_log)
    assert record["kernel"] == "hopper.ops.mm:mm_kernel_general" and record["launched_as"] == "LibEntry"
    if max_shared == 4096:
        assert record["action"] == "fallback" and gpu.launches == []
        assert torch.equal(hopper_result, a @ b)
    else:
        # Misaligned operands keep sm_90's pipeline off: the tuned 128x256x64 tile fits with fewer stages.
        assert record["action"] == "stages_reduced" and record["autotune_key"] == list(key)
        assert "BLOCK_M=128 BLOCK_N=256" in record["final"] and gpu.launches[-1].num_stages < 4
        assert gpu.launches and all(launch.shared <= max_shared for launch in gpu.launches)


def test_observe_mode_records_flaggems_launch_in_full_and_changes_nothing(install_guard, incident_log, triton_cache,
                                                                         hopper_mm):
    from triton.runtime.errors import OutOfResources

    install_guard(mode="observe")
    a, b, c = _operands(M=128)
    tuned = hopper_mm.mm_kernel_general_host_tma.fn.configs[0]
    key = _tuned_elsewhere(hopper_mm, a, b, tuned)
    with fake_gpu(**L20_ON_HOPPER, cache_dir=triton_cache) as gpu, pytest.raises(OutOfResources):
        hopper_mm.general_mm(a, b, c, 128, b.shape[1], a.shape[1])
    assert gpu.launches == []
    (record,) = records(incident_log)
    assert record["action"] == "observed" and record["autotune_key"] == list(key), "read through LibEntry/LibTuner"
    assert hopper_mm.mm_kernel_general_host_tma.fn.cache.get(key).all_kwargs() == tuned.all_kwargs()


def test_flaggems_own_alignment_assertion_passes_through_untouched(install_guard, incident_log, hopper_mm):
    install_guard()
    a, b, c = _operands()
    misaligned = torch.empty(a.numel() + 1, dtype=a.dtype)[1:].view_as(a).copy_(a)
    with fake_gpu(**L20_ON_HOPPER), pytest.raises(AssertionError, match="16-byte aligned"):
        hopper_mm.general_mm(misaligned, b, c, *a.shape[:1], b.shape[1], a.shape[1])
    assert records(incident_log) == []


def test_importing_flaggems_after_install_patches_it_and_uninstall_removes_it(tmp_path):
    if importlib.util.find_spec("flag_gems") is None:
        pytest.skip("FlagGems is not installed (CI stage 'flaggems' installs it)")
    out = run_python("""
        import sys, smemguard
        from smemguard.kernels import registry, tuners
        from smemguard.patches.contrib import flaggems
        smemguard.install()
        assert not flaggems.PATCH.is_patched()
        import flag_gems  # the post-import hooks patch it here
        kernel = sys.modules["flag_gems.ops.mm"].mm_kernel_general
        assert flaggems.PATCH.is_patched() and tuners.is_entry(kernel) and registry.fallback_for(kernel)
        smemguard.uninstall()
        assert not flaggems.PATCH.is_patched() and not tuners.is_entry(kernel) and not registry.fallback_for(kernel)
        print("ok")
    """, env={**FLAGGEMS_ENV, "FLAGGEMS_DB_URL": f"sqlite:///{tmp_path}/db"})
    assert out.stdout.strip().endswith("ok")
