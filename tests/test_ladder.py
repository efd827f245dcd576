"""The candidate ladder compiles only what may fit: measured bytes steer it, decisions stay measured."""

import threading

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

from smemguard.testing import fake_gpu

from conftest import records
from kernels import autotuned, config, matmul_args, matmul_kernel, tiled_grid


def operands(n=256):
    return tuple(torch.randn(n, n, dtype=torch.float16) for _ in range(3))


def tuned_elsewhere(configs):
    """``matmul_kernel`` autotuned over ``configs``, its choice for the 256^3 fp16 key made where the
    first one fit (a bigger GPU's tuning); with the operands of that key."""
    tuned = autotuned(configs)
    tuned.cache[(256, 256, 256, "torch.float16", "torch.float16", "torch.float16")] = configs[0]
    return tuned, operands()


def test_fewer_stages_go_straight_to_the_count_the_measured_bytes_predict(install_guard, incident_log, triton_cache):
    """sm_86 (no calibrated estimate) keeps one stage in registers, 32768 B a stage for 128x128x64
    fp16: from 5 stages (131072 B) and 4 (98304 B) the line says 2, the largest count that fits
    40000 B, compiled next rather than 3 and then 2."""
    a, b, c = operands()
    install_guard()
    with fake_gpu(86, max_shared=40000, cache_dir=triton_cache) as gpu:
        matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5)
    (record,) = records(incident_log)
    assert record["action"] == "stages_reduced" and gpu.launches[-1].num_stages == 2
    assert [attempt.get("changes") for attempt in record["attempts"][1:]] == ["num_stages=4", "num_stages=2"]
    assert record["compiles"] == 2 and record["compile_ms"] > 0 and record["skipped"] == []


def test_a_measurement_the_calibrated_estimate_explains_gives_the_stage_count_at_once(install_guard, incident_log,
                                                                                      triton_cache):
    """sm_90 (calibrated) keeps every stage in shared memory: 163840 B at 5 stages is exactly 5 stages
    of 128x128x64 fp16 tiles, so the first compile is the one stage that fits 40000 B."""
    a, b, c = operands()
    install_guard()
    with fake_gpu(90, max_shared=40000, cache_dir=triton_cache) as gpu:
        matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5)
    (record,) = records(incident_log)
    assert record["required"] == 163840 and gpu.launches[-1].num_stages == 1
    assert [attempt.get("changes") for attempt in record["attempts"][1:]] == ["num_stages=1"]
    assert record["compiles"] == 1


def test_stages_whose_tiles_alone_overflow_by_the_estimate_are_not_compiled(install_guard, incident_log, triton_cache):
    """One stage of 256x128x128 fp16 tiles is 98304 B, over a T4's 65536 B by more than the margin:
    no stage count can fit, and none is compiled; the decision is still a measured one."""
    configs = [config(256, 128, 128, 4, num_warps=8), config(64, 64, 64, 3), config(128, 128, 64, 2)]
    tuned, (a, b, c) = tuned_elsewhere(configs)
    install_guard()
    with fake_gpu(90, max_shared=65536, cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(256, 256)](*matmul_args(a, b, c))
    (record,) = records(incident_log)
    assert record["action"] == "config_changed" and gpu.launches[-1].shared <= 65536
    assert record["skipped"][0] == "num_stages=1 to 3: at least 98304 B, one stage of its tiles (calibrated estimate)"
    compiled = [attempt["changes"] for attempt in record["attempts"][1:]]
    assert not any("num_stages" in text and "BLOCK" not in text for text in compiled), compiled
    assert all(attempt["fits"] for attempt in record["attempts"][1:]) and record["compiles"] <= 3, record


def test_before_sm_80_no_stage_count_is_compiled(install_guard, incident_log, triton_cache):
    """sm_75 runs no software pipeliner: 128x128x128 fp16 needs 65536 B at any stage count, so neither
    fewer stages nor the other configs' fewer-stage variants are compiled; only the other configs."""
    configs = [config(128, 128, 128, 3), config(128, 64, 64, 3), config(64, 64, 64, 2)]
    tuned, (a, b, c) = tuned_elsewhere(configs)
    install_guard()
    with fake_gpu("T4", max_shared=40000, cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(256, 256)](*matmul_args(a, b, c))
    (record,) = records(incident_log)
    assert record["required"] == 65536 and record["action"] == "config_changed"
    assert record["skipped"][0] == "num_stages=1 to 2: Triton pipelines nothing before sm_80, stages change no byte"
    compiled = [attempt["changes"] for attempt in record["attempts"][1:]]
    assert len(compiled) == record["compiles"] == 2 and all("BLOCK" in text for text in compiled), compiled
    assert gpu.launches[-1].num_stages in (2, 3) and gpu.launches[-1].shared <= 40000


def test_no_estimate_for_a_kernel_whose_bytes_it_does_not_explain(install_guard, incident_log, triton_cache):
    """The same tiles on sm_86, outside the calibrated archs: every stage count is compiled and measured."""
    a, b, c = operands()
    install_guard()
    with fake_gpu(86, max_shared=20000, cache_dir=triton_cache), pytest.raises(OutOfResources):
        matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, num_stages=3,
                              num_warps=8)
    (record,) = records(incident_log)
    assert record["skipped"] == [] and record["compiles"] >= 1


