"""Kernels as Inductor generates them for torch.compile, wrapped in Inductor's own ``CachingAutotuner`` by its
own decorators (``triton_heuristics.template``, ``pointwise``), and a CPU harness that loads them the way
Inductor loads a compiled graph: real Triton compiles for the stand-in GPU of ``smemguard.testing.fake_gpu``,
Inductor's ``_precompile_config``, ``_make_launchers`` and ``make_launcher``, Triton's own load check.

What the harness stands in for (none of it is Triton's or Inductor's logic): the GPU backend check of
``triton_helpers.set_driver_to_gpu`` (fake_gpu's driver is active already), the CUDA device guard (there
is no CUDA device), and Inductor's static launcher is off (it loads cubins, which fake_gpu leaves empty).
"""

import contextlib

import triton
import triton.language as tl

pytest_torch = __import__("pytest").importorskip("torch._inductor.runtime.triton_heuristics")

from torch._inductor.runtime import triton_heuristics, triton_helpers  # noqa: E402
from torch._inductor.runtime.hints import DeviceProperties  # noqa: E402

from smemguard.facts import gpus  # noqa: E402
from smemguard.testing import fake_gpu  # noqa: E402


class _NoDevice:
    """Inductor's device guard with no CUDA device to switch to."""

    @staticmethod
    def exchange_device(index):
        return index

    @staticmethod
    def maybe_exchange_device(index):
        return index


def properties(gpu: str) -> DeviceProperties:
    arch = gpus.lookup(gpu).target_arch
    return DeviceProperties(type="cuda", index=0, multi_processor_count=58, cc=arch, major=arch // 10,
                            regs_per_multiprocessor=65536, max_threads_per_multi_processor=1536, warp_size=32)


@contextlib.contextmanager
def inductor_gpu(monkeypatch, gpu: str = "L4", max_shared: int | None = None, cache_dir: str | None = None):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(triton_helpers, "set_driver_to_gpu", lambda: None)
    monkeypatch.setattr(triton_heuristics.CachingAutotuner, "get_device_interface", lambda self: _NoDevice)
    with inductor_config.patch(use_static_triton_launcher=False), \
            fake_gpu(gpu, max_shared=max_shared, cache_dir=cache_dir) as device:
        yield device


_INDUCTOR_META = {"backend_hash": "smemguard-tests", "are_deterministic_algorithms_enabled": False,
                  "assert_indirect_indexing": True, "autotune_local_cache": False, "autotune_pointwise": True,
                  "autotune_remote_cache": None, "force_disable_caches": True, "dynamic_scale_rblock": True,
                  "max_autotune": False, "max_autotune_pointwise": False, "min_split_scan_rblock": 256,
                  "spill_threshold": 16, "store_cubin": False, "mutated_arg_names": []}


def _aligned(count: int) -> dict:
    return {(index,): [["tt.divisibility", 16]] for index in range(count)}


