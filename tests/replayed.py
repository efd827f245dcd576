"""Kernels whose incident records tests/test_replay_paths.py replays in a fresh process: each with what recovered it
declared at import (a fallback, alternatives, a wrapper's tile choice), as a library declares them, so the replaying
process sees the same declarations. Each is matmul_kernel's own function under a JIT of its own (its own name in
the records, and its own registrations)."""

import torch
import triton

import smemguard
from smemguard.examples import matmul_args, matmul_kernel


def _own(name: str):
    """``matmul_kernel``'s Python function under ``name`` here: a kernel the records name as ``replayed:<name>``."""
    fn = matmul_kernel.fn
    copy = type(fn)(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__module__, copy.__annotations__ = name, __name__, dict(fn.__annotations__)
    return triton.jit(copy)


#: Falls back to torch where no stage count of its tiles fits.
with_fallback = _own("with_fallback")
#: Registered alternatives: smaller tiles, its grid a function of them.
with_alternatives = _own("with_alternatives")
#: Launched by a wrapper that chooses BLOCK_M and computes the grid from it.
in_a_wrapper = _own("in_a_wrapper")


def torch_matmul(a_ptr, b_ptr, c_ptr, **rest):
    c_ptr.copy_((a_ptr.float() @ b_ptr.float()).to(c_ptr.dtype))


smemguard.register_fallback(with_fallback, torch_matmul)
smemguard.register_alternatives(with_alternatives, [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64},
                                                                  num_warps=4, num_stages=1)])


@smemguard.tile_choice(kernel=in_a_wrapper, tile="BLOCK_M", smallest=32)
def block_m_for(rows: int) -> int:
    return 128


@smemguard.rerun_on_overflow(block_m_for)
def wrapped_matmul(a, b, c):
    block_m = block_m_for(a.shape[0])
    grid = (triton.cdiv(a.shape[0], block_m), triton.cdiv(b.shape[1], 128))
    in_a_wrapper[grid](*matmul_args(a, b, c), BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, num_stages=1)


def operands(n: int = 256):
    return [torch.empty(n, n, dtype=torch.float16) for _ in range(3)]
