"""smemguard check (the preflight) and smemguard.fits, on CPU against real Triton compiles."""

import csv
import json
import logging
import re
import textwrap
from pathlib import Path

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

import smemguard
from smemguard.cli import commands
from smemguard.facts import gpus
from smemguard import preflight
from smemguard.examples import attention_fwd_kernel, matmul_args, matmul_kernel, matmul_persistent_kernel, tiled_grid
from smemguard.testing import fake_gpu

from conftest import run_python
from kernels import autotuned, config

L4 = gpus.lookup("L4")
# The measurements of the Triton 3.6 sweep (DESIGN.md section 4: 743 compiles, sm_80/89/90) that the
# estimate was calibrated on; the sweep's timing columns are left out.
SWEEP = Path(__file__).parent / "data" / "triton36_smem_sweep.csv"

# fp16 matmul configs around the L4's 101376 B, aligned: two fit (one only because sm_89 buffers
# S-1 stages, where the textbook S·(BM·BK+BK·BN)·2 says 131072), two overflow.
AROUND_L4 = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
             dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
             dict(BLOCK_M=256, BLOCK_N=32, BLOCK_K=64, num_warps=8, num_stages=4),
             dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)]


def textbook(meta, element_bytes=2):
    return (meta["BLOCK_M"] * meta["BLOCK_K"] + meta["BLOCK_K"] * meta["BLOCK_N"]) * element_bytes * meta["num_stages"]


@pytest.fixture
def results(tmp_path) -> preflight.ResultCache:
    return preflight.ResultCache(tmp_path / "preflight")


def check_cli(argv, monkeypatch, cache):
    """``smemguard check ARGV`` through the CLI's own entry point; returns the exit status."""
    monkeypatch.setattr(preflight, "default_cache", lambda: cache)
    return commands.main(["check", *argv])


def launch_on_fake_l4(kernel, args, meta, triton_cache):
    """What a real launch on an L4 does: the shared bytes it ran with, or OutOfResources' required bytes."""
    with fake_gpu("L4", cache_dir=triton_cache) as gpu:
        try:
            kernel[(1,)](*args, **meta)
        except OutOfResources as error:
            return "overflows", error.required
        return "fits", gpu.launches[-1].shared


def matmul_operands(n, aligned, dtype=torch.float16, b_columns=None):
    """``n``-sized operands; misaligned ones start 2 bytes into their storage and have odd sizes."""
    size = n if aligned else n - 1
    offset = 0 if aligned else 1

    def tensor(rows, columns):
        storage = torch.empty(rows * columns + offset, dtype=dtype)
        return storage[offset:].view(rows, columns)

    columns = b_columns or size
    return tensor(size, size), tensor(size, columns), tensor(size, columns)


def launches_by_specialization(kernel):
    """Real launch arguments for each specialization the check compiles ``kernel`` in."""
    if kernel.jit is matmul_persistent_kernel:
        # vLLM's N == 1: a (K, 1) weight and an (M, 1) output in fp32, so every stride of B and C is 1.
        return {"aligned": matmul_args(*matmul_operands(256, True, torch.float32)),
                "misaligned": matmul_args(*matmul_operands(256, False, torch.float32)),
                "N=1": matmul_args(torch.empty(256, 256), torch.empty(256, 1), torch.empty(256, 1))}
    return {"aligned": matmul_args(*matmul_operands(256, True)),
            "misaligned": matmul_args(*matmul_operands(256, False))}


