"""Run Triton's real launch path on a machine without a GPU, against any GPU's limit.

``fake_gpu("L4")`` installs a small stand-in for Triton's CUDA driver; ``fake_gpu("MI300X")``
one for its HIP driver. Everything above the driver is Triton's own: ``JITFunction.run``, the
binder and its specialization (the HIP backend's own, with its buffer-op ``pointer_range``
attribute), the compile for the chosen arch (sm_89 to PTX, gfx942 through the AMD LLVM backend to
its code object: both ship in the Triton wheel), the JIT cache, the autotuner, and
``CompiledKernel._init_handles``, which raises a genuine ``OutOfResources`` when the compiled
kernel's shared memory (LDS on AMD) exceeds the limit, or its warps times the wave size (64 on
CDNA, 32 on RDNA and NVIDIA) exceed the threads per block. Launches that pass the check are
recorded in :attr:`FakeGpu.launches` and execute nothing, so numerics need a real GPU. Nor is the
PTX assembled: ptxas is about half of a large kernel's compile (measured: docs/MEASURED.md,
smemguard/testing.py), and the shared memory a launch checks is allocated before it.
The stand-in's cubin is empty, and filed in Triton's cache under a key of its own: it never answers
a real compile that shares ``cache_dir``.

    from smemguard.testing import fake_gpu

    with fake_gpu("L4") as gpu:
        my_kernel[grid](x, y, n, BLOCK=256)   # raises OutOfResources if it would on an L4
        assert gpu.launches[-1].shared <= 101376

``fake_gpu("H100", torch_device=True)`` makes torch report the stand-in too (``torch.cuda.is_available()``,
``get_device_properties``, ``get_device_name``, ``get_device_capability``), and vLLM's own query of the per-block
limit, for code that sizes itself from them (SGLang's fused-MoE default, vLLM's prefill attention); with smemguard
installed under ``SMEMGUARD_MAX_SHARED=L4`` they then report the emulated L4, as on a real H100.

Checked against Triton 3.4 to 3.9. Triton 3.4 links AMD code objects with an external
``ld.lld`` of LLVM 16 or newer (ROCm's, or Debian's ``lld-19`` named by ``TRITON_HIP_LLD_PATH``);
3.5 and later link them themselves.
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from .facts import gpus


@dataclass(frozen=True)
class RecordedLaunch:
    kernel: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    shared: int


@dataclass
class FakeGpu:
    """The stand-in device: its target, its limits and what was launched on it."""

    arch: int | str  # Triton's target arch: 89, or "gfx942"
    max_shared: int
    name: str | None = None  # the table's name ("L4"); None for a bare arch
    multiprocessor_count: int = 132
    max_threads: int = 1024
    launches: list[RecordedLaunch] = field(default_factory=list)
    bench_ms: Callable[[], float] = lambda: 1.0

    @property
    def backend(self) -> str:
        return "cuda" if isinstance(self.arch, int) else "hip"

    @property
    def warp_size(self) -> int:
        return gpus.warp_size(self.arch)

    @property
    def capability(self) -> tuple[int, int]:
        """(8, 9) for sm_89; what torch reports on ROCm for a gfx arch: (9, 4) for gfx942."""
        arch = self.arch
        return divmod(arch, 10) if isinstance(arch, int) else (int(arch[3:-2]), int(arch[-2], 16))


#: The shared memory every CUDA block gets without opting in.
_STATIC_SHARED = 49152


@dataclass(frozen=True)
class TorchProperties:
    """What ``torch.cuda.get_device_properties`` reports for the stand-in (the attributes libraries read)."""

    name: str
    major: int
    minor: int
    multi_processor_count: int
    warp_size: int
    shared_memory_per_block: int
    shared_memory_per_block_optin: int
    shared_memory_per_multiprocessor: int
    max_threads_per_multi_processor: int = 2048
    regs_per_multiprocessor: int = 65536
    total_memory: int = 80 * 2**30
    is_integrated: int = 0
    gcnArchName: str = ""  # noqa: N815 (torch's name)

    @classmethod
    def of(cls, gpu: FakeGpu) -> "TorchProperties":
        known = gpus.lookup(gpu.name) if gpu.name else None
        name = known.device_name if known else f"smemguard stand-in {gpu.arch}"
        per_sm = (known.shared_per_sm if known else None) or gpu.max_shared
        hip = gpu.backend == "hip"
        return cls(name, *gpu.capability, gpu.multiprocessor_count, gpu.warp_size,
                   gpu.max_shared if hip else min(_STATIC_SHARED, gpu.max_shared), gpu.max_shared, per_sm,
                   gcnArchName=gpu.arch if hip else "")


class _Launcher:
    """Takes the arguments of Triton's generated launcher, records the launch, runs nothing."""

    def __init__(self, gpu: FakeGpu, metadata) -> None:
        self._gpu = gpu
        self._record = (metadata.name, metadata.num_warps, metadata.num_stages, metadata.shared)

    def __call__(self, grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook,
                 exit_hook, *args) -> None:
        name, num_warps, num_stages, shared = self._record
        self._gpu.launches.append(RecordedLaunch(name, (grid_x, grid_y, grid_z), num_warps, num_stages, shared))


