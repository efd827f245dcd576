"""Example Triton kernels shipped with smemguard, for the demo and for trying the guard out."""

import triton
import triton.language as tl


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C = A @ B, one BLOCK_M x BLOCK_N tile per program, tails masked; fp32 accumulation."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    _matmul_tile(a_ptr, b_ptr, c_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                 stride_cn, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _matmul_tile(a_ptr, b_ptr, c_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                 stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``rm`` x columns ``rn`` of C = A @ B: fp32 accumulation over K in BLOCK_K steps, tails masked."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k + rk)[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k + rk)[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul_args(a, b, c) -> tuple:
    """The positional arguments of ``matmul_kernel`` for ``c = a @ b``."""
    M, K = a.shape
    N = b.shape[1]
    return (a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride())


def tiled_grid(M: int, N: int):
    """One program per output tile, computed from the tile size the launch really uses."""
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))


def autotuned_matmul(configs, **kwargs):
    """A new autotuner (its own tuning cache) over ``matmul_kernel``, keyed on M, N, K."""
    return triton.autotune(configs=configs, key=["M", "N", "K"], **kwargs)(matmul_kernel)


@triton.jit
def matmul_persistent_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                             stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             NUM_SMS: tl.constexpr):
    """C = A @ B with NUM_SMS programs looping over the output tiles, as vLLM's batch-invariant matmul.

    Each output element is reduced over K in BLOCK_K steps in the same order whatever M is,
    so row i of C does not depend on how many rows the batch has.
    """
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * num_tiles_n, NUM_SMS):
        rm = (tile // num_tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % num_tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        _matmul_tile(a_ptr, b_ptr, c_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                     stride_cn, BLOCK_M, BLOCK_N, BLOCK_K)


def _flaggems_matmul_configs() -> list:
    """FlagGems' matmul search space: BLOCK_M x BLOCK_N x BLOCK_K x stages x warps, 216 configs."""
    return [triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k), num_stages=stages, num_warps=warps)
            for block_m in (32, 64, 128, 256) for block_n in (32, 64, 128) for block_k in (32, 64, 128)
            for stages in (2, 3, 4) for warps in (4, 8)]


#: The 216-config grid FlagGems tunes its matmul over; sized for the biggest GPUs, so part of it
#: overflows an L4 or an A100 (``smemguard check --examples`` says which).
FLAGGEMS_MATMUL_CONFIGS = _flaggems_matmul_configs()

#: ``matmul_kernel`` autotuned over :data:`FLAGGEMS_MATMUL_CONFIGS` (launch with :func:`tiled_grid`).
flaggems_matmul = autotuned_matmul(FLAGGEMS_MATMUL_CONFIGS)

#: vLLM's batch-invariant matmul config for fp32 (128x128x32, 3 stages, 8 warps) and the 4-stage
#: variant of the GPU test: 131072 B compiled for sm_90 (over an L20's 101376 B when an H200
#: emulates one), 98304 B for sm_89, where one stage stays in registers.
PERSISTENT_MATMUL_CONFIGS = [
    triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32), num_stages=3, num_warps=8),
    triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32), num_stages=4, num_warps=4),
]


@triton.jit
def attention_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seq_len, sm_scale, stride_qh, stride_qm, stride_qd, stride_kh,
                         stride_kn, stride_kd, stride_vh, stride_vn, stride_vd, stride_oh, stride_om, stride_od,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Flash-attention forward, O = softmax(Q K^T * sm_scale) V, without causal masking.

    Program (i, h) computes BLOCK_M query rows of head h, streaming keys and values in BLOCK_N
    blocks with an online softmax; the K and V tiles are what the pipeline multi-buffers.
    """
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, HEAD_DIM)
    head = tl.program_id(1)
    q = tl.load(q_ptr + head * stride_qh + rm[:, None] * stride_qm + rd[None, :] * stride_qd,
                mask=rm[:, None] < seq_len, other=0.0)
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + head * stride_kh + rn[None, :] * stride_kn + rd[:, None] * stride_kd,
                    mask=rn[None, :] < seq_len, other=0.0)
        scores = tl.where(rn[None, :] < seq_len, tl.dot(q, k) * sm_scale, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        probs = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v = tl.load(v_ptr + head * stride_vh + rn[:, None] * stride_vn + rd[None, :] * stride_vd,
                    mask=rn[:, None] < seq_len, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
        row_max = new_max
    tl.store(o_ptr + head * stride_oh + rm[:, None] * stride_om + rd[None, :] * stride_od,
             (acc / row_sum[:, None]).to(o_ptr.dtype.element_ty), mask=rm[:, None] < seq_len)


def attention_args(q, k, v, o, sm_scale: float) -> tuple:
    """The positional arguments of ``attention_fwd_kernel`` for tensors shaped (heads, seq_len, head_dim)."""
    return (q, k, v, o, q.shape[1], sm_scale, *q.stride(), *k.stride(), *v.stride(), *o.stride())


def attention_grid(seq_len: int, heads: int):
    return lambda meta: (triton.cdiv(seq_len, meta["BLOCK_M"]), heads)


ATTENTION_CONFIGS = [
    triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n), num_stages=stages, num_warps=warps)
    for block_m, block_n, stages, warps in ((64, 32, 2, 4), (64, 64, 3, 4), (128, 64, 3, 8), (128, 64, 4, 8),
                                            (128, 128, 2, 8), (128, 128, 3, 8))
]

#: ``attention_fwd_kernel`` autotuned over :data:`ATTENTION_CONFIGS`; HEAD_DIM is the caller's.
attention_fwd = triton.autotune(configs=ATTENTION_CONFIGS, key=["seq_len", "HEAD_DIM"])(attention_fwd_kernel)

#: What ``smemguard check`` needs to know about these kernels beyond their source (see
#: ``smemguard check --help``): pointer element type, argument types it cannot infer, values of
#: constexprs no config sets, configs of plain ``@triton.jit`` kernels, and extra specializations
#: (arguments equal to 1) worth checking.
SMEMGUARD_PREFLIGHT = {
    "flaggems_matmul": {"dtype": "fp16"},
    "matmul_persistent_kernel": {
        "dtype": "fp32",
        "configs": PERSISTENT_MATMUL_CONFIGS,
        # An H100's SM count; it only sets the loop stride, not the shared memory.
        "constants": {"NUM_SMS": 132},
        # A (K, 1) weight and a (M, 1) output, as in vLLM's N == 1 case: every stride of B and C is 1 too.
        "ones": [("N", "stride_bk", "stride_bn", "stride_cm", "stride_cn")],
    },
    # K is loaded transposed (its last-axis offset multiplies stride_kn), so the source alone leaves
    # unsure which stride of K is 1; attention_args passes contiguous tensors: the head_dim strides.
    "attention_fwd": {"dtype": "fp16", "signature": {"sm_scale": "fp32"}, "constants": {"HEAD_DIM": 128},
                      "unit": ["stride_qd", "stride_kd", "stride_vd", "stride_od"]},
}
