"""Host cost per call of smemguard's layer on a vLLM wrapper function (unified_attention,
context_attention_fwd), measured around a no-op with the argument list vLLM's Triton backend passes.

Answered (2-core AMD EPYC, Python 3.11.7, wrapt 2.5.2): the plain function layer costs 0.11 to 0.13 us a call over
the bare call (0.10 to 0.11 us), a wrapt ``FunctionWrapper`` with the same ``try`` 0.55 us: about 5 times as much,
in every run. So the vLLM wrapper patches use plain function layers.

    python benchmarks/experiments/wrapper_layer_cost.py [--calls 200000] [--repeat 7]

Prints the bare call and, for each layer, its cost over the bare call (best of --repeat timeit
runs, microseconds per call): smemguard's plain function layer (``patches.contrib._retried_wrapper``), and a
wrapt ``FunctionWrapper`` whose wrapper is the same ``try`` (what the patch used before).
"""

from __future__ import annotations

import argparse
import timeit

import wrapt

from smemguard.patches.contrib import vllm_unified_attention

# unified_attention's positional arguments as the Triton backend passes them (values do not matter to a no-op)
ARGS = tuple(range(9)) + (True, (-1, -1), 11, 0, None, None, None)


def noop(q, k, v, out, *args, **kwargs):
    return None


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
        except ArithmeticError:  # never raised: only the healthy path is timed
            raise

    layers = {"smemguard plain function layer": vllm_unified_attention.PATCH._guarded(noop),
              "wrapt FunctionWrapper with the same try": wrapt.FunctionWrapper(noop, wrapt_try)}
    bare = per_call_us(noop, options.calls, options.repeat)
    print(f"bare call: {bare:.3f} us")
    for name, layer in layers.items():
        print(f"{name}: +{per_call_us(layer, options.calls, options.repeat) - bare:.3f} us per call")


if __name__ == "__main__":
    main()