def test_candidate_configs_compile_concurrently_and_decide_as_one_at_a_time(install_guard, incident_log,
                                                                            triton_cache):
    """Triton 3.5 and later compile the configs of one batch in worker threads; the decision is the
    one the same candidates give compiled in turn (Triton 3.4, below)."""
    from triton import knobs

    pytest.importorskip("triton.runtime._async_compile", reason="Triton 3.4 has no AsyncCompileMode: compiles in turn")

    compiled_in = []
    listener = knobs.compilation.listener
    knobs.compilation.listener = lambda **_: compiled_in.append(threading.current_thread().name)
    configs = [config(256, 128, 128, 4, num_warps=8), config(64, 64, 64, 3), config(128, 64, 64, 2),
               config(64, 128, 32, 3)]
    tuned, (a, b, c) = tuned_elsewhere(configs)
    install_guard()
    try:
        with fake_gpu(90, max_shared=65536, cache_dir=triton_cache):
            tuned[tiled_grid(256, 256)](*matmul_args(a, b, c))
    finally:
        knobs.compilation.listener = listener
    (record,) = records(incident_log)
    assert record["compiles"] == 3 and all(attempt["fits"] for attempt in record["attempts"][1:]), record
    # the failing compile ran in the launching thread, the three candidates in smemguard's workers (one of them
    # again in this thread if CPython 3.11's ast.parse race broke its worker: the next test)
    assert compiled_in[0] == threading.current_thread().name
    assert len(compiled_in) == 4 and sum(name.startswith("smemguard-compile") for name in compiled_in[1:]) >= 2
    assert record["compile_ms"] <= sum(attempt["compile_ms"] for attempt in record["attempts"][1:])


def test_a_candidate_whose_worker_thread_failed_is_compiled_again_in_turn(install_guard, incident_log, triton_cache,
                                                                         monkeypatch):
    """CPython 3.11's ``ast.parse`` can raise ``SystemError: AST constructor recursion depth mismatch`` while
    another thread parses (cpython gh-106905; seen here under load): Triton parses the kernel's called
    functions in each compile thread. The thread failed, not the candidate: it is compiled again in turn."""
    import ast

    pytest.importorskip("triton.runtime._async_compile", reason="Triton 3.4 has no AsyncCompileMode: compiles in turn")
    parse, failed = ast.parse, []

    def racing_parse(*args, **kwargs):
        if threading.current_thread().name.startswith("smemguard-compile") and not failed:
            failed.append(threading.current_thread().name)
            raise SystemError("AST constructor recursion depth mismatch (before=84, after=123)")
        return parse(*args, **kwargs)

    monkeypatch.setattr(ast, "parse", racing_parse)
    configs = [config(256, 128, 128, 4, num_warps=8), config(64, 64, 64, 3), config(128, 64, 64, 2),
               config(64, 128, 32, 3)]
    tuned, (a, b, c) = tuned_elsewhere(configs)
    install_guard()
    with fake_gpu(90, max_shared=65536, cache_dir=f"{triton_cache}-parse-race"):
        tuned[tiled_grid(256, 256)](*matmul_args(a, b, c))
    (record,) = records(incident_log)
    assert failed, "one compile thread met the interpreter's error"
    assert record["compiles"] == 3 and all(attempt["fits"] for attempt in record["attempts"][1:]), record


def test_stages_that_do_not_lower_the_bytes_stop_the_ladder(install_guard, incident_log, triton_cache):
    """sm_89 keeps one stage in registers: 128x128x64 needs 32768 B at 2 stages and at 1 (within the
    estimate's margin of 30000 B, so the one stage is compiled and measured)."""
    a, b, c = operands()
    install_guard()
    with fake_gpu("L4", max_shared=30000, cache_dir=triton_cache), pytest.raises(OutOfResources):
        matmul_kernel[(2, 2)](*matmul_args(a, b, c), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=2)
    (record,) = records(incident_log)
    assert record["action"] == "reraised" and record["compiles"] == 1
    assert "fewer stages did not lower the shared memory (32768 B at 2 stages, 32768 B at 1)" in record["reason"]


def test_configs_at_least_as_big_as_one_measured_too_big_are_not_compiled(install_guard, incident_log, triton_cache):
    configs = [config(128, 128, 64, 3), config(256, 128, 64, 4), config(128, 256, 64, 3), config(64, 64, 64, 3)]
    tuned, (a, b, c) = tuned_elsewhere(configs)
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


def test_the_candidate_vocabulary_on_plain_values():
    """The steps the launch ladder, the compile-time core and Inductor's recovery share (engine.candidates)."""
    from smemguard.engine import candidates

    assert list(candidates.fewer_warps(8)) == [4, 2, 1] and list(candidates.fewer_warps(1)) == []
    # 131072 B at 5 stages, 114688 B at 4 (16384 B a stage) over 101376 B: 4 - ceil(13312 / 16384) = 3
    assert candidates.next_stage_count((5, 131072), 4, 114688, 101376) == 3
    assert candidates.next_stage_count((5, 131072), 4, 131072, 101376) is None, "fewer stages saved nothing"
    assert candidates.next_stage_count((3, 90000), 2, 80000, 10000) == 1, "one stage is always tried"
    assert candidates.next_stage_count((2, 90000), 1, 80000, 10000) == 0, "nothing below one stage"
    config = triton.Config({"BLOCK": 64, "NUM_STAGES": 4}, num_stages=4, num_warps=8)
    changed = candidates.variant(config, {"NUM_STAGES": 2}, num_stages=2)
    assert (changed.kwargs, changed.num_stages, changed.num_warps) == ({"BLOCK": 64, "NUM_STAGES": 2}, 2, 8)
    assert (config.kwargs, config.num_stages) == ({"BLOCK": 64, "NUM_STAGES": 4}, 4), "the original untouched"
    assert candidates.variant(config, num_warps=4).kwargs is not config.kwargs
