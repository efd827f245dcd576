"""Recovery on Triton's real launch path (CPU harness: real compiles for sm_89, real OutOfResources)."""

import threading

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

import smemguard
from smemguard.engine import recovery
from smemguard.testing import fake_gpu

from kernels import autotuned, config, matmul_args, matmul_kernel, tiled_grid, with_heuristic_block_n

N = 256

from conftest import records  # noqa: E402


def aligned_and_misaligned(n=N):
    """Two views of the same shape: 16-byte aligned, and shifted by one element (no cp.async)."""
    storage = torch.empty(n * n + 8, dtype=torch.float16)
    return storage[: n * n].view(n, n), storage[1: n * n + 1].view(n, n)


def operands(n=N):
    return torch.empty(n, n, dtype=torch.float16), torch.empty(n, n, dtype=torch.float16)


@pytest.fixture
def compiles(monkeypatch):
    """(num_stages, BLOCK_M) of every kernel Triton compiles from now on."""
    from triton import knobs

    seen = []

    def hook(**kwargs):
        constants = kwargs["compile"]["constants"]
        block_m = next((v for k, v in constants.items() if k == (12,) or k == "BLOCK_M"), None)
        seen.append((kwargs["compile"]["num_stages"], block_m))
        return False

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", hook)
    return seen


def test_autotune_trap_recovers_with_fewer_stages_and_then_costs_nothing(install_guard, incident_log, triton_cache,
                                                                         compiles, monkeypatch):
    """Tuned on misaligned views (no cp.async: fits), launched on aligned tensors of the same shape (overflows)."""
    aligned, misaligned = aligned_and_misaligned()
    b, c = operands()
    tuned = autotuned([config(64, 64, 64, 4), config(32, 32, 32, 4)])
    install_guard()
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(N, N)](*matmul_args(misaligned, b, c))
        assert gpu.launches[-1].shared == 32768

        kernel = tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        assert (gpu.launches[-1].num_stages, gpu.launches[-1].shared, gpu.launches[-1].grid) == (3, 32768, (4, 4, 1))
        assert kernel.metadata.num_stages == 3

        handled = []
        monkeypatch.setattr(recovery, "handle", lambda *a: handled.append(a))
        compiles.clear()
        again = tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        assert again is kernel and gpu.launches[-1].num_stages == 3
        assert compiles == [] and handled == [], "a remembered case compiles nothing and raises nothing"

    [record] = records(incident_log)
    assert record["action"] == "stages_reduced"
    assert record["kernel"] == "smemguard.examples:matmul_kernel" and record["launched_as"] == "Autotuner"
    assert (record["required"], record["limit_hit"], record["resource"]) == (49152, 40000, "shared memory")
    # The 3-stage variant and the other config both fit; timed equal by the stand-in GPU, fewer stages win.
    assert [(a["required"], a["fits"]) for a in record["attempts"]] == [(49152, False), (32768, True), (12288, True)]
    assert len(record["timings_ms"]) == 2
    assert record["args"]["a_ptr"] == {"shape": [N, N], "stride": [N, 1], "dtype": "torch.float16", "ptr_mod_16": 0}
    assert record["specialization"]["a_ptr"] == "div16" and record["specialization"]["stride_ak"] == "==1"
    assert record["constexprs"] == {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}
    assert record["grid"] == [4, 4] and record["autotune_key"][:3] == [N, N, N]
    assert (record["num_warps"], record["num_stages"]) == (4, 4)
    assert record["source"].endswith("examples.py:7") and len(record["source_hash"]) == 16
    assert record["device"]["arch"] == 89 and record["triton"] == triton.__version__


def test_without_the_guard_the_trap_raises(triton_cache):
    aligned, misaligned = aligned_and_misaligned()
    b, c = operands()
    tuned = autotuned([config(64, 64, 64, 4), config(32, 32, 32, 4)])
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache):
        tuned[tiled_grid(N, N)](*matmul_args(misaligned, b, c))
        with pytest.raises(OutOfResources):
            tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))


