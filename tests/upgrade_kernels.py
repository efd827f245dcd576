"""Kernels whose shared memory moves between Triton releases, for ``smemguard check --compare``
(tests/test_check_compare.py). Measured on the CPU harness, 2026-12-07:

* ``tf32x3_tile``: triton #11526's minimal repro (one 16x16 tile, a bf16 ``x`` against an fp32 ``w``, one warp, two
  stages, ``input_precision="tf32x3"``): 1536 B on sm_89 with Triton 3.6 and 3.7, 3072 B with 3.8 (the regression that
  took a TransformerEngine kernel off an L40, PR #3442), 1536 B again with 3.9.
* ``matmul_kernel`` (smemguard's example) at 32x32x512: on gfx950 65536 B at 2 stages and 131072 B at 3 with Triton
  3.6, 136112 B and 204208 B from 3.8 on (asynchronous copies straight into LDS): at 3 stages it no longer fits an
  MI355X's 163840 B. On sm_89 the same on every release (65536 B, 131072 B).
"""

import triton
import triton.language as tl

from smemguard.examples import matmul_kernel  # noqa: F401 (checked here, with the configs below)


@triton.jit
def tf32x3_tile(x_ptr, w_ptr, o_ptr, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP_K: tl.constexpr,
                PRECISION: tl.constexpr):
    """o[16, 16] = sum over k of x[16, k] @ w[16, k].T, as triton #11526's repro computes it."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, STEP_K):
        ks = k + tl.arange(0, STEP_K)
        x = tl.load(x_ptr + offs_m[:, None] * K + ks[None, :])
        w = tl.load(w_ptr + offs_n[:, None] * K + ks[None, :])
        acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision=PRECISION)
    tl.store(o_ptr + offs_m[:, None] * BLOCK_N + offs_n[None, :], acc)


SMEMGUARD_PREFLIGHT = {
    "tf32x3_tile": {"signature": {"x_ptr": "*bf16", "w_ptr": "*fp32", "o_ptr": "*fp32", "K": "i32"},
                    "constants": {"BLOCK_M": 16, "BLOCK_N": 16, "STEP_K": 16, "PRECISION": "tf32x3"},
                    "configs": [{"num_warps": 1, "num_stages": 2}], "unit": "none"},
    "matmul_kernel": {"dtype": "fp16", "configs": [{"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 512, "num_stages": stages}
                                                   for stages in (2, 3)]},
}
