"""Every path that writes an incident record names the launch behind it (or, where no launch caused it, what the
compile was given), and ``smemguard replay`` in a fresh process rebuilds it from the record alone: it reproduces the
failure (the same ``Required`` bytes) and what smemguard did about it. CPU harness (sm_89), the default install
(the compile-time core on) unless a path needs it off."""

import os
import subprocess
import sys

import pytest
import torch
import triton

import replayed
from conftest import ROOT, TESTS, records
from kernels import autotuned, config, matmul_args, matmul_kernel
from smemguard.testing import fake_gpu
from smemguard.patches.triton_seams import kernel_warmup

#: 128x128x64 fp16 tiles need 32768 B at one stage on sm_89: no stage count fits; 64x64x64 need 16384 B.
SMALL = 30000


def replay(log, *more) -> subprocess.CompletedProcess:
    """``smemguard replay`` of the last record of ``log`` in a fresh interpreter, the tests' kernels importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMEMGUARD")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT)])
    return subprocess.run([sys.executable, "-m", "smemguard.cli", "replay", str(log), *more], env=env,
                          capture_output=True, text=True, timeout=600)


def assert_replayed(log, record, *recovered: str):
    result = replay(log)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (f"reproduced: OutOfResources shared memory, required {record['required']} B, limit "
            f"{record['limit_hit']} B (same as recorded)") in result.stdout, result.stdout
    for line in recovered:
        assert line in result.stdout, result.stdout
    return result.stdout


def assert_names_its_launch(record, grid, shape):
    assert record["grid"] == grid and record["args"]["a_ptr"]["shape"] == shape, record
    assert {"config", "constexprs", "specialization", "num_warps", "num_stages"} <= set(record), record


def test_the_core_on_a_launch(install_guard, incident_log, triton_cache):
    install_guard(core=True)
    with fake_gpu("L4", cache_dir=triton_cache):
        matmul_kernel[(2, 2)](*matmul_args(*replayed.operands()), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5)
    [record] = records(incident_log)
    assert (record["phase"], record["action"], record["required"]) == ("compile", "stages_reduced", 131072)
    assert_names_its_launch(record, [2, 2], [256, 256])
    assert_replayed(incident_log, record, "num_stages=4: 98304 B, limit 101376 B: fits", "smemguard: stages_reduced")


def test_report_shows_the_shapes_of_a_compile_phase_incident(install_guard, incident_log, triton_cache, capsys):
    from smemguard.cli import commands

    install_guard(core=True)
    with fake_gpu("L4", cache_dir=triton_cache):
        matmul_kernel[(2, 2)](*matmul_args(*replayed.operands()), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5)
    assert commands.main(["report", str(incident_log)]) == 0
    out = capsys.readouterr().out
    assert ("smemguard.examples:matmul_kernel on cuda:89:\n"
            "    a_ptr[256, 256] b_ptr[256, 256] c_ptr[256, 256]  x1") in out


def test_the_core_inside_an_autotuners_benchmark(install_guard, incident_log, triton_cache):
    kernel = autotuned([config(128, 128, 64, 5), config(64, 64, 64, 2)])
    install_guard(core=True)
    with fake_gpu("L4", cache_dir=triton_cache):
        kernel[lambda meta: (triton.cdiv(256, meta["BLOCK_M"]), triton.cdiv(256, meta["BLOCK_N"]))](
            *matmul_args(*replayed.operands()))
    [record] = records(incident_log)
    assert (record["phase"], record["config"]) == ("autotune",
                                                   "BLOCK_M=128 BLOCK_N=128 BLOCK_K=64 num_warps=4 num_stages=5")
    assert_names_its_launch(record, [2, 2], [256, 256])
    assert record["autotune_key"] == [256, 256, 256, "torch.float16", "torch.float16", "torch.float16"]
    assert_replayed(incident_log, record, "smemguard: stages_reduced")


def test_the_launch_guard_with_the_core_off(install_guard, incident_log, triton_cache):
    install_guard()  # the core left off
    with fake_gpu("L4", max_shared=40000, cache_dir=triton_cache):
        matmul_kernel[(4, 4)](*matmul_args(*replayed.operands()), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4)
    [record] = records(incident_log)
    assert (record["phase"], record["launched_as"], record["action"]) == ("launch", "JITFunction", "stages_reduced")
    assert_replayed(incident_log, record, "smemguard: stages_reduced")


#: A warm-up's record names its launch through the warm-up seam, which reads Triton 3.6 and later.
needs_the_warmup_seam = pytest.mark.skipif(kernel_warmup.PATCH.supported.refusal() is not None,
                                           reason="kernel_warmup reads Triton 3.6 and later; this Triton's warm-up "
                                                  "records carry what the compile alone knows")


@needs_the_warmup_seam
def test_a_warm_up_with_tensors(install_guard, incident_log, triton_cache):
    install_guard(core=True)
    with fake_gpu("L4", cache_dir=triton_cache):
        matmul_kernel.warmup(*matmul_args(*replayed.operands()), grid=(2, 2), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                             num_stages=5)
    [record] = records(incident_log)
    assert record["phase"] == "warmup"
    assert_names_its_launch(record, [2, 2], [256, 256])
    assert_replayed(incident_log, record, "smemguard: stages_reduced")


@needs_the_warmup_seam
def test_a_compile_with_no_tensors_replays_from_its_signature(install_guard, incident_log, triton_cache):
    """A warm-up given dtypes in place of tensors (as vLLM's start-up does): the record keeps what the compile was
    given, and replay compiles the same variant, saying that no tensors were recorded."""
    install_guard(core=True)
    with fake_gpu("L4", cache_dir=triton_cache):
        matmul_kernel.warmup(torch.float16, torch.float16, torch.float16, 256, 256, 256, 256, 1, 256, 1, 256, 1,
                             grid=(2, 2), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5)
    [record] = records(incident_log)
    assert record["signature"]["a_ptr"] == "*fp16" and record["specialization"]["M"] == "div16"
    assert record["args"]["a_ptr"] == "torch.float16", "a placeholder is kept as text, never as a shape"
    out = assert_replayed(incident_log, record, "smemguard: stages_reduced")
    assert "no tensors were recorded" in out


def test_registered_alternatives(install_guard, incident_log, triton_cache):
    a, b, c = replayed.operands()
    install_guard(core=True)
    with fake_gpu("L4", max_shared=SMALL, cache_dir=triton_cache):
        replayed.with_alternatives[lambda meta: (triton.cdiv(256, meta["BLOCK_M"]), triton.cdiv(256, meta["BLOCK_N"]))](
            *matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=1)
    [record] = records(incident_log)
    assert (record["action"], record["kernel"]) == ("config_changed", "replayed:with_alternatives")
    assert_names_its_launch(record, [2, 2], [256, 256])
    assert_replayed(incident_log, record, f"the chosen config {record['final']} fits {SMALL} B: recovered as recorded")


def test_a_registered_fallback(install_guard, incident_log, triton_cache):
    install_guard(core=True)
    with fake_gpu("L4", max_shared=SMALL, cache_dir=triton_cache):
        replayed.with_fallback[(2, 2)](*matmul_args(*replayed.operands()), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                       num_stages=1)
    [record] = records(incident_log)
    assert (record["action"], record["final"]) == ("fallback", "fallback replayed:torch_matmul")
    assert_names_its_launch(record, [2, 2], [256, 256])
    assert_replayed(incident_log, record, "smemguard: fallback -> fallback replayed:torch_matmul")


def test_a_declared_wrappers_tiles(install_guard, incident_log, triton_cache):
    install_guard(core=True)
    with fake_gpu("L4", max_shared=SMALL, cache_dir=triton_cache):
        replayed.wrapped_matmul(*replayed.operands())
    [record] = records(incident_log)
    assert (record["action"], record["final"]) == ("tiles_reduced", "BLOCK_M=64")
    assert_names_its_launch(record, [2, 2], [256, 256])
    assert record["config"] == "BLOCK_M=128" and record["constexprs"]["BLOCK_N"] == 128, "the tile, and the launch"
    assert_replayed(incident_log, record, f"the chosen config BLOCK_M=64 fits {SMALL} B: recovered as recorded")


def test_a_config_switch_replays_through_the_config_the_tuner_chose(install_guard, incident_log, triton_cache):
    """A tuner's config tuned elsewhere that fits at no stage count here: the launch guard switches to the other
    config; replay compiles the config it switched to (was: the plain kernel alone, "not recovered", exit 1)."""
    big, small = config(128, 128, 64, 1), config(64, 64, 64, 1)
    kernel = autotuned([big, small])
    a, b, c = replayed.operands()
    kernel.cache[(256, 256, 256, "torch.float16", "torch.float16", "torch.float16")] = big  # tuned on a big GPU
    install_guard(core=True)
    with fake_gpu("L4", max_shared=SMALL, cache_dir=triton_cache):
        kernel[lambda meta: (triton.cdiv(256, meta["BLOCK_M"]), triton.cdiv(256, meta["BLOCK_N"]))](
            *matmul_args(a, b, c))
    [record] = records(incident_log)
    assert (record["action"], record["launched_as"]) == ("config_changed", "Autotuner")
    assert_replayed(incident_log, record, f"the chosen config {record['final']} fits {SMALL} B: recovered as recorded")


@pytest.mark.parametrize("launched_as, why", [("CachingAutotuner", "a torch.compile kernel"),
                                              ("torch.compile", "FlexAttention's tiles were chosen before")])
def test_a_record_of_a_source_with_no_launch_says_why_in_one_line(tmp_path, launched_as, why):
    import json

    record = {"schema": 1, "kernel": "m:k", "launched_as": launched_as, "phase": "compile", "action": "reraised",
              "resource": "shared memory", "required": 70000, "limit_hit": 65536, "num_warps": 4, "num_stages": 2,
              "constexprs": {}, "config": "num_warps=4 num_stages=2", "device": {"backend": "cuda", "arch": 75}}
    log = tmp_path / "incidents.jsonl"
    log.write_text(json.dumps(record) + "\n")
    result = replay(log)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"no 'args' field (an object {{...}}); {why}" in result.stderr, result.stderr


def test_a_torch_compile_kernel_replays_from_its_generated_source_while_inductors_cache_holds_it(
        install_guard, incident_log, monkeypatch, triton_cache):
    """Inductor's load recovery records the generated module (path and SHA-256) and what its compile was given;
    replay loads that module from Inductor's cache directory, checked unchanged, and compiles the same variant.
    (The stand-in kernel's module is tests/inductor_kernels.py: the cache directory is pointed at the tests.)"""
    pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    from inductor_kernels import inductor_gpu, template_matmul

    kernel = template_matmul("L4", num_stages=5)
    install_guard(disabled=("triton_compile",))
    with inductor_gpu(monkeypatch, "L4", cache_dir=triton_cache):
        kernel.precompile()
    [record] = records(incident_log)
    assert record["launched_as"] == "CachingAutotuner" and record["inductor"]["source_file"].endswith(
        "inductor_kernels.py")
    assert record["signature"]["arg_A"].startswith("*") and record["num_stages"] == 5
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(TESTS))
    assert_replayed(incident_log, record, "no tensors were recorded", "smemguard: stages_reduced")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(TESTS / "elsewhere"))
    result = replay(incident_log)
    assert result.returncode == 2 and "is not in Inductor's cache" in result.stderr, result.stderr