def test_check_reports_exactly_the_configs_a_launch_on_an_l4_rejects(results, triton_cache):
    kernels = (preflight.discover(["smemguard.examples:flaggems_matmul"], overrides={"configs": AROUND_L4})
               + preflight.discover(["smemguard.examples:matmul_persistent_kernel"], overrides={"configs": [
                   dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=4)]}))
    report = preflight.check(kernels, [L4], exact=True, jobs=1, cache=results)
    assert report.counts()[preflight.ESTIMATED] == 0

    checked = 0
    for k, kernel in enumerate(report.kernels):
        launches = launches_by_specialization(kernel)
        assert [spec.name for spec in kernel.specializations] == list(launches)
        for v, variant in enumerate(kernel.variants):
            meta = {**dict(variant.constexprs), **kernel.constants, "num_warps": variant.num_warps,
                    "num_stages": variant.num_stages}
            for spec_name, args in launches.items():
                verdict = report.verdict(k, v, spec_name, "L4")
                expected = launch_on_fake_l4(kernel.jit, args, meta, triton_cache)
                assert (verdict.verdict, verdict.shared) == expected, (kernel.name, variant.label(), spec_name)
                assert verdict.how == preflight.MEASURED
                checked += 1
    assert checked == 4 * 2 + 1 * 3
    over = [report.kernels[0].variants[v].label() for v in range(4)
            if report.verdict(0, v, "aligned", "L4").verdict == preflight.OVERFLOWS]
    assert over == ["BLOCK_M=256 BLOCK_N=32 BLOCK_K=64 num_warps=8 num_stages=4",
                    "BLOCK_M=64 BLOCK_N=128 BLOCK_K=128 num_warps=4 num_stages=4"]
    # The first config fits although the textbook formula says it cannot.
    assert report.verdict(0, 0, "aligned", "L4").shared == 98304 < L4.max_shared < textbook(AROUND_L4[0])
    assert report.exit_status == 0


def assert_estimates_agree(estimated: preflight.Report, exact: preflight.Report) -> None:
    """Every verdict of ``estimated`` is the compiled one of ``exact``, and every estimate holds the bytes."""
    for key, verdict in estimated.verdicts.items():
        assert verdict.verdict == exact.verdicts[key].verdict, key
        if verdict.how == preflight.ESTIMATED:
            assert verdict.shared is None and verdict.low <= exact.verdicts[key].shared <= verdict.high, key


def test_estimated_verdicts_agree_with_compiled_ones_and_say_so(results, tmp_path):
    clear = [dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2),
             dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3),
             dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4)]
    kernels = preflight.discover(["smemguard.examples:flaggems_matmul"], overrides={"configs": AROUND_L4 + clear})
    estimated = preflight.check(kernels, [L4], jobs=1, cache=preflight.ResultCache(tmp_path / "cold"))
    exact = preflight.check(kernels, [L4], exact=True, jobs=1, cache=results)
    hows = {verdict.how for verdict in estimated.verdicts.values()}
    assert hows == {preflight.MEASURED, preflight.ESTIMATED}
    assert estimated.compiles < exact.compiles == len(AROUND_L4 + clear) * 2
    assert_estimates_agree(estimated, exact)
    # Near the limit nothing is estimated: 128x128x64 with 4 stages needs 98304 of 101376 B.
    assert estimated.verdict(0, 0, "aligned", "L4").how == preflight.MEASURED
    table = preflight.format_table(estimated)
    assert "~<=" in table and "98304 fits" in table


@pytest.mark.parametrize("arch, spec, meta, measured", [
    (89, "aligned", (128, 128, 64, 4, 4), 98304),
    (80, "aligned", (256, 128, 32, 2, 8), 65536),  # an epilogue scratch of BM*BN*2 dominates
    (90, "aligned", (128, 128, 64, 4, 4), 131072),
    (89, "misaligned", (128, 128, 32, 4, 4), 32768),
    (90, "N=1", (128, 128, 64, 4, 4), 81920),
])
def test_estimate_interval_holds_the_measured_bytes(arch, spec, meta, measured):
    block_m, block_n, block_k, stages, warps = meta
    [kernel] = preflight.discover(["smemguard.examples:matmul_kernel"], overrides={
        "configs": [dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)],
        "ones": [["N"]]})
    specialization = next(s for s in kernel.specializations if s.name == spec)
    interval = preflight.estimate(preflight.build_request(kernel, kernel.variants[0], specialization, arch),
                                  specialization)
    assert interval.low <= measured <= interval.high


def test_estimate_interval_holds_every_config_of_the_triton_36_sweep():
    variants = {"fp16_aligned": ("fp16", "aligned"), "fp32_aligned": ("fp32", "aligned"),
                "fp16_unaligned": ("fp16", "misaligned"), "fp16_ptrunaligned": ("fp16", "misaligned"),
                "fp16_n1": ("fp16", "N=1")}
    kernels = {dtype: preflight.discover(["smemguard.examples:matmul_kernel"],
                                         overrides={"dtype": dtype, "ones": [["N"]],
                                                    "configs": [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)]})[0]
               for dtype in ("fp16", "fp32")}
    rows = list(csv.DictReader(SWEEP.open()))
    outside = []
    for row in rows:
        dtype, spec_name = variants[row["variant"]]
        kernel = kernels[dtype]
        spec = next(s for s in kernel.specializations if s.name == spec_name)
        variant = preflight.Variant((("BLOCK_M", int(row["BM"])), ("BLOCK_N", int(row["BN"])),
                                     ("BLOCK_K", int(row["BK"]))), int(row["num_warps"]), int(row["num_stages"]))
        interval = preflight.estimate(preflight.build_request(kernel, variant, spec, int(row["arch"])), spec)
        if not interval.holds(int(row["shared_bytes"])):
            outside.append(row)
    assert len(rows) == 743 and outside == []


