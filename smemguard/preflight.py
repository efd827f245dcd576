"""Preflight: which configs of which Triton kernels overflow which GPUs, found without the GPUs.

``smemguard check`` compiles every config of every kernel it finds for each GPU's arch with
Triton's own compiler (``triton.compile`` on an ``ASTSource`` for a ``GPUTarget``: no GPU, no
driver; ptxas ships in the Triton wheel) and compares the compiled kernel's ``metadata.shared``
with the GPU's per-block opt-in limit from :mod:`smemguard.gpus`: the comparison
``CompiledKernel._init_handles`` makes before it raises ``OutOfResources`` on the real GPU.

Specializations. Shared memory depends on how a kernel is launched (DESIGN.md sections 4-5), so
each config is compiled as the launches that matter would compile it:

- ``aligned``: every pointer 16-byte aligned and every integer divisible by 16 (``tt.divisibility``
  16, as Triton's launcher marks them): cp.async, the full software pipeline, the most memory;
- ``misaligned``: none of them divisible: no cp.async, about one stage;
- on request, ``NAME=1``: the aligned launch with named integer arguments equal to 1, which Triton
  turns into constants (``N == 1`` changes what the pipeline buffers).

Arguments that are 1 in every launch (the innermost stride of a contiguous tensor) are constants in
all of them. A config fits a GPU when it fits in every specialization checked; a kernel is a
deploy risk on a GPU when, for some specialization, none of its configs fits.

Speed. Results are cached on disk under Triton's own compile-cache key (Triton, kernel source and
dependencies, signature, constants, attributes, options, ptxas version, arch) in
``<SMEMGUARD_CACHE_DIR>/preflight``; compiles run in a pool of processes; and for matmul-like
configs (``BLOCK_M``/``BLOCK_N``/``BLOCK_K`` constexprs) inside the calibrated domain (sm_80, sm_89,
sm_90; fp16, bf16 or fp32 operands; tiles 32 to 256, BLOCK_K 32 to 128, 1 to 5 stages, 4 or 8
warps) an interval estimate decides the clear cases. With T the bytes of one stage of the A and B
tiles, E those of one output tile and S the stages:

=================================================================  ===========================
code path                                                          interval (bytes)
=================================================================  ===========================
wgmma: sm_90, BLOCK_M >= 64, pipelined                             [S·T, S·T]
mma: sm_80/89, or BLOCK_M < 64, pipelined                          [(S-1)·T, max((S-1)·T, E)]
one stage: misaligned 2-byte operands (cp.async needs 4 bytes)     [T, max(T, E)]
launches with arguments == 1                                       [T, S·T + E]
=================================================================  ===========================

"Pipelined" means cp.async can feed the stages: 16-byte aligned, or 4-byte elements (fp32 is
pipelined even misaligned). Calibration: every measurement lies inside its interval, so the
estimate is off by at most the interval's width (nothing for wgmma; up to E - (S-1)·T where an
epilogue scratch dominates, 16 of 446 configs in the Triton 3.6 sweep). Measured: the 743
configs of ``data/triton36_smem_sweep.csv`` beside DESIGN.md (Triton 3.6; fp16, fp32; aligned,
misaligned, N == 1; sm_80/89/90) and, with Triton 3.9.0 on the same archs, 3096 compiles:
FlagGems' 216-config grid in fp16 and 138 configs in bf16 (aligned, misaligned), 108 in fp32
(aligned, misaligned, N == 1). The textbook S·T is off by S/(S-1) on sm_80/89: it drops configs that fit. A verdict
is taken from the estimate only when the whole interval is :data:`ESTIMATE_MARGIN` clear of the
limit, and only for a kernel whose measured configs agree with the model on that arch,
specialization and code path: the configs nearest the limit on each side are always compiled,
and one measurement outside its interval makes the check compile every config of that group.
Estimated verdicts are labelled as such everywhere; ``--exact`` compiles all.

The runtime counterpart, :func:`smemguard.fits`, lives in :mod:`smemguard.pruning`: serving
processes import it without this module.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import hashlib
import importlib
import importlib.util
import io
import json
import logging
import math
import multiprocessing
import os
import re
import sys
import tempfile
import textwrap
import time
import warnings
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

from . import __version__, gpus, incidents, registry
from .pruning import error_line

log = logging.getLogger("smemguard")

#: Distinct error messages the text report lists (``--json`` has every one).
MAX_ERRORS_SHOWN = 5

#: Version of the ``--json`` document (see :func:`Report.to_json`).
SCHEMA = "smemguard.check/1"

#: How far (relative) an estimate's whole interval must be from the limit to decide a verdict.
#: Every calibration measurement lies inside its interval; the margin covers other Triton releases
#: and kernels that differ from the calibrated ones in ways the validation compiles did not catch.
ESTIMATE_MARGIN = 0.10

#: Archs with calibration data. Others (sm_86, sm_100, sm_120, ...) are always compiled.
CALIBRATED_ARCHS = (80, 89, 90)

#: Element types of the A operand with calibration data.
CALIBRATED_OPERANDS = ("fp16", "bf16", "fp32")

#: How many of the configs nearest the limit, per side, to consider when picking the one compiled
#: to validate the estimate (the cheapest of them: big tiles take up to a minute to compile).
VALIDATION_CANDIDATES = 4

ALIGNED = "aligned"
MISALIGNED = "misaligned"

FITS = "fits"
OVERFLOWS = "overflows"
ERROR = "error"
NOT_CHECKED = "not_checked"

MEASURED = "measured"
CACHED = "cached"
ESTIMATED = "estimated"

#: Integer sizes Triton's launcher marks as divisible by 16 and turns into a constant when 1.
_INT_TYPES = ("i32", "i64", "u32", "u64")
_ELEMENT_BYTES = {"fp8e4nv": 1, "fp8e5": 1, "fp8e4b15": 1, "fp8e4b8": 1, "fp8e5b16": 1, "i8": 1, "u8": 1,
                  "fp16": 2, "bf16": 2, "i16": 2, "u16": 2, "fp32": 4, "i32": 4, "u32": 4, "fp64": 8, "i64": 8,
                  "u64": 8}
_TILE_NAME = re.compile(r"^(?:BLOCK|BLOCK_SIZE|TILE|TILE_SIZE)_?([MNK])$|^B([MNK])$")
_HINT_KEYS = ("dtype", "signature", "constants", "configs", "ones", "unit")


class TargetError(ValueError):
    """A check that cannot start: unknown GPU, unimportable target, malformed option."""


# ---------------------------------------------------------------------------------------------
# What is checked


@dataclass(frozen=True)
class Specialization:
    name: str
    aligned: bool
    ones: tuple[str, ...] = ()  # integer arguments equal to 1 in this specialization

    def to_json(self) -> dict:
        return {"name": self.name, "aligned": self.aligned, "ones": list(self.ones)}


@dataclass(frozen=True)
class Variant:
    """One config: constexpr values and compile options."""

    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int = 4
    num_stages: int = 3
    num_ctas: int = 1
    maxnreg: int | None = None

    @classmethod
    def of(cls, config) -> "Variant":
        """From a ``triton.Config`` or a dict of constexprs plus ``num_warps``/``num_stages``/..."""
        if isinstance(config, Variant):
            return config
        if isinstance(config, dict):
            meta = dict(config)
            options = {key: meta.pop(key) for key in ("num_warps", "num_stages", "num_ctas", "maxnreg") if key in meta}
            return cls(tuple(meta.items()), **options)
        return cls(tuple(config.kwargs.items()), config.num_warps or 4,
                   config.num_stages if config.num_stages is not None else 3,
                   getattr(config, "num_ctas", 1) or 1, getattr(config, "maxnreg", None))

    def label(self) -> str:
        parts = [f"{name}={value}" for name, value in (*self.constexprs, *self.options().items())]
        return " ".join(parts)

    def options(self) -> dict:
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.num_ctas != 1:
            options["num_ctas"] = self.num_ctas
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options


@dataclass
class CheckedKernel:
    """A kernel as the check sees it: its JIT function, configs, argument types and specializations."""

    name: str  # how the user can name it: "module:attr"
    jit: Any
    variants: list[Variant]
    types: dict[str, str]  # non-constexpr parameter -> Triton type ("*fp16", "i32", "fp32")
    constants: dict[str, Any]  # constexprs no config sets
    unit_args: tuple[str, ...]  # integer arguments that are 1 in every launch
    specializations: list[Specialization]
    heuristics: list[dict] = field(default_factory=list)  # values of triton.heuristics layers
    locator: tuple[str, str, str | None] | None = None  # (module, attribute, file) for worker processes

    @property
    def jit_name(self) -> str:
        return registry.kernel_name(self.jit)


# ---------------------------------------------------------------------------------------------
# Finding kernels


def _triton_classes():
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    return JITFunction, Autotuner, Heuristics


def _is_kernel(obj) -> bool:
    return isinstance(obj, _triton_classes())


def _load_file(path: Path) -> ModuleType:
    """Import a kernel file under a name of its own (a file called ``triton.py`` must not shadow Triton)."""
    name = f"smemguard_check_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    # Kernel files import their neighbours like scripts do.
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import(module_name: str, file: str | None) -> ModuleType:
    if file is not None:
        return _load_file(Path(file))
    return importlib.import_module(module_name)


def _split_target(target: str) -> tuple[str, str | None]:
    """``"pkg.mod:kernel"`` -> ("pkg.mod", "kernel"); ``"kernels.py"`` -> ("kernels.py", None)."""
    match = re.fullmatch(r"(.+):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", target)
    return (match.group(1), match.group(2)) if match else (target, None)


def _open_target(target: str) -> tuple[ModuleType, str | None, str | None]:
    """The module named or pointed at by ``target``, the attribute asked for, and the file if a path."""
    where, attribute = _split_target(target)
    looks_like_path = where.endswith(".py") or os.sep in where or Path(where).is_file()
    try:
        if looks_like_path:
            path = Path(where).expanduser().resolve()
            if not path.is_file():
                raise TargetError(f"{target!r}: no such file")
            return _load_file(path), attribute, str(path)
        return importlib.import_module(where), attribute, None
    except TargetError:
        raise
    except Exception as error:
        raise TargetError(f"{target!r} could not be imported: {type(error).__name__}: {error}") from error


def _resolve_attribute(module: ModuleType, attribute: str):
    obj: Any = module
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def _innermost(obj):
    """The JIT function under autotuner/heuristics layers, the autotuner, and the heuristics values."""
    JITFunction, Autotuner, Heuristics = _triton_classes()
    autotuner, heuristics = None, []
    while not isinstance(obj, JITFunction):
        if isinstance(obj, Autotuner) and autotuner is None:
            autotuner = obj
        elif isinstance(obj, Heuristics):
            heuristics.append(dict(obj.values))
        elif not hasattr(obj, "fn"):
            raise TargetError(f"{type(obj).__name__} is not a Triton kernel")
        obj = obj.fn
    return obj, autotuner, heuristics


def _jit_from_locator(locator: tuple[str, str, str | None]):
    module_name, attribute, file = locator
    return _innermost(_resolve_attribute(_import(module_name, file), attribute))[0]


def discover(targets: Sequence[str], examples: bool = False, overrides: dict | None = None) -> list[CheckedKernel]:
    """The kernels named by ``targets`` (modules, ``module:kernel``, files) and, with ``examples``,
    smemguard's own example kernels. ``overrides`` are hints (see :data:`_HINT_KEYS`) that win over
    those a module declares in ``SMEMGUARD_PREFLIGHT``. Raises :class:`TargetError`."""
    overrides = overrides or {}
    found: list[tuple[str, ModuleType, str, str | None, Any, bool]] = []
    names = list(targets) + (["smemguard.examples"] if examples else [])
    if not names:
        raise TargetError("nothing to check: name a module, module:kernel or file, or pass --examples")
    for target in names:
        module, attribute, file = _open_target(target)
        label = Path(file).name if file else module.__name__
        if attribute is not None:
            try:
                obj = _resolve_attribute(module, attribute)
            except AttributeError:
                raise TargetError(f"{target!r}: {label} has no attribute {attribute!r}") from None
            if not _is_kernel(obj):
                raise TargetError(f"{target!r} is a {type(obj).__name__}, not a Triton kernel "
                                  "(@triton.jit, triton.autotune or triton.heuristics)")
            found.append((f"{label}:{attribute}", module, attribute, file, obj, True))
            continue
        in_module = [(name, obj) for name, obj in vars(module).items() if _is_kernel(obj)]
        if not in_module:
            raise TargetError(f"{target!r} defines no Triton kernel")
        hints = getattr(module, "SMEMGUARD_PREFLIGHT", {})
        wrapped = {id(_innermost(obj)[0]) for _, obj in in_module if not isinstance(obj, _triton_classes()[0])}
        seen: set[int] = set()
        for name, obj in in_module:
            # A JIT function an autotuner of the same module wraps is checked through it, with its configs.
            if id(obj) in seen or (id(obj) in wrapped and name not in hints):
                continue
            seen.add(id(obj))
            found.append((f"{label}:{name}", module, name, file, obj, False))

    kernels = []
    for name, module, attribute, file, obj, explicit in found:
        hints = {**getattr(module, "SMEMGUARD_PREFLIGHT", {}).get(attribute, {})}
        for key, value in overrides.items():
            hints[key] = {**hints.get(key, {}), **value} if key in ("signature", "constants") else value
        kernel = _make_kernel(name, obj, hints, locator_from=(module, attribute, file))
        if kernel is None:
            if explicit:
                raise TargetError(f"{name}: no config to check: it is a plain @triton.jit kernel with constexprs "
                                  "that have no default; give them with --meta NAME=VALUE,... (one --meta per config)")
            log.warning("smemguard check: skipping %s: a plain @triton.jit kernel whose constexprs have no default "
                        "(name it as module:kernel with --meta to check it)", name)
            continue
        if all(kernel.name != known.name for known in kernels):
            kernels.append(kernel)
    if not kernels:
        raise TargetError("no kernel to check: the kernels found need --meta to give their constexprs")
    return kernels


def _make_kernel(name: str, obj, hints: dict, locator_from: tuple) -> CheckedKernel | None:
    unknown = sorted(set(hints) - set(_HINT_KEYS))
    if unknown:
        raise TargetError(f"{name}: unknown preflight hints {unknown}; known: {', '.join(_HINT_KEYS)}")
    jit, autotuner, heuristics = _innermost(obj)
    runtime_names = [p.name for p in jit.params if not p.is_constexpr]
    constants = dict(hints.get("constants", {}))
    if hints.get("configs"):
        variants = [Variant.of(config) for config in hints["configs"]]
    elif autotuner is not None:
        variants = [Variant.of(config) for config in autotuner.configs]
    else:
        missing = [p.name for p in jit.params if p.is_constexpr and not p.has_default and p.name not in constants
                   and not any(p.name in values for values in heuristics)]
        if missing:
            return None
        variants = [Variant(())]

    for label, names in (("--const", constants), ("signature", hints.get("signature", {}))):
        strangers = sorted(set(names) - set(jit.arg_names))
        if strangers:
            raise TargetError(f"{name}: {label} names {strangers}, which are not parameters of {jit.fn.__name__}")
    unit = _unit_args(runtime_names, hints.get("unit", "auto"), name)
    ones_lists = [tuple(ones) for ones in hints.get("ones", [])]
    for ones in ones_lists:
        wrong = [arg for arg in ones if arg not in runtime_names]
        if wrong:
            raise TargetError(f"{name}: --one names {wrong}, which are not integer parameters of {jit.fn.__name__} "
                              f"(those are: {', '.join(runtime_names)})")
    specializations = [Specialization(ALIGNED, True), Specialization(MISALIGNED, False)]
    specializations += [Specialization(f"{ones[0]}=1", True, ones) for ones in ones_lists]

    types = _argument_types(jit, hints.get("dtype", "fp16"), hints.get("signature", {}))
    module, attribute, file = locator_from
    # How a worker process finds the same JIT function; it cannot import one defined in __main__.
    locator = None if module.__name__ == "__main__" else (module.__name__, attribute, file)
    return CheckedKernel(name, jit, variants, types, constants, unit, specializations, heuristics, locator)


def _unit_args(runtime_names: list[str], unit, kernel_name: str) -> tuple[str, ...]:
    """Arguments equal to 1 in every launch: named, none, or ``auto``: the last of each run of
    ``stride_<tensor><dim>`` parameters of one tensor (``stride_am, stride_ak`` -> ``stride_ak``),
    the innermost stride of a contiguous tensor."""
    if unit == "none":
        return ()
    if unit != "auto":
        names = tuple(unit)
        wrong = [arg for arg in names if arg not in runtime_names]
        if wrong:
            raise TargetError(f"{kernel_name}: --unit names {wrong}, which are not runtime parameters")
        return names
    runs: list[list[str]] = []
    for arg in runtime_names:
        if not arg.startswith("stride"):
            runs.append([])
        elif runs and runs[-1] and runs[-1][-1][:-1] == arg[:-1]:
            runs[-1].append(arg)
        else:
            runs.append([arg])
    return tuple(run[-1] for run in runs if len(run) >= 2)


# Calls whose first argument (or ``pointer=``/``base=``) is a pointer expression.
_POINTER_CALLS = {"load", "store", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min",
                  "atomic_and", "atomic_or", "atomic_xor", "make_block_ptr", "make_tensor_descriptor"}


def _pointer_parameters(jit) -> set[str]:
    """Parameters the kernel loads from or stores to, read from its source.

    A pointer expression is a sum whose terms are pointers and offsets; offsets are products
    (``rm * stride_am``) or locals made of them, so the names found among the *terms* of the
    sums reaching ``tl.load``/``tl.store`` (through local variables) are the pointers. Also
    counted: parameters whose ``.dtype`` or ``.type`` is read, and names ending in ``ptr``.
    """
    params = set(jit.arg_names)
    tree = ast.parse(textwrap.dedent(jit.src))
    origins: dict[str, set[str]] = {}
    pointer_expressions: list[ast.AST] = []
    found = {name for name in params if name.lower().endswith("ptr")}

    def terms(node) -> set[str]:
        if isinstance(node, ast.Name):
            return {node.id}
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            return terms(node.left) | terms(node.right)
        if isinstance(node, ast.Subscript):
            return terms(node.value)
        return set()

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            origins.setdefault(node.targets[0].id, set()).update(terms(node.value))
        elif isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in _POINTER_CALLS:
                pointer_expressions += node.args[:1]
                pointer_expressions += [kw.value for kw in node.keywords if kw.arg in ("pointer", "base")]
        elif isinstance(node, ast.Attribute) and node.attr in ("dtype", "type") and isinstance(node.value, ast.Name):
            found.add(node.value.id)

    pending = [name for expression in pointer_expressions for name in terms(expression)]
    visited: set[str] = set()
    while pending:
        name = pending.pop()
        if name in visited:
            continue
        visited.add(name)
        if name in params:
            found.add(name)
        pending.extend(origins.get(name, ()))
    return found & params


def _argument_types(jit, dtype: str, explicit: dict[str, str]) -> dict[str, str]:
    """Triton type of each runtime parameter: given, annotated, or inferred (pointer to ``dtype``, else i32)."""
    pointers = _pointer_parameters(jit)
    types = {}
    for param in jit.params:
        if param.is_constexpr:
            continue
        annotation = param.annotation_type if isinstance(param.annotation_type, str) else ""
        if param.name in explicit:
            types[param.name] = explicit[param.name]
        elif annotation:
            types[param.name] = annotation
        elif param.name in pointers:
            types[param.name] = f"*{dtype}"
        else:
            types[param.name] = "i32"
    return types


# ---------------------------------------------------------------------------------------------
# Compile requests: what one compile of one (kernel, config, specialization, arch) needs


@dataclass
class CompileRequest:
    signature: dict[str, str]
    constants: dict[str, Any]
    divisible: tuple[str, ...]
    options: dict[str, Any]
    arch: int
    locator: tuple[str, str, str | None] | None
    key: str = ""


class _PlanError(Exception):
    """This config cannot be compiled as asked (missing constexpr, failing heuristic)."""


class _StandInPointer:
    """What a ``triton.heuristics`` function sees for a tensor argument during a check."""

    def __init__(self, dtype: str, aligned: bool) -> None:
        self._dtype = dtype
        self._aligned = aligned

    @property
    def dtype(self):
        import torch

        names = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64", "i8": "int8",
                 "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8", "fp8e4nv": "float8_e4m3fn",
                 "fp8e5": "float8_e5m2"}
        return getattr(torch, names.get(self._dtype, self._dtype))

    def element_size(self) -> int:
        return _ELEMENT_BYTES.get(self._dtype, 4)

    def data_ptr(self) -> int:
        return 1 << 20 if self._aligned else (1 << 20) + 2


#: The size a heuristic sees for an integer argument (divisible by 16 or not, as the specialization).
HEURISTIC_SIZE = {True: 4096, False: 4095}


def _heuristic_values(kernel: CheckedKernel, values: dict, spec: Specialization, ones: set[str]) -> dict:
    named: dict[str, Any] = {}
    for name, ty in kernel.types.items():
        if ty.startswith("*"):
            named[name] = _StandInPointer(ty[1:], spec.aligned)
        elif ty in _INT_TYPES:
            named[name] = 1 if name in ones else HEURISTIC_SIZE[spec.aligned]
        else:
            named[name] = 1.0
    named.update(values)
    computed = {}
    for layer in kernel.heuristics:  # outermost first: Heuristics.run fills its values, then calls the inner layer
        for name, heuristic in layer.items():
            try:
                computed[name] = named[name] = heuristic(dict(named))
            except Exception as error:
                raise _PlanError(f"heuristic for {name} failed on stand-in arguments ({type(error).__name__}: "
                                 f"{error}); give {name} with --const") from error
    return computed


def build_request(kernel: CheckedKernel, variant: Variant, spec: Specialization, arch: int) -> CompileRequest:
    """The signature, constants and divisibility a launch in ``spec`` would compile ``variant`` with."""
    values = {p.name: p.default for p in kernel.jit.params if p.is_constexpr and p.has_default}
    values.update(kernel.constants)
    values.update(variant.constexprs)
    ones = set(kernel.unit_args) | set(spec.ones)
    if kernel.heuristics:
        values.update(_heuristic_values(kernel, values, spec, ones))
    signature: dict[str, str] = {}
    constants: dict[str, Any] = {}
    divisible = []
    for param in kernel.jit.params:
        name = param.name
        if param.is_constexpr:
            if name not in values:
                raise _PlanError(f"constexpr {name} has no value; give it with --const {name}=VALUE")
            signature[name], constants[name] = "constexpr", values[name]
            continue
        ty = kernel.types[name]
        if name in ones and ty in _INT_TYPES and not param.do_not_specialize:
            signature[name], constants[name] = "constexpr", 1
            continue
        signature[name] = ty
        specializable = ty.startswith("*") or (ty in _INT_TYPES and not param.do_not_specialize)
        if spec.aligned and specializable and not param.do_not_specialize_on_alignment:
            divisible.append(name)
    return CompileRequest(signature, constants, tuple(divisible), variant.options(), arch, kernel.locator)


def _triton_version() -> tuple[int, int]:
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def _attrs(jit, request: CompileRequest) -> dict:
    """``ASTSource`` attributes, laid out as Triton's launcher lays them out (parameter-index paths;
    an empty list for an argument it could have marked): the same compile-cache entry as a launch.
    Before 3.7 constexprs carried no entry unless their value was a string."""
    every_constexpr_listed = _triton_version() >= (3, 7)
    attrs = {}
    for index, param in enumerate(jit.params):
        name, ty = param.name, request.signature[param.name]
        if name in request.divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif ty == "constexpr":
            if every_constexpr_listed or isinstance(request.constants[name], str):
                attrs[(index,)] = []
        elif ty.startswith("*") or (ty in _INT_TYPES and not param.do_not_specialize):
            attrs[(index,)] = []
    return attrs


def _source(jit, request: CompileRequest):
    from triton.compiler.compiler import ASTSource

    return ASTSource(jit, dict(request.signature), dict(request.constants), _attrs(jit, request))


@contextlib.contextmanager
def _quiet_triton():
    """Triton 3.9 warns once per process that an fp-fusion default will change; not ours to show."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
        yield