class _Utils:

    def __init__(self, gpu: FakeGpu) -> None:
        self._gpu = gpu

    def get_device_properties(self, device) -> dict:
        gpu = self._gpu
        properties = {
            "max_shared_mem": gpu.max_shared,
            "multiprocessor_count": gpu.multiprocessor_count,
            "max_num_regs": 65536,
            "warpSize": gpu.warp_size,
            "sm_clock_rate": 1_980_000,
            "mem_clock_rate": 2_619_000,
            "mem_bus_width": 5120,
        }
        if gpu.backend == "hip":  # HIP's driver also reports the gfx arch with its target features
            properties["arch"] = f"{gpu.arch}:sramecc+:xnack-"
        return properties

    def load_binary(self, name, kernel, shared, device):
        return _FakeModule(), object(), 32, 0, self._gpu.max_threads

    def unload_module(self, module) -> None:
        pass


class _Driver:
    """Duck-types the parts of Triton's ``DriverBase`` that compile and launch use."""

    def __init__(self, gpu: FakeGpu) -> None:
        from triton.backends.compiler import GPUTarget

        self._gpu = gpu
        self._target = GPUTarget(gpu.backend, gpu.arch, gpu.warp_size)
        self.utils = _Utils(gpu)

    @staticmethod
    def is_active() -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        if self._gpu.backend == "hip":
            from triton.backends.amd.driver import ty_to_cpp
        else:
            from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)

    def get_current_target(self):
        return self._target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device) -> None:
        pass

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_device_capability(self, device=None) -> tuple[int, int]:
        return self._gpu.capability

    def get_benchmarker(self):
        gpu = self._gpu

        def bench(kernel_call, quantiles: Sequence[float] = (0.5, 0.2, 0.8), **kwargs):
            kernel_call()
            ms = gpu.bench_ms()
            return [ms] * len(quantiles) if quantiles else ms

        return bench

    def launcher_cls(self, src, metadata) -> _Launcher:
        return _Launcher(self._gpu, metadata)

    # What ``triton.testing.do_bench`` uses: autotuners given ``warmup``/``rep`` (FlagGems' LibTuner) time with it.
    def get_device_interface(self) -> "_DeviceInterface":
        return _DeviceInterface(self._gpu)

    def get_empty_cache_for_benchmark(self) -> None:
        return None

    def clear_cache(self, cache) -> None:
        pass


class _Event:
    def __init__(self, gpu: FakeGpu) -> None:
        self._gpu = gpu

    def record(self) -> None:
        pass

    def elapsed_time(self, end: "_Event") -> float:
        return self._gpu.bench_ms()


class _DeviceInterface:
    """The ``torch.cuda`` calls ``do_bench`` makes: every timed interval lasts ``bench_ms()``."""

    def __init__(self, gpu: FakeGpu) -> None:
        self._gpu = gpu

    def synchronize(self) -> None:
        pass

    def Event(self, enable_timing: bool = True) -> _Event:  # noqa: N802 (torch.cuda's name)
        return _Event(self._gpu)


class _FakeModule:
    """What ``load_binary`` returns as the module; marks kernels loaded on the stand-in."""


def _forget_compiled_kernels() -> None:
    """Drop every JIT function's compiled kernels and unlink kernels loaded on the stand-in.

    Kernels compiled for another target must not be reused, and a kernel loaded by the fake
    driver must not ask the real one to unload it when it is garbage-collected later.
    """
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction

    for obj in gc.get_objects():
        kind = type(obj)
        if issubclass(kind, JITFunction):
            obj.device_caches.clear()
        elif issubclass(kind, CompiledKernel) and isinstance(obj.__dict__.get("module"), _FakeModule):
            obj.module = None


def _no_cubin(ptx: str, metadata: dict) -> bytes:
    return b""


#: What the backend's part of Triton's compile-cache key gains while the cubin is left empty.
STAND_IN_CACHE_MARK = "smemguard-fake-gpu-no-cubin"


@contextlib.contextmanager
def _ptx_not_assembled() -> Iterator[None]:
    """The CUDA backend's stages with an empty cubin in place of ptxas' (the stand-in loads nothing),
    cached apart from real compiles."""
    from triton.backends.nvidia.compiler import CUDABackend

    add_stages, backend_hash = CUDABackend.add_stages, CUDABackend.hash

    def add_stages_but_ptxas(self, stages, *args, **kwargs):
        add_stages(self, stages, *args, **kwargs)
        stages["cubin"] = _no_cubin

    CUDABackend.add_stages = add_stages_but_ptxas
    CUDABackend.hash = lambda self: f"{backend_hash(self)}-{STAND_IN_CACHE_MARK}"
    try:
        yield
    finally:
        CUDABackend.add_stages, CUDABackend.hash = add_stages, backend_hash