def test_check_exits_1_when_a_kernel_has_no_fitting_config_and_writes_the_json_schema(
        monkeypatch, capsys, results):
    argv = ["smemguard.examples:attention_fwd", "--meta", "BLOCK_M=128,BLOCK_N=128,num_warps=8,num_stages=3",
            "--gpu", "L4,MI300X", "--json", "--quiet", "--jobs", "1"]
    assert check_cli(argv, monkeypatch, results) == 1
    document = json.loads(capsys.readouterr().out)

    assert document["schema"] == "smemguard.check/1" and document["exit_status"] == 1
    assert document["triton"] == triton.__version__ and isinstance(document["seconds"], float)
    assert document["gpus"] == [{"name": "L4", "arch": "sm_89", "limit": 101376, "checked": True},
                                {"name": "MI300X", "arch": "gfx942", "limit": 65536, "checked": True}]
    [kernel] = document["kernels"]
    assert kernel["kernel"] == "smemguard.examples:attention_fwd"
    assert kernel["jit"] == "smemguard.examples:attention_fwd_kernel"
    assert [spec["name"] for spec in kernel["specializations"]] == ["aligned", "misaligned"]
    assert kernel["unit_args"] == ["stride_qd", "stride_kd", "stride_vd", "stride_od"]
    [row] = kernel["configs"]
    assert row["constexprs"] == {"BLOCK_M": 128, "BLOCK_N": 128} and (row["num_warps"], row["num_stages"]) == (8, 3)
    aligned = row["gpus"]["L4"]["specializations"]["aligned"]
    assert aligned["verdict"] == "overflows" and aligned["how"] == "measured" and aligned["shared"] > 101376
    assert row["gpus"]["L4"]["fits"] is False and row["gpus"]["MI300X"]["fits"] is False
    on_amd = row["gpus"]["MI300X"]["specializations"]["aligned"]
    assert on_amd["verdict"] == "overflows" and on_amd["how"] == "measured" and on_amd["shared"] > 65536
    for gpu in ("L4", "MI300X"):
        assert document["summary"][gpu] == {"checked": True, "configs": 1, "fit": 0, "kernels_without_fit": [
            {"kernel": "smemguard.examples:attention_fwd", "specializations": ["aligned"]}]}
    assert document["verdicts"] == {"measured": 4, "cached": 0, "estimated": 0} and document["compiles"] == 4


def test_check_exits_0_when_every_kernel_fits_and_shows_progress_and_a_table(
        monkeypatch, capsys, results):
    argv = ["smemguard.examples:attention_fwd", "--meta", "BLOCK_M=64,BLOCK_N=32,num_warps=4,num_stages=2",
            "--meta", "BLOCK_M=128,BLOCK_N=128,num_warps=8,num_stages=3", "--gpu", "L4", "--jobs", "2"]
    assert check_cli(argv, monkeypatch, results) == 0
    captured = capsys.readouterr()
    assert "[4/4] sm_89 attention_fwd" in captured.err, "one progress line per compile, on stderr"
    first = next(line for line in captured.err.splitlines() if line.startswith("smemguard check: [1/4]"))
    assert re.search(r"\d+\.\d compiles/s, ~\d+ s left\)$", first), first
    lines = captured.out.splitlines()
    assert lines[0].split() == ["kernel", "config", "L4", "(101376)"]
    assert "36864 fits" in lines[2] and "163840 OVER [aligned]" in lines[3]
    assert "L4 (sm_89, 101376 B): configs that fit: attention_fwd 1/2" in captured.out
    assert "NO FITTING CONFIG" not in captured.out

    # A second run compiles nothing: every result comes from the cache.
    assert check_cli(argv + ["--json", "--quiet"], monkeypatch, results) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["compiles"], document["cache_hits"]) == (0, 4)
    assert document["verdicts"]["cached"] == 4


