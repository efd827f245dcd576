"""Decisions at warm-up: a kernel compiled by ``kernel.warmup(...)`` that would not fit is replaced
then, so that its first launch pays no exception and no compile."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import triton

from smemguard.patches.triton_seams import kernel_warmup
from smemguard.testing import fake_gpu

from conftest import records
from kernels import matmul_args, matmul_kernel

pytestmark = pytest.mark.skipif(not kernel_warmup.PATCH.supported.admits(triton.__version__),
                                reason=f"Triton {triton.__version__} defines warmup on JITFunction: "
                                       "decided at the first launch there (tests/test_recovery.py)")

CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)  # 49152 B on sm_89, 32768 with 3 stages


def operands():
    return tuple(torch.randn(128, 128, dtype=torch.float16) for _ in range(3))


def test_a_warmup_compile_that_does_not_fit_is_replaced_before_the_first_launch(install_guard, incident_log,
                                                                              triton_cache):
    a, b, c = operands()
    install_guard(cache_dir=None)
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
        warmed = matmul_kernel.warmup(torch.float16, torch.float16, torch.float16, *matmul_args(a, b, c)[3:],
                                      grid=(1,), **CONFIG)
        assert warmed.metadata.num_stages == 3 and warmed.metadata.shared <= 40000
        assert gpu.launches == [], "warm-up launches nothing"
        (record,) = records(incident_log)
        assert record["phase"] == "warmup" and record["action"] == "stages_reduced"
        launched = matmul_kernel[(2, 2)](*matmul_args(a, b, c), **CONFIG)
    assert launched is warmed, "the first launch ran the kernel decided at warm-up"
    assert [launch.num_stages for launch in gpu.launches] == [3]
    assert len(records(incident_log)) == 1, "and raised nothing"


def test_in_async_compile_mode_a_warmup_is_decided_when_finalized_without_waiting_on_other_compiles(
        install_guard, incident_log, triton_cache):
    """vLLM compiles its CUDA warm-up in ``triton.AsyncCompileMode`` (some of it with ``ignore_errors``):
    ``warmup`` returns a ``FutureKernel`` and nothing is waited for; finalizing it (here inside the mode,
    while a sibling compile that fails is still unfinalized in the same JIT cache) decides it, its
    candidates compiled at once."""
    a, b, c = operands()
    dtypes_and_sizes = (torch.float16, torch.float16, torch.float16, *matmul_args(a, b, c)[3:])
    install_guard(cache_dir=None)
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu, ThreadPoolExecutor(1) as pool:
        with triton.AsyncCompileMode(pool, ignore_errors=True):
            warmed = matmul_kernel.warmup(*dtypes_and_sizes, grid=(1,), **CONFIG)
            matmul_kernel.warmup(*dtypes_and_sizes, grid=(1,), **{**CONFIG, "BLOCK_K": 48})  # not a power of 2
            assert isinstance(warmed, triton.FutureKernel) and records(incident_log) == [], "nothing waited for"
            decided = warmed.result()
            assert type(decided) is triton.compiler.CompiledKernel and decided.metadata.num_stages == 3
        (record,) = records(incident_log)
        assert record["phase"] == "warmup" and record["action"] == "stages_reduced"
        launched = matmul_kernel[(2, 2)](*matmul_args(a, b, c), **CONFIG)
    assert launched is decided and warmed.result() is decided
    assert [launch.num_stages for launch in gpu.launches] == [3] and len(records(incident_log)) == 1


def test_a_warmup_that_fits_or_runs_in_observe_mode_is_left_as_it_is(install_guard, incident_log, triton_cache):
    a, b, c = operands()
    install_guard(mode="observe")
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache):
        warmed = matmul_kernel.warmup(torch.float16, torch.float16, torch.float16, *matmul_args(a, b, c)[3:],
                                      grid=(1,), **CONFIG)
    assert warmed.metadata.num_stages == 4 and records(incident_log) == []
