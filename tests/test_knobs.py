"""Kernels that write their own pipeline depth (smemguard.kernels.parameters): a ``NUM_STAGES`` parameter given to
``tl.range(..., num_stages=)``, passed through a helper, also used in arithmetic, or a literal depth;
and tuners whose pruner pins a single config. Real compiles on the CPU harness (sm_90: every stage of
a 64x64x64 fp16 tile is 16384 B), plus one bitwise check on a real GPU."""

import json

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from smemguard.kernels import introspect, parameters
from smemguard.kernels.parameters import OTHER, PIPELINE_DEPTH, UNUSED, WARP_COUNT, knobs_of
from smemguard.testing import fake_gpu

from conftest import records, run_python
from kernels import (depth_also_in_arithmetic, depth_parameter_matmul, depth_passed_to_a_helper,
                     literal_stages_matmul, matmul_args, matmul_kernel, tiled_grid)

LIMIT = 50000  # 4 stages of 64x64x64 fp16 need 65536 B on sm_90, 3 stages 49152
TILE = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64)


def operands(n=128, device="cpu"):
    a = torch.randn(n, n, dtype=torch.float16, device=device)
    b = torch.randn(n, n, dtype=torch.float16, device=device)
    return a, b, torch.empty(n, n, dtype=torch.float16, device=device)


# -- The analysis ---------------------------------------------------------------------------------

@triton.jit
def _loop_with_positional_depth(x_ptr, n, DEPTH: tl.constexpr, WARPS: tl.constexpr):
    total = 0.0
    for i in tl.range(0, n, 1, DEPTH):
        total += tl.load(x_ptr + i)
    tl.store(x_ptr, total)


@triton.jit
def _takes_num_warps(x_ptr, n, DEPTH: tl.constexpr, num_warps: tl.constexpr):
    _loop_with_positional_depth(x_ptr, n, DEPTH, 0)


@triton.jit
def _warps_passed_on(x_ptr, n, DEPTH: tl.constexpr, WARPS: tl.constexpr, UNREAD: tl.constexpr):
    _takes_num_warps(x_ptr, n, DEPTH, num_warps=WARPS)


@triton.jit
def _depth_assigned_in_the_body(x_ptr, n, DEPTH: tl.constexpr):
    DEPTH = 2
    for i in tl.range(0, n, num_stages=DEPTH):
        tl.store(x_ptr + i, 0.0)


def test_each_parameter_gets_the_role_its_uses_give_it():
    assert knobs_of(depth_parameter_matmul).roles["NUM_STAGES"] == PIPELINE_DEPTH
    assert knobs_of(depth_passed_to_a_helper).roles["NUM_STAGES"] == PIPELINE_DEPTH, "through the helper's STAGES"
    assert knobs_of(depth_also_in_arithmetic).roles["NUM_STAGES"] == OTHER, "it divides the result"
    assert knobs_of(depth_parameter_matmul).roles["BLOCK_K"] == OTHER
    positional = knobs_of(_loop_with_positional_depth)
    assert positional.roles["DEPTH"] == PIPELINE_DEPTH and positional.roles["WARPS"] == UNUSED
    passed_on = knobs_of(_warps_passed_on)
    assert passed_on.roles["WARPS"] == WARP_COUNT and passed_on.roles["UNREAD"] == UNUSED
    assert passed_on.roles["DEPTH"] == PIPELINE_DEPTH
    assert knobs_of(_depth_assigned_in_the_body).roles["DEPTH"] == OTHER, "a reassigned parameter is no pure knob"


@triton.jit
def _one_dot_no_loop(a_ptr, b_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    input = tl.dot(tl.load(a_ptr + rm[:, None] * BK + rk[None, :]), tl.load(b_ptr + rk[:, None] * BN + rn[None, :]))
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], input.to(tl.float16))  # a local named like a builtin


def test_a_kernel_without_a_loop_keeps_its_bytes_at_any_stage_count(triton_cache):
    assert knobs_of(_one_dot_no_loop).stages_futile() == "the kernel has no loop to pipeline, so stages change no byte"
    a, c = torch.empty(128 * 64, dtype=torch.float16), torch.empty(128 * 128, dtype=torch.float16)
    with fake_gpu(90, max_shared=LIMIT, cache_dir=triton_cache):
        shared = {_one_dot_no_loop.warmup(a, a, c, 128, 128, 64, num_stages=stages, grid=(1,)).metadata.shared
                  for stages in (1, 4)}
    assert shared == {32768}


