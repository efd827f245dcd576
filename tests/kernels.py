"""Helpers over smemguard's example kernels for the tests."""

import triton
import triton.language as tl

from smemguard.examples import autotuned_matmul as autotuned, matmul_args, matmul_kernel, tiled_grid  # noqa: F401


def config(block_m, block_n, block_k, num_stages, num_warps=4, pre_hook=None):
    return triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k), num_stages=num_stages,
                         num_warps=num_warps, pre_hook=pre_hook)


def with_heuristic_block_n():
    """``matmul_kernel`` behind a heuristics layer that picks BLOCK_N from N."""
    return triton.heuristics({"BLOCK_N": lambda args: 64 if args["N"] >= 64 else 16})(matmul_kernel)


@triton.jit
def vllm_style_persistent_matmul(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                 stride_cm, stride_cn, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                                 BLOCK_SIZE_K: tl.constexpr, NUM_SMS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The parameters and loop structure of vLLM's batch-invariant ``matmul_kernel_persistent``."""
    num_tiles_n = tl.cdiv(N, BLOCK_SIZE_N)
    for tile in range(tl.program_id(0), tl.cdiv(M, BLOCK_SIZE_M) * num_tiles_n, NUM_SMS):
        rm = (tile // num_tiles_n) * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
        rn = (tile % num_tiles_n) * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        rk = tl.arange(0, BLOCK_SIZE_K)
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_SIZE_K):
            a = tl.load(a_ptr + rm[:, None] * stride_am + (k + rk)[None, :] * stride_ak,
                        mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
            b = tl.load(b_ptr + (k + rk)[:, None] * stride_bk + rn[None, :] * stride_bn,
                        mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))
