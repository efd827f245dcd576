"""The candidate ladder compiles only what may fit: measured bytes steer it, decisions stay measured."""

import pytest
import torch
from triton.runtime.errors import OutOfResources

from smemguard.testing import fake_gpu

from conftest import records
from kernels import autotuned, config, matmul_args, matmul_kernel, tiled_grid


def operands(n=256):
    return tuple(torch.randn(n, n, dtype=torch.float16) for _ in range(3))


def test_fewer_stages_go_straight_to_the_count_the_measured_bytes_predict(install_guard, incident_log, triton_cache):
    """sm_90 keeps every stage in shared memory (32768 B a stage for 128x128x64 fp16): from 5 stages
    the second compile is already the one stage that fits, not 3, 2 and 1 in turn."""
    a, b, c = operands()
    install_guard()
    with fake_gpu(90, max_shared=40000, cache_dir=triton_cache) as gpu:
        matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5)
    (record,) = records(incident_log)
    assert record["action"] == "stages_reduced" and gpu.launches[-1].num_stages == 1
    assert [attempt.get("changes") for attempt in record["attempts"][1:]] == ["num_stages=4", "num_stages=1"]
    assert record["compiles"] == 2 and record["compile_ms"] > 0


def test_stages_that_do_not_lower_the_bytes_stop_the_ladder(install_guard, incident_log, triton_cache):
    """sm_89 keeps one stage in registers: 128x128x64 needs 32768 B at 2 stages and at 1."""
    a, b, c = operands()
    install_guard()
    with fake_gpu("L4", max_shared=20000, cache_dir=triton_cache), pytest.raises(OutOfResources):
        matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=2)
    (record,) = records(incident_log)
    assert record["action"] == "reraised" and record["compiles"] == 1
    assert "fewer stages did not lower the shared memory (32768 B at 2 stages, 32768 B at 1)" in record["reason"]


def test_configs_at_least_as_big_as_one_measured_too_big_are_not_compiled(install_guard, incident_log, triton_cache):
    configs = [config(128, 128, 64, 3), config(256, 128, 64, 4), config(128, 256, 64, 3), config(64, 64, 64, 3)]
    tuned = autotuned(configs)
    a, b, c = operands()
    tuned.cache[(256, 256, 256, "torch.float16", "torch.float16", "torch.float16")] = configs[0]
    install_guard()
    with fake_gpu(90, max_shared=30000, cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(256, 256)](*matmul_args(a, b, c))
    (record,) = records(incident_log)
    assert record["action"] == "config_changed" and "BLOCK_M=64 BLOCK_N=64" in record["final"]
    assert gpu.launches[-1].shared <= 30000
    skipped = [text.split(":")[0] for text in record["skipped"]]
    assert "BLOCK_M=256 BLOCK_N=128 BLOCK_K=64 num_warps=4 num_stages=4" in skipped
    assert "BLOCK_M=128 BLOCK_N=256 BLOCK_K=64 num_warps=4 num_stages=3" in skipped
    compiled = [attempt["changes"] for attempt in record["attempts"][1:]]
    assert not any("BLOCK_M=256" in text or "BLOCK_N=256" in text for text in compiled), compiled