def test_loops_that_follow_the_option_or_a_depth_parameter_are_told_from_fixed_ones():
    assert knobs_of(matmul_kernel).following_loops == 1 and knobs_of(matmul_kernel).stages_futile() is None
    assert knobs_of(depth_passed_to_a_helper).stages_futile() is None
    literal = knobs_of(literal_stages_matmul)
    assert literal.complete and literal.following_loops == 0
    assert "_pipelined_tile line" in literal.fixed_text() and "num_stages=4" in literal.fixed_text()
    assert literal.stages_futile().startswith("every pipelined loop sets its own num_stages")
    arithmetic = knobs_of(depth_also_in_arithmetic)
    assert "num_stages=NUM_STAGES (a parameter with other uses, never changed)" in arithmetic.fixed_text()


@triton.jit
def _tile_of(x_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, stride_row: tl.constexpr):
    rows = tl.arange(0, ROWS)
    return tl.load(x_ptr + rows[:, None] * stride_row + tl.arange(0, COLS)[None, :])


@triton.jit
def _strides_as_constexprs(x_ptr, out_ptr, stride_x: tl.constexpr, stride_out: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SCALE: tl.constexpr):
    # LMDeploy's way: strides declared tl.constexpr beside the tiles; tiles sized in a helper and by an
    # accumulator's shape
    a = _tile_of(x_ptr, BLOCK_M, BLOCK_N // 2, stride_x)
    b = _tile_of(x_ptr, BLOCK_N // 2, BLOCK_D, stride_x)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32) + SCALE
    acc += tl.dot(a, b)
    tl.store(out_ptr + tl.arange(0, BLOCK_M)[:, None] * stride_out + tl.arange(0, BLOCK_D)[None, :], acc)


@triton.jit
def _block_pointer_tile(y_ptr, stride_y: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # read, never compiled here (Triton 3.9 removed block pointers)
    block = tl.make_block_ptr(y_ptr, (64, 64), (stride_y, 1), (0, 0), (BLOCK_N, BLOCK_D), (1, 0))
    tl.store(y_ptr, tl.sum(tl.load(block)))


def test_the_parameters_that_size_a_block_are_the_tiles_not_the_strides():
    assert knobs_of(_strides_as_constexprs).shapes == ("BLOCK_M", "BLOCK_N", "BLOCK_D")
    assert knobs_of(_tile_of).shapes == ("ROWS", "COLS")
    assert knobs_of(matmul_kernel).shapes == ("BLOCK_M", "BLOCK_N", "BLOCK_K")
    if hasattr(tl, "make_block_ptr"):
        assert knobs_of(_block_pointer_tile).shapes == ("BLOCK_N", "BLOCK_D")


def test_a_re_raise_names_the_tiles_a_wrapper_chose_not_its_constexpr_strides(install_guard, incident_log,
                                                                              triton_cache):
    x, out = torch.empty(64 * 64, dtype=torch.float16), torch.empty(64 * 64, dtype=torch.float32)
    install_guard()
    with fake_gpu(90, max_shared=1024, cache_dir=triton_cache), pytest.raises(OutOfResources) as raised:
        _strides_as_constexprs[(1,)](x, out, 64, 64, 64, 64, 64, 2)
    note = "\n".join(raised.value.__notes__)
    assert "never changed: BLOCK_M=64, BLOCK_N=64, BLOCK_D=64 were chosen by" in note, "the tiles, no stride, no SCALE"
    assert records(incident_log)[-1]["action"] == "reraised"


def test_only_parameters_that_follow_an_option_are_lowered_with_it():
    depth = knobs_of(depth_parameter_matmul)
    assert depth.lowered_with({"num_stages": 2}, {"NUM_STAGES": 4, "BLOCK_K": 64}) == {"NUM_STAGES": 2}
    assert depth.lowered_with({"num_stages": 5}, {"NUM_STAGES": 4}) == {}, "never raised"
    assert knobs_of(depth_also_in_arithmetic).lowered_with({"num_stages": 2}, {"NUM_STAGES": 4}) == {}
    with pytest.raises(parameters.OptionIsAParameter):  # the keyword would set the parameter too
        knobs_of(_warps_passed_on).lowered_with({"num_stages": 2, "DEPTH": 1}, {"DEPTH": 4})
    assert parameters.Knobs().lowered_with({"num_stages": 2}, {"NUM_STAGES": 4}) == {}, "unreadable: nothing changed"


# -- Recovery on the CPU harness ------------------------------------------------------------------

def pin_the_first(configs, named_args, **kwargs):
    """A library's pruner: one config from its own per-GPU file, tuned on a bigger GPU."""
    return [configs[0]]


def test_a_depth_parameter_under_a_pruner_that_pins_one_overflowing_config_keeps_its_tiles(
        install_guard, incident_log, triton_cache):
    configs = [triton.Config({**TILE, "NUM_STAGES": 4}, num_stages=4),
               triton.Config(dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, NUM_STAGES=2), num_stages=2)]
    tuned = triton.autotune(configs=configs, key=["M", "N", "K"],
                            prune_configs_by={"early_config_prune": pin_the_first})(depth_parameter_matmul)
    a, b, c = operands()
    install_guard()
    with fake_gpu(90, max_shared=LIMIT, cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(128, 128)](*matmul_args(a, b, c))
    (record,) = records(incident_log)
    assert record["action"] == "stages_reduced" and record["required"] == 65536
    assert record["final"] == "BLOCK_M=64 BLOCK_N=64 BLOCK_K=64 NUM_STAGES=3 num_warps=4 num_stages=3"
    assert any("pruner test_knobs:pin_the_first pins BLOCK_M=64" in text for text in record["skipped"])
    assert gpu.launches[-1].shared == 49152


def test_when_the_pinned_config_cannot_fit_the_re_raise_names_the_pinning(install_guard, incident_log, triton_cache):
    configs = [triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, NUM_STAGES=2), num_stages=2),
               triton.Config({**TILE, "NUM_STAGES": 4}, num_stages=4)]
    tuned = triton.autotune(configs=configs, key=["M", "N", "K"],
                            prune_configs_by={"early_config_prune": pin_the_first})(depth_parameter_matmul)
    a, b, c = operands()
    install_guard()
    with fake_gpu(90, max_shared=LIMIT, cache_dir=triton_cache), pytest.raises(OutOfResources):
        tuned[tiled_grid(128, 128)](*matmul_args(a, b, c))  # one stage of 128x128x128 needs 65536 B
    (record,) = records(incident_log)
    assert record["action"] == "reraised" and record["attempts"][1]["changes"] == "NUM_STAGES=1 num_stages=1"
    assert "the tuner's pruner test_knobs:pin_the_first pins BLOCK_M=128" in record["reason"]