def test_cache_is_keyed_by_target_and_specialization(results):
    [kernel] = preflight.discover(["smemguard.examples:flaggems_matmul"], overrides={"configs": AROUND_L4[:1]})
    aligned, misaligned = kernel.specializations
    keys = {preflight.cache_key(kernel.jit, preflight.build_request(kernel, kernel.variants[0], spec, arch))
            for spec in (aligned, misaligned) for arch in (80, 89, 90)}
    assert len(keys) == 6
    first = preflight.check([kernel], [L4], exact=True, jobs=1, cache=results)
    again = preflight.check([kernel], [gpus.lookup("L20")], exact=True, jobs=1, cache=results)
    assert (again.compiles, again.cache_hits) == (0, 2), "L20 is sm_89 too: the L4's results answer"
    assert again.verdict(0, 0, "aligned", "L20").shared == first.verdict(0, 0, "aligned", "L4").shared
    assert len(list(results.directory.glob("*/*.json"))) >= 2


def test_usage_errors_exit_2(monkeypatch, capsys, results):
    cases = [(["--examples", "--gpu", "L5"], "unknown GPU 'L5'"),
             (["no_such_module_xyz", "--gpu", "L4"], "could not be imported"),
             (["smemguard.examples:nothing", "--gpu", "L4"], "has no attribute 'nothing'"),
             (["smemguard.examples:matmul_args", "--gpu", "L4"], "not a Triton kernel"),
             (["smemguard.examples:matmul_kernel", "--gpu", "L4"], "--meta"),
             (["smemguard.examples:flaggems_matmul", "--one", "Q", "--gpu", "L4"], "not integer parameters"),
             (["--gpu", "L4"], "nothing to check")]
    for argv, message in cases:
        assert check_cli(argv, monkeypatch, results) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_help_teaches_targets_exit_status_and_the_json_schema(capsys):
    with pytest.raises(SystemExit):
        commands.build_parser().parse_args(["check", "--help"])
    text = capsys.readouterr().out
    for expected in ("pkg.kernels:matmul", "kernels.py", "Exit status: 0", "1 when some kernel has none",
                     "--examples --gpu L4,A100,H100", "smemguard.check/1", "SMEMGUARD_PREFLIGHT", "--one", "estimate"):
        assert expected in text, expected