_backends: dict[int, Any] = {}


def _backend(arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    if arch not in _backends:
        _backends[arch] = make_backend(GPUTarget("cuda", arch, 32))
    return _backends[arch]


def _triton_key() -> str:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # Triton 3.4
        from triton.compiler.compiler import triton_key
    return triton_key()


def cache_key(jit, request: CompileRequest) -> str:
    """Triton's own compile-cache key for this compile (3.4-3.9 compute it the same way), plus the target."""
    from triton._C.libtriton import get_cache_invalidating_env_vars

    backend = _backend(request.arch)
    with _quiet_triton():
        options = backend.parse_options(dict(request.options))
    env = sorted(get_cache_invalidating_env_vars().items())
    triton_key = f"{_triton_key()}-{_source(jit, request).hash()}-{backend.hash()}-{options.hash()}-{env}"
    return hashlib.sha256(f"smemguard-preflight-1|cuda:{request.arch}|{triton_key}".encode()).hexdigest()


def compile_request(jit, request: CompileRequest) -> dict:
    """Compile for the request's arch; the measured result (``shared`` or ``error``). Never raises
    for a config that does not compile: that is a verdict."""
    import triton
    from triton.backends.compiler import GPUTarget

    started = time.perf_counter()
    try:
        # Triton prints a ptxas reproducer on stdout when ptxas fails; stdout may be --json.
        with _quiet_triton(), contextlib.redirect_stdout(io.StringIO()):
            kernel = triton.compile(_source(jit, request), target=GPUTarget("cuda", request.arch, 32),
                                    options=dict(request.options))
        return {"shared": int(kernel.metadata.shared), "error": None, "seconds": time.perf_counter() - started}
    except Exception as error:  # CompilationError, PTXASError, assertion in a pass: the config does not compile
        return {"shared": None, "error": error_line(error), "seconds": time.perf_counter() - started}


_worker_jits: dict = {}


def _worker_init(triton_cache_dir: str | None) -> None:
    if triton_cache_dir is not None:
        from triton import knobs

        knobs.cache.dir = triton_cache_dir


def _compile_in_worker(request: CompileRequest) -> dict:
    if request.locator not in _worker_jits:
        _worker_jits[request.locator] = _jit_from_locator(request.locator)
    return compile_request(_worker_jits[request.locator], request)


class _Compiler:
    """Compiles in a pool of spawned processes (a fresh Triton each) when there are several jobs and
    the kernel can be imported there; here otherwise."""

    def __init__(self, jobs: int, triton_cache_dir: str | None) -> None:
        self._jobs = jobs
        self._triton_cache_dir = triton_cache_dir
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def submit(self, jit, request: CompileRequest) -> concurrent.futures.Future:
        if self._jobs > 1 and request.locator is not None and _picklable(request):
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self._jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                    initargs=(self._triton_cache_dir,))
            try:
                return self._pool.submit(_compile_in_worker, request)
            except BrokenProcessPool:
                self.close()
                self._pool = None
                return self.submit(jit, request)
        done: concurrent.futures.Future = concurrent.futures.Future()
        with _triton_cache(self._triton_cache_dir):
            done.set_result(compile_request(jit, request))
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