pin_as_gemlite_does = lambda configs, named_args, **kwargs: pin_the_first(configs, named_args)  # noqa: E731


def test_a_pruner_written_as_a_lambda_is_named_by_its_line():
    """GemLite's pruners are lambdas: ``<lambda>`` alone would not say which one pins."""
    line = pin_as_gemlite_does.__code__.co_firstlineno
    assert introspect.callable_name(pin_as_gemlite_does) == f"test_knobs:<lambda> line {line}"
    assert introspect.callable_name(pin_the_first) == "test_knobs:pin_the_first"


def test_other_configs_are_tried_with_fewer_stages_through_their_depth_parameter(install_guard, incident_log,
                                                                                 triton_cache):
    """Rung 2: one stage of the tuned 128x128x128 tile needs 65536 B; the other config's fewer-stage
    variant fits because its NUM_STAGES goes down with num_stages (alone, it would keep 65536 B)."""
    configs = [triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, NUM_STAGES=2), num_stages=2),
               triton.Config({**TILE, "NUM_STAGES": 4}, num_stages=4)]
    tuned = triton.autotune(configs=configs, key=["M", "N", "K"])(depth_parameter_matmul)
    tuned.cache[(128, 128, 128, "torch.float16", "torch.float16", "torch.float16")] = configs[0]  # tuned elsewhere
    a, b, c = operands()
    install_guard()
    with fake_gpu(90, max_shared=LIMIT, cache_dir=triton_cache) as gpu:
        tuned[tiled_grid(128, 128)](*matmul_args(a, b, c))
    (record,) = records(incident_log)
    assert record["action"] == "config_changed"
    assert record["final"] == "BLOCK_M=64 BLOCK_N=64 BLOCK_K=64 NUM_STAGES=3 num_warps=4 num_stages=3"
    assert gpu.launches[-1].shared == 49152


def test_a_depth_passed_through_a_called_jit_function_is_lowered(install_guard, incident_log, triton_cache):
    a, b, c = operands()
    install_guard()
    with fake_gpu(90, max_shared=LIMIT, cache_dir=triton_cache) as gpu:
        kernel = depth_passed_to_a_helper[(2, 2)](*matmul_args(a, b, c), **TILE, NUM_STAGES=4, num_stages=4)
    assert kernel.metadata.shared == 49152 == gpu.launches[-1].shared
    (record,) = records(incident_log)
    assert record["action"] == "stages_reduced" and "NUM_STAGES=3" in record["final"]
    assert record["compiles"] == 1, "one compile: option and parameter lowered together"


def test_a_depth_parameter_also_used_in_arithmetic_is_never_changed(install_guard, incident_log, triton_cache):
    a, b, c = operands()
    install_guard()
    with fake_gpu(90, max_shared=LIMIT, cache_dir=triton_cache), pytest.raises(OutOfResources):
        depth_also_in_arithmetic[(2, 2)](*matmul_args(a, b, c), **TILE, NUM_STAGES=4, num_stages=4)
    (record,) = records(incident_log)
    assert record["action"] == "reraised" and record["compiles"] == 0, "no futile compile"
    assert "NUM_STAGES (a parameter with other uses, never changed)" in record["reason"]


