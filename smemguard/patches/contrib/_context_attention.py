"""LightLLM's context attention kernel (``_fwd_kernel``), as SGLang and vLLM keep their copies of it: what its shared
memory depends on besides its tiles, and its wrapper's grid for smaller tiles. The packs that declare it
(``sglang_prefill_attention``, ``vllm_prefill_attention``) each read their release's kernel for the argument."""

from __future__ import annotations

import inspect

WRAPPER = "context_attention_fwd"
KERNEL = "_fwd_kernel"
TILES = ("BLOCK_M", "BLOCK_N")


def shape(args: tuple, kwargs: dict) -> dict:
    """The query dtype (the kernel's first argument) and the head size (``Lk``)."""
    return {"dtype": args[0].dtype, "head_size": kwargs["Lk"]}


def grid(launched_grid: tuple, launched: dict, lowered: dict) -> tuple:
    """The wrapper's grid, ``(batch, heads, cdiv(max_input_len, BLOCK_M))``, for a smaller ``BLOCK_M``: the launch
    does not carry ``max_input_len``, so the rows are the launched blocks' (at most one block more than the wrapper
    would compute; the kernel masks every row past its sequence)."""
    batch, heads, blocks = launched_grid
    rows = blocks * launched["BLOCK_M"]  # at least max_input_len
    return batch, heads, -(-rows // lowered["BLOCK_M"])


def launches_its_block(module) -> bool:
    """The wrapper computes ``BLOCK`` itself and launches the kernel with it."""
    code = inspect.unwrap(getattr(module, WRAPPER)).__code__
    return "BLOCK" in code.co_varnames and KERNEL in code.co_names
