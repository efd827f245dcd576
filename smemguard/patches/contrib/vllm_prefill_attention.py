"""vLLM's Triton prefill attention: a smaller ``BLOCK`` for the calls whose ``_fwd_kernel`` does not fit.

Why: ``context_attention_fwd`` (``vllm.v1.attention.ops.triton_prefill_attention``) is the
bidirectional attention of encoder-only models and encoders in the Triton attention backend
(``TRITON_ATTN``, vLLM's choice on Turing, where FlashAttention does not run) and of the Triton ViT
attention. It picks ``BLOCK = get_block_size(q.dtype)`` (128 on sm_80 and newer, 64 before, 32 for
fp32; at most 32 from head size 512 on), computes a tuple grid ``(batch, heads, cdiv(max_input_len,
BLOCK))`` and launches ``_fwd_kernel`` with ``BLOCK_M=BLOCK_N=BLOCK`` and already ``num_stages=1``.
Head size 256 (EmbeddingGemma and other Gemma-based encoders) needs 131072 B on sm_75 in fp16 and
163840 B on sm_89/sm_120 in bf16: more than a T4's 65536 and an L4's or RTX 5090's 101376. No stage
is left to take away, and the engine never changes a tile of a kernel launched with a tuple grid.

Why a smaller ``BLOCK`` is safe: every load and store is masked on the query rows (``offs_m <
cur_batch_seq_len``) and keys (``pos_k < cur_batch_seq_len``); the key loop steps by ``BLOCK_N`` from a multiple of
``BLOCK_N`` with the causal and sliding-window masks applied per element, so it covers the same keys for any
``BLOCK_M``/``BLOCK_N``; a program whose rows all lie past its sequence stores nothing. So the grid for a smaller
``BLOCK_M`` is ``cdiv(grid[2] * BLOCK_M, smaller BLOCK_M)`` query blocks (at most one more than the wrapper would
compute, which stores nothing). Results equal the larger tile's up to the order of floating-point additions in the
online softmax (not bitwise). Halving every tile equal to the largest (the wrapper's ``BLOCK_N`` is ``BLOCK`` or, on
RDNA, ``min(BLOCK, 32)``), down to 16 (``tl.dot``): 64 fits head size 256 on sm_89/sm_120 (73728 B), 32 on sm_75
(65536 B).

What it does: the kernel is declared where the wrapper launches it (``smemguard.tiles_at_launch``: from the first
failure on, or from install when the decision cache holds learnt tiles, the module's ``_fwd_kernel`` is a proxy that,
inside a declared call, launches the tiles learnt for the shape class, query dtype
and head size, with the grid above) and the wrapper ``smemguard.rerun_on_overflow`` (also in the modules that
imported it by name: the Triton and ROCm attention backends), the public mechanism
(:mod:`smemguard.engine.wrapper_tiles`) as for SGLang's copy of the kernel. The tiles are read at the launch, after
every adjustment the wrapper makes to ``BLOCK`` (at most 32 from head size 512 on, 0.32 on; 0.34's fit to the
device). When a call raises ``OutOfResources`` for shared memory from ``_fwd_kernel`` (its only launch), the tiles
are halved for the call's shape class (per device and limit) and the call runs again; later calls of that class,
and later processes (the decision cache's table ``tiles``), launch the smaller tiles at once. One incident record
(``"action": "tiles_reduced"``) per shape class.

Not applied in ``SMEMGUARD=observe``: it changes what runs.

Where it applies (:class:`smemguard.patches.Kernels`): wherever a release keeps ``_fwd_kernel`` with the parameters
read above, ``BLOCK_M`` and ``BLOCK_N`` sizing its blocks and every load and store they index masked, and
``context_attention_fwd`` computing ``BLOCK`` and launching it. Every release from 0.27 to 0.34 has all of it
(``PATCH.checked``, ``vllm/v1/attention/ops/triton_prefill_attention.py`` in each): ``get_block_size(dtype)``, the
grid from ``BLOCK``, one launch ``_fwd_kernel[grid](q, k, v, ..., BLOCK_M=BLOCK, BLOCK_N=BLOCK_N, Lk=Lk,
num_stages=1)`` with ``BLOCK_N`` equal to ``BLOCK`` or, on RDNA (0.31 on), ``min(BLOCK, 32)``. 0.28 adds the
windowed key range (it starts at a multiple of ``BLOCK_N`` and ends past the block's last row, for any tile);
0.32 keeps ``BLOCK`` at 32 or less from head size 512 on; 0.34 fits its block to the device's shared memory itself
on CUDA (``_fit_block_to_shared_memory(BLOCK, ...)``, which never reads an emulated limit). The tiles are read at
the launch, after both.
"""

from __future__ import annotations

from ...engine.wrapper_tiles import tiles_at_launch
from ...facts.versions import Supported
from .. import Kernels
from . import _context_attention
from ._declared_wrappers import DeclaredWrappers

HOMES = ("vllm.v1.attention.ops.triton_prefill_attention",)
WRAPPER, KERNEL, TILES = _context_attention.WRAPPER, _context_attention.KERNEL, _context_attention.TILES

_KERNEL_PARAMETERS = ("Q", "BLOCK_M", "BLOCK_N", "Lk")
_SMALLEST = 16  # tl.dot needs M, N, K >= 16


def _declare(module, original):
    return tiles_at_launch(original, tile=TILES, grid=_context_attention.grid, shape=_context_attention.shape,
                           smallest=_SMALLEST)


#: the wrapper and its kernel, with what makes smaller tiles safe (above)
PATCH = DeclaredWrappers(
    __name__, supported=Supported("vllm", (0, 27), (0, 34), label="vLLM"),
    checked=("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),
    kernels=Kernels(HOMES, {KERNEL: _KERNEL_PARAMETERS}, tiles=TILES, masked=TILES,
                    reads=((f"{WRAPPER} choosing BLOCK and launching {KERNEL} with it",
                            _context_attention.launches_its_block),)),
    declared=KERNEL, declare=_declare, wrappers=(WRAPPER,))
