"""Tuners as the field writes them: Autotuner subclasses (fla's CachedAutotuner), alone or under
triton.heuristics, recovered like Triton's own when their code keeps Autotuner's contract."""

import json

import pytest
import torch
from triton.runtime.autotuner import Autotuner
from triton.runtime.errors import OutOfResources

from smemguard.kernels import tuners
from smemguard.testing import fake_gpu

from conftest import records
from kernels import config, matmul_args, matmul_kernel, tiled_grid


class LoadsThenTunes(Autotuner):
    """The shape of fla's CachedAutotuner: a choice filed elsewhere goes into ``cache``, then Autotuner.run."""

    choice = None

    def run(self, *args, **kwargs):
        self.load_choice(args)
        return super().run(*args, **kwargs)

    def load_choice(self, args):
        if self.choice is not None:
            self.cache[tuple(args[3:6]) + ("torch.float16",) * 3] = self.choice


class LaunchesFirst(Autotuner):
    """Launches a kernel of its own before tuning: a retry could run that one twice."""

    def run(self, *args, **kwargs):
        self.warm(args)
        return super().run(*args, **kwargs)

    def warm(self, args):
        matmul_kernel[(1, 1)](*args, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)


class DoesNotReturnTheLaunch(Autotuner):
    def run(self, *args, **kwargs):
        super().run(*args, **kwargs)


def tuner(cls, configs):
    return cls(matmul_kernel, matmul_kernel.arg_names, configs, ["M", "N", "K"], None, None)


def operands(n=128):
    return (torch.randn(n, n, dtype=torch.float16), torch.randn(n, n, dtype=torch.float16),
            torch.empty(n, n, dtype=torch.float16))


def test_the_contract_is_read_from_the_subclass_code():
    assert tuners.keeps_autotuner_contract(Autotuner)
    assert tuners.keeps_autotuner_contract(LoadsThenTunes)
    assert not tuners.keeps_autotuner_contract(LaunchesFirst), "its own method launches a kernel"
    assert not tuners.keeps_autotuner_contract(DoesNotReturnTheLaunch)
    assert not tuners.keeps_autotuner_contract(type("OwnBench", (Autotuner,), {"_bench": lambda self: None}))


def test_a_subclass_that_files_a_choice_made_elsewhere_is_recovered(install_guard, incident_log, triton_cache):
    configs = [config(128, 128, 64, 5), config(64, 64, 64, 3)]
    tuned = tuner(LoadsThenTunes, configs)
    tuned.choice = configs[0]  # 131072 B on sm_89 (L4: 101376): chosen on a bigger GPU
    a, b, c = operands()
    install_guard()
    with fake_gpu("L4", cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(128, 128)](*matmul_args(a, b, c))
    (record,) = records(incident_log)
    # The stand-in GPU times every candidate alike: the tie keeps the tuned tile with fewer stages.
    assert record["launched_as"] == "LoadsThenTunes" and record["action"] == "stages_reduced"
    assert "BLOCK_M=128 BLOCK_N=128 BLOCK_K=64 num_warps=4 num_stages=4" == record["final"]
    assert gpu.launches and gpu.launches[-1].shared <= 101376


def test_a_subclass_that_may_launch_by_itself_is_never_retried(install_guard, incident_log, triton_cache):
    tuned = tuner(LaunchesFirst, [config(128, 128, 64, 5), config(64, 64, 64, 3)])
    tuned.cache[(128, 128, 128, "torch.float16", "torch.float16", "torch.float16")] = tuned.configs[0]
    a, b, c = operands()
    install_guard()
    with fake_gpu("L4", cache_dir=triton_cache), pytest.raises(OutOfResources):
        tuned[tiled_grid(128, 128)](*matmul_args(a, b, c))
    (record,) = records(incident_log)
    assert record["action"] == "reraised" and record["reason"].startswith("LaunchesFirst is not")


FLA_KERNEL = "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"