def _cleared_device_caches() -> None:
    """Forget what was cached of the device (it changes with each stand-in): smemguard's name of it, and vLLM's
    per-block limit where vLLM is imported."""
    import sys

    from .facts import process

    process.gpu_name.cache_clear()
    cached = getattr(sys.modules.get("vllm.utils.mem_utils"), "get_max_shared_memory_bytes", None)
    getattr(cached, "cache_clear", lambda: None)()


@contextlib.contextmanager
def _torch_reports(device: FakeGpu) -> Iterator[None]:
    """torch.cuda (and vLLM's C query, where vLLM is imported) reporting the stand-in: what lies under smemguard's
    layers on ``get_device_properties`` and ``get_max_shared_memory_bytes``, replaced, and put back after."""
    import importlib
    import sys

    import torch

    properties = TorchProperties.of(device)
    stand_ins = {(torch.cuda, "is_available"): lambda: True, (torch.cuda, "device_count"): lambda: 1,
                 (torch.cuda, "current_device"): lambda: 0, (torch.cuda, "_lazy_init"): lambda: None,
                 (torch.cuda, "_get_device_properties"): lambda index: properties,
                 (torch.cuda, "is_current_stream_capturing"): lambda: False}
    if "vllm" in sys.modules:
        with contextlib.suppress(ImportError):
            ops = importlib.import_module("vllm._custom_ops")
            stand_ins[ops, "get_max_shared_memory_per_block_device_attribute"] = lambda index: device.max_shared
    missing = object()
    saved = {(owner, name): vars(owner).get(name, missing) for owner, name in stand_ins}
    for (owner, name), value in stand_ins.items():
        setattr(owner, name, value)
    _cleared_device_caches()
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        _cleared_device_caches()


@contextlib.contextmanager
def fake_gpu(gpu: str | int = "L4", *, max_shared: int | None = None, cache_dir: str | None = None,
             max_threads: int = 1024, torch_device: bool = False) -> Iterator[FakeGpu]:
    """Make Triton compile for and "launch" on a stand-in GPU.

    ``gpu`` is a name from :mod:`smemguard.facts.gpus` (NVIDIA or AMD: "L4", "MI300X") or an
    integer NVIDIA arch (89). ``max_shared`` overrides the table's limit. ``cache_dir`` is
    Triton's cache (default: a fresh temp dir). ``torch_device``: torch (and vLLM's query of the
    limit) report the stand-in too (see the module's docstring).
    """
    from triton import knobs
    from triton.compiler import compiler
    from triton.runtime import driver

    if isinstance(gpu, int):
        arch, limit = gpu, max_shared
    else:
        known = gpus.lookup(gpu)
        if known is None:
            raise ValueError(f"fake_gpu needs a GPU name from smemguard.facts.gpus (see 'smemguard gpus') or an NVIDIA "
                             f"arch number, not {gpu!r}")
        arch, limit = known.target_arch, max_shared or known.max_shared
    if limit is None:
        raise ValueError("fake_gpu(arch) needs max_shared=")
    from .facts import process

    problem = gpus.compile_problem(arch, process.triton_version())
    if problem is not None:
        raise RuntimeError(f"fake_gpu({gpu!r}): {problem}")
    if isinstance(arch, str):
        from .preflight.compiling import hip_compile_problem

        problem = hip_compile_problem()
        if problem is not None:
            raise RuntimeError(f"fake_gpu({gpu!r}): {problem}")
    device = FakeGpu(arch=arch, max_shared=limit, name=None if isinstance(gpu, int) else known.name,
                     max_threads=max_threads)
    # The driver config is a plain object in every version; saving its fields restores
    # exactly what was there, without creating the real driver on a machine that has none.
    saved_driver = dict(vars(driver))
    with contextlib.ExitStack() as stack:
        if cache_dir is None:
            cache_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="smemguard-triton-"))
        stack.enter_context(knobs.cache.scope())
        knobs.cache.dir = cache_dir
        stack.enter_context(_ptx_not_assembled())
        if torch_device:
            stack.enter_context(_torch_reports(device))
        driver.set_active(_Driver(device))
        compiler.max_shared_mem.cache_clear()
        _forget_compiled_kernels()
        try:
            yield device
        finally:
            _forget_compiled_kernels()
            vars(driver).clear()
            vars(driver).update(saved_driver)
            compiler.max_shared_mem.cache_clear()


@contextlib.contextmanager
def load_check_failures() -> Iterator[list]:
    """Every ``OutOfResources`` Triton's load check (``CompiledKernel._init_handles``) raises inside the block,
    caught by someone or not, in a list: how a test or a benchmark counts the overflows smemguard let happen."""
    from triton.compiler import compiler
    from triton.runtime.errors import OutOfResources

    raised: list = []
    checked = compiler.CompiledKernel._init_handles

    def counting(self):
        try:
            return checked(self)
        except OutOfResources as error:
            raised.append(error)
            raise

    compiler.CompiledKernel._init_handles = counting
    try:
        yield raised
    finally:
        compiler.CompiledKernel._init_handles = checked
