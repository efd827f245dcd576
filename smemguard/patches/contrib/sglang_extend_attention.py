"""SGLang's Triton extend (prefill with a prefix) attention: smaller ``BLOCK_M``/``BLOCK_N`` for the calls whose
kernel does not fit.

Why: ``extend_attention_fwd`` and ``extend_attention_fwd_unified`` (the Triton attention backend's prefill;
``sglang.kernels.ops.attention.extend_attention`` from SGLang 0.5.16 on, ``sglang.srt.layers.attention.triton_ops.
extend_attention`` before) take their tiles from ``_get_block_sizes_for_extend_attention(Lq, Lv)``, a table keyed
by the compute capability read once at import: a GPU the table does not know gets a neighbour's tiles. Before
SGLang's PR #14311 (releases 0.5.5 to 0.5.8), sm_120 (RTX 5090, RTX PRO 6000: 101376 B per block) took Hopper's
(``>= 9``): Kimi K2's absorbed MLA shape (Lq 576, Lv 512) needs 106496 B at ``BLOCK_M=32, BLOCK_N=64`` and one
stage (ktransformers #1570, on 0.5.5). The wrappers launch with ``num_stages=1`` and a tuple grid ``(batch, heads,
cdiv(max_len_extend, BLOCK_M))``: no stage is left to take away, and the engine never changes a tile of a tuple-grid
launch.

Why smaller tiles are safe: both wrappers compute the grid from the ``BLOCK_M`` the choice returned, so a lowered
choice recomputes it; the kernels mask query rows (``mask_m``) and keys per element (sequence ends, the causal and
sliding-window masks, the custom mask by absolute index), and step the key loops by ``BLOCK_N`` (the prefix loop by
``BLOCK_N_PREFIX``, the same choice on CUDA) from multiples of it; a window offset the backend aligned to a larger
``BLOCK_N`` is a multiple of every smaller one. The results equal the larger tiles' up to the order of the online
softmax's additions (not bitwise). Halving: every tile equal to the largest (``wrapper_tiles``), so a ``BLOCK_M``
no larger than ``BLOCK_N`` stays so; down to 16 (``tl.dot``). The scheduler's tile budget reads the library's own
``BLOCK_M`` (``triton_backend.extend_attention_block_m``, computed outside the wrappers): an estimate, unchanged.

Where not even 16x16 fits (Lq 576, Lv 512 on a T4: 69632 B at one stage in fp16, 204800 in bf16),
``extend_attention_fwd`` runs in torch (``smemguard.fallbacks.sglang_extend_attention``: each sequence's queries
over its prefix and its own keys, causal, float32) for the options it computes; the unified wrapper and the other
options get the caller's error, with a note naming the wrapper, its tiles and what 16x16 still needs.

What it does: the choice function becomes a declared ``smemguard.tile_choice`` (tiles at positions 3 and 4 of the
tuple it returns, for both kernels), the two wrappers ``smemguard.rerun_on_overflow`` (also where the Triton backend
and the dLLM attention imported them by name). On CUDA each wrapper's first launch is its kernel (the FP8 casts and
the compact grid are gfx950 paths; where a wrapper launches other tiles than the choice's, as gfx950's
``BLOCK_M=256``, the error is the caller's, unchanged). The choice is declared from the first overflow of either
kernel on (or from install, when the decision cache holds learnt tiles); until then a healthy call pays for the
wrapper's layer only. Not applied in ``SMEMGUARD=observe``: it changes what runs.

Where it applies (:class:`smemguard.patches.Kernels`): wherever a release keeps the two kernels with the parameters
read above, ``BLOCK_M`` and ``BLOCK_N`` sizing their blocks and every load and store they index masked, the choice
taking ``(Lq, Lv)`` and both wrappers taking ``BLOCK_M`` from it. Every release from 0.5.5 to 0.5.23 has all of
it (``PATCH.checked``, each imported and read; 0.5.14 adds the gfx950 paths, 0.5.18 the compact grid (HIP, from the
same ``BLOCK_M``), 0.5.20 ``BLOCK_N_PREFIX`` and ``num_stages`` above 1 for Kimi K3's shape); a release whose
kernels miss any of it gets one line and is left as it is.
"""

from __future__ import annotations

import inspect

from ...engine.wrapper_tiles import tile_choice
from ...facts.versions import Supported
from .. import Kernels
from ._declared_wrappers import DeclaredWrappers

#: Where SGLang's releases keep the kernels, newest first: 0.5.16 moved them out of ``sglang.srt``.
HOMES = ("sglang.kernels.ops.attention.extend_attention", "sglang.srt.layers.attention.triton_ops.extend_attention")
CHOICE = "_get_block_sizes_for_extend_attention"
WRAPPERS = ("extend_attention_fwd", "extend_attention_fwd_unified")
KERNELS = ("_fwd_kernel", "_fwd_kernel_unified")
#: What the argument reads of each kernel: the sequence bounds, the masks and the tiles.
_PARAMETERS = ("qo_indptr", "kv_indptr", "IS_CAUSAL", "SLIDING_WINDOW_SIZE", "USE_CUSTOM_MASK", "BLOCK_M", "BLOCK_N")

#: (BLOCK_DMODEL, BLOCK_DPE, BLOCK_DV, BLOCK_M, BLOCK_N, num_warps): where the tiles are in the choice's answer.
TILES, POSITIONS = ("BLOCK_M", "BLOCK_N"), (3, 4)
_SMALLEST = 16  # tl.dot needs M, N, K >= 16


def _chooses_by_head_sizes(module) -> bool:
    return tuple(inspect.signature(getattr(module, CHOICE)).parameters) == ("Lq", "Lv")


def _wrappers_take_the_choice(module) -> bool:
    """Each wrapper calls the choice and keeps a ``BLOCK_M`` (the one its grid is computed from)."""
    codes = [inspect.unwrap(getattr(module, name)).__code__ for name in WRAPPERS]
    return all(CHOICE in code.co_names and "BLOCK_M" in code.co_varnames for code in codes)


def _declare(module, original):
    return tile_choice(kernel=tuple(getattr(module, name) for name in KERNELS), tile=TILES, at=POSITIONS,
                       smallest=_SMALLEST)(original)


PATCH = DeclaredWrappers(
    __name__, supported=Supported("sglang", (0, 5), (0, 5), label="SGLang"),
    checked=tuple(f"0.5.{release}" for release in range(5, 24)),
    kernels=Kernels(HOMES, {name: _PARAMETERS for name in KERNELS}, tiles=TILES, masked=TILES, reads=(
        (f"{CHOICE}(Lq, Lv)", _chooses_by_head_sizes),
        (f"{' and '.join(WRAPPERS)} taking BLOCK_M from {CHOICE}", _wrappers_take_the_choice))),
    declared=CHOICE, declare=_declare, wrappers=WRAPPERS, fallbacks={"extend_attention_fwd": "sglang_extend_attention"})
