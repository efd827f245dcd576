"""The calibrated estimate of sm_70, sm_75 and sm_120 against the sweeps it was calibrated on, and the
check sharing one compile among stage variants where stages change nothing (sm_70, sm_75)."""

import csv
import functools
from pathlib import Path

from smemguard.facts import gpus
from smemguard import preflight
from smemguard.kernels.estimate import stages_change_bytes

from test_preflight import SWEEP, assert_estimates_agree, results  # noqa: F401 (results is a fixture)

# Shared memory of smemguard's example matmuls compiled for sm_70, sm_75 and sm_120 by
# benchmarks/smem_sweep.py --vendor nvidia, with the Triton release of each row.
NVIDIA_SWEEP = Path(__file__).parent / "data" / "nvidia_smem_sweep.csv"
T4 = gpus.lookup("T4")
DUMMY_CONFIG = [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)]


@functools.cache
def sweep_kernel(kernel: str, dtype: str) -> preflight.CheckedKernel:
    """The kernel of a sweep row as the sweep compiled it (the persistent matmul with its own hints)."""
    overrides = {"dtype": dtype, "configs": DUMMY_CONFIG}
    if kernel == "matmul_kernel":
        overrides["ones"] = [["N"]]
    [checked] = preflight.discover([f"smemguard.examples:{kernel}"], overrides=overrides)
    return checked


def sweep_rows():
    """(row, arch, kernel, specialization, variant) for the matmul rows of both NVIDIA sweeps."""
    for row in csv.DictReader(NVIDIA_SWEEP.open()):
        if row["shared"] and row["BK"]:
            yield row, int(row["arch"]), sweep_kernel(row["kernel"], row["dtype"]), row["spec"], _variant(row)
    triton36 = {"fp16_aligned": ("fp16", "aligned"), "fp32_aligned": ("fp32", "aligned"),
                "fp16_unaligned": ("fp16", "misaligned"), "fp16_ptrunaligned": ("fp16", "misaligned"),
                "fp16_n1": ("fp16", "N=1")}
    for row in csv.DictReader(SWEEP.open()):
        dtype, spec = triton36[row["variant"]]
        row = {**row, "triton": "3.6.0", "kernel": "matmul_kernel", "dtype": dtype, "spec": spec,
               "shared": row["shared_bytes"]}
        yield row, int(row["arch"]), sweep_kernel("matmul_kernel", dtype), spec, _variant(row)


def _variant(row) -> preflight.Variant:
    return preflight.Variant.of(dict(BLOCK_M=int(row["BM"]), BLOCK_N=int(row["BN"]), BLOCK_K=int(row["BK"]),
                                     num_warps=int(row["num_warps"]), num_stages=int(row["num_stages"])))


def interval_of(kernel, variant, spec_name, arch) -> preflight.Estimate | None:
    spec = next(spec for spec in kernel.specializations if spec.name == spec_name)
    return preflight.estimate(preflight.build_request(kernel, variant, spec, arch), spec)


def test_the_estimate_holds_every_config_the_sm70_sm75_sm120_sweeps_measured():
    rows = [(row, arch, kernel, spec, variant) for row, arch, kernel, spec, variant in sweep_rows()
            if arch in (70, 75, 120)]
    outside, uncalibrated = [], []
    for row, arch, kernel, spec, variant in rows:
        interval = interval_of(kernel, variant, spec, arch)
        if interval is None:
            uncalibrated.append(row)
        elif not interval.holds(int(row["shared"])):
            outside.append((row, interval))
    assert outside == [] and uncalibrated == []
    releases = {arch: {row["triton"] for row, row_arch, *_ in rows if row_arch == arch} for arch in (70, 75, 120)}
    assert len(rows) >= 1000 and releases[70], releases
    assert {"3.6.0", "3.9.0"} <= releases[75] and {"3.6.0", "3.9.0"} <= releases[120], releases


