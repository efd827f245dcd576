"""Host cost per healthy call of smemguard on a vLLM wrapper function (unified_attention), measured around a no-op
with the argument list vLLM's Triton backend passes, that asks its tile choice twice (prefill and decode) as vLLM's
wrapper does.

Answered (2-core AMD EPYC, Python 3.11.7, wrapt 2.5.2, 2026-12-04): a plain function layer with a ``try`` costs 0.11 to
0.13 us a call over the bare call, a wrapt ``FunctionWrapper`` with the same ``try`` 0.55 us: so a layer on a
wrapper is a plain function. 2026-12-07: the declared wrapper (``smemguard.rerun_on_overflow`` over the wrapper,
``smemguard.tile_choice`` over its choice, as the vLLM packs now declare them) costs about 1 us a call over the bare
call; a pack's declaration, held back until an overflow, leaves the choice as it is and costs the wrapper's layer
only: the numbers of the day are in docs/MEASURED.md.

    python benchmarks/experiments/wrapper_layer_cost.py [--calls 200000] [--repeat 7]

Prints the bare call and, for each layer, its cost over the bare call (best of --repeat timeit runs, microseconds per
call), with smemguard installed (no GPU needed: nothing is launched).
"""

from __future__ import annotations

import argparse
import timeit

import wrapt

import smemguard
from smemguard.engine.wrapper_tiles import declaration_of
from smemguard.examples import matmul_kernel
from smemguard.facts.settings import Settings

# unified_attention's positional arguments as the Triton backend passes them (values do not matter to a no-op)
ARGS = tuple(range(9)) + (True, (-1, -1), 11, 0, None, None, None)


def tile_size(head_size, sliding_window, element_size, is_prefill):
    return 32


def wrapper_asking(choose):
    """A no-op wrapper that asks ``choose`` for its prefill and its decode tile, as vLLM's does."""

    def unified_attention(q, k, v, out, *args, **kwargs):
        choose(128, 0, 2, is_prefill=True)
        choose(128, 0, 2, is_prefill=False)

    return unified_attention


def plain_layer(original):
    def guarded(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except ArithmeticError:  # never raised: only the healthy path is timed
            raise

    return guarded


def per_call_us(function, calls: int, repeat: int) -> float:
    return min(timeit.repeat(lambda: function(*ARGS), number=calls, repeat=repeat)) / calls * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=7)
    options = parser.parse_args(argv)

    def wrapt_try(wrapped, instance, args, kwargs):
        try:
            return wrapped(*args, **kwargs)
        except ArithmeticError:
            raise

    bare = wrapper_asking(tile_size)
    declared_choice = smemguard.tile_choice(kernel=matmul_kernel, tile="BLOCK_M")(tile_size)
    held_back = declaration_of(smemguard.tile_choice(kernel=matmul_kernel, tile="BLOCK_M")(tile_size))
    held_back.put_in_place = lambda: None  # a pack's: the wrapper asks vLLM's own choice until an overflow
    layers = {"plain function layer with a try": plain_layer(bare),
              "wrapt FunctionWrapper with the same try": wrapt.FunctionWrapper(bare, wrapt_try),
              "declared wrapper and choice (a library's own)": smemguard.rerun_on_overflow(declared_choice)(
                  wrapper_asking(declared_choice)),
              "declared wrapper, choice held back (a pack's)": smemguard.rerun_on_overflow(held_back)(bare)}
    assert smemguard.install(Settings())
    try:
        base = per_call_us(bare, options.calls, options.repeat)
        print(f"bare call: {base:.3f} us")
        for name, layer in layers.items():
            print(f"{name}: +{per_call_us(layer, options.calls, options.repeat) - base:.3f} us per call")
    finally:
        smemguard.uninstall()


if __name__ == "__main__":
    main()
