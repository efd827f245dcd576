"""SGLang's Triton prefill attention (``context_attention_fwd``): a smaller ``BLOCK`` for the calls whose
``_fwd_kernel`` does not fit.

Why: ``context_attention_fwd`` (the vision encoders' attention and prefill without a prefix;
``sglang.kernels.ops.attention.prefill_attention`` from SGLang 0.5.16 on, ``sglang.srt.layers.attention.triton_ops.
prefill_attention`` before) chooses ``BLOCK = 128`` inline when the capability read at import has a major above 8,
else 64, computes a tuple grid ``(batch, heads, cdiv(max_input_len, BLOCK))`` and launches ``_fwd_kernel`` with
``BLOCK_M=BLOCK_N=BLOCK`` and ``num_stages=1``. On sm_120 (101376 B per block) head size 256 in fp32 needs 131072 B
(SGLang PR #27962, open; reported on 0.5.5); on a T4 (sm_75, 65536 B) head size 256 in fp16 at 64 does not fit
either. No stage is left to take away, and the engine never changes a tile of a tuple-grid launch.

Why smaller tiles are safe (the kernel, the same in every release from 0.5.5 to 0.5.23): every query load and the
store are masked on the rows (``offs_m < cur_batch_seq_len``), keys and values per element (``start_n + offs_n <
cur_batch_seq_len``, the causal mask ``offs_m >= start_n + offs_n``); the key loop runs from 0 in steps of
``BLOCK_N`` to the sequence end (causal: the block's last row), and a program whose ``BLOCK_M * start_m`` is past
its sequence runs no iteration and stores nothing. So the grid for smaller tiles is ``cdiv(grid[2] * BLOCK_M,
smaller BLOCK_M)`` query blocks (at most one more than the wrapper would compute, which exits at once), and the
results equal the larger tiles' up to the order of the online softmax's additions (not bitwise). Causal rows need
``BLOCK_M <= BLOCK_N`` (a row whose every key in a block is masked would turn the online softmax into NaN): halving
every tile equal to the largest keeps the wrapper's ``BLOCK_M == BLOCK_N``; down to 16 (``tl.dot``).

What it does: the choice is inline, so the kernel is declared where the wrapper launches it
(``smemguard.tiles_at_launch``: from the first overflow on, or from install when the decision cache holds learnt
tiles, the module's ``_fwd_kernel`` is a proxy that, inside a declared call, launches the tiles learnt for the
shape class, query dtype and head size, with the grid above) and the wrapper ``smemguard.rerun_on_overflow`` (also
where the vision attention imported it by name). ``_fwd_kernel`` is the wrapper's only launch. Where not even 16x16
fits, the call runs in torch (``smemguard.fallbacks.sglang_context_attention``). Not applied in
``SMEMGUARD=observe``: it changes what runs.

Where it applies (:class:`smemguard.patches.Kernels`): wherever a release keeps ``_fwd_kernel`` with the parameters
read above, ``BLOCK_M`` and ``BLOCK_N`` sizing its blocks and every load and store they index masked, and
``context_attention_fwd`` computing ``BLOCK`` and launching it. Every release from 0.5.5 to 0.5.23 has all of it
(``PATCH.checked``, each imported and read; 0.5.11 adds ``sm_scale`` to the wrapper, which the fallback takes too);
a release whose kernel misses any of it gets one line and is left as it is.
"""

from __future__ import annotations

from ...engine.wrapper_tiles import tiles_at_launch
from ...facts.versions import Supported
from .. import Kernels
from . import _context_attention
from ._declared_wrappers import DeclaredWrappers

#: Where SGLang's releases keep the kernel, newest first: 0.5.16 moved it out of ``sglang.srt``.
HOMES = ("sglang.kernels.ops.attention.prefill_attention", "sglang.srt.layers.attention.triton_ops.prefill_attention")
WRAPPER, KERNEL, TILES = _context_attention.WRAPPER, _context_attention.KERNEL, _context_attention.TILES
#: What the argument reads of the kernel: the sequence bounds, the causal mask, the tiles and the head size.
_PARAMETERS = ("Q", "B_Start_Loc", "B_Seqlen", "IS_CAUSAL", "BLOCK_M", "BLOCK_N", "Lk")
_SMALLEST = 16  # tl.dot needs M, N, K >= 16


def _declare(module, original):
    return tiles_at_launch(original, tile=TILES, grid=_context_attention.grid, shape=_context_attention.shape,
                           smallest=_SMALLEST)


PATCH = DeclaredWrappers(
    __name__, supported=Supported("sglang", (0, 5), (0, 5), label="SGLang"),
    checked=tuple(f"0.5.{release}" for release in range(5, 24)),
    kernels=Kernels(HOMES, {KERNEL: _PARAMETERS}, tiles=TILES, masked=TILES,
                    reads=((f"{WRAPPER} choosing BLOCK and launching {KERNEL} with it",
                            _context_attention.launches_its_block),)),
    declared=KERNEL, declare=_declare, wrappers=(WRAPPER,), fallbacks={WRAPPER: "sglang_context_attention"})