def test_stage_variants_measured_the_same_bytes_wherever_the_estimate_says_stages_change_nothing():
    measured: dict[tuple, set[int]] = {}
    for row, arch, kernel, spec, variant in sweep_rows():
        if not stages_change_bytes(arch, interval_of(kernel, variant, spec, arch)):
            family = (row["triton"], arch, row["kernel"], row["dtype"], spec, variant.constexprs, variant.num_warps)
            measured.setdefault(family, set()).add(int(row["shared"]))
    assert len(measured) >= 200 and [values for values in measured.values() if len(values) > 1] == []


def test_sm_120_pipelines_like_sm_89_and_sm_70_sm_75_ignore_stages_and_alignment():
    kernel = sweep_kernel("matmul_kernel", "fp16")
    variant = preflight.Variant.of(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4))
    assert interval_of(kernel, variant, "aligned", 120) == preflight.Estimate(98304, 98304, "mma")
    assert interval_of(kernel, variant, "aligned", 90).regime == "wgmma"
    assert interval_of(kernel, variant, "aligned", 75) == preflight.Estimate(32768, 32768, "registers")
    assert interval_of(kernel, variant, "misaligned", 70) == interval_of(kernel, variant, "aligned", 70)
    assert interval_of(kernel, variant, "aligned", 100) is None  # sm_100: no calibration, always compiled


# Around the T4's 65536 B: 32x128x128 needs 2 x 32768 B (at the limit, compiled) whatever its stages;
# 32x32x32 and 64x64x32 fit by far. On sm_75 the stages of each share one compile.
AROUND_T4 = [dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=stages) for stages in (2, 3, 4)] + [
    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=stages) for stages in (2, 3)] + [
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)]


def test_check_for_a_t4_compiles_one_config_per_family_of_stage_variants(results, tmp_path):
    kernels = preflight.discover(["smemguard.examples:flaggems_matmul"], overrides={"configs": AROUND_T4})
    estimated = preflight.check(kernels, [T4], jobs=1, cache=preflight.ResultCache(tmp_path / "cold"))
    exact = preflight.check(kernels, [T4], exact=True, jobs=1, cache=results)
    assert_estimates_agree(estimated, exact)
    assert exact.compiles == len(AROUND_T4) * 2
    # Per specialization: 32x32x32 at 2 and 3 stages show that stages change nothing here; then
    # 32x128x128 compiles once, and 64x64x32 is estimated.
    assert estimated.compiles == 3 * 2
    for spec in ("aligned", "misaligned"):
        at_limit = [estimated.verdict(0, v, spec, "T4") for v in range(3)]
        assert [verdict.how for verdict in at_limit] == [preflight.MEASURED, preflight.ESTIMATED, preflight.ESTIMATED]
        assert {(verdict.verdict, verdict.low or verdict.shared, verdict.high or verdict.shared)
                for verdict in at_limit} == {(preflight.FITS, 65536, 65536)}


def test_stage_variants_that_measured_different_bytes_are_all_compiled(tmp_path):
    """A cached result (another Triton's, or edited) that differs from its stage variant's ends the sharing."""
    configs = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=stages) for stages in (2, 3)] + [
        dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=stages) for stages in (2, 3)]
    [kernel] = preflight.discover(["smemguard.examples:flaggems_matmul"], overrides={"configs": configs})
    cache = preflight.ResultCache(tmp_path / "edited")
    request = preflight.build_request(kernel, kernel.variants[1], kernel.specializations[0], T4.target_arch)
    # Inside 128x128x32's interval [16384, 32768] (so the estimate stays trusted), unlike any compile.
    cache.put(preflight.cache_key(kernel.jit, request), {"shared": 20000, "error": None, "seconds": 0.0})
    report = preflight.check([kernel], [T4], jobs=1, cache=cache)
    assert report.verdict(0, 1, "aligned", "T4").how == preflight.CACHED
    assert [report.verdict(0, v, "aligned", "T4").how for v in (0, 2, 3)] == [preflight.MEASURED] * 3
    # Misaligned: 128x128x32 at 2 and 3 stages agree, so 32x128x128 at 3 stages takes its 2-stage bytes.
    assert [report.verdict(0, v, "misaligned", "T4").how for v in range(4)] == [
        preflight.MEASURED, preflight.MEASURED, preflight.MEASURED, preflight.ESTIMATED]
    assert report.compiles == 3 + 3