@contextlib.contextmanager
def _triton_cache(directory: str | None):
    if directory is None:
        yield
        return
    from triton import knobs

    with knobs.cache.scope():
        knobs.cache.dir = directory
        yield


def _picklable(request: CompileRequest) -> bool:
    return all(isinstance(value, (int, float, str, bool, type(None))) for value in request.constants.values())


# ---------------------------------------------------------------------------------------------
# Disk cache of results


class ResultCache:
    """Measured results as small JSON files, one per compile key; written atomically."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    def _path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict | None:
        if self.directory is None:
            return None
        try:
            return json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, result: dict) -> None:
        if self.directory is None:
            return
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
                json.dump(result, handle)
            os.replace(handle.name, path)
        except OSError:
            log.debug("smemguard check: could not write %s", path, exc_info=True)


def default_cache() -> ResultCache:
    from . import settings

    directory = settings.current().cache_dir
    return ResultCache(directory / "preflight" if directory is not None else None)


# ---------------------------------------------------------------------------------------------
# The calibrated estimate


def _tiles(constexprs: dict) -> tuple[int, int, int] | None:
    dims: dict[str, int] = {}
    for name, value in constexprs.items():
        match = _TILE_NAME.match(name)
        if match and isinstance(value, int) and not isinstance(value, bool):
            dims[match.group(1) or match.group(2)] = value
    return (dims["M"], dims["N"], dims["K"]) if len(dims) == 3 else None


@dataclass(frozen=True)
class Estimate:
    """Bounds on the shared memory a compile will need, and the code path they assume."""

    low: int
    high: int
    regime: str  # "wgmma", "mma", "one stage" or "arguments == 1"

    def holds(self, shared: int) -> bool:
        return self.low <= shared <= self.high

    def decides(self, limit: int) -> str | None:
        """FITS or OVERFLOWS when the whole interval is :data:`ESTIMATE_MARGIN` clear of ``limit``."""
        if self.high <= limit * (1 - ESTIMATE_MARGIN):
            return FITS
        if self.low >= limit * (1 + ESTIMATE_MARGIN):
            return OVERFLOWS
        return None

    def distance(self, limit: int) -> float:
        return (limit - self.high) / limit if self.high <= limit else (self.low - limit) / limit


def estimate(request: CompileRequest, spec: Specialization) -> Estimate | None:
    """Calibrated bounds for a matmul-like compile, or None outside the calibrated domain
    (arch, operand type, tile sizes, stages, warps): then only a compile can tell."""
    tiles = _tiles(request.constants)
    pointer_types = [ty[1:] for ty in request.signature.values() if ty.startswith("*")]
    if request.arch not in CALIBRATED_ARCHS or tiles is None or not pointer_types:
        return None
    operand, stages, warps = pointer_types[0], request.options["num_stages"], request.options["num_warps"]
    block_m, block_n, block_k = tiles
    in_domain = (operand in CALIBRATED_OPERANDS and all(ty in _ELEMENT_BYTES for ty in pointer_types)
                 and 32 <= min(block_m, block_n) and max(block_m, block_n) <= 256 and 32 <= block_k <= 128
                 and 1 <= stages <= 5 and warps in (4, 8))
    if not in_domain:
        return None
    element = _ELEMENT_BYTES[operand]
    stage = (block_m * block_k + block_k * block_n) * element
    epilogue = block_m * block_n * max(_ELEMENT_BYTES[ty] for ty in pointer_types)
    if spec.ones:
        return Estimate(stage, stages * stage + epilogue, "arguments == 1")
    # cp.async copies 4, 8 or 16 bytes: 4-byte elements are always pipelined, 2-byte ones only
    # from 16-byte aligned addresses; otherwise the loads go through registers, one stage.
    if not spec.aligned and element < 4:
        return Estimate(stage, max(stage, epilogue), "one stage")
    if request.arch >= 90 and block_m >= 64:  # wgmma reads every stage from shared memory
        return Estimate(stages * stage, stages * stage, "wgmma")
    pipelined = max(stages - 1, 1) * stage  # mma: one stage lives in registers
    return Estimate(pipelined, max(pipelined, epilogue), "mma")


def _compile_cost(variant: Variant) -> float:
    """Relative compile time: accumulator elements per warp drive LLVM's time (256x256 tiles on 4
    warps take a minute where 64x64 take a second)."""
    blocks = [value for _, value in variant.constexprs if isinstance(value, int) and value > 1]
    return math.prod(blocks) / max(variant.num_warps, 1) if blocks else 1.0


# ---------------------------------------------------------------------------------------------
# The check


@dataclass
class Item:
    """One compile: kernel x config x specialization x arch, and what is known about it."""

    kernel: CheckedKernel
    variant: Variant
    spec: Specialization
    arch: int
    request: CompileRequest | None = None
    problem: str | None = None  # could not even be set up
    interval: Estimate | None = None
    result: dict | None = None  # {"shared", "error", "seconds"}
    how: str | None = None  # MEASURED or CACHED once result is set
    submitted: bool = False
    retried: bool = False

    def agrees(self) -> bool:
        shared = self.result and self.result["shared"]
        return shared is not None and self.interval is not None and self.interval.holds(shared)


@dataclass(frozen=True)
class Progress:
    done: int
    planned: int
    item: Item
    elapsed: float


@dataclass
class Verdict:
    verdict: str  # FITS, OVERFLOWS, ERROR, NOT_CHECKED
    how: str | None = None  # MEASURED, CACHED, ESTIMATED
    shared: int | None = None
    low: int | None = None
    high: int | None = None
    error: str | None = None

    def to_json(self) -> dict:
        data: dict[str, Any] = {"verdict": self.verdict, "how": self.how, "shared": self.shared}
        if self.how == ESTIMATED:
            data["estimate"] = {"low": self.low, "high": self.high}
        if self.error:
            data["error"] = self.error
        return data


class _Group:
    """The items of one kernel, specialization and arch: the estimate is trusted or not per group."""

    def __init__(self, items: list[Item], limits: list[int]) -> None:
        self.items = items
        self.limits = limits
        self.trusted = True
        self.tried: set[int] = set()

    def unknown(self) -> list[Item]:
        return [item for item in self.items if item.result is None and item.problem is None]

    def to_compile(self) -> list[Item]:
        """Items to compile now: ambiguous ones, validation samples, or all when the model failed."""
        if any(item.result is not None and item.result["shared"] is not None and item.interval is not None
               and not item.agrees() for item in self.items):
            self.trusted = False
        unknown = [item for item in self.unknown() if not item.submitted]
        if not self.trusted:
            return unknown
        chosen = [item for item in unknown
                  if item.interval is None or any(item.interval.decides(limit) is None for limit in self.limits)]
        for limit in self.limits:
            for side in (FITS, OVERFLOWS):
                on_side = [item for item in self.items if item.interval is not None
                           and item.interval.decides(limit) == side]
                for regime in dict.fromkeys(item.interval.regime for item in on_side):
                    chosen += self._sample([item for item in on_side if item.interval.regime == regime], limit)
                    if not self.trusted:  # _sample changes no item: the unknown ones are as above
                        return unknown
        return list({id(item): item for item in chosen}.values())

    def _sample(self, on_side: list[Item], limit: int) -> list[Item]:
        """The cheapest of the configs nearest ``limit`` among ``on_side`` (one side of the limit, one
        code path), unless one of them already agrees with the model or is being compiled to find out."""
        if any(item.agrees() or (id(item) in self.tried and item.result is None) for item in on_side):
            return []
        untried = [item for item in sorted(on_side, key=lambda item: item.interval.distance(limit))
                   if id(item) not in self.tried][:VALIDATION_CANDIDATES]
        if not untried:
            return []
        if sum(id(item) in self.tried for item in on_side) >= VALIDATION_CANDIDATES:
            self.trusted = False  # the configs near the limit do not compile: no evidence for the model
            return []
        sample = min(untried, key=lambda item: _compile_cost(item.variant))
        self.tried.add(id(sample))
        return [sample]


@dataclass
class Report:
    kernels: list[CheckedKernel]
    gpus: list[gpus.Gpu]
    verdicts: dict[tuple[int, int, str, str], Verdict]  # (kernel index, variant index, spec name, gpu name)
    compiles: int
    cache_hits: int
    seconds: float
    exact: bool

    def verdict(self, kernel: int, variant: int, spec: str, gpu: str) -> Verdict:
        return self.verdicts[(kernel, variant, spec, gpu)]

    def checked_gpus(self) -> list[gpus.Gpu]:
        return [gpu for gpu in self.gpus if gpu.capability is not None]

    def fits_everywhere(self, kernel: int, variant: int, gpu: str) -> bool:
        return all(self.verdict(kernel, variant, spec.name, gpu).verdict == FITS
                   for spec in self.kernels[kernel].specializations)

    def without_fit(self, kernel: int, gpu: str) -> list[str]:
        """Specializations in which no config of the kernel fits ``gpu``."""
        k = self.kernels[kernel]
        return [spec.name for spec in k.specializations
                if not any(self.verdict(kernel, v, spec.name, gpu).verdict == FITS for v in range(len(k.variants)))]

    @property
    def exit_status(self) -> int:
        return 1 if any(self.without_fit(k, gpu.name) for k in range(len(self.kernels))
                        for gpu in self.checked_gpus()) else 0

    def counts(self) -> dict[str, int]:
        counted = {MEASURED: 0, CACHED: 0, ESTIMATED: 0}
        for verdict in self.verdicts.values():
            if verdict.how in counted:
                counted[verdict.how] += 1
        return counted

    def to_json(self) -> dict:
        """The ``--json`` document (schema ``smemguard.check/1``)::

            {"schema": "smemguard.check/1", "smemguard": "0.1.0", "triton": "3.9.0", "exact": false,
             "exit_status": 1, "seconds": 41.2, "compiles": 52, "cache_hits": 0,
             "verdicts": {"measured": 52, "cached": 0, "estimated": 1244},
             "gpus": [{"name": "L4", "arch": "sm_89", "limit": 101376, "checked": true}, ...],
             "kernels": [{"kernel": "smemguard.examples:flaggems_matmul",
                          "jit": "smemguard.examples:matmul_kernel",
                          "specializations": [{"name": "aligned", "aligned": true, "ones": []}, ...],
                          "unit_args": ["stride_ak", "stride_bn", "stride_cn"],
                          "configs": [{"config": "BLOCK_M=128 ... num_stages=4",
                                       "constexprs": {"BLOCK_M": 128, ...}, "num_warps": 4, "num_stages": 4,
                                       "gpus": {"L4": {"fits": false,
                                                       "specializations": {"aligned": VERDICT, ...}}}}]}],
             "summary": {"L4": {"checked": true, "configs": 229, "fit": 150,
                                "kernels_without_fit": [{"kernel": "...", "specializations": ["N=1"]}]}}}

        VERDICT = {"verdict": "fits" | "overflows" | "error" | "not_checked",
                   "how": "measured" | "cached" | "estimated" | null,
                   "shared": bytes measured (null when estimated or failed),
                   "estimate": {"low": bytes, "high": bytes} (estimated only), "error": "..." (errors only)}.
        A config "fits" a GPU when it fits in every specialization. "cached" is a measurement
        made by an earlier run.
        """
        import triton

        kernels = []
        for k, kernel in enumerate(self.kernels):
            configs = []
            for v, variant in enumerate(kernel.variants):
                per_gpu = {}
                for gpu in self.gpus:
                    per_gpu[gpu.name] = {
                        "fits": self.fits_everywhere(k, v, gpu.name) if gpu.capability is not None else None,
                        "specializations": {spec.name: self.verdict(k, v, spec.name, gpu.name).to_json()
                                            for spec in kernel.specializations}}
                constexprs = {name: incidents.describe_arg(value) for name, value in variant.constexprs}
                configs.append({"config": variant.label(), "constexprs": constexprs,
                                "num_warps": variant.num_warps, "num_stages": variant.num_stages, "gpus": per_gpu})
            kernels.append({"kernel": kernel.name, "jit": kernel.jit_name,
                            "specializations": [spec.to_json() for spec in kernel.specializations],
                            "unit_args": list(kernel.unit_args), "configs": configs})
        summary = {}
        for gpu in self.gpus:
            checked = gpu.capability is not None
            total = sum(len(kernel.variants) for kernel in self.kernels)
            fit = sum(self.fits_everywhere(k, v, gpu.name) for k, kernel in enumerate(self.kernels)
                      for v in range(len(kernel.variants))) if checked else None
            missing = [{"kernel": kernel.name, "specializations": self.without_fit(k, gpu.name)}
                       for k, kernel in enumerate(self.kernels) if checked and self.without_fit(k, gpu.name)]
            summary[gpu.name] = {"checked": checked, "configs": total, "fit": fit, "kernels_without_fit": missing}
        return {"schema": SCHEMA, "smemguard": __version__, "triton": triton.__version__, "exact": self.exact,
                "exit_status": self.exit_status, "seconds": round(self.seconds, 2), "compiles": self.compiles,
                "cache_hits": self.cache_hits, "verdicts": self.counts(),
                "gpus": [{"name": gpu.name, "arch": gpu.arch, "limit": gpu.max_shared,
                          "checked": gpu.capability is not None} for gpu in self.gpus],
                "kernels": kernels, "summary": summary}


def check(kernels: list[CheckedKernel], gpu_list: Sequence[gpus.Gpu], *, exact: bool = False, jobs: int | None = None,
          cache: ResultCache | None = None, triton_cache_dir: str | None = None,
          progress: Callable[[Progress], None] | None = None) -> Report:
    """Verdicts for every kernel x config x specialization x GPU (see the module docstring)."""
    started = time.perf_counter()
    cache = cache or ResultCache(None)
    jobs = max(1, jobs or os.cpu_count() or 1)
    nvidia = [gpu for gpu in gpu_list if gpu.capability is not None]
    limits = {arch: sorted({gpu.max_shared for gpu in nvidia if gpu.capability == arch})
              for arch in sorted({gpu.capability for gpu in nvidia})}

    groups: list[_Group] = []
    items: dict[tuple[int, int, str, int], Item] = {}
    cache_hits = 0
    for k, kernel in enumerate(kernels):
        for spec in kernel.specializations:
            for arch, arch_limits in limits.items():
                group_items = []
                for v, variant in enumerate(kernel.variants):
                    item = Item(kernel, variant, spec, arch)
                    try:
                        item.request = build_request(kernel, variant, spec, arch)
                        item.request.key = cache_key(kernel.jit, item.request)
                    except _PlanError as error:
                        item.problem = str(error)
                    except Exception as error:  # the compiler's front end rejected the signature
                        item.problem = error_line(error)
                    if item.request is not None and item.problem is None:
                        item.result = cache.get(item.request.key)
                        if item.result is not None:
                            item.how, cache_hits = CACHED, cache_hits + 1
                        if not exact:
                            item.interval = estimate(item.request, spec)
                    items[(k, v, spec.name, arch)] = item
                    group_items.append(item)
                groups.append(_Group(group_items, arch_limits))

    compiles = 0
    compiler = _Compiler(jobs, triton_cache_dir)
    try:
        in_flight: dict[concurrent.futures.Future, Item] = {}
        planned = 0
        while True:
            batch = [item for group in groups for item in (group.unknown() if exact else group.to_compile())
                     if not item.submitted]
            # Longest first: the pool finishes together instead of waiting on one late big tile.
            for item in sorted(batch, key=lambda item: -_compile_cost(item.variant)):
                item.submitted = True
                planned += 1
                in_flight[compiler.submit(item.kernel.jit, item.request)] = item
            if not in_flight:
                break
            finished, _ = concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                item = in_flight.pop(future)
                try:
                    item.result = future.result()
                except BrokenProcessPool as error:  # a compiler process died (crash, out of memory)
                    if not item.retried:  # maybe a neighbour's compile took it down: once more, in a fresh pool
                        item.retried = True
                        in_flight[compiler.submit(item.kernel.jit, item.request)] = item
                        continue
                    item.result = {"shared": None, "error": f"compiler process failed: {error_line(error)}",
                                   "seconds": 0.0}
                else:
                    cache.put(item.request.key, {**item.result, "kernel": item.kernel.jit_name,
                                                 "config": item.variant.label(), "specialization": item.spec.name,
                                                 "arch": item.arch})
                item.how = MEASURED
                compiles += 1
                if progress is not None:
                    progress(Progress(compiles, planned, item, time.perf_counter() - started))
    finally:
        compiler.close()

    verdicts = {}
    for k, kernel in enumerate(kernels):
        for v in range(len(kernel.variants)):
            for spec in kernel.specializations:
                for gpu in gpu_list:
                    if gpu.capability is None:
                        verdict = Verdict(NOT_CHECKED, error="AMD GPUs are not compiled for here")
                    else:
                        verdict = _verdict(items[(k, v, spec.name, gpu.capability)], gpu.max_shared)
                    verdicts[(k, v, spec.name, gpu.name)] = verdict
    return Report(list(kernels), list(gpu_list), verdicts, compiles, cache_hits, time.perf_counter() - started, exact)


def _verdict(item: Item, limit: int) -> Verdict:
    if item.problem is not None:
        return Verdict(ERROR, error=item.problem)
    if item.result is not None:
        shared = item.result["shared"]
        if shared is None:
            return Verdict(ERROR, item.how, error=item.result["error"])
        return Verdict(FITS if shared <= limit else OVERFLOWS, item.how, shared)
    assert item.interval is not None, "an item without a result was decided by the estimate"
    decided = item.interval.decides(limit)
    assert decided is not None
    return Verdict(decided, ESTIMATED, low=item.interval.low, high=item.interval.high)


# ---------------------------------------------------------------------------------------------
# Output


def _cell(verdict: Verdict) -> str:
    if verdict.verdict == NOT_CHECKED:
        return "not checked (AMD)"
    if verdict.verdict == ERROR:
        return "error"
    word = "fits" if verdict.verdict == FITS else "OVER"
    if verdict.how == ESTIMATED:
        bound = f"<={verdict.high}" if verdict.verdict == FITS else f">={verdict.low}"
        return f"~{bound} {word}"
    return f"{verdict.shared} {word}"


_SEVERITY = {ERROR: 3, OVERFLOWS: 2, FITS: 1, NOT_CHECKED: 0}


def _row_cell(report: Report, k: int, v: int, gpu: gpus.Gpu) -> str:
    """The worst verdict over the specializations, naming the specialization when they disagree."""
    kernel = report.kernels[k]
    verdicts = [(spec.name, report.verdict(k, v, spec.name, gpu.name)) for spec in kernel.specializations]
    worst_name, worst = max(verdicts, key=lambda pair: (_SEVERITY[pair[1].verdict], pair[1].shared or 0))
    if len({verdict.verdict for _, verdict in verdicts}) > 1:
        return f"{_cell(worst)} [{worst_name}]"
    return _cell(worst)


def format_table(report: Report) -> str:
    header = ["kernel", "config"] + [f"{gpu.name} ({gpu.max_shared})" for gpu in report.gpus]
    rows = [[kernel.name.rsplit(":", 1)[-1], variant.label()]
            + [_row_cell(report, k, v, gpu) for gpu in report.gpus]
            for k, kernel in enumerate(report.kernels) for v, variant in enumerate(kernel.variants)]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def format_summary(report: Report) -> str:
    lines = []
    for k, kernel in enumerate(report.kernels):
        specs = ", ".join(spec.name + (f" ({', '.join(spec.ones)} = 1)" if len(spec.ones) > 1 else "")
                          for spec in kernel.specializations)
        unit = f"; always 1: {', '.join(kernel.unit_args)}" if kernel.unit_args else ""
        lines.append(f"{kernel.name}: {len(kernel.variants)} configs, specializations {specs}{unit}")
    lines.append("")
    for gpu in report.gpus:
        if gpu.capability is None:
            lines.append(f"{gpu.name} ({gpu.arch}): not checked (AMD GPUs cannot be compiled for here)")
            continue
        parts = []
        for k, kernel in enumerate(report.kernels):
            fit = sum(report.fits_everywhere(k, v, gpu.name) for v in range(len(kernel.variants)))
            parts.append(f"{kernel.name.rsplit(':', 1)[-1]} {fit}/{len(kernel.variants)}")
        lines.append(f"{gpu.name} ({gpu.arch}, {gpu.max_shared} B): configs that fit: {', '.join(parts)}")
        for k, kernel in enumerate(report.kernels):
            missing = report.without_fit(k, gpu.name)
            if missing:
                lines.append(f"  NO FITTING CONFIG: {kernel.name} when launched {' / '.join(missing)}: "
                             f"OutOfResources on {gpu.name}")
    errors: dict[str, list[str]] = {}
    for (k, v, spec, gpu), verdict in report.verdicts.items():
        if verdict.verdict == ERROR:
            where = f"{report.kernels[k].name.rsplit(':', 1)[-1]} {report.kernels[k].variants[v].label()} [{spec}] on {gpu}"
            errors.setdefault(verdict.error or "unknown error", []).append(where)
    if errors:
        lines.append("")
        lines.append("errors (a wrong argument type guess? see --sig, --dtype, --const):")
        for message, places in list(errors.items())[:MAX_ERRORS_SHOWN]:
            more = f" and {len(places) - 1} more" if len(places) > 1 else ""
            lines.append(f"  {places[0]}{more}: {message}")
    counts = report.counts()
    lines.append("")
    lines.append(f"verdicts: {counts[MEASURED]} measured by compiling now, {counts[CACHED]} measured earlier (cache), "
                 f"{counts[ESTIMATED]} estimated (~, calibrated bound at least {ESTIMATE_MARGIN:.0%} from the limit); "
                 f"{report.compiles} compiles in {report.seconds:.1f} s")
    lines.append("cells: required bytes and verdict in the worst specialization ([name] when they differ); "
                 "--json has every one")
    return "\n".join(lines)
