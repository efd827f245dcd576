"""The GPUs people run (issue 47): each nameable everywhere a GPU is named, listed with its limits, and compiled for on
the CPU harness by this Triton, or refused in one line where this Triton cannot compile for it."""

import json

import pytest
import torch
import triton
import triton.language as tl

from smemguard.cli import commands
from smemguard.facts import gpus, process, settings
from smemguard.testing import fake_gpu

#: name: (arch, per-block limit, tensor-memory columns), as the issue names them (docs in smemguard/facts/gpus.py).
FIELD_GPUS = {
    "GB10": ("sm_121", 101376, None), "B300": ("sm_103", 232448, 512), "GB300": ("sm_103", 232448, 512),
    "RTX4080": ("sm_89", 101376, None), "RTX4090D": ("sm_89", 101376, None), "RTX5080": ("sm_120", 101376, None),
    "RTX5070": ("sm_120", 101376, None), "RTX5880Ada": ("sm_89", 101376, None),
    "JetsonThor": ("sm_110", 232448, 512), "Rubin": ("sm_107", 232448, 576),
    "RX9070": ("gfx1201", 65536, None), "R9700": ("gfx1201", 65536, None), "StrixHalo": ("gfx1151", 65536, None),
    "RX7700S": ("gfx1102", 65536, None), "MI100": ("gfx908", 65536, None),
}
#: How the field writes them: the issue's spelling, torch's device name, an alias.
SPELLINGS = {
    "GB10": ("DGX Spark", "NVIDIA GB10"), "B300": ("b300",), "GB300": ("NVIDIA GB300",),
    "RTX4080": ("RTX 4080", "NVIDIA GeForce RTX 4080", "4080"), "RTX4090D": ("NVIDIA GeForce RTX 4090 D", "4090D"),
    "RTX5080": ("NVIDIA GeForce RTX 5080",), "RTX5070": ("RTX 5070",),
    "RTX5880Ada": ("NVIDIA RTX 5880 Ada Generation",),
    "JetsonThor": ("Jetson Thor", "Thor"), "Rubin": ("rubin",), "RX9070": ("AMD Radeon RX 9070 XT", "RX 9070"),
    "R9700": ("AMD Radeon AI PRO R9700", "R9700"), "StrixHalo": ("Strix Halo", "Ryzen AI Max 395"),
    "RX7700S": ("Radeon RX 7700S",), "MI100": ("AMD Instinct MI100",),
}


@pytest.mark.parametrize("name", FIELD_GPUS)
def test_each_field_gpu_is_in_the_table_with_its_limits(name):
    gpu = gpus.lookup(name)
    assert gpu is not None and gpu.name == name
    assert (gpu.arch, gpu.max_shared, gpu.tensor_memory) == FIELD_GPUS[name]
    for spelling in SPELLINGS[name]:
        assert gpus.lookup(spelling) is gpu, spelling


@pytest.mark.parametrize("name", FIELD_GPUS)
def test_smemguard_max_shared_takes_each_by_name(name):
    loaded = settings.load({settings.MAX_SHARED: SPELLINGS[name][0]})
    assert loaded.problems == ()
    assert (loaded.max_shared, loaded.max_shared_label) == (FIELD_GPUS[name][1], name)
    assert loaded.emulated_gpu is gpus.lookup(name)


def test_shared_memory_per_sm_follows_the_cuda_guide():
    """1 KB of each SM's shared memory is the system's from cc 8.0 on (228 KB an SM, 227 a block on Blackwell)."""
    assert gpus.lookup("B300").shared_per_sm == 228 * 1024 and gpus.lookup("GB10").shared_per_sm == 100 * 1024
    assert gpus.lookup("T4").shared_per_sm == 64 * 1024 and gpus.lookup("MI100").shared_per_sm is None


def test_smemguard_gpus_lists_them_with_tensor_memory(capsys):
    assert commands.main(["gpus"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-3:] == ["tensor", "memory", "(columns)"]
    rows = {line.split()[0].rstrip("*"): line.split() for line in lines[1:] if not line.startswith("* ")}
    for name, (arch, limit, columns) in FIELD_GPUS.items():
        assert arch in rows[name] and str(limit) in rows[name], rows[name]
        assert rows[name][-1] == (str(columns) if columns else "-")
    assert commands.main(["gpus", "--json"]) == 0
    listed = {gpu["name"]: gpu for gpu in json.loads(capsys.readouterr().out)}
    assert listed["Rubin"]["tensor_memory"] == 576 and listed["B300"]["shared_per_sm"] == 233472
    assert listed["GB10"]["tensor_memory"] is None and listed["MI100"]["shared_per_sm"] is None


def test_a_triton_that_cannot_compile_for_an_arch_is_named_in_one_line():
    """Triton 3.4 to 3.7 abort the process in LLVM when compiling for arch 107 (measured): refused before."""
    problem = gpus.compile_problem("sm_107", "3.7.1")
    assert problem == ("Triton 3.7.1 cannot compile for sm_107 (its LLVM aborts the process); Triton 3.8 or newer "
                       "can") and "\n" not in problem
    assert gpus.compile_problem(107, "3.6.0") == gpus.compile_problem("sm_107", "3.6.0")
    assert gpus.compile_problem("sm_107", "3.8.0") is None and gpus.compile_problem("sm_103", "3.4.0") is None


@triton.jit
def _scaled(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)


#: One GPU per new arch.
NEW_ARCHS = ("B300", "Rubin", "JetsonThor", "GB10", "RX9070", "StrixHalo", "RX7700S", "MI100")


@pytest.mark.parametrize("name", NEW_ARCHS)
def test_this_triton_compiles_for_each_new_arch_or_says_why_not(name, triton_cache):
    gpu = gpus.lookup(name)
    problem = gpus.compile_problem(gpu.arch, process.triton_version())
    if gpu.backend == "hip":
        from smemguard.preflight.compiling import hip_compile_problem

        problem = problem or hip_compile_problem()
    x = torch.zeros(1000)
    if problem is not None:
        with pytest.raises(RuntimeError, match=problem.split(" (")[0]):
            with fake_gpu(name, cache_dir=triton_cache):
                pass
        return
    with fake_gpu(name, cache_dir=triton_cache) as device:
        _scaled[(4,)](x, x, 1000, BLOCK=256)
    assert [launch.kernel for launch in device.launches] == ["_scaled"]


def test_check_names_a_gpu_this_triton_cannot_compile_for_and_checks_the_rest(monkeypatch, capsys):
    """As ``smemguard check`` runs with a Triton that cannot compile for sm_103 (stands for Rubin on 3.4 to 3.7)."""
    monkeypatch.setitem(gpus.OLDEST_TRITON, "sm_103", (99, 0))
    status = commands.main(["check", "smemguard.examples:matmul_kernel", "--gpu", "B300,L4", "--meta",
                            "BLOCK_M=32,BLOCK_N=32,BLOCK_K=32,num_stages=2", "--no-cache", "--quiet", "--jobs", "1"])
    out = capsys.readouterr().out
    problem = gpus.compile_problem("sm_103", process.triton_version())
    assert f"B300 (sm_103): not checked: {problem}" in out
    assert "L4 (sm_89, 101376 B): configs that fit: matmul_kernel 1/1" in out and status == 0
