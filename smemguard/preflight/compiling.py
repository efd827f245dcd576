"""Compiling one config: the request a launch in a specialization would compile (signature,
constants, divisibility), Triton's own compile-cache key for it, and the pool of compiler processes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import inspect
import io
import multiprocessing
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, fields
from typing import Any

from ..facts import gpus, process
from ..kernels import introspect
from .discovery import jit_from_locator
from .model import ELEMENT_BYTES, INT_TYPES, NONE, CheckedKernel, Specialization, Variant


@dataclass
class CompileRequest:
    signature: dict[str, str]
    constants: dict[str, Any]
    divisible: tuple[str, ...]
    options: dict[str, Any]
    arch: int | str  # Triton's target arch: 89 (sm_89) or "gfx942"
    locator: tuple[str, str, str | None] | None
    key: str = ""

    @property
    def backend(self) -> str:
        return "cuda" if isinstance(self.arch, int) else "hip"


class PlanError(Exception):
    """This config cannot be compiled as asked (missing constexpr, failing heuristic)."""


#: Triton's element type names -> torch's.
_TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64", "i8": "int8",
                 "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8", "fp8e4nv": "float8_e4m3fn",
                 "fp8e5": "float8_e5m2"}


def torch_dtype(name: str):
    """torch's dtype for a Triton element type name ("fp16" -> torch.float16)."""
    import torch

    return getattr(torch, _TORCH_DTYPES.get(name, name))


class _StandInPointer:
    """What a ``triton.heuristics`` function sees for a tensor argument during a check."""

    def __init__(self, dtype: str, aligned: bool) -> None:
        self._dtype = dtype
        self._aligned = aligned

    @property
    def dtype(self):
        return torch_dtype(self._dtype)

    def element_size(self) -> int:
        return ELEMENT_BYTES.get(self._dtype, 4)

    def data_ptr(self) -> int:
        return 1 << 20 if self._aligned else (1 << 20) + 2


#: The size a heuristic sees for an integer argument (divisible by 16 or not, as the specialization).
HEURISTIC_SIZE = {True: 4096, False: 4095}


def _heuristic_values(kernel: CheckedKernel, values: dict, spec: Specialization, ones: set[str]) -> dict:
    named: dict[str, Any] = {}
    for name, ty in kernel.types.items():
        if ty.startswith("*"):
            named[name] = _StandInPointer(ty[1:], spec.aligned)
        elif ty in INT_TYPES:
            named[name] = 1 if name in ones else HEURISTIC_SIZE[spec.aligned]
        elif ty == NONE:
            named[name] = None
        else:
            named[name] = 1.0
    named.update(values)
    computed = {}
    for layer in kernel.heuristics:  # outermost first: Heuristics.run fills its values, then calls the inner layer
        for name, heuristic in layer.items():
            try:
                computed[name] = named[name] = heuristic(dict(named))
            except Exception as error:
                raise PlanError(f"heuristic for {name} failed on stand-in arguments ({type(error).__name__}: "
                                 f"{error}); give {name} with --const") from error
    return computed


def build_request(kernel: CheckedKernel, variant: Variant, spec: Specialization, arch: int | str) -> CompileRequest:
    """The signature, constants and divisibility a launch in ``spec`` would compile ``variant`` with.

    A config's keyword arguments that are no parameter of the kernel are compile options, as
    at a launch: on AMD ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack`` (the CUDA
    backend has none of them)."""
    values = {p.name: p.default for p in kernel.jit.params if p.is_constexpr and p.has_default}
    values.update(kernel.constants)
    values.update(variant.constexprs)
    options = variant.options()
    if not isinstance(arch, int):
        options.update((name, value) for name, value in variant.constexprs if name not in kernel.jit.arg_names)
    ones = set(kernel.unit_args) | set(spec.ones) | set(spec.guessed_ones)
    if kernel.heuristics:
        values.update(_heuristic_values(kernel, values, spec, ones))
    signature: dict[str, str] = {}
    constants: dict[str, Any] = {}
    divisible = []
    for param in kernel.jit.params:
        name = param.name
        if param.is_constexpr:
            if name not in values:
                raise PlanError(f"constexpr {name} has no value; give it with --const {name}=VALUE")
            signature[name], constants[name] = "constexpr", values[name]
            continue
        ty = kernel.types[name]
        if ty == NONE:  # as Triton specializes a None argument
            signature[name], constants[name] = "constexpr", None
            continue
        if name in ones and ty in INT_TYPES and not param.do_not_specialize:
            signature[name], constants[name] = "constexpr", 1
            continue
        signature[name] = ty
        specializable = ty.startswith("*") or (ty in INT_TYPES and not param.do_not_specialize)
        if spec.aligned and specializable and not param.do_not_specialize_on_alignment:
            divisible.append(name)
    return CompileRequest(signature, constants, tuple(divisible), options, arch, kernel.locator)