def test_a_kernel_file_is_found_typed_and_compiled_in_worker_processes(tmp_path, results):
    source = tmp_path / "my_kernels.py"
    source.write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def scale_rows(X, Out, scale, n_cols, stride_xm, stride_xn, stride_om, stride_on, BLOCK: tl.constexpr = 256):
            row = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            offsets = row * stride_xm + cols * stride_xn
            x = tl.load(X + offsets, mask=cols < n_cols)
            tl.store(Out + row * stride_om + cols * stride_on, x * scale, mask=cols < n_cols)
    """))
    [kernel] = preflight.discover([str(source)], overrides={"signature": {"scale": "fp32"}})
    assert kernel.name == "my_kernels.py:scale_rows"
    assert kernel.types == {"X": "*fp16", "Out": "*fp16", "scale": "fp32", "n_cols": "i32", "stride_xm": "i32",
                            "stride_xn": "i32", "stride_om": "i32", "stride_on": "i32"}
    assert kernel.unit_args == ("stride_xn", "stride_on")
    assert kernel.locator is not None and kernel.locator[2] == str(source)
    report = preflight.check([kernel], [L4], jobs=2, cache=results)
    assert {v.verdict for v in report.verdicts.values()} == {preflight.FITS}
    assert report.compiles == 2 and report.exit_status == 0


def test_heuristics_see_the_specialization(tmp_path):
    source = tmp_path / "tuned_ops.py"
    source.write_text(textwrap.dedent("""
        import triton
        from smemguard.examples import matmul_kernel

        block_n_by_size = triton.heuristics({"BLOCK_N": lambda args: 64 if args["N"] >= 64 else 16})(matmul_kernel)
    """))
    [kernel] = preflight.discover([str(source)], overrides={"configs": [dict(BLOCK_M=64, BLOCK_K=32)],
                                                             "ones": [["N"]]})
    assert kernel.name == "tuned_ops.py:block_n_by_size"
    block_n = {spec.name: preflight.build_request(kernel, kernel.variants[0], spec, 89).constants["BLOCK_N"]
               for spec in kernel.specializations}
    assert block_n == {"aligned": 64, "misaligned": 64, "N=1": 16}


def test_stacked_heuristics_run_outermost_first_as_at_a_launch(tmp_path):
    source = tmp_path / "stacked_ops.py"
    source.write_text(textwrap.dedent("""
        import triton
        from smemguard.examples import matmul_kernel

        inner = triton.heuristics({"BLOCK_K": lambda args: args["BLOCK_N"] // 2})(matmul_kernel)
        stacked = triton.heuristics({"BLOCK_N": lambda args: 64})(inner)
    """))
    kernels = preflight.discover([f"{source}:stacked"], overrides={"configs": [dict(BLOCK_M=64)]})
    constants = preflight.build_request(kernels[0], kernels[0].variants[0], kernels[0].specializations[0],
                                        89).constants
    assert (constants["BLOCK_N"], constants["BLOCK_K"]) == (64, 32)


def operands_256(aligned=True):
    return matmul_args(*matmul_operands(256, aligned))


def test_fits_keeps_what_the_textbook_formula_wrongly_drops_on_sm_89(triton_cache):
    fitting, too_big = config(128, 128, 64, 4), config(128, 128, 128, 4)
    assert textbook(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4)) > L4.max_shared
    tuned = autotuned([fitting, too_big], prune_configs_by={"early_config_prune": smemguard.fits})
    with fake_gpu("L4", cache_dir=triton_cache) as gpu:
        tuned.nargs = dict(zip(tuned.arg_names, operands_256()))
        assert tuned.prune_configs({}) == [fitting]
        # Misaligned views use no cp.async: there, the big tile fits too.
        tuned.nargs = dict(zip(tuned.arg_names, operands_256(aligned=False)))
        assert tuned.prune_configs({}) == [fitting, too_big]
        tuned.nargs = None
        tuned[tiled_grid(256, 256)](*operands_256())
        assert (gpu.launches[-1].num_stages, gpu.launches[-1].shared) == (4, 98304)


def test_fits_never_returns_nothing_and_follows_the_emulated_limit(triton_cache, install_guard, caplog):
    small, big = config(64, 64, 64, 4), config(128, 128, 64, 4)  # 49152 B and 98304 B aligned on sm_89
    prune = smemguard.fits_for(matmul_kernel)
    named = dict(zip(matmul_kernel.arg_names, operands_256()))
    with fake_gpu("L4", cache_dir=triton_cache):
        assert prune([small, big], named) == [small, big]
        install_guard(max_shared=60000, max_shared_label="60000")
        assert prune([small, big], named) == [small]
        with caplog.at_level(logging.WARNING, logger="smemguard"):
            assert prune([big], named) == [big], "nothing fits: the smallest is kept"
    assert "no config of matmul_kernel fits the 60000 B" in caplog.text and "98304 B" in caplog.text


def test_fits_outside_an_autotuner_says_what_to_use_instead():
    with pytest.raises(TypeError, match="fits_for"):
        smemguard.fits([config(32, 32, 32, 2)], {})


def test_the_pruner_loads_without_the_offline_checker():
    loaded = run_python("""
        import sys
        import smemguard
        smemguard.fits, smemguard.fits_for
        print(sorted(name for name in sys.modules if name.startswith("smemguard")))
        print(sorted(name for name in ("triton", "torch", "multiprocessing", "concurrent.futures")
                     if name in sys.modules))
    """).stdout.splitlines()
    assert "'smemguard.kernels.pruning'" in loaded[0] and "preflight" not in loaded[0]
    assert loaded[1] == "[]", "importing the pruner imports neither Triton, torch nor the checker's process pool"


def test_examples_declare_what_the_check_needs():
    kernels = preflight.discover([], examples=True)
    by_name = {kernel.name.rsplit(":", 1)[1]: kernel for kernel in kernels}
    assert set(by_name) == {"flaggems_matmul", "matmul_persistent_kernel", "attention_fwd"}
    assert len(by_name["flaggems_matmul"].variants) == 216
    assert by_name["matmul_persistent_kernel"].types["a_ptr"] == "*fp32"
    assert [spec.name for spec in by_name["matmul_persistent_kernel"].specializations] == ["aligned", "misaligned",
                                                                                           "N=1"]
    assert by_name["attention_fwd"].jit is attention_fwd_kernel
    assert by_name["attention_fwd"].types["sm_scale"] == "fp32"


def test_a_warm_cache_gives_the_cold_runs_verdicts(results):
    # Misaligned on sm_89 one stage is buffered whatever num_stages: the cold run compiles the family's
    # fewest and most stages and shares their bytes with the 3-stage config (98304 B, too near the
    # L4's limit for the estimate). The warm run found both in the cache and crashed (issue 24, item 1).
    stages = [dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=s) for s in (2, 3, 4)]
    [kernel] = preflight.discover(["smemguard.examples:flaggems_matmul"], overrides={"configs": stages})
    cold = preflight.check([kernel], [L4], jobs=2, cache=results)
    warm = preflight.check([kernel], [L4], jobs=2, cache=results)
    assert warm.compiles == 0 and warm.cache_hits == cold.compiles
    assert {key: verdict.verdict for key, verdict in warm.verdicts.items()} == \
        {key: verdict.verdict for key, verdict in cold.verdicts.items()}


SCALE_ROWS = """
    import triton
    import triton.language as tl

    @triton.jit
    def {name}(X, Out, n_cols, BLOCK: tl.constexpr = 256):
        cols = tl.arange(0, BLOCK)
        tl.store(Out + cols, tl.load(X + cols, mask=cols < n_cols), mask=cols < n_cols)
"""


def test_a_package_is_checked_module_by_module(tmp_path, monkeypatch, caplog):
    """vLLM keeps kernels in the modules of packages (``vllm.third_party.flash_linear_attention.ops``): naming
    the package checks every kernel its modules define, once each (the package imports them too), not the
    device functions they call, and a module that cannot be imported is skipped with one line."""
    package = tmp_path / "kernel_pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .rows import scale_rows\n")
    (package / "rows.py").write_text(textwrap.dedent(SCALE_ROWS.format(name="scale_rows")))
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "cols.py").write_text("from ..rows import scale_rows\n"
                                             + textwrap.dedent(SCALE_ROWS.format(name="scale_cols")))
    (package / "needs_a_gpu.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    (package / "helpers.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def fast_exp(x):
            return tl.math.exp2(x * 1.4426950408889634)
    """))
    (tmp_path / "empty_pkg").mkdir()
    (tmp_path / "empty_pkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="smemguard"):
        kernels = preflight.discover(["kernel_pkg"])
    assert sorted(kernel.name for kernel in kernels) == ["kernel_pkg.rows:scale_rows", "kernel_pkg.sub.cols:scale_cols"]
    assert "skipping kernel_pkg.needs_a_gpu: it cannot be imported (ImportError: libcuda.so.1" in caplog.text
    with pytest.raises(preflight.TargetError, match="'empty_pkg' defines no Triton kernel, nor does any module"):
        preflight.discover(["empty_pkg"])
    # a device function (vLLM's fast_exp): kernels call it, nothing launches it; not compiled as a kernel
    with pytest.raises(preflight.TargetError, match="is a device function .it returns a value."):
        preflight.discover(["kernel_pkg.helpers:fast_exp"])


def test_an_argument_every_launch_passes_as_none(tmp_path):
    """``--sig b=none``: an optional tensor the launch leaves out (vLLM's FLA passes ``gk=None``) is compiled as
    Triton compiles a None argument, a constant, and heuristics see None, so the variant is the launch's."""
    source = tmp_path / "optional_ops.py"
    source.write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.heuristics({"HAS_B": lambda args: args["b"] is not None})
        @triton.jit
        def add_optional(X, b, Out, n, BLOCK: tl.constexpr = 64, HAS_B: tl.constexpr = False):
            cols = tl.arange(0, BLOCK)
            x = tl.load(X + cols, mask=cols < n)
            if HAS_B:
                x += tl.load(b + cols, mask=cols < n)
            tl.store(Out + cols, x, mask=cols < n)
    """))
    [given] = preflight.discover([str(source)], overrides={"signature": {"b": "none"}})
    [guessed] = preflight.discover([str(source)])
    requests = {name: preflight.build_request(kernel, kernel.variants[0], kernel.specializations[0], 89)
                for name, kernel in (("given", given), ("guessed", guessed))}
    assert (requests["given"].signature["b"], requests["given"].constants["b"]) == ("constexpr", None)
    assert requests["given"].constants["HAS_B"] is False and requests["guessed"].constants["HAS_B"] is True
    report = preflight.check([given], [L4], jobs=1, cache=preflight.ResultCache(None))
    assert {v.verdict for v in report.verdicts.values()} == {preflight.FITS}
