"""smemguard.testing.fake_gpu drives Triton's real JIT path on a CPU machine."""

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.errors import OutOfResources

from smemguard.testing import fake_gpu

from kernels import matmul_args, matmul_kernel


def operands(n=128, dtype=torch.float16):
    return torch.empty(n, n, dtype=dtype), torch.empty(n, n, dtype=dtype), torch.empty(n, n, dtype=dtype)


def test_real_out_of_resources_over_the_limit_and_a_launch_under_it(triton_cache):
    a, b, c = operands()
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache) as gpu:
        kernel = matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=3)
        assert kernel.metadata.target.arch == 89
        assert gpu.launches == [gpu.launches[0]]
        launch = gpu.launches[0]
        assert (launch.kernel, launch.grid, launch.num_stages, launch.shared) == ("matmul_kernel", (2, 2, 1), 3, 32768)

        with pytest.raises(OutOfResources) as error:
            matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)
        assert (error.value.required, error.value.limit, error.value.name) == (49152, 40000, "shared memory")
        assert len(gpu.launches) == 1, "a kernel that does not fit is never launched"


def test_the_table_limit_and_arch_are_used(triton_cache):
    a, b, c = operands()
    with fake_gpu("A100", cache_dir=triton_cache) as gpu:
        kernel = matmul_kernel[(1, 1)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4)
        assert (gpu.arch, gpu.max_shared, kernel.metadata.target.arch) == (80, 166912, 80)


def test_threads_limit(triton_cache):
    a, b, c = operands()
    with fake_gpu("L4", max_threads=128, cache_dir=triton_cache):
        with pytest.raises(OutOfResources) as error:
            matmul_kernel[(1, 1)](*matmul_args(a, b, c), BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=8)
        assert (error.value.required, error.value.limit, error.value.name) == (256, 128, "threads")


def test_leaving_restores_the_driver_and_forgets_fake_kernels(triton_cache):
    from triton.runtime import driver

    a, b, c = operands()
    before = dict(vars(driver))
    with fake_gpu("L4", cache_dir=triton_cache):
        kernel = matmul_kernel[(1, 1)](*matmul_args(a, b, c), BLOCK_M=32, BLOCK_N=32, BLOCK_K=32)
        assert kernel.module is not None
    assert dict(vars(driver)) == before
    assert kernel.module is None, "a fake-loaded kernel must not ask the real driver to unload it"
    assert not matmul_kernel.device_caches


def test_autotuner_benchmarks_through_the_harness(triton_cache):
    from kernels import autotuned, config, tiled_grid

    a, b, c = operands()
    tuned = autotuned([config(64, 64, 64, 4), config(32, 32, 32, 2)])
    times = iter([2.0, 1.0])
    with fake_gpu("L4", cache_dir=triton_cache) as gpu:
        gpu.bench_ms = lambda: next(times)
        tuned[tiled_grid(128, 128)](*matmul_args(a, b, c))
    assert tuned.best_config.kwargs["BLOCK_M"] == 32


def test_unknown_gpu_name():
    with pytest.raises(ValueError, match="GPU name from smemguard.facts.gpus"):
        with fake_gpu("L5"):
            pass


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


def test_the_stand_in_skips_ptxas_and_its_empty_cubin_never_answers_a_real_compile(tmp_path):
    """ptxas is not run for the stand-in (its cubin is empty), and Triton's cache files that apart:
    a real compile of the same kernel for the same arch, sharing the cache, still gets a real cubin."""
    x = torch.empty(256)
    with fake_gpu("L4", cache_dir=str(tmp_path)) as gpu:
        stand_in = _copy[(1,)](x, x, 256, BLOCK=256)
    assert stand_in.asm["cubin"] == b"" and "ptx" in stand_in.asm and gpu.launches
    with knobs.cache.scope():
        knobs.cache.dir = str(tmp_path)
        real = triton.compile(stand_in.src, target=GPUTarget("cuda", 89, 32))  # what the launch compiled
    assert real.asm["cubin"].startswith(b"\x7fELF") and real.hash != stand_in.hash