@pytest.fixture
def fla_choice_from_a_bigger_gpu(tmp_path, monkeypatch):
    """fla-core's real GDN backward kernel with a config in FLA's config directory (FLA_CACHE_MODE=default)
    that was tuned where 165 KB of shared memory per block were available."""
    cache = pytest.importorskip("fla.ops.utils.cache", reason="fla-core is not installed (CI stage 'fla' installs it)")
    from fla.ops.common import chunk_delta_h

    (tmp_path / f"{FLA_KERNEL}.json").write_text(json.dumps({
        "kernel_name": FLA_KERNEL,
        "default_config": {"kwargs": {"BV": 64}, "num_warps": 4, "num_stages": 4, "num_ctas": 1}}))
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.DEFAULT)
    kernel = getattr(chunk_delta_h, FLA_KERNEL)
    monkeypatch.setattr(kernel.fn, "cache", {})
    shape = dict(B=1, T=64, H=1, K=64, V=64)
    tensors = [torch.randn(shape["B"], shape["T"], shape["H"], shape["K"], dtype=torch.bfloat16) for _ in range(5)]
    gate = torch.randn(shape["B"], shape["T"], shape["H"], dtype=torch.float32)
    return lambda: chunk_delta_h.chunk_gated_delta_rule_bwd_dhu(*tensors, g=gate, scale=0.125), kernel


@pytest.mark.fla
def test_fla_gdn_backward_under_heuristics_with_a_cached_autotuner_is_recovered(
        install_guard, incident_log, triton_cache, fla_choice_from_a_bigger_gpu):
    run, kernel = fla_choice_from_a_bigger_gpu
    assert type(kernel).__name__ == "Heuristics" and type(kernel.fn).__name__ == "CachedAutotuner"
    install_guard(mode="observe")
    with fake_gpu(90, max_shared=65536, cache_dir=triton_cache), pytest.raises(OutOfResources):
        run()  # what fla does on a T4-sized limit without smemguard
    import smemguard

    smemguard.uninstall()
    install_guard()
    with fake_gpu(90, max_shared=65536, cache_dir=triton_cache) as gpu:
        run()
        run()  # decided once: the second call pays no incident
    observed, recovered = records(incident_log)
    assert observed["action"] == "observed" and observed["required"] > 65536
    assert recovered["launched_as"] == "Heuristics" and recovered["action"] == "stages_reduced"
    assert "BV=64" in recovered["final"] and "num_stages=4" not in recovered["final"], "same tile, fewer stages"
    assert gpu.launches and all(launch.shared <= 65536 for launch in gpu.launches)


# -- Kernels whose own parameters are named like launch options (Liger-Kernel's) -------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _tile_product(a_ptr, b_ptr, K, stride_am, stride_ak, stride_bk, stride_bn, rm, rn, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k + rk)[None, :] * stride_ak)
        b = tl.load(b_ptr + (k + rk)[:, None] * stride_bk + rn[None, :] * stride_bn)
        acc += tl.dot(a, b)
    return acc


def _matmul_taking_its_options(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                               stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               num_stages: tl.constexpr, num_warps: tl.constexpr):
    """Liger-Kernel's convention: the launch options are parameters too, unused in the body."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tile_product(a_ptr, b_ptr, K, stride_am, stride_ak, stride_bk, stride_bn, rm, rn, BLOCK_M, BLOCK_N, BLOCK_K)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(tl.float16))


def _matmul_computing_with_its_stages(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                      stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                      BLOCK_K: tl.constexpr, num_stages: tl.constexpr, num_warps: tl.constexpr):
    """The same, but the result depends on the parameter named num_stages."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tile_product(a_ptr, b_ptr, K, stride_am, stride_ak, stride_bk, stride_bn, rm, rn, BLOCK_M, BLOCK_N, BLOCK_K)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, (acc * num_stages).to(tl.float16))


