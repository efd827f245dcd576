"""Helpers over smemguard's example kernels for the tests."""

import torch
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


# -- Kernels that write their own pipeline depth (smemguard.kernels.parameters) ---------------------------------

@triton.jit
def _pipelined_tile(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """A tile of A @ B whose K loop is pipelined ``STAGES`` deep, whatever the launch option says."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k + rk)[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k + rk)[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    return acc


@triton.jit
def depth_parameter_matmul(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                           stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           NUM_STAGES: tl.constexpr):
    """The quantized-GEMM library's way: the K loop's own ``num_stages=`` is a parameter its configs set."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k + rk)[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k + rk)[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def depth_passed_to_a_helper(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                             stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             NUM_STAGES: tl.constexpr):
    """The depth reaches the loop through a called ``@triton.jit`` function's parameter."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _pipelined_tile(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                          BLOCK_M, BLOCK_N, BLOCK_K, STAGES=NUM_STAGES)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def depth_also_in_arithmetic(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                             stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             NUM_STAGES: tl.constexpr):
    """The depth parameter also scales the result: changing it would change the answer."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _pipelined_tile(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                          BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, (acc / NUM_STAGES).to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def literal_stages_matmul(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                          stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K loop is pipelined 4 deep, written into the source: no launch option changes it."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _pipelined_tile(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                          BLOCK_M, BLOCK_N, BLOCK_K, 4)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


# -- Causal attention shaped like Triton's tutorial 06 (the issue-45 wrong-result case) -----------------------------

@triton.jit
def _attend(acc, l_i, m_i, q, k_ptr, v_ptr, start_n, offs_m, offs_n, offs_d, sm_scale, HEAD_DIM: tl.constexpr,
            MASKED: tl.constexpr):
    """One block of keys into the online softmax of a block of rows."""
    k = tl.load(k_ptr + (start_n + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
    v = tl.load(v_ptr + (start_n + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
    qk = tl.dot(q, tl.trans(k)) * sm_scale
    if MASKED:
        qk = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp(qk - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def causal_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """Causal attention of one head, as tutorial 06 splits it: the keys below the block's first row unmasked, then the
    diagonal block masked. Correct only where BLOCK_N divides BLOCK_M (and BLOCK_M the sequence): else the
    unmasked loop reads keys past the causal edge and the masked one counts some twice."""
    start_m = tl.program_id(0)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, start_m * BLOCK_M, BLOCK_N):
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_ptr, v_ptr, start_n, offs_m, offs_n, offs_d, sm_scale, HEAD_DIM,
                                False)
    for start_n in range(start_m * BLOCK_M, (start_m + 1) * BLOCK_M, BLOCK_N):
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_ptr, v_ptr, start_n, offs_m, offs_n, offs_d, sm_scale, HEAD_DIM,
                                True)
    tl.store(o_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))


def causal_attention_reference(q, k, v, sm_scale):
    """The same attention in torch, in float32."""
    scores = (q.float() @ k.float().T) * sm_scale
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v.float()