def test_a_literal_stage_loop_costs_no_compile_and_the_record_says_why(install_guard, incident_log, triton_cache):
    a, b, c = operands()
    install_guard()
    with fake_gpu(90, max_shared=LIMIT, cache_dir=triton_cache), pytest.raises(OutOfResources) as caught:
        literal_stages_matmul[(2, 2)](*matmul_args(a, b, c), **TILE, num_stages=2)
    assert caught.value.required == 65536, "4 stages written in the source, whatever the option"
    (record,) = records(incident_log)
    assert record["action"] == "reraised" and record["compiles"] == 0
    assert record["skipped"][0].startswith("num_stages=1: every pipelined loop sets its own num_stages (")
    assert "_pipelined_tile line" in record["reason"] and "num_stages=4" in record["reason"]


WORKER = """
import json, pathlib, torch
import smemguard
from smemguard.engine import recovery
from smemguard.facts.settings import Settings
from smemguard.testing import fake_gpu
from kernels import depth_passed_to_a_helper, matmul_args

cache_dir, triton_cache, log = ARGS
handled = []
handle = recovery.handle
recovery.handle = lambda *a: handled.append(1) or handle(*a)
smemguard.install(Settings(cache_dir=pathlib.Path(cache_dir), log_path=pathlib.Path(log)))
a, b, c = (torch.empty(128, 128, dtype=torch.float16) for _ in range(3))
with fake_gpu(90, max_shared=50000, cache_dir=triton_cache) as gpu:
    depth_passed_to_a_helper[(2, 2)](*matmul_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, NUM_STAGES=4,
                                     num_stages=4)
print(json.dumps({"shared": gpu.launches[-1].shared, "handled": len(handled)}))
"""


def test_a_second_process_compiles_the_lowered_depth_directly(tmp_path, triton_cache):
    from smemguard.patches.triton_seams import jit_compile

    if not jit_compile.PATCH.supported.admits(triton.__version__):
        pytest.skip("Triton 3.4 compiles inline: remembered decisions apply at the first failing launch")
    for run in ("first", "second"):
        arguments = [str(tmp_path / "cache"), triton_cache, str(tmp_path / f"{run}.jsonl")]
        result = run_python(f"ARGS = {arguments!r}\n" + WORKER)
        outcome = json.loads(result.stdout.strip().splitlines()[-1])
        assert outcome["shared"] == 49152
    assert outcome["handled"] == 0 and not (tmp_path / "second.jsonl").exists(), "no incident in the second process"
    (record,) = records(tmp_path / "first.jsonl")
    assert record["action"] == "stages_reduced" and "NUM_STAGES=3" in record["final"]


# -- The offline check ----------------------------------------------------------------------------

def test_the_check_shares_one_compile_among_stage_variants_of_a_kernel_whose_loops_set_their_depth(tmp_path):
    """The launch option changes no byte of literal_stages_matmul on any arch: of its stage variants, the
    fewest and the most stages are compiled (they agree), and the one between takes their bytes."""
    from smemguard.facts import gpus
    from smemguard import preflight

    configs = [dict(TILE, num_warps=4, num_stages=stages) for stages in (1, 2, 3)]
    [kernel] = preflight.discover(["kernels:literal_stages_matmul"], overrides={"configs": configs})
    report = preflight.check([kernel], [gpus.lookup("H100")], jobs=1, cache=preflight.ResultCache(tmp_path / "cold"))
    assert report.compiles == 2 * len(kernel.specializations)
    assert {report.verdict(0, v, "aligned", "H100").verdict for v in range(3)} == {preflight.FITS}
    assert report.verdict(0, 1, "aligned", "H100").how == preflight.ESTIMATED, "taken from its stage variants"


# -- On a real GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_lowered_depth_parameter_gives_bitwise_the_same_output(install_guard, incident_log):
    n, tile = 2048, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)
    a, b, original = operands(n, "cuda")
    grid = (n // 128, n // 128)
    kernel = depth_parameter_matmul[grid](*matmul_args(a, b, original), **tile, NUM_STAGES=4, num_stages=4)
    limit = kernel.metadata.shared - 1  # the unguarded kernel overflows by one byte: a stage must go
    depth_parameter_matmul.device_caches.clear()
    install_guard(max_shared=limit, max_shared_label="one byte short")
    recovered = torch.full((n, n), float("nan"), device="cuda", dtype=torch.float16)
    replacement = depth_parameter_matmul[grid](*matmul_args(a, b, recovered), **tile, NUM_STAGES=4, num_stages=4)
    torch.cuda.synchronize()
    assert replacement.metadata.shared <= limit
    assert torch.equal(recovered, original)
    (record,) = records(incident_log)
    assert record["action"] == "stages_reduced" and "NUM_STAGES=3" in record["final"]
