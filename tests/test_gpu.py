"""On a real GPU (the H200): recovery computes the right answer. Skipped without CUDA."""

import json

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

import smemguard
from smemguard.examples import autotuned_matmul, matmul_args, matmul_kernel, matmul_persistent_kernel, tiled_grid

from conftest import records, run_python

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

L20 = 101376


def first_config_wins(kernel_call, quantiles):
    """A do_bench that makes the first config that compiles the winner, as a replayed tuning result would."""
    kernel_call()
    first_config_wins.calls += 1
    return [float(first_config_wins.calls)] * 3


def test_autotune_trap_raises_without_smemguard_and_runs_correctly_with_it(install_guard, incident_log):
    """Tuned on misaligned views (no cp.async: 65536 B), the winner needs far more on aligned tensors."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the sizes below are for sm_90")
    n = 1024
    first_config_wins.calls = 0
    tuned = autotuned_matmul([triton.Config(dict(BLOCK_M=256, BLOCK_N=256, BLOCK_K=64), num_stages=5, num_warps=8),
                              triton.Config(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), num_stages=3, num_warps=4)],
                             do_bench=first_config_wins)
    storage = torch.randn(n * n + 8, device="cuda", dtype=torch.float16)
    aligned, misaligned = storage[: n * n].view(n, n), storage[1: n * n + 1].view(n, n)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    c = torch.empty(n, n, device="cuda", dtype=torch.float16)
    tuned[tiled_grid(n, n)](*matmul_args(misaligned, b, c))
    assert tuned.best_config.kwargs["BLOCK_M"] == 256
    with pytest.raises(OutOfResources) as caught:
        tuned[tiled_grid(n, n)](*matmul_args(aligned, b, c))
    assert caught.value.required > caught.value.limit

    install_guard()
    c.fill_(float("nan"))
    tuned[tiled_grid(n, n)](*matmul_args(aligned, b, c))
    torch.cuda.synchronize()
    reference = (aligned.double() @ b.double())
    assert not c.isnan().any(), "every element was written"
    assert ((c.double() - reference).norm() / reference.norm()).item() < 1e-2
    [record] = records(incident_log)
    assert record["action"] in ("stages_reduced", "config_changed") and record["device"]["arch"] == 90


def test_emulated_l20_recovery_is_bitwise_equal_to_the_original_config(install_guard, incident_log):
    n = 2048
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    meta = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4, num_warps=4)
    original = torch.empty(n, n, device="cuda", dtype=torch.float16)
    kernel = matmul_kernel[(n // 128, n // 128)](*matmul_args(a, b, original), **meta)
    assert kernel.metadata.shared > L20, "the original config must overflow an L20 for this test to mean anything"

    matmul_kernel.device_caches.clear()  # forget the kernel that fits the H200
    install_guard(max_shared=L20, max_shared_label="L20")
    recovered = torch.full((n, n), float("nan"), device="cuda", dtype=torch.float16)
    replacement = matmul_kernel[(n // 128, n // 128)](*matmul_args(a, b, recovered), **meta)
    torch.cuda.synchronize()
    assert replacement.metadata.num_stages < 4 and replacement.metadata.shared <= L20
    assert torch.equal(recovered, original)
    [record] = records(incident_log)
    assert record["action"] == "stages_reduced" and record["limit"]["emulated"] == L20


def test_batch_invariant_fp32_matmul_with_n_equal_1_stays_invariant(install_guard, incident_log):
    """vLLM's batch-invariant case: persistent fp32 128x128x32, N == 1, on an emulated L20."""
    k = 4096
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    meta = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, NUM_SMS=sms, num_stages=4)
    install_guard(max_shared=L20, max_shared_label="L20")
    a = torch.randn(64, k, device="cuda", dtype=torch.float32)
    b = torch.randn(k, 1, device="cuda", dtype=torch.float32)

    def mm(rows):
        out = torch.full((rows.shape[0], 1), float("nan"), device="cuda", dtype=torch.float32)
        matmul_persistent_kernel[(sms,)](*matmul_args(rows, b, out), **meta)
        return out

    batch = mm(a)
    single = torch.cat([mm(a[i: i + 1]) for i in range(64)])
    torch.cuda.synchronize()
    assert not batch.isnan().any()
    assert torch.equal(single, batch), "row i must not depend on the batch size"
    reference = a.double() @ b.double()
    assert ((batch.double() - reference).norm() / reference.norm()).item() < 1e-2
    actions = {r["action"] for r in records(incident_log)}
    assert actions == {"stages_reduced"}, "4 stages of 128x128x32 fp32 overflow an L20 and were reduced"


WORKER = """
import json, torch
from triton import knobs
import smemguard
from smemguard.examples import matmul_args, matmul_kernel

compiled = []
knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(kw["compile"]["num_stages"]) or False
smemguard.install()
a, b = (torch.randn(1024, 1024, device="cuda", dtype=torch.float16) for _ in range(2))
c = torch.empty(1024, 1024, device="cuda", dtype=torch.float16)
kernel = matmul_kernel[(8, 8)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4)
torch.cuda.synchronize()
print(json.dumps({"compiled": compiled, "stages": kernel.metadata.num_stages}))
"""


