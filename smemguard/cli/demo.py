"""``smemguard demo``: an autotuned matmul's cached winner overflows a stand-in GPU on this machine
(no GPU needed, :func:`smemguard.testing.fake_gpu`), first without smemguard, then recovered by it."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from .._version import __version__
from ..facts import files, gpus, process, untrusted


def _step(text: str) -> float:
    print(text, flush=True)
    return time.perf_counter()


def _done(started: float, result: str) -> None:
    print(f"   -> {result} ({time.perf_counter() - started:.1f} s)", flush=True)


def _appended_record(path: Path, offset: int) -> dict | None:
    """The first incident record written to ``path`` past ``offset`` bytes (the demo's own)."""
    try:
        with files.open_read(path) as log:
            log.seek(offset)
            first = log.readline(untrusted.MAX_LINE).decode("utf-8", "replace")
    except OSError:
        return None
    record, _ = untrusted.loads(first)
    return record if isinstance(record, dict) else None


@dataclasses.dataclass(frozen=True)
class DemoScenario:
    """How the demo makes an autotuned matmul's cached winner overflow one GPU."""

    tuned_on: gpus.Gpu  # where the autotuner timed the configs and chose the winner
    misaligned: bool  # tuned on misaligned views of the launch's shape (else on the same tensors)
    dtype: str  # of the matmul's tensors: "fp16", "fp32"
    configs: list  # [the winner, which overflows the GPU at the launch, a config that fits]


def demo_scenario(gpu: gpus.Gpu) -> DemoScenario:
    """The demo's configs for ``gpu`` (any GPU of :mod:`smemguard.facts.gpus`); the tests run each.

    From sm_80 on, Triton multi-buffers the operand tiles in shared memory through asynchronous
    copies, which need 16-byte-aligned pointers: tuned on misaligned views, the 5-stage winner
    fits (fp16 128x128x64: 81920 B on sm_89), and on aligned tensors of the same shape, the same
    autotune key, it overflows (131072 B > 101376; 128x256x64 for the 160+ KiB GPUs); 4 stages
    fit. The V100 and the T4 have no asynchronous copies: shared memory holds one tile of each
    operand whatever the alignment and the stage count, so the winner is one chosen on an A100, as
    a tuning result carried to another GPU (a tuning database, a config file) would be: fp32
    32x32x512, 131072 B, which fits the A100's 166912 B (fp32 keeps the tile, and the compile, small).

    On gfx90a and gfx942 Triton's stream pipeliner leaves the misaligned A tile out of LDS: the
    4-stage fp16 128x128x64 winner needs 65536 B on misaligned views and 98304 B aligned (S-1
    stages); 3 stages fit. gfx1100 (from Triton 3.6) and gfx950 (3.6; from 3.8 async copies straight
    into LDS) pipeline misaligned loads too, so there the winner is one tuned on an H100: fp16
    32x32x512 at 4 stages, 196608 B on sm_90 (of 232448), over the LDS of both (196608 B; 272304 B
    on gfx950 with Triton 3.9); 2 or 3 stages fit (measured: docs/MEASURED.md, smemguard/cli/demo.py).
    """
    import triton

    def config(block_m, block_n, block_k, stages):
        return triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k), num_stages=stages, num_warps=4)

    if gpu.backend == "hip":
        if gpu.arch in ("gfx90a", "gfx942"):
            return DemoScenario(gpu, True, "fp16", [config(128, 128, 64, 4), config(64, 64, 32, 2)])
        return DemoScenario(gpus.lookup("H100"), False, "fp16", [config(32, 32, 512, 4), config(64, 64, 32, 2)])
    if gpu.capability >= 80:
        block_n = 256 if gpu.max_shared > 160000 else 128
        return DemoScenario(gpu, True, "fp16", [config(128, block_n, 64, 5), config(64, block_n // 2, 32, 2)])
    return DemoScenario(gpus.lookup("A100"), False, "fp32", [config(32, 32, 512, 1), config(32, 32, 64, 1)])


def run(gpu_name: str, settings) -> int:
    """``smemguard demo --gpu GPU_NAME`` under ``settings``; returns the exit status."""
    gpu = gpus.lookup(gpu_name)
    problem = _why_no_demo(gpu_name, gpu)
    if problem is not None:
        print(f"smemguard demo: {problem}", file=sys.stderr)
        return 2
    import torch

    from ..examples import autotuned_matmul, tiled_grid

    scenario = demo_scenario(gpu)
    n, dtype = 512, {"fp16": torch.float16, "fp32": torch.float32}[scenario.dtype]
    storage = torch.empty(n * n + 8, dtype=dtype)
    aligned, misaligned = storage[: n * n].view(n, n), storage[1: n * n + 1].view(n, n)
    b, c = torch.empty(n, n, dtype=dtype), torch.empty(n, n, dtype=dtype)
    grid = tiled_grid(n, n)
    _print_header(gpu, settings)
    tuned = autotuned_matmul(scenario.configs)
    elsewhere = scenario.tuned_on != gpu
    _autotune_where_tuned(scenario, n, _launcher(tuned, grid, misaligned if scenario.misaligned else aligned, b, c),
                          elsewhere)
    return _overflow_then_recover(gpu, settings, _launcher(tuned, grid, aligned, b, c), elsewhere)


def _why_no_demo(gpu_name: str, gpu: gpus.Gpu | None) -> str | None:
    """Why the demo cannot stand in for ``gpu_name`` (``gpu`` as looked up) on this machine, or None."""
    if gpu is None:
        return f"{gpu_name!r} is not a GPU from 'smemguard gpus'; one of: {', '.join(gpus.names())}"
    problem = gpus.compile_problem(gpu.arch, process.triton_version())
    if problem is not None:
        return f"cannot compile for the {gpu.name} here: {problem}"
    if gpu.backend == "hip":
        from ..preflight.compiling import hip_compile_problem

        problem = hip_compile_problem()
        if problem is not None:
            return f"cannot compile for the {gpu.name} ({gpu.arch}) here: {problem}"
    return None


def _print_header(gpu: gpus.Gpu, settings) -> None:
    import triton

    from ..facts.settings import MAX_SHARED

    memory = "of shared memory per block" if gpu.backend == "cuda" else "of LDS (shared memory) per workgroup"
    print(f"smemguard {__version__} demo: Triton {triton.__version__} compiles for a stand-in {gpu.name} "
          f"({gpu.arch}, {gpu.max_shared} B {memory}); no kernel executes.")
    if settings.max_shared is not None:
        print(f"({MAX_SHARED} does not apply here: --gpu sets the limit.)")
    print()


def _launcher(tuned, grid, a, b, c) -> Callable[[], object]:
    """The matmul launch of ``a @ b`` into ``c``, made again under each stand-in GPU in turn."""
    from ..examples import matmul_args

    return lambda: tuned[grid](*matmul_args(a, b, c))


def _autotune_where_tuned(scenario: DemoScenario, n: int, launch: Callable[[], object], elsewhere: bool) -> None:
    """Step 1: the autotuner chooses the scenario's big config on the GPU it tunes on."""
    from ..testing import fake_gpu

    big = scenario.configs[0]
    views = "misaligned views" if scenario.misaligned else "16-byte-aligned tensors"
    with fake_gpu(scenario.tuned_on.name) as device:
        # The fastest-looking config is the big one, as it would be on the GPU it was tuned for.
        timings = itertools.chain([1.0, 2.0], itertools.repeat(1.0))
        device.bench_ms = lambda: next(timings)
        where = f" on a stand-in {scenario.tuned_on.name} (tuned elsewhere)" if elsewhere else ""
        started = _step(f"1. autotune a {n}x{n} {scenario.dtype} matmul over {len(scenario.configs)} configs on "
                        f"{views}{where}")
        launch()
        won = device.launches[-1]
        _done(started, f"winner {big.kwargs['BLOCK_M']}x{big.kwargs['BLOCK_N']}x{big.kwargs['BLOCK_K']}, "
                       f"{untrusted.counted(won.num_stages, 'stage')}, {won.shared} B")


def _overflow_then_recover(gpu: gpus.Gpu, settings, launch: Callable[[], object], elsewhere: bool) -> int:
    """Steps 2 to 4 on the stand-in ``gpu``: the winner overflows, then smemguard recovers it; prints
    the incident record and returns the exit status."""
    from triton.runtime.errors import OutOfResources

    import smemguard

    from ..testing import fake_gpu

    with fake_gpu(gpu.name) as device, tempfile.TemporaryDirectory(prefix="smemguard-demo-") as scratch:
        what = f"on the {gpu.name} (the autotuner keeps its choice)" if elsewhere else "with 16-byte-aligned tensors"
        started = _step(f"2. the same shape {what}, without smemguard")
        try:
            launch()
            _done(started, "it fit: nothing to show on this GPU (a bug in the demo's configs: please report it)")
            return 1
        except OutOfResources as error:
            _done(started, f"OutOfResources: {error.name}, Required: {error.required}, Hardware limit: {error.limit}")

        incidents = settings.log_path or Path(scratch) / "incidents.jsonl"
        offset = incidents.stat().st_size if incidents.exists() else 0
        if not _install_in_memory(settings, incidents):
            return 2
        try:
            _launch_guarded(settings, launch, device)
        finally:
            smemguard.uninstall()
        _print_record(_appended_record(incidents, offset), incidents, settings)  # before a temporary one is removed
    return 0


def _install_in_memory(settings, incidents: Path) -> bool:
    """Installs smemguard logging to ``incidents``; False (and why, on stderr) when it refuses."""
    import smemguard

    from ..facts.settings import SettingsError

    try:  # decisions stay in memory: the stand-in's must never reach the host's decision cache
        smemguard.install(dataclasses.replace(settings, max_shared=None, max_shared_label=None, cache_dir=None,
                                              log_path=incidents, problems=()))
    except SettingsError as error:  # strict mode, and smemguard cannot guard this Triton
        print(f"smemguard demo: {error}", file=sys.stderr)
        return False
    return True


def _launch_guarded(settings, launch: Callable[[], object], device) -> None:
    """Steps 3 and 4: the overflowing launch with smemguard installed, then once more."""
    from triton.runtime.errors import OutOfResources

    from ..facts.settings import MODE

    started = _step(f"3. the same launch with smemguard installed ({MODE}={settings.mode})")
    try:
        launch()
    except OutOfResources:
        _done(started, "OutOfResources again: " + ("smemguard is off, nothing installed" if not
              settings.enabled else "observe mode records the incident and changes nothing"))
    else:
        fixed = device.launches[-1]
        _done(started, f"ran with {untrusted.counted(fixed.num_stages, 'stage')}, {fixed.shared} B, "
                       f"grid {fixed.grid}")
        started = _step("4. again (remembered: no exception, no compile)")
        launch()
        _done(started, f"ran with {untrusted.counted(device.launches[-1].num_stages, 'stage')}")


def _print_record(record: dict | None, incidents: Path, settings) -> None:
    from ..facts.settings import MODE

    if record is None:
        print(f"\nno incident record ({MODE}=off)" if not settings.enabled else
              f"\nno incident record could be written to {incidents} (see the warning above)")
        return
    where = incidents if settings.log_path else (f"{incidents}, named above: a temporary file, removed as the demo "
                                                 "ends; set SMEMGUARD_LOG to keep it")
    print(f"\nincident record ({where}):")
    for field in ("kernel", "resource", "required", "limit_hit", "config", "action", "final", "recovery_ms"):
        print(f"  {field:12} {record.get(field)}")
    for number, attempt in enumerate(record.get("attempts") or []):
        print(f"  {'attempts' if number == 0 else '':12} {attempt.get('changes') or attempt['config']}: "
              f"{attempt['required']} B")
