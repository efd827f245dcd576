"""Preflight: which configs of which Triton kernels overflow which GPUs, found without the GPUs.

``smemguard check`` compiles every config of every kernel it finds for each GPU's arch with
Triton's own compiler (its stages on an ``ASTSource`` for a ``GPUTarget``, as ``triton.compile``
runs them: no GPU, no driver) up to the stage that allocates shared memory (LLVM IR; PTX and
ptxas, most of a large config's compile, are skipped), and compares the ``metadata.shared`` it
sets with the GPU's per-block opt-in limit from :mod:`smemguard.facts.gpus`: the comparison
``CompiledKernel._init_handles`` makes before it raises ``OutOfResources`` on the real GPU.

Specializations. Shared memory depends on how a kernel is launched (DESIGN.md sections 4-5), so
each config is compiled as the launches that matter would compile it:

- ``aligned``: every pointer 16-byte aligned and every integer divisible by 16 (``tt.divisibility``
  16, as Triton's launcher marks them): cp.async, the full software pipeline, the most memory;
- ``misaligned``: none of them divisible: no cp.async, about one stage;
- on request, ``NAME=1``: the aligned launch with named integer arguments equal to 1, which Triton
  turns into constants (``N == 1`` changes what the pipeline buffers).

Arguments that are 1 in every launch (the innermost stride of a contiguous tensor, read from the
kernel's source by :mod:`.source`) are constants in all of them. Strides the source leaves unsure
are 1 in each specialization above and not 1 in a ``non-unit`` twin of it. A config fits a GPU when
it fits in every specialization checked; a kernel is a deploy risk on a GPU when, for some
specialization, none of its configs fits.

Speed. Results are cached on disk under Triton's own compile-cache key (Triton, kernel source and
dependencies, signature, constants, attributes, options, backend, arch) in
``<SMEMGUARD_CACHE_DIR>/preflight``; compiles run in a pool of processes; and for matmul-like
configs a calibrated interval estimate decides the clear cases (:mod:`smemguard.kernels.estimate`, which
recovery uses too). Estimated
verdicts are labelled as such everywhere; ``--exact`` compiles all.

One module per job, each importing only those listed before it: :mod:`.model` (what is checked),
:mod:`.source` (reading a kernel's source: pointers, unit strides), :mod:`.discovery` (finding
kernels, their argument types), :mod:`.compiling` (compile requests,
the cache key, the process pool), :mod:`.cache` (results on disk),
:mod:`.check` (the scheduler, the verdicts, the report and its JSON), :mod:`.output` (the text),
:mod:`.decide` (``--decisions``: recovery's decisions for the overflows found, on a stand-in GPU).

The runtime counterpart, :func:`smemguard.fits`, lives in :mod:`smemguard.kernels.pruning`: serving
processes import it without this package.
"""

from ..kernels.estimate import Estimate, estimate
from .cache import ResultCache, default_cache
from .check import Progress, check
from .report import Report, Verdict
from .compiling import build_request, cache_key
from .discovery import discover
from .model import (
    ALIGNED,
    CACHED,
    ERROR,
    ESTIMATED,
    FITS,
    MEASURED,
    MISALIGNED,
    NON_UNIT,
    NOT_CHECKED,
    OVERFLOWS,
    CheckedKernel,
    Specialization,
    TargetError,
    Variant,
)
from .output import format_summary, format_table, unsure_strides

__all__ = ["discover", "check", "format_table", "format_summary", "ResultCache", "default_cache", "build_request",
           "cache_key", "estimate", "Estimate", "CheckedKernel", "Specialization", "Variant", "Progress", "Report",
           "Verdict", "TargetError", "ALIGNED", "MISALIGNED", "FITS", "OVERFLOWS", "ERROR", "NOT_CHECKED", "MEASURED",
           "CACHED", "ESTIMATED", "NON_UNIT", "unsure_strides"]