@triton.jit
def triton_tem_fused_mm_0(arg_A, arg_B, out_ptr0):
    # A template as Inductor renders one: the tiles are constants of the source.
    BLOCK_M: tl.constexpr = 128
    BLOCK_N: tl.constexpr = 128
    BLOCK_K: tl.constexpr = 64
    N = 1024
    K = 1024
    pid_m = tl.program_id(0) // (N // BLOCK_N)
    pid_n = tl.program_id(0) % (N // BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(arg_A + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(arg_B + (k + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(out_ptr0 + rm[:, None] * N + rn[None, :], acc.to(tl.float16))


def template_matmul(gpu: str, num_stages: int = 4, num_warps: int = 4, jit=triton_tem_fused_mm_0):
    """A 128x128x64 fp16 matmul template at ``num_stages`` (131072 B at 3 stages on sm_89); ``jit`` a copy of
    the kernel's JIT function for a test that changes it."""
    return triton_heuristics.template(
        num_stages=num_stages, num_warps=num_warps,
        triton_meta={"signature": {"arg_A": "*fp16", "arg_B": "*fp16", "out_ptr0": "*fp16"}, "device": properties(gpu),
                     "constants": {}, "configs": [_aligned(3)]},
        inductor_meta={**_INDUCTOR_META, "kernel_name": "triton_tem_fused_mm_0", "grid_type": "FixedGrid",
                       "fixed_grid": ["_grid_0", "_grid_1", "_grid_2"],
                       "extra_launcher_args": ["_grid_0", "_grid_1", "_grid_2"]},
    )(jit)


@triton.jit
def triton_poi_fused_clone_0(in_ptr0, out_ptr0, ynumel, xnumel, YBLOCK: tl.constexpr, XBLOCK: tl.constexpr):
    # A transpose (``x.t().contiguous()``): loads and stores disagree on the fast axis, so Triton converts the
    # tile's layout through shared memory, as much as the tile holds.
    yoffset = tl.program_id(1) * YBLOCK
    yindex = yoffset + tl.arange(0, YBLOCK)[None, :]
    ymask = yindex < ynumel
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    tmp0 = tl.load(in_ptr0 + (yindex + ynumel * xindex), xmask & ymask)
    tl.store(out_ptr0 + (xindex + xnumel * yindex), tmp0, xmask & ymask)


def pointwise_transpose(gpu: str, xblock: int, yblock: int, num_warps: int = 4):
    """The transpose with one config, as ``triton_heuristics.pointwise`` builds a kernel for fixed blocks."""
    config = triton_heuristics.Config({"XBLOCK": xblock, "YBLOCK": yblock}, num_warps=num_warps, num_stages=1)
    autotuner = triton_heuristics.CachingAutotuner(
        triton_poi_fused_clone_0,
        triton_meta={"signature": {"in_ptr0": "*fp32", "out_ptr0": "*fp32", "ynumel": "i32", "xnumel": "i32",
                                   "YBLOCK": "constexpr", "XBLOCK": "constexpr"},
                     "device": properties(gpu), "constants": {}, "configs": [_aligned(4)]},
        configs=[config], save_cache_hook=None, mutated_arg_names=[], optimize_mem=True,
        heuristic_type=triton_heuristics.HeuristicType.POINTWISE,
        inductor_meta={**_INDUCTOR_META, "kernel_name": "triton_poi_fused_clone_0", "grid_type": "Grid2D"},
    )
    return autotuner


@triton.jit
def triton_tem_fused_mm_depth_0(arg_A, arg_B, out_ptr0, NUM_STAGES: tl.constexpr):
    # The template above, pipelined through its loop's own depth (as Inductor's mix-order reductions are):
    # the launch option stays at one stage.
    BLOCK_M: tl.constexpr = 128
    BLOCK_N: tl.constexpr = 128
    BLOCK_K: tl.constexpr = 64
    N = 1024
    K = 1024
    pid_m = tl.program_id(0) // (N // BLOCK_N)
    pid_n = tl.program_id(0) % (N // BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = tl.load(arg_A + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(arg_B + (k + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(out_ptr0 + rm[:, None] * N + rn[None, :], acc.to(tl.float16))


def depth_kwarg_matmul(gpu: str, depth: int):
    """The template with ``NUM_STAGES=depth`` in its config's kwargs and ``num_stages=1``."""
    config = triton_heuristics.Config({"NUM_STAGES": depth}, num_warps=4, num_stages=1)
    return triton_heuristics.CachingAutotuner(
        triton_tem_fused_mm_depth_0,
        triton_meta={"signature": {"arg_A": "*fp16", "arg_B": "*fp16", "out_ptr0": "*fp16", "NUM_STAGES": "constexpr"},
                     "device": properties(gpu), "constants": {}, "configs": [_aligned(3)]},
        configs=[config], save_cache_hook=None, mutated_arg_names=[], optimize_mem=True,
        heuristic_type=triton_heuristics.HeuristicType.PERSISTENT_REDUCTION,
        inductor_meta={**_INDUCTOR_META, "kernel_name": "triton_tem_fused_mm_depth_0", "grid_type": "FixedGrid",
                       "fixed_grid": ["_grid_0", "_grid_1", "_grid_2"],
                       "extra_launcher_args": ["_grid_0", "_grid_1", "_grid_2"]},
    )