def hip_option_names() -> frozenset[str]:
    """What a config may name on AMD besides the kernel's parameters (``waves_per_eu``, ``kpack``, ...): the
    fields of Triton's ``HIPOptions``, which :func:`build_request` passes on as options, as a launch does."""
    from triton.backends.amd.compiler import HIPOptions

    return frozenset(field.name for field in fields(HIPOptions))


def _attrs(jit, request: CompileRequest) -> dict:
    """``ASTSource`` attributes, laid out as Triton's launcher lays them out (parameter-index paths;
    an empty list for an argument it could have marked): the same compile-cache entry as a launch.
    Before 3.7 constexprs carried no entry unless their value was a string. On AMD, with buffer
    ops (Triton's default from 3.5 on), the launcher also marks each tensor under 2 GB, which
    this check assumes every tensor is ("S": ``tt.pointer_range`` 32)."""
    from triton import knobs

    every_constexpr_listed = process.triton_release() >= (3, 7)
    in_2gb = "S" if request.backend == "hip" and knobs.amd.use_buffer_ops else ""
    backend = _backend(request.arch)
    attrs = {}
    for index, param in enumerate(jit.params):
        name, ty = param.name, request.signature[param.name]
        if ty == "constexpr":
            if every_constexpr_listed or isinstance(request.constants[name], str):
                attrs[(index,)] = []
        elif ty.startswith("*") or (ty in INT_TYPES and not param.do_not_specialize):
            marks = ("D" if name in request.divisible else "") + (in_2gb if ty.startswith("*") else "")
            attrs[(index,)] = backend.parse_attr(marks)
    return attrs


def _source(jit, request: CompileRequest):
    from triton.compiler.compiler import ASTSource

    return ASTSource(jit, dict(request.signature), dict(request.constants), _attrs(jit, request))


