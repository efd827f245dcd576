"""vLLM's unified attention: a smaller ``TILE_SIZE`` for the calls whose attention kernel does not fit.

Why: ``unified_attention`` (the Triton attention backend, vLLM's default on Turing) picks the
KV tile with ``_get_tile_size(head_size, sliding_window, element_size, is_prefill)`` and
launches ``kernel_unified_attention`` with a tuple grid, then, on the 3D (split-KV decode)
path, ``reduce_segments`` with the same tile. Head size 512 in fp16 (Gemma 4's global
layers) needs 98304 B on sm_75 at every stage count, and head size 256 in fp32 (Gemma 3 on a
T4, where vLLM runs it in fp32) 81920 B: more than a T4's 65536. With a 16-wide tile they
need 65536 and 49152. The engine cannot help: the stage ladder changes nothing on sm_75, and
it never changes a constexpr of a plain kernel launched with a tuple grid.

Why a smaller tile is safe: ``TILE_SIZE`` is the width of the KV slice each step of the
kernel's online softmax reads; the grid does not depend on it (the 2D grid is query blocks x
KV heads, the 3D one adds the segment count), every KV load is masked against the sequence
length, and ``reduce_segments`` reads it only to find the same segment boundaries the
attention kernel used, which is why both must see the same value. The results equal the
larger tile's up to the order of floating-point additions in the softmax (not bitwise).
The smallest tile is 16 (``tl.dot`` needs K >= 16), 32 for fp8 queries, as vLLM says.

What it does: ``_get_tile_size`` becomes a declared ``smemguard.tile_choice`` of ``TILE_SIZE`` for
``kernel_unified_attention``, and ``unified_attention`` ``smemguard.rerun_on_overflow`` (also where the Triton backend
imported it by name): the public mechanism (:mod:`smemguard.engine.wrapper_tiles`), as a library that declares its own
wrappers gets. When a call raises ``OutOfResources`` for shared memory from its first launch,
``kernel_unified_attention``, and that launch's ``TILE_SIZE`` is the one ``_get_tile_size`` answered in the call for
the launch's shape class (head size, window, element size, prefill or decode, read back from the launch: the wrapper
asks twice, and the 2D launch takes the prefill answer, the 3D one the decode answer), the tile is halved for that
class (per device and limit) and ``unified_attention`` called again, down to the smallest tile. ``_get_tile_size`` is
declared from the first such failure on (or from install, when the decision cache holds learnt tiles): until then a
healthy call pays for the wrapper's layer only. Inside the wrapper's calls it answers the smaller tile for that
class, so the attention kernel and ``reduce_segments`` get
the same value, and later calls of that class, and later processes (the decision cache's table ``tiles``), pick it
at once, with no failed launch. A failure of any other launch (``reduce_segments``, after the attention kernel ran)
is never retried. One incident record (``"action": "tiles_reduced"``) per shape class.

Not applied in ``SMEMGUARD=observe``: it changes what runs.

Where it applies (:class:`smemguard.patches.Kernels`): wherever a release keeps ``kernel_unified_attention`` with the
parameters read above and ``TILE_SIZE`` sizing its blocks, and ``_get_tile_size(head_size, sliding_window,
element_size, is_prefill)``. Not required: every load ``TILE_SIZE`` indexes masked, since the block-table load is not
(it reads the entries of the last tile's positions past the sequence end, no further than the larger tile did; the
KV loads they address are masked). Every release from 0.27 to 0.34 has all of it (``PATCH.checked``,
``vllm/v1/attention/ops/triton_unified_attention.py`` in each): both choose ``TILE_SIZE_PREFILL``/``TILE_SIZE_DECODE``
with ``_get_tile_size`` before any launch, launch ``kernel_unified_attention[grid](...)`` first with keyword
arguments only, and pass ``TILE_SIZE_DECODE`` to ``reduce_segments``. (Their INT4 path hands the call to another
kernel before that; its tile is not changed.) On Blackwell (sm_100) with head size 256 the wrapper overrides the
prefill tile after ``_get_tile_size``, and 0.34 adds AMD RDNA prefill overrides and a tensor-descriptor clamp to the
block size: such a launch does not match the check above and is left to the engine.
"""

from __future__ import annotations

import inspect

from ...engine.wrapper_tiles import tile_choice
from ...facts.versions import Supported
from .. import Kernels
from ._declared_wrappers import DeclaredWrappers

HOMES = ("vllm.v1.attention.ops.triton_unified_attention",)
WRAPPER = "unified_attention"
TILE_CHOICE = "_get_tile_size"
KERNEL = "kernel_unified_attention"

_TILE_CHOICE_PARAMETERS = ("head_size", "sliding_window", "element_size", "is_prefill")
_KERNEL_PARAMETERS = ("query_ptr", "TILE_SIZE", "HEAD_SIZE", "SLIDING_WINDOW", "IS_3D")
#: ``tl.dot`` needs K >= 16; vLLM keeps fp8 (one-byte) queries at 32 or more.
_SMALLEST_TILE = {1: 32}
_DEFAULT_SMALLEST_TILE = 16


def _smallest(shape: dict) -> int:
    return _SMALLEST_TILE.get(shape["element_size"], _DEFAULT_SMALLEST_TILE)


def _launch_shape(launched: dict) -> dict:
    """The arguments ``_get_tile_size`` was given for this launch's tile: the 3D (split-KV) launch takes the decode
    tile, the 2D one the prefill tile."""
    return {"head_size": launched["HEAD_SIZE"], "sliding_window": max(launched["SLIDING_WINDOW"], 0),
            "element_size": launched["query_ptr"].element_size(), "is_prefill": not launched["IS_3D"]}


def _chooses_by_shape(module) -> bool:
    return tuple(inspect.signature(getattr(module, TILE_CHOICE)).parameters) == _TILE_CHOICE_PARAMETERS


def _declare(module, original):
    return tile_choice(kernel=getattr(module, KERNEL), tile="TILE_SIZE", smallest=_smallest,
                       launch_shape=_launch_shape)(original)


#: the wrapper, its choice and its kernel, with what makes a smaller tile safe (above)
PATCH = DeclaredWrappers(
    __name__, supported=Supported("vllm", (0, 27), (0, 34), label="vLLM"),
    checked=("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),
    kernels=Kernels(HOMES, {KERNEL: _KERNEL_PARAMETERS}, tiles=("TILE_SIZE",),
                    reads=((f"{TILE_CHOICE}({', '.join(_TILE_CHOICE_PARAMETERS)})", _chooses_by_shape),
                           (WRAPPER, lambda module: callable(getattr(module, WRAPPER))))),
    declared=TILE_CHOICE, declare=_declare, wrappers=(WRAPPER,))