@pytest.mark.parametrize("gpu, limit, tuned_tile, attempted", [
    # 65536 B is 2 stages of 128x128x64 tiles (sm_89 keeps the third in registers): the ladder goes straight
    # to 1 stage, 32768 B, still too big; of 64x64's variants the one predicted biggest among those that
    # may fit (2 stages) is compiled next, and fits.
    ("L4", 30000, (128, 128, 64), [65536, 32768, 16384]),
    # gfx942 keeps (S-1) stages of both tiles in LDS, one tile at one stage; 64x64x64 at 4 stages failed
    # in tuning, so only its fewer stages are tried: the one predicted to fit first (1 stage, 8192 B), then
    # one more while its own bytes per stage allow (2 stages, 16384 B, the one that runs).
    ("MI300X", 20000, (128, 128, 128), [131072, 65536, 32768, 8192, 16384]),
])
def test_all_configs_overflow_recovers_with_fewer_stages_of_another_config(gpu, limit, tuned_tile, attempted,
                                                                            install_guard, incident_log, triton_cache):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    tuned = autotuned([config(*tuned_tile, 3), config(64, 64, 64, 4)])
    install_guard()
    with fake_gpu(gpu, max_shared=limit, cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        launch = gpu.launches[-1]
        assert (launch.shared, launch.num_stages, launch.grid) == (16384, 2, (4, 4, 1)), "grid recomputed for 64x64"
        chosen = tuned.cache[next(iter(tuned.cache))]
        assert (chosen.kwargs["BLOCK_M"], chosen.num_stages) == (64, 2), "the tuner's cached choice is updated"
        tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
    [record] = records(incident_log)
    assert record["action"] == "config_changed" and record["final"].startswith("BLOCK_M=64")
    assert [a["required"] for a in record["attempts"]] == attempted


def test_prefers_the_config_the_autotuner_timed_fastest(install_guard, incident_log, triton_cache):
    """Tuned on a big GPU (a replayed autotune cache), launched on a small one."""
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    hooks = []
    configs = [config(32, 32, 32, 2, pre_hook=lambda nargs: hooks.append("32x32")),
               config(64, 64, 32, 2, pre_hook=lambda nargs: hooks.append("64x64")),
               config(128, 128, 64, 1, pre_hook=lambda nargs: hooks.append("128x128"))]
    tuned = autotuned(configs)
    install_guard()
    times = iter([2.0, 3.0, 1.0])
    with fake_gpu("H100", cache_dir=triton_cache) as gpu:
        gpu.bench_ms = lambda: next(times)
        tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        assert gpu.launches[-1].shared == 32768
    hooks.clear()
    with fake_gpu("L4", max_shared=20000, cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        launch = gpu.launches[-1]
        # 32x32 was timed faster (2.0 ms) than 64x64 (3.0 ms); both fit.
        assert (launch.shared, launch.grid) == (4096, (8, 8, 1))
    assert hooks[-1] == "32x32", "the chosen config's pre_hook runs before the relaunch"
    [record] = records(incident_log)
    assert record["action"] == "config_changed" and record["final"].startswith("BLOCK_M=32 BLOCK_N=32")


def test_plain_kernel_with_a_tuple_grid_is_never_shrunk(install_guard, incident_log, triton_cache, compiles):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    install_guard()
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache) as gpu:
        with pytest.raises(OutOfResources) as caught:
            matmul_kernel[(2, 2)](*matmul_args(aligned, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=3)
        assert gpu.launches == []
    error = caught.value
    assert type(error) is OutOfResources
    assert (error.required, error.limit, error.name) == (65536, 30000, "shared memory")
    note = "\n".join(error.__notes__)
    assert "smemguard.examples:matmul_kernel" in note and "examples.py:7" in note
    assert "BLOCK_M=128 BLOCK_N=128 BLOCK_K=64 num_warps=4 num_stages=3: 65536 B (too big)" in note
    assert "num_stages=1: 32768 B (too big)" in note
    assert "a_ptr: torch.float16[256, 256] stride [256, 1]" in note
    assert "tile sizes of a plain @triton.jit kernel are never changed" in note
    # Who chose the tiles (this test, launching with a tuple grid), what the best candidate still needs, the calls.
    line = test_plain_kernel_with_a_tuple_grid_is_never_shrunk.__code__.co_firstlineno + 6
    assert (f"BLOCK_M=128, BLOCK_N=128, BLOCK_K=64 were chosen by {__file__}:{line} "
            "(test_plain_kernel_with_a_tuple_grid_is_never_shrunk); the least any candidate needs is 32768 B over "
            "30000 B; the grid is a tuple the caller computed from them, so only the caller can choose smaller ones; "
            "or smemguard.register_fallback(smemguard.examples.matmul_kernel, fn) with fn(a_ptr, b_ptr, c_ptr, M, N, "
            "K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, BLOCK_M, BLOCK_N, BLOCK_K) "
            "computing the same result in torch") in note
    assert f"incident record: {incident_log}#" in note
    assert {block_m for _, block_m in compiles} == {128}, "no other tile size was compiled"
    assert records(incident_log)[0]["action"] == "reraised"


def test_the_same_failure_is_answered_the_same_way_without_new_compiles(install_guard, triton_cache, compiles):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    install_guard()
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache):
        for attempt in range(2):
            with pytest.raises(OutOfResources) as caught:
                matmul_kernel[(2, 2)](*matmul_args(aligned, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                      num_stages=3)
            assert "tried:" in "\n".join(caught.value.__notes__)
            if attempt == 0:
                compiles.clear()
        assert compiles == []


def test_registered_fallback_runs_with_the_named_arguments(install_guard, incident_log, triton_cache):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    calls = []

    def fallback(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M, **rest):
        calls.append((a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M))

    smemguard.register_fallback(matmul_kernel, fallback)
    install_guard()
    try:
        with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache) as gpu:
            for _ in range(2):
                result = matmul_kernel[(2, 2)](*matmul_args(aligned, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)
                assert result is None and gpu.launches == []
    finally:
        smemguard.unregister_fallback(matmul_kernel)
    assert len(calls) == 2
    assert calls[0][0] is aligned and calls[0][2] is c and calls[0][3:] == (N, N, N, 128)
    [record] = records(incident_log)
    assert record["action"] == "fallback" and "fallback" in record["final"]


def test_a_failing_fallback_reraises_the_original_error(install_guard, incident_log, triton_cache, caplog):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()

    def fallback(**_):
        raise ValueError("no cuBLAS here")

    smemguard.register_fallback("smemguard.examples:matmul_kernel", fallback)
    install_guard()
    try:
        with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache):
            with pytest.raises(OutOfResources) as caught:
                matmul_kernel[(2, 2)](*matmul_args(aligned, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)
    finally:
        smemguard.unregister_fallback(matmul_kernel)
    assert isinstance(caught.value.__cause__, ValueError)
    assert "fallback" in caught.value.__notes__[0] and "no cuBLAS here" in caught.value.__notes__[0]
    [record] = records(incident_log)
    assert record["action"] == "reraised" and "no cuBLAS here" in record["reason"], "recorded as what happened"
    assert not any("ran fallback" in line.getMessage() for line in caplog.records)


@pytest.mark.parametrize("gpu, max_shared, big, required, arch", [
    ("L4", 40000, 64, 49152, 89),
    ("MI300X", None, 128, 98304, "gfx942"),
])
def test_observe_mode_changes_nothing_but_writes_the_record(gpu, max_shared, big, required, arch, install_guard,
                                                            incident_log, triton_cache, compiles):
    aligned, misaligned = aligned_and_misaligned()
    b, c = operands()
    tuned = autotuned([config(big, big, 64, 4), config(big // 2, big // 2, big // 2, 4)])
    install_guard(mode="observe")
    with fake_gpu(gpu, max_shared=max_shared, cache_dir=triton_cache) as device:
        tuned[tiled_grid(N, N)](*matmul_args(misaligned, b, c))
        launches, cached = len(device.launches), dict(tuned.cache)
        compiles.clear()
        with pytest.raises(OutOfResources) as caught:
            tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        assert len(device.launches) == launches and tuned.cache == cached
        assert compiles == [(4, big)], "only the launch's own compile"
    assert (caught.value.required, caught.value.limit) == (required, device.max_shared)
    assert not getattr(caught.value, "__notes__", None)
    [record] = records(incident_log)
    assert record["action"] == "observed" and record["required"] == required and record["device"]["arch"] == arch


def test_heuristics_layer_is_followed(install_guard, incident_log, triton_cache):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    kernel = with_heuristic_block_n()
    install_guard()
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
        kernel[(4, 4)](*matmul_args(aligned, b, c), BLOCK_M=64, BLOCK_K=64, num_stages=4)
        assert (gpu.launches[-1].num_stages, gpu.launches[-1].shared) == (3, 32768)
    [record] = records(incident_log)
    assert record["launched_as"] == "Heuristics" and record["constexprs"]["BLOCK_N"] == 64


def test_threads_are_recovered_with_fewer_warps(install_guard, incident_log, triton_cache):
    a, b = operands()
    c = torch.empty(N, N, dtype=torch.float16)
    install_guard()
    with fake_gpu("L4", max_threads=128, cache_dir=triton_cache) as gpu:
        matmul_kernel[(8, 8)](*matmul_args(a, b, c), BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=8)
        assert gpu.launches[-1].num_warps == 4
    [record] = records(incident_log)
    assert record["action"] == "warps_reduced" and record["resource"] == "threads"


class TwoKernelLauncher(triton.runtime.KernelInterface):
    """A wrapper of unknown behaviour: it may have launched something before the failing kernel."""

    def __init__(self, fn):
        self.fn = fn

    def run(self, *args, grid, warmup, **kwargs):
        return self.fn.run(*args, grid=grid, warmup=warmup, **kwargs)


def test_unknown_wrappers_are_not_retried(install_guard, incident_log, triton_cache):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    install_guard()
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
        with pytest.raises(OutOfResources) as caught:
            TwoKernelLauncher(matmul_kernel)[(4, 4)](*matmul_args(aligned, b, c), BLOCK_M=64, BLOCK_N=64,
                                                      BLOCK_K=64, num_stages=4)
        assert gpu.launches == []
    [record] = records(incident_log)
    assert record["action"] == "reraised" and "TwoKernelLauncher" in record["reason"]
    assert "smemguard did not retry smemguard.examples:matmul_kernel" in caught.value.__notes__[0]


class OpaqueLauncher(triton.runtime.KernelInterface):
    """A library's launcher that keeps its kernel under another name: nothing for smemguard to name it by."""

    def __init__(self, kernel):
        self.kernel = kernel

    def run(self, *args, grid, warmup, **kwargs):
        return self.kernel.run(*args, grid=grid, warmup=warmup, **kwargs)


def test_a_launcher_smemguard_cannot_even_name_still_gets_the_users_error(install_guard, incident_log,
                                                                          triton_cache):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    install_guard()
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache):
        with pytest.raises(OutOfResources) as caught:
            OpaqueLauncher(matmul_kernel)[(4, 4)](*matmul_args(aligned, b, c), BLOCK_M=64, BLOCK_N=64,
                                                   BLOCK_K=64, num_stages=4)
    [record] = records(incident_log)
    assert record["kernel"].endswith(":OpaqueLauncher") and record["action"] == "reraised"
    assert "smemguard did not retry" in caught.value.__notes__[0]


def test_emulated_limit_is_enforced_in_tuning_and_at_launch(install_guard, incident_log, triton_cache):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    tuned = autotuned([config(128, 128, 64, 4), config(64, 64, 64, 2)])
    install_guard(max_shared=40000, max_shared_label="40000")
    with fake_gpu("H100", cache_dir=triton_cache) as gpu:  # sm_90: S * (BM*BK + BK*BN) * 2 bytes
        assert gpu.max_shared == 232448
        tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        assert gpu.launches[-1].shared == 32768, "the 131072 B config failed in tuning under the emulated limit"
        assert records(incident_log) == []
        matmul_kernel[(2, 2)](*matmul_args(aligned, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=2)
        assert (gpu.launches[-1].num_stages, gpu.launches[-1].shared) == (1, 32768)
    [record] = records(incident_log)
    assert (record["required"], record["limit_hit"]) == (65536, 40000)
    assert record["limit"] == {"device": 232448, "emulated": 40000}


def test_sixteen_threads_on_a_new_shape_decide_once(install_guard, incident_log, triton_cache, monkeypatch):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    decisions = []
    decide = recovery._decide
    monkeypatch.setattr(recovery, "_decide", lambda *args: decisions.append(1) or decide(*args))
    install_guard()
    errors = []
    barrier = threading.Barrier(16)

    def worker():
        try:
            barrier.wait()
            kernel = matmul_kernel[(4, 4)](*matmul_args(aligned, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
                                           num_stages=4)
            assert kernel.metadata.num_stages == 3
        except Exception as error:  # surfaced below
            errors.append(error)

    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
        threads = [threading.Thread(target=worker) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert len(gpu.launches) == 16 and {launch.num_stages for launch in gpu.launches} == {3}
    assert len(decisions) == 1
    assert len(records(incident_log)) == 1


def test_an_unwritable_incident_log_warns_once_and_recovery_goes_on(install_guard, tmp_path, triton_cache, caplog):
    blocked = tmp_path / "logs"
    install_guard(log_path=blocked / "incidents.jsonl")
    blocked.write_text("a file where the log directory should be")
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    with caplog.at_level("WARNING", logger="smemguard"), \
            fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
        for tile, depth in ((64, 64), (128, 32)):  # both need 49152 B with 4 stages
            matmul_kernel[(4, 4)](*matmul_args(aligned, b, c), BLOCK_M=tile, BLOCK_N=tile, BLOCK_K=depth, num_stages=4)
        assert [launch.num_stages for launch in gpu.launches] == [3, 3]
    complaints = [r.getMessage() for r in caplog.records if "cannot write incident records" in r.getMessage()]
    assert len(complaints) == 1 and str(blocked / "incidents.jsonl") in complaints[0]
    assert "SMEMGUARD_LOG" in complaints[0]


class LoggingAutotuner(triton.runtime.Autotuner):
    """A subclass that keeps Triton's own run(): recovered like triton.autotune."""

    def prune_configs(self, kwargs):
        self.pruned = True
        return super().prune_configs(kwargs)


def test_autotuner_subclass_that_keeps_triton_run(install_guard, incident_log, triton_cache):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    tuned = LoggingAutotuner(matmul_kernel, matmul_kernel.arg_names, [config(128, 128, 64, 3), config(64, 64, 64, 4)],
                             ["M", "N", "K"], None, None)
    install_guard()
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        assert gpu.launches[-1].shared <= 30000 and tuned.pruned
    assert records(incident_log)[0]["action"] == "config_changed"


def test_configs_the_autotuners_pruner_rejects_are_never_candidates(install_guard, incident_log, triton_cache):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    seen = []

    def reject_64(configs, named_args, **kwargs):
        seen.append(named_args["M"])
        return [c for c in configs if c.kwargs["BLOCK_M"] != 64]

    # Under 10000 B: 128x128x64 never fits, 32x32x32 fits only below 4 stages, 64x64x32 fits as it is.
    tuned = autotuned([config(128, 128, 64, 3), config(32, 32, 32, 4), config(64, 64, 32, 2)],
                      prune_configs_by={"early_config_prune": reject_64})
    install_guard()
    with fake_gpu("L4", max_shared=10000, cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        # 64x64x32 is the larger tile that fits, but the kernel's own pruner rejects it.
        assert (gpu.launches[-1].shared, gpu.launches[-1].grid) == (8192, (8, 8, 1))
    assert seen and all(m == N for m in seen)


@pytest.fixture
def alternatives():
    smemguard.register_alternatives(matmul_kernel, [config(64, 64, 64, 2), config(32, 32, 32, 2)])
    yield
    smemguard.unregister_alternatives(matmul_kernel)


def test_registered_alternatives_shrink_tiles_when_the_grid_follows_them(install_guard, incident_log,
                                                                         triton_cache, alternatives):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    install_guard()
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache) as gpu:
        # BLOCK_M passed positionally: the alternative must be bound by name.
        matmul_kernel[tiled_grid(N, N)](*matmul_args(aligned, b, c), 128, BLOCK_N=128, BLOCK_K=64, num_stages=2)
        launch = gpu.launches[-1]
        assert (launch.shared, launch.grid) == (16384, (4, 4, 1)), "64x64 tiles, grid recomputed from them"
    [record] = records(incident_log)
    assert record["action"] == "config_changed" and record["final"].startswith("BLOCK_M=64 BLOCK_N=64")


def test_registered_alternatives_never_apply_to_a_tuple_grid(install_guard, incident_log, triton_cache,
                                                             alternatives, compiles):
    aligned, _ = aligned_and_misaligned()
    b, c = operands()
    install_guard()
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache) as gpu:
        with pytest.raises(OutOfResources) as caught:
            matmul_kernel[(2, 2)](*matmul_args(aligned, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=2)
        assert gpu.launches == []
    assert {block_m for _, block_m in compiles} == {128}
    assert "the grid is a tuple computed by the caller" in "\n".join(caught.value.__notes__)


def test_the_faster_of_fewer_stages_and_another_config_is_chosen_by_timing(install_guard, incident_log,
                                                                          triton_cache):
    """Fewer stages keep the tiles but can be slower than another config that fits: both are timed."""
    aligned, misaligned = aligned_and_misaligned()
    b, c = operands()
    tuned = autotuned([config(64, 64, 64, 4), config(32, 32, 32, 4)])
    install_guard()
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(N, N)](*matmul_args(misaligned, b, c))
        timings = iter([5.0, 1.0])  # the 3-stage 64x64 variant, then 32x32
        gpu.bench_ms = lambda: next(timings)
        tuned[tiled_grid(N, N)](*matmul_args(aligned, b, c))
        assert (gpu.launches[-1].shared, gpu.launches[-1].grid) == (12288, (8, 8, 1))
        assert tuned.cache[next(iter(tuned.cache))].kwargs["BLOCK_M"] == 32
    [record] = records(incident_log)
    assert record["action"] == "config_changed"
    assert sorted(record["timings_ms"].values()) == [1.0, 5.0]