def gpu_target(arch: int | str):
    """Triton's ``GPUTarget`` for a target arch: ``("cuda", 89, 32)``, ``("hip", "gfx942", 64)``."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda" if isinstance(arch, int) else "hip", arch, gpus.warp_size(arch))


#: The oldest LLVM whose ld.lld links the code objects Triton 3.4 writes for AMD (LLVM 14's refuses them).
OLDEST_HIP_LLD = 16


def hip_compile_problem() -> str | None:
    """Why the installed Triton cannot compile for AMD GPUs on this machine, or None.

    Triton 3.5 and later link AMD code objects themselves; 3.4 runs an external ``ld.lld``
    (``TRITON_HIP_LLD_PATH``, ROCm's, or ``/usr/bin/ld.lld``), also to name the backend in its
    cache key."""
    from triton.backends.amd.compiler import HIPBackend

    find_linker = getattr(HIPBackend, "path_to_rocm_lld", None)
    if find_linker is None:
        return None
    advice = (f"Triton {process.triton_version()} links AMD code objects with an external ld.lld of LLVM "
              f"{OLDEST_HIP_LLD} or newer: install ROCm, or run 'apt-get install lld-19' and set "
              "TRITON_HIP_LLD_PATH=/usr/lib/llvm-19/bin/ld.lld (Triton 3.5 and later need none)")
    try:
        linker = find_linker()
        version = subprocess.run([str(linker), "--version"], capture_output=True, text=True, timeout=60).stdout
    except Exception as error:
        return f"{advice}; none was found ({introspect.error_summary(error)})"
    major = re.search(r"LLD (\d+)\.", version)
    if major is None or int(major.group(1)) < OLDEST_HIP_LLD:
        return f"{advice}; {linker} is {version.strip() or 'of an unknown version'}"
    return None


@functools.cache
def _backend(arch: int | str):
    from triton.compiler.compiler import make_backend

    return make_backend(gpu_target(arch))


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
    with process.quiet_warnings():
        options = backend.parse_options(dict(request.options))
    env = sorted(get_cache_invalidating_env_vars().items())
    triton_key = f"{_triton_key()}-{_source(jit, request).hash()}-{backend.hash()}-{options.hash()}-{env}"
    return hashlib.sha256(f"smemguard-preflight-1|{request.backend}:{request.arch}|{triton_key}".encode()).hexdigest()


def compile_request(jit, request: CompileRequest) -> dict:
    """Compile for the request's arch; the measured result (``shared`` or ``error``). Never raises
    for a config that does not compile: that is a verdict."""
    started = time.perf_counter()
    try:
        # A failing pass may print a reproducer on stdout; stdout may be --json.
        with process.quiet_warnings(), contextlib.redirect_stdout(io.StringIO()):
            shared = shared_memory(_source(jit, request), request.arch, request.options)
        return {"shared": shared, "error": None, "seconds": time.perf_counter() - started}
    except Exception as error:  # CompilationError, assertion in a pass: the config does not compile
        return {"shared": None, "error": introspect.error_summary(error), "seconds": time.perf_counter() - started}


def shared_memory(source, arch: int | str, options: dict) -> int:
    """The shared memory (LDS on AMD) Triton allocates for ``source``, from its own stages run as
    ``triton.compile`` runs them, up to the one that allocates it (LLVM IR), which sets the
    ``metadata.shared`` a launch checks. PTX, ptxas and the AMD code object are not made: they are
    about two thirds of a large config's compile and change no byte of it; a config only ptxas
    would reject is not seen. Writes nothing to Triton's cache."""
    from triton._C.libtriton import get_cache_invalidating_env_vars, ir

    backend, target = _backend(arch), gpu_target(arch)
    options = backend.parse_options(dict(options, **source.parse_options()))
    stages: dict = {}
    backend.add_stages(stages, options, source.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    lowering = (options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    if _make_ir_takes_target(type(source)):
        lowering = (target, *lowering)
    module = source.make_ir(*lowering)
    metadata = {"hash": "", "target": target, **options.__dict__, **get_cache_invalidating_env_vars()}
    for stage in list(stages.values())[list(stages).index(source.ext):]:
        module = stage(module, metadata)
        if "shared" in metadata:
            return int(metadata["shared"])
    raise RuntimeError(f"no stage of Triton {process.triton_version()} set metadata.shared")


@functools.cache
def _make_ir_takes_target(source_type) -> bool:
    """Triton 3.5 and later pass the target to ``make_ir`` first."""
    return "target" in inspect.signature(source_type.make_ir).parameters


class _Worker:
    """A compile worker's process (one the pool spawned): the kernels it imported, by locator, and how long an
    import may take."""

    def __init__(self) -> None:
        self.jits: dict = {}
        self.import_timeout: float | None = None


_worker = _Worker()


def _start_worker(import_timeout: float | None) -> None:
    _worker.import_timeout = import_timeout


def _compile_in_worker(request: CompileRequest) -> dict:
    if request.locator not in _worker.jits:
        with process.quiet_warnings():  # this process imports the target on smemguard's account
            _worker.jits[request.locator] = jit_from_locator(request.locator, _worker.import_timeout)
    return compile_request(_worker.jits[request.locator], request)


class Compiler:
    """Compiles in a pool of spawned processes (a fresh Triton each) when there are several jobs and
    the kernel can be imported there; here otherwise. Each process imports the kernels' modules again
    (their code runs there too), each import bounded by ``import_timeout`` seconds; one that fails
    there raises :class:`TargetError` from the future. The processes write on this process's stdout
    and stderr."""

    def __init__(self, jobs: int, import_timeout: float | None = None) -> None:
        self._jobs = jobs
        self._import_timeout = import_timeout
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def submit(self, jit, request: CompileRequest) -> concurrent.futures.Future:
        if self._jobs > 1 and request.locator is not None and _picklable(request):
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self._jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                    initargs=(self._import_timeout,))
            try:
                return self._pool.submit(_compile_in_worker, request)
            except BrokenProcessPool:
                self.close()
                self._pool = None
                return self.submit(jit, request)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(compile_request(jit, request))
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


#: Signals that end a check started from a shell or a CI runner (``kill``, a closed terminal, a job's timeout).
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def workers_end_with_this_process():
    """While the block runs (in the main thread), SIGTERM or SIGHUP to this process ends its compiler processes
    first, then this process as the signal would have: left alone, they compile on for minutes (about 280 MB each)
    and hold this process's stdout and stderr open, so that a caller reading them waits as long."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
        yield
        return

    def end(signum, frame):
        for worker in multiprocessing.active_children():
            worker.kill()  # a compile holds nothing another process needs
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    previous = {ending: signal.signal(ending, end) for ending in ENDING_SIGNALS}
    try:
        yield
    finally:
        for ending, handler in previous.items():
            signal.signal(ending, handler)


def _picklable(request: CompileRequest) -> bool:
    return all(isinstance(value, (int, float, str, bool, type(None))) for value in request.constants.values())
