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

Why a smaller ``BLOCK`` is safe: the wrapper computes the grid from the same ``BLOCK`` it passes as
``BLOCK_M``, so lowering its choice recomputes the grid; every load and store is masked on the query
rows (``offs_m < cur_batch_seq_len``) and keys (``pos_k < cur_batch_seq_len``); the key loop steps
by ``BLOCK_N`` from a multiple of ``BLOCK_N`` with the causal and sliding-window masks applied per
element, so it covers the same keys for any ``BLOCK_M``/``BLOCK_N``. Results equal the larger
tile's up to the order of floating-point additions in the online softmax (not bitwise). Halved
down to 16 (``tl.dot``): 64 fits head size 256 on sm_89/sm_120 (73728 B), 32 on sm_75 (65536 B).

What it does (:mod:`smemguard.patches.contrib._retried_wrapper`, shared with ``vllm_unified_attention``):
``context_attention_fwd`` gets a plain function layer (also in the modules that imported it by
name: the Triton and ROCm attention backends): a ``try`` around the call. When a call raises
``OutOfResources`` for shared memory from ``_fwd_kernel`` (its only launch) with the ``BLOCK_M`` the
wrapper chose, the choice is halved for the call's shape class (query dtype and head size, per
device and limit) and the call runs again. ``get_block_size`` gets a layer (from the first such
decision on) that returns the smaller tile when ``context_attention_fwd`` asks for that class (the
head size is read from the wrapper's frame, its keys' last size), so later calls of that class choose it at
once. One incident record (``"action": "tiles_reduced"``) per shape class.

Not applied in ``SMEMGUARD=observe``: it changes what runs.

Where it applies (:class:`smemguard.patches.Kernels`): wherever a release keeps ``_fwd_kernel`` with the parameters
read above, ``BLOCK_M`` and ``BLOCK_N`` sizing its blocks and every load and store they index masked,
``get_block_size(dtype)`` and a wrapper with a local ``Lk``. Every release from 0.27 to 0.34 has all of it
(``PATCH.checked``, ``vllm/v1/attention/ops/triton_prefill_attention.py`` in each): ``get_block_size(dtype)``, the
grid from ``BLOCK``, one launch ``_fwd_kernel[grid](q, k, v, ..., BLOCK_M=BLOCK, BLOCK_N=BLOCK_N, Lk=Lk,
num_stages=1)`` with ``BLOCK_N`` equal to ``BLOCK`` or, on RDNA (0.31 on), ``min(BLOCK, 32)``. 0.28 adds the
windowed key range (it starts at a multiple of ``BLOCK_N`` and ends past the block's last row, for any tile);
0.32 keeps ``BLOCK`` at 32 or less from head size 512 on (read in the wrapper, whose constants then hold both
numbers); 0.34 fits its block to the device's shared memory itself on CUDA (``_fit_block_to_shared_memory(BLOCK,
...)``, a ``min`` over ``get_block_size``'s choice: a lowered choice still lowers ``BLOCK``, and the formula never
reads an emulated limit).
"""

from __future__ import annotations

import inspect

from ...facts.versions import Supported
from .. import Kernels
from ._retried_wrapper import RetriedWrapper

HOMES = ("vllm.v1.attention.ops.triton_prefill_attention",)
WRAPPER = "context_attention_fwd"
TILE_CHOICE = "get_block_size"
KERNEL = "_fwd_kernel"

_KERNEL_PARAMETERS = ("Q", "BLOCK_M", "BLOCK_N", "Lk")
#: vLLM's wrapper keeps ``BLOCK`` at 32 or less from this head size on (0.32 on).
_WIDE_HEAD, _WIDE_HEAD_BLOCK = 512, 32
_SMALLEST_BLOCK = 16  # tl.dot needs M, N, K >= 16


def _dtype(dtype):
    return dtype


def _choice_shape(args, kwargs, frame) -> tuple:
    """The shape class of a ``get_block_size(dtype)`` call by the wrapper: the dtype and the call's head size, read
    from its keys (releases before 0.32 choose before they compute ``Lk = k.shape[-1]``)."""
    return _dtype(*args, **kwargs), frame.f_locals["k"].shape[-1]


def _launch_shape(args, kwargs) -> tuple:
    return args[0].dtype, kwargs["Lk"]


def _caps_wide_heads(module) -> bool:
    """Whether the release's wrapper keeps ``BLOCK`` at 32 or less from head size 512 on."""
    constants = inspect.unwrap(getattr(module, WRAPPER)).__code__.co_consts
    return _WIDE_HEAD in constants and _WIDE_HEAD_BLOCK in constants


def _wrapper_tile(module, choose, shape: tuple, learnt: int | None) -> int:
    """``BLOCK`` as the wrapper computes it from its choice."""
    dtype, head_size = shape
    block = choose(dtype)
    if learnt is not None:
        block = min(block, learnt)
    return min(block, _WIDE_HEAD_BLOCK) if head_size >= _WIDE_HEAD and _caps_wide_heads(module) else block


def _chooses_by_dtype(module) -> bool:
    return tuple(inspect.signature(getattr(module, TILE_CHOICE)).parameters) == ("dtype",)


def _wrapper_takes_the_keys(module) -> bool:
    """The wrapper's keys ``k`` (whose last size is the head size its ``Lk`` is), and ``Lk`` passed to the kernel."""
    wrapper = inspect.unwrap(getattr(module, WRAPPER))
    return "k" in inspect.signature(wrapper).parameters and "Lk" in wrapper.__code__.co_varnames


#: the wrapper, its choice and its kernel, with what makes a smaller tile safe (above)
PATCH = RetriedWrapper(
    __name__, supported=Supported("vllm", (0, 27), (0, 34), label="vLLM"),
    checked=("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),
    kernels=Kernels(HOMES, {KERNEL: _KERNEL_PARAMETERS}, tiles=("BLOCK_M", "BLOCK_N"), masked=("BLOCK_M", "BLOCK_N"),
                    reads=((f"{TILE_CHOICE}(dtype)", _chooses_by_dtype),
                           (f"{WRAPPER}(q, k, ...) with a local Lk", _wrapper_takes_the_keys))),
    wrapper=WRAPPER, choice=TILE_CHOICE, tile="BLOCK_M", shape_fields=("dtype", "head_size"),
    choice_shape=_choice_shape, launch_shape=_launch_shape, wrapper_tile=_wrapper_tile,
    smallest=lambda shape: _SMALLEST_BLOCK)
