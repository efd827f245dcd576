"""Kernels whose config is fixed before they are launched, for the preflight-decisions round trip
(tests/test_preflight_decisions.py)."""

import triton

from smemguard.examples import matmul_kernel

#: 128x128x128 fp16 at 4 stages: 196608 B on sm_89 and on gfx942, over an L4's 101376 B and an MI300X's 65536 B.
FIXED = triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128), num_stages=4, num_warps=4)
#: Over a T4's 65536 B at any stage count (sm_75 runs no software pipeliner): only another config fits there.
BIG = triton.Config(dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=128), num_stages=2, num_warps=8)
SMALL = triton.Config(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64), num_stages=2, num_warps=4)

#: An autotuner whose config in force was tuned elsewhere (the tests put BIG in its cache, as a tuning cache would).
tuned_elsewhere = triton.autotune(configs=[BIG, SMALL], key=["M", "N", "K"])(matmul_kernel)

SMEMGUARD_PREFLIGHT = {"matmul_kernel": {"dtype": "fp16", "configs": [FIXED]}, "tuned_elsewhere": {"dtype": "fp16"}}