def test_second_worker_process_compiles_no_failing_variant(tmp_path):
    """Two worker processes, one cache dir, emulated L20: the second never compiles the 4-stage variant."""
    env = {"SMEMGUARD_MAX_SHARED": "L20", "SMEMGUARD_CACHE_DIR": str(tmp_path / "cache"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    first, second = (json.loads(run_python(WORKER, env=env).stdout.strip().splitlines()[-1]) for _ in range(2))
    assert first["stages"] == second["stages"] == 3
    assert 4 in first["compiled"], "the first worker met the overflow"
    assert second["compiled"] == [3], "the second worker compiled the remembered replacement only"


def test_replay_on_the_gpu_reproduces_and_checks_the_recovered_output(install_guard, incident_log, capsys):
    from smemguard.cli import commands

    n = 1024
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.float16) for _ in range(2))
    c = torch.empty(n, n, device="cuda", dtype=torch.float16)
    install_guard(max_shared=L20, max_shared_label="L20")
    matmul_kernel[(n // 128, n // 128)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4)
    smemguard.uninstall()
    assert commands.main(["replay", str(incident_log)]) == 0
    out = capsys.readouterr().out
    print(out)  # kept in the GPU log: the README's replay example comes from here
    assert "reproduced: OutOfResources shared memory, required 131072 B, limit 101376 B" in out
    assert "recovered output equals the original config's bitwise" in out


def _kernel_names(profile) -> list[str]:
    return [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def test_cublas_mm_bypasses_flaggems_override_of_aten_mm():
    flag_gems = pytest.importorskip("flag_gems")
    from smemguard.fallbacks import cublas_mm

    a = torch.randn(300, 512, device="cuda", dtype=torch.float16)
    b = torch.randn(512, 256, device="cuda", dtype=torch.float16)
    expected = torch.mm(a, b)  # PyTorch's own, before FlagGems is enabled
    out = torch.empty_like(expected)
    with flag_gems.use_gems(include=["mm"]):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as overridden:
            torch.mm(a, b)
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as bypassed:
            cublas_mm(a, b, out)
            torch.cuda.synchronize()
    assert any("mm_kernel" in name for name in _kernel_names(overridden)), "FlagGems' matmul runs aten::mm here"
    assert _kernel_names(bypassed) and not any("mm_kernel" in name for name in _kernel_names(bypassed))
    assert torch.equal(out, expected), "the same cuBLAS product as torch.mm without FlagGems"


def test_flaggems_matmul_that_fits_nowhere_falls_back_to_cublas_through_its_own_aten_mm(install_guard,
                                                                                        incident_log):
    """FlagGems serves torch.mm; no config of its Hopper matmul fits 12 KiB; the fallback must not re-enter it."""
    flag_gems = pytest.importorskip("flag_gems")
    import sys

    hopper = sys.modules[flag_gems.mm.__module__]  # the arch module FlagGems picked for this GPU
    tuner = hopper.mm_kernel_general_host_tma.fn
    saved, tuner.configs = tuner.configs, [c for c in tuner.configs if c.kwargs["BLOCK_K"] == 64
                                           and c.kwargs["BLOCK_M"] == 64 and c.num_warps == 4]
    try:
        install_guard(max_shared=12288)
        a = torch.randn(200, 1024, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
        expected = torch.mm(a, b)
        with flag_gems.use_gems(include=["mm"]):
            got = torch.mm(a, b)
            again = torch.mm(a, b)
    finally:
        tuner.configs = saved
    assert torch.equal(got, expected) and torch.equal(again, expected)
    actions = [record["action"] for record in records(incident_log)]
    assert actions == ["fallback"], actions


def test_torch_fallbacks_never_reenter_an_overridden_aten_matmul():
    """vLLM's batch-invariant mode and FlagGems replace aten::mm and friends with the kernels these fallbacks
    replace."""
    from smemguard.fallbacks import batch_invariant_mm, cublas_mm

    a = torch.randn(300, 256, device="cuda")
    b = torch.randn(256, 96, device="cuda")
    bias = torch.randn(96, device="cuda")
    expected, expected_half = torch.empty(300, 96, device="cuda"), torch.empty(300, 96, device="cuda",
                                                                              dtype=torch.float16)
    batch_invariant_mm(a, b, expected, bias)
    cublas_mm(a.half(), b.half(), expected_half)
    override = torch.library.Library("aten", "IMPL")

    def refuse(*args, **kwargs):
        raise AssertionError("a fallback re-entered an overridden aten matmul")

    for op in ("mm", "mm.out", "addmm", "addmm.out", "matmul", "linear"):
        override.impl(op, refuse, "CUDA")
    try:
        with pytest.raises(AssertionError, match="re-entered"):
            a @ b  # the override is in force
        out, out_half = torch.empty_like(expected), torch.empty_like(expected_half)
        batch_invariant_mm(a, b, out, bias)
        cublas_mm(a.half(), b.half(), out_half)
    finally:
        override._destroy()
    assert torch.equal(out, expected) and torch.equal(out_half, expected_half)
