"""vLLM's prefix-prefill attention: smaller ``BLOCK_M``/``BLOCK_N`` alternatives for ``_fwd_kernel``.

Why: ``context_attention_fwd`` launches ``_fwd_kernel`` with ``BLOCK_M=128, BLOCK_N=64``,
``num_warps=4`` and already ``num_stages=1``. On sm_75 (T4, 65536 B) that needs 98304 B at
head size 128 in fp16, 131072 in fp32 and 196608 at head size 256: no stage count is left
to take away, and the engine never changes the tiles of a plain kernel by itself.

Why smaller tiles are safe: the caller passes the grid as a function of the meta-parameters
(``lambda META: (batch, head, cdiv(max_input_len, META["BLOCK_M"]))``), so it is recomputed
for the tile that runs; every load and store of the kernel is masked on the query rows
(``offs_m < cur_batch_query_len``) and on the keys (``start_n + offs_n < cur_batch_query_len``);
the causal loop runs to ``(start_m + 1) * BLOCK_M`` in steps of ``BLOCK_N`` with the causal
mask inside, so it covers every key of the block for any ``BLOCK_M``/``BLOCK_N``; the context
loop steps by ``BLOCK_SIZE``, which does not change. Results equal the larger tiles' up to the
order of floating-point additions in the online softmax. Alternatives stay at 16 or more
(``tl.dot``) and keep the wrapper's ``num_warps=4, num_stages=1``; the engine tries them
largest first, and only for a launch whose grid is a callable.

What it does: registers those alternatives with :func:`smemguard.register_alternatives` when
``vllm.v1.attention.ops.prefix_prefill`` is imported (``patches._alternative_tiles``). ``_fwd_kernel_alibi`` is
not given any: its grid is a tuple computed from the wrapper's ``BLOCK`` (``BASE_BLOCK``, 64 on sm_75), and at
head size 128 it needs 65536 B on sm_75, which fits a T4.

Where it applies (:class:`smemguard.patches.Kernels`): wherever a release keeps ``_fwd_kernel`` with the parameters
read above, ``BLOCK_M`` and ``BLOCK_N`` sizing its blocks and every load and store they index masked (the context
loop's unmasked loads are indexed by ``BLOCK_SIZE`` only, and ``_paged_kv_cache_offsets`` masks its block-table load
where ``BLOCK_N`` indexes it). Every release from 0.27 to 0.34 has all of it (``PATCH.checked``,
``vllm/v1/attention/ops/prefix_prefill.py`` in each), with the same launch of ``_fwd_kernel`` (grid function,
``num_warps=4, num_stages=1``) and the same masks; 0.27 to 0.29 launch non-power-of-two KV-cache block sizes (544,
Qwen3-Next) at ``BLOCK_M=BLOCK_N=32``, 0.30 on at 128/64 for all; 0.33 adds ``INTERLEAVED_V_PACK_FACTOR`` to the
V-cache addressing, which does not involve either tile.
"""

from __future__ import annotations

from ...facts.versions import Supported
from .. import Kernels
from ._alternative_tiles import AlternativeTiles

HOMES = ("vllm.v1.attention.ops.prefix_prefill",)

PATCH = AlternativeTiles(
    __name__, supported=Supported("vllm", (0, 27), (0, 34), label="vLLM"),
    checked=("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),
    kernels=Kernels(HOMES, {"_fwd_kernel": ("BLOCK_M", "BLOCK_N", "BLOCK_SIZE", "Q", "Out")},
                    tiles=("BLOCK_M", "BLOCK_N"), masked=("BLOCK_M", "BLOCK_N")),
    # largest first; the wrapper's own is (128, 64)
    tiles=((64, 64), (64, 32), (32, 32), (32, 16), (16, 16)), num_warps=4, num_stages=1)
