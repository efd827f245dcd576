"""A choice an autotuner times and may discard is not a failed request: a config (or Inductor max-autotune choice)
that fits at no stage count is recorded once per kernel and shape class as ``autotune_skipped`` (``phase:
autotune``), never as ``reraised``, the series an operator is paged on (docs/METRICS.md); a fewer-stage recompile
while timing is recorded once per kernel and shape class too. A launch whose caller gets the error is still
``reraised``. CPU harness, real compiles."""

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

from conftest import records
from kernels import autotuned, config, matmul_args, matmul_kernel
from smemguard.cli import commands
from smemguard.testing import fake_gpu

#: 128x128x64 fp16 tiles need 32768 B at one stage on sm_89; 64x64x64 need 16384 B.
SMALL = 30000
RERAISED_ALERT = 'smemguard_incidents_total{action="reraised"'


def operands(n=256):
    return [torch.empty(n, n, dtype=torch.float16) for _ in range(3)]


def grid(meta):
    return triton.cdiv(256, meta["BLOCK_M"]), triton.cdiv(256, meta["BLOCK_N"])


def exposition(incident_log, capsys) -> str:
    """The Prometheus series of the records, as ``smemguard report --format prometheus`` exports them."""
    pytest.importorskip("prometheus_client")
    assert commands.main(["report", str(incident_log), "--format", "prometheus"]) == 0
    return capsys.readouterr().out


def test_a_config_that_fits_nowhere_is_skipped_once_by_the_autotuner_not_reraised(install_guard, incident_log,
                                                                                 triton_cache, capsys):
    install_guard(core=True)
    kernel = autotuned([config(128, 128, 64, 1), config(64, 64, 64, 1)])
    with fake_gpu("L4", max_shared=SMALL, cache_dir=triton_cache) as gpu:
        for n in (256, 512):  # two shape classes: the second times the first one's compiled configs again
            a, b, c = operands(n)
            kernel[lambda meta, n=n: (triton.cdiv(n, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))](
                *matmul_args(a, b, c))
        assert gpu.launches[-1].shared == 16384, "the config that fits runs"
    found = records(incident_log)
    assert [(r["phase"], r["action"], r["autotune_key"][0]) for r in found] == [
        ("autotune", "autotune_skipped", 256)], "once, when it was compiled: never per config timed, never reraised"
    assert found[0]["config"] == "BLOCK_M=128 BLOCK_N=128 BLOCK_K=64 num_warps=4 num_stages=1"
    assert RERAISED_ALERT not in exposition(incident_log, capsys), "the alert's expression stays at 0"


def test_fewer_stage_recompiles_while_timing_are_recorded_once_per_shape_class(install_guard, incident_log,
                                                                               triton_cache):
    """Two configs of one shape class each fitted with fewer stages: one record, not one per config timed."""
    install_guard(core=True)
    kernel = autotuned([config(128, 128, 64, 5), config(128, 64, 64, 6), config(32, 32, 32, 2)])
    with fake_gpu("L4", cache_dir=triton_cache):
        kernel[grid](*matmul_args(*operands()))
    assert [(r["phase"], r["action"]) for r in records(incident_log)] == [("autotune", "stages_reduced")]


def test_a_launch_whose_caller_gets_the_error_is_still_reraised(install_guard, incident_log, triton_cache, capsys):
    install_guard(core=True)
    with fake_gpu("L4", max_shared=SMALL, cache_dir=triton_cache), pytest.raises(OutOfResources):
        matmul_kernel[(2, 2)](*matmul_args(*operands()), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=1)
    [record] = records(incident_log)
    assert (record["phase"], record["action"]) == ("launch", "reraised")
    assert RERAISED_ALERT in exposition(incident_log, capsys)


def test_max_autotune_choices_that_fit_nowhere_are_skipped_once_never_reraised(install_guard, incident_log,
                                                                               monkeypatch, triton_cache, tmp_path,
                                                                               capsys):
    """Inductor's max-autotune precompiles each template choice from a benchmark module
    (``TritonBenchmarkRequest.precompile``); a choice that loads at no stage count fails there and Inductor times
    the others. Two such choices of one shape class: one ``autotune_skipped`` record, no ``reraised``."""
    pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    from torch._inductor.autotune_process import TensorMeta, TritonBenchmarkRequest

    from inductor_kernels import inductor_gpu

    module = tmp_path / "choice.py"
    module.write_text("from inductor_kernels import template_matmul\n"
                      "triton_tem_fused_mm_0 = template_matmul('L4', num_stages=1)\n")
    meta = TensorMeta(device=torch.device("cpu"), dtype=torch.float16, sizes=(1024, 1024), strides=(1024, 1),
                      offset=0)
    install_guard(core=True)
    with inductor_gpu(monkeypatch, "L4", max_shared=SMALL, cache_dir=triton_cache):
        for choice in range(2):
            request = object.__new__(TritonBenchmarkRequest)
            request.__dict__.update(module_cache_key=f"choice{choice}", module_path=str(module),
                                    kernel_name="triton_tem_fused_mm_0", input_tensor_meta=[meta, meta],
                                    output_tensor_meta=meta, _benchmark_module=None)
            with pytest.raises(Exception, match="No valid triton configs|out of resource"):
                request.precompile()
    assert [(r["phase"], r["action"], r["launched_as"]) for r in records(incident_log)] == [
        ("autotune", "autotune_skipped", "CachingAutotuner")]
    assert RERAISED_ALERT not in exposition(incident_log, capsys)
