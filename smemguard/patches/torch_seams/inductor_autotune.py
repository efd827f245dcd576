"""Inductor's max-autotune timing its choices: wraps ``torch._inductor.autotune_process.TritonBenchmarkRequest``'s
``precompile`` and ``benchmark``.

Why: under ``mode="max-autotune"`` Inductor compiles and times every template choice it generated (tiles, stages
and warps for each matmul, convolution or attention shape), in threads of a pool and in the process that
compiles. A choice that does not fit the GPU fails its load there and Inductor marks it as failed and times the
others: nothing the user asked for failed, and Inductor would discard it anyway. While a choice is compiled or
timed, the thread is marked as benchmarking (``facts.process.benchmarking``, with the shape class of the inputs
timed): the engine then records a choice no stage count fits once per kernel and shape class as
``autotune_skipped`` (``phase: autotune``) rather than as a re-raised launch, which would page an operator for
every max-autotune compile on a small GPU (docs/METRICS.md), and a fewer-stage recompile once per kernel and shape
class too.

Nothing is changed that runs: the wrappers set a thread-local value around Inductor's own call. In every release
checked, ``TritonBenchmarkRequest.precompile(self)`` loads the benchmark module and precompiles its kernel, and
``benchmark(self, *input_tensors, out=None)`` (inherited from ``BenchmarkRequest``) runs it; each request keeps
``input_tensor_meta`` and ``output_tensor_meta`` (``TensorMeta``: ``dtype``, ``sizes``, ``strides``).
"""

from __future__ import annotations

from ...facts import process
from ...facts.versions import Supported
from .. import Layer, Patch, wrapt_layer

_MODULE = "torch._inductor.autotune_process"


def _shape_class(request) -> tuple:
    """The inputs' and the output's dtypes, sizes and strides: what makes one choice's timing another's."""
    output = getattr(request, "output_tensor_meta", None)
    metas = [*(getattr(request, "input_tensor_meta", None) or ()), *(output if isinstance(output, list) else
                                                                      [output] if output is not None else [])]
    return tuple((str(meta.dtype), tuple(map(str, meta.sizes)), tuple(map(str, meta.strides))) for meta in metas)


def _timing_a_choice(wrapped, instance, args, kwargs):
    try:
        choice = process.TimedChoice(_shape_class(instance))
    except Exception:  # describing it only names the shape class: never disturb Inductor's autotuning
        choice = process.TimedChoice(())
    with process.benchmarking.scope(choice):
        return wrapped(*args, **kwargs)


PATCH = Patch(__name__, target=f"{_MODULE}.TritonBenchmarkRequest.precompile", modules=(_MODULE,),
              supported=Supported("torch", (2, 8), (2, 14), label="PyTorch"),
              checked=("2.11.0", "2.13.0", "2.14.0", "2.14.1"),
              observe_safe=True,  # marks the thread only: nothing that runs changes
              layers={Layer(_MODULE, "TritonBenchmarkRequest.precompile"): wrapt_layer(_timing_a_choice),
                      Layer(_MODULE, "TritonBenchmarkRequest.benchmark"): wrapt_layer(_timing_a_choice)})
