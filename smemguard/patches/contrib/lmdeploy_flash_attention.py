"""LMDeploy's prefill attention: smaller ``BLOCK_M``/``BLOCK_N`` alternatives for ``_flash_prefill_fwd_kernel``.

Why: ``flash_attn_varlen_func`` (``lmdeploy.pytorch.kernels.cuda.flashattention``, the PyTorch engine's prefill)
picks ``BLOCK_M``, ``BLOCK_N``, warps and stages from the compute capability, sized by ``BLOCK_DK``, the largest
power of two under the head size. sm_120 takes the table written for sm_100: the absorbed MLA of DeepSeek-V3
(q/k 576, v 512) gets 32x64 tiles, which need 106496 B at one stage on an RTX 5090 (101376 B); head size 256 with
the keys shared as values gets 64x128, 102400 B at any stage count. No stage is left to take away, and the engine
never changes the tiles of a plain kernel by itself.

Why smaller tiles are safe (the kernel, read in every release from 0.8 to 0.18): the wrapper passes the grid as a
function of the meta-parameters (``(cdiv(max_seqlen_q, META["BLOCK_M"]), heads, batch)``), so it is recomputed for
the tile that runs, and a program whose ``BLOCK_M * start_m`` is past its sequence returns before touching anything.
Query loads and the store are masked on the rows (``offs_m < q_seqlen``). Keys and values come through block
pointers: the first key loop covers whole ``BLOCK_N`` blocks below ``(history + start_m * BLOCK_M) // BLOCK_N *
BLOCK_N`` (causal) or ``kv_seqlen // BLOCK_N * BLOCK_N``, every key of which each row of the block may see; the
second starts there, loads with the sequence's boundary check (zero padding) and masks each score by position
(causal, sliding window, block-sparse, or ``kv_seqlen - 1``), up to ``loop_start + BLOCK_M + BLOCK_N`` (causal: past
the block's last row) or the sequence end; both start at a multiple of ``BLOCK_N``, as ``tl.multiple_of`` says. A
score masked at ``-1e30`` in a row's first blocks (a sliding window's start) weighs 1 until the row's first visible
key rescales it by ``exp2(-1e30 - m) = 0``, for any tile. The head dimensions (``BLOCK_DK``, ``BLOCK_DK1``,
``BLOCK_DV``) are not touched. So any ``BLOCK_M``/``BLOCK_N`` of 16 or more (``tl.dot``) computes the same
attention; the results equal the wrapper's tiles' up to the order of the online softmax's additions (not bitwise).
``tests/test_lmdeploy.py`` runs every alternative on a GPU against the wrapper's own tiles and a float64 reference
(causal with history, non-causal GQA, a sliding window, the 192/128 split, shared keys, the absorbed MLA).

What it does: registers the alternatives below with :func:`smemguard.register_alternatives` when the module is
imported (``patches._alternative_tiles``); the engine tries them, largest first, with one stage fewer after, only
once the wrapper's tiles fit at no stage count, and records the tiles that ran (``config_changed``, one record
per case). A later launch of the same variant is answered from that decision (its load is refused again and the
alternative runs, compiled already). Where not even 16x16 fits (the absorbed MLA on a T4:
69632 B), the user gets LMDeploy's own error, the record saying so.

Where it applies (:class:`smemguard.patches.Kernels`): wherever a release keeps ``_flash_prefill_fwd_kernel`` with
the parameters read above, the tiles sizing its blocks and every load and store ``BLOCK_M`` indexes masked (the keys'
block pointers are read unchecked in the first loop by design, whole blocks, as above). Every release from 0.8 to
0.18 has all of it (``PATCH.checked``, ``lmdeploy/pytorch/kernels/cuda/flashattention.py`` in each): 0.10 adds
attention sinks, 0.10.2 block-sparse masks (per position, as above), 0.11 the key boundary check where ``BLOCK_DK +
BLOCK_DK1`` exceeds the head size (the head dimensions, not the tiles), 0.12 ``cu_seqlens`` and ALiBi (a bias per
position); 0.17 reads the capability per call instead of once.
"""

from __future__ import annotations

from ...facts.versions import Supported
from .. import Kernels
from ._alternative_tiles import AlternativeTiles

HOMES = ("lmdeploy.pytorch.kernels.cuda.flashattention",)

PATCH = AlternativeTiles(
    __name__, supported=Supported("lmdeploy", (0, 8), (0, 18), label="LMDeploy"),
    checked=("0.8.0", "0.9.0", "0.9.2", "0.10.0", "0.10.2", "0.11.0", "0.12.0", "0.12.3", "0.13.0", "0.14.0", "0.15.0",
             "0.16.0", "0.17.0", "0.18.0"),
    kernels=Kernels(HOMES, {"_flash_prefill_fwd_kernel": (
        "q_ptr", "k_ptr", "v_ptr", "o_ptr", "causal", "window_size", "shared_kv", "BLOCK_M", "BLOCK_N", "BLOCK_DK",
        "BLOCK_DK1", "BLOCK_DV")}, tiles=("BLOCK_M", "BLOCK_N"), masked=("BLOCK_M",)),
    # largest first; the wrapper's own reach 128x128
    tiles=((128, 64), (64, 128), (64, 64), (64, 32), (32, 64), (32, 32), (32, 16), (16, 32), (16, 16)), num_warps=4,
    num_stages=2)
