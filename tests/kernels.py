"""Helpers over smemguard's example kernels for the tests."""

import triton

from smemguard.examples import autotuned_matmul as autotuned, matmul_args, matmul_kernel, tiled_grid  # noqa: F401


def config(block_m, block_n, block_k, num_stages, num_warps=4, pre_hook=None):
    return triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k), num_stages=num_stages,
                         num_warps=num_warps, pre_hook=pre_hook)


def with_heuristic_block_n():
    """``matmul_kernel`` behind a heuristics layer that picks BLOCK_N from N."""
    return triton.heuristics({"BLOCK_N": lambda args: 64 if args["N"] >= 64 else 16})(matmul_kernel)