@pytest.mark.parametrize("body, own_stages, action, final_stages", [
    (_matmul_taking_its_options, 5, "stages_reduced", 2),
    # Liger-Kernel's case: the parameter already holds the count the option is lowered to
    (_matmul_taking_its_options, 2, "stages_reduced", 2),
    (_matmul_computing_with_its_stages, 5, "reraised", None)])
def test_kernels_taking_num_stages_and_num_warps_positionally(install_guard, incident_log, triton_cache, body,
                                                              own_stages, action, final_stages):
    """Passed positionally, they are the kernel's parameters and Triton launches with its default
    options (3 stages: 65536 B for 128x128x64 on sm_89). Fewer stages are tried unless the kernel
    computes with the parameter: changing the option would change it too."""
    kernel = triton.jit(body)
    a, b, c = operands()
    install_guard()
    with fake_gpu("L4", max_shared=60000, cache_dir=triton_cache) as gpu:
        launch = lambda: kernel[(1, 1)](*matmul_args(a, b, c), 128, 128, 64, own_stages, 4)  # noqa: E731
        if final_stages is None:
            with pytest.raises(OutOfResources):
                launch()
        else:
            assert launch().metadata.num_stages == final_stages == gpu.launches[-1].num_stages
    (record,) = records(incident_log)
    assert record["action"] == action and record["internal_errors"] == 0
    if final_stages is None:
        candidates = record["attempts"][1:]
        assert candidates and all("is also a parameter the kernel uses" in attempt["error"] for attempt in candidates)


def test_a_candidate_smemguard_cannot_build_is_counted_and_the_next_one_still_recovers(
        install_guard, incident_log, triton_cache):
    import smemguard

    a, b, c = operands()
    broken = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "NO_SUCH_PARAMETER": 1}, num_stages=1)
    smemguard.register_alternatives(matmul_kernel, [broken, config(32, 32, 32, 1)])
    install_guard()
    try:
        with fake_gpu("L4", max_shared=16384, cache_dir=triton_cache):  # 128x128x64 needs 32768 B at any stage count
            matmul_kernel[tiled_grid(128, 128)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                                num_stages=1)
    finally:
        smemguard.unregister_alternatives(matmul_kernel)
    (record,) = records(incident_log)
    assert record["action"] == "config_changed" and "BLOCK_M=32" in record["final"]
    assert record["internal_errors"] == 1
    assert [a["internal_error"] for a in record["attempts"]][-2:] == [True, False], "built wrongly, then the next fits"


@pytest.mark.fla
def test_liger_kernels_neighborhood_attention_backward_recovers_on_a_t4_sized_limit(install_guard, incident_log,
                                                                                   triton_cache):
    """Liger-Kernel 0.8.5's kernel, launched as its backward launches it: num_stages=2 passed
    positionally as its own parameter, Triton's default 3 stages as the option (98304 B on sm_90)."""
    fna = pytest.importorskip("liger_kernel.ops.fused_neighborhood_attention",
                              reason="Liger-Kernel is not installed (CI stage 1b installs it)")
    batch, heads, seq_len, head_dim = 1, 2, 48, 128
    grad_out, value = torch.randn(batch, heads, seq_len, head_dim), torch.randn(batch, heads, seq_len, head_dim)
    grad_attn = torch.empty(batch, heads, seq_len, seq_len)
    install_guard()
    with fake_gpu(90, max_shared=65536, cache_dir=triton_cache) as gpu:
        fna._fused_neighborhood_attention_grad_attn_kernel[(batch * heads, 1, 1)](
            grad_out, value, grad_attn, *grad_out.stride(), *value.stride(), *grad_attn.stride(), batch, heads,
            seq_len, head_dim, 64, 64, 64, 2, 4)
    (record,) = records(incident_log)
    assert record["action"] == "stages_reduced" and record["required"] == 98304
    assert record["attempts"][1]["changes"] == "num_stages=2" and gpu.launches[-1].shared <= 65536
